"""The hooks of a device spec, reproduced as exact files instead of host programs.

A CDI spec may ask the runtime to run a host program in the new container before it
starts (`hooks`). The provider never does: a hook runs as root-in-the-container with
the host's binary, outside the barrier, and what it leaves cannot be recorded for the
gate. For NVIDIA's three hooks the effect is known and small, so the provider makes
it itself, at configure time, from files it has checked:

- `update-ldcache --folder F`: `ldconfig` in the container, so the loader finds the
  mounted libraries by the name programs ask for. Reproduced as (1) for each mounted
  library in F whose ELF DT_SONAME is another name, the same file mounted read-only
  at F/SONAME, the link `ldconfig` would make (a SONAME two different files claim is
  refused); (2) F in `LD_LIBRARY_PATH`, which the loader searches as it would the
  cache (the container never runs a set-user-ID program: NoNewPrivs).
- `create-symlinks --link TARGET::LINK`: a link in the container. Reproduced as the
  file TARGET resolves to mounted at LINK too (same source, same identity), or, for a
  link to a device node (`/dev/dri/by-path/...`), the node bound at LINK as well (the
  device policy is by number: the same node opens or is refused at both paths). A
  TARGET that is not a file or node of the bundle is refused: the image's own files
  are not known at configure time.
- `chmod --mode 755 --path P`: accepted where it changes nothing: runc creates every
  directory below `/dev` that holds a bound node with mode 0755, and chmod skips a
  path that does not exist. Any other mode, or a path outside `/dev` or in the
  runtime's own `/dev/pts`, `/dev/shm`, `/dev/mqueue`, is refused.

Every other hook (`enable-cuda-compat`, `disable-device-node-modification`,
`update-application-profile`, any other program) is refused by name, with the
`nvidia-ctk` option that leaves it out. Both forms NVIDIA writes are read:
`/usr/bin/nvidia-cdi-hook NAME ...` and `/usr/bin/nvidia-ctk hook NAME ...`.
"""

from __future__ import annotations

import os
import posixpath
import stat
from collections.abc import Iterable
from dataclasses import dataclass, field

from ficc_provider_podman import elf
from ficc_provider_podman.bundle import FileMount, Node
from ficc_provider_podman.cdi import Hook
from ficc_provider_podman.errors import ProviderError

UNSUPPORTED = "cdi_hook_unsupported"
LIFECYCLE = "createContainer"
CHMOD_MODE = 0o755
RUNTIME_DEV_TREES = ("/dev/pts", "/dev/shm", "/dev/mqueue")  # noqa: S108 (container paths)
LIBRARY_PATH = "LD_LIBRARY_PATH"
_OPTIONS = {
    "create-symlinks": ({"link"}, set()),
    "update-ldcache": ({"folder"}, {"ldconfig-path"}),
    "chmod": ({"path"}, {"mode"}),
}
"""Per reproduced hook: the options it may repeat, and those it may give once."""


@dataclass
class Draft:
    """A bundle being resolved: its nodes and mounts (by container path), the device
    links and library folders the hooks add."""

    where: str
    nodes: list[Node]
    mounts: dict[str, FileMount]
    aliases: dict[str, str] = field(default_factory=dict)
    """alias path -> the node path it shows."""
    folders: list[str] = field(default_factory=list)


def _refused(draft: Draft, message: str) -> ProviderError:
    return ProviderError(
        UNSUPPORTED,
        f"{draft.where}: {message}; the provider runs no host program in a job's container",
    )


def apply(hooks: Iterable[Hook], draft: Draft) -> None:
    """Reproduce every hook on `draft` (library links first, then links, then modes)."""
    parsed = [(_command(hook, draft), hook) for hook in hooks]
    for (name, options), _hook in parsed:
        if name == "update-ldcache":
            _library_links(draft, options.get("folder", []))
    links = [link for (name, options), _ in parsed if name == "create-symlinks"
             for link in options.get("link", [])]  # fmt: skip
    _links(draft, links)
    for (name, options), _hook in parsed:
        if name == "chmod":
            _modes(draft, options.get("mode", [""])[0], options.get("path", []))


def _command(hook: Hook, draft: Draft) -> tuple[str, dict[str, list[str]]]:
    """The NVIDIA hook's name and options; anything else is refused by name."""
    program = posixpath.basename(hook.path)
    args = [posixpath.basename(hook.args[0]), *hook.args[1:]] if hook.args else []
    if program == "nvidia-ctk" and args[:2] == ["nvidia-ctk", "hook"] and len(args) > 2:
        name, rest = args[2], args[3:]
    elif program == "nvidia-cdi-hook" and args[:1] == ["nvidia-cdi-hook"] and len(args) > 1:
        name, rest = args[1], args[2:]
    else:
        raise _refused(draft, f"hook {hook.path} {' '.join(hook.args[1:3])!r} is not one it knows")
    if name not in _OPTIONS:
        raise _refused(
            draft,
            f"hook {name!r} ({hook.path}) cannot be reproduced; generate the spec without it"
            f" (`nvidia-ctk cdi generate --disable-hook {name}`)",
        )
    if hook.hook_name != LIFECYCLE:
        raise _refused(draft, f"hook {name!r} runs at {hook.hook_name!r}, not {LIFECYCLE!r}")
    return name, _options(name, rest, draft)


def _options(name: str, args: list[str], draft: Draft) -> dict[str, list[str]]:
    repeated, single = _OPTIONS[name]
    found: dict[str, list[str]] = {}
    index = 0
    while index < len(args):
        key, equals, value = args[index].removeprefix("--").partition("=")
        if not args[index].startswith("--") or key not in repeated | single:
            raise _refused(draft, f"hook {name!r} has the argument {args[index]!r}")
        if not equals:
            if index + 1 >= len(args):
                raise _refused(draft, f"hook {name!r}: --{key} has no value")
            index += 1
            value = args[index]
        if key in single and key in found:
            raise _refused(draft, f"hook {name!r} gives --{key} twice")
        found.setdefault(key, []).append(value)
        index += 1
    return found


# --- update-ldcache -------------------------------------------------------------------------


def _library_links(draft: Draft, folders: list[str]) -> None:
    for folder in folders:
        if not folder.startswith("/") or posixpath.normpath(folder) != folder:
            raise _refused(draft, f"update-ldcache folder {folder!r} is not a normalized path")
        claims: dict[str, FileMount] = {}
        for target, mount in sorted(draft.mounts.items()):
            base = posixpath.basename(target)
            library = base.startswith("lib") and ".so" in base  # what ldconfig looks at
            if posixpath.dirname(target) != folder or not library:
                continue
            soname = _soname(mount, draft)
            if soname is None or soname == base:
                continue
            earlier = claims.setdefault(soname, mount)
            if earlier.identity != mount.identity:
                raise _refused(
                    draft, f"{earlier.source} and {mount.source} both claim SONAME {soname}"
                )
        for soname, mount in claims.items():
            _add_mount(draft, mount, posixpath.join(folder, soname))
        if folder not in draft.folders:
            draft.folders.append(folder)


def _soname(mount: FileMount, draft: Draft) -> str | None:
    """The SONAME of the mounted file, read from the very file whose identity was recorded."""
    fd = os.open(mount.source, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or (st.st_dev, st.st_ino) != mount.identity:
            raise _refused(draft, f"{mount.source} changed while it was read")
        return elf.soname_of_fd(fd)
    finally:
        os.close(fd)


def _add_mount(draft: Draft, mount: FileMount, target: str) -> None:
    """`mount`'s file at `target` too; a different file already there is refused."""
    present = draft.mounts.get(target)
    if present is not None and present.identity != mount.identity:
        raise _refused(draft, f"{target} would be both {present.source} and {mount.source}")
    if target in draft.aliases or any(node.path == target for node in draft.nodes):
        raise _refused(draft, f"{target} would be both a device node and {mount.source}")
    draft.mounts[target] = FileMount(mount.source, target, mount.device, mount.inode, mount.noexec)


# --- create-symlinks -----------------------------------------------------------------------


def _links(draft: Draft, links: list[str]) -> None:
    """Resolve every link, following links to links (in any order of the spec)."""
    pending: list[tuple[str, str]] = []
    for spec in links:
        target, separator, link = spec.partition("::")
        if not separator or not link.startswith("/") or posixpath.normpath(link) != link:
            raise _refused(draft, f"create-symlinks link {spec!r} is not TARGET::/ABSOLUTE/LINK")
        resolved = posixpath.normpath(posixpath.join(posixpath.dirname(link), target))
        pending.append((resolved, link))
    while pending:
        left = [(target, link) for target, link in pending if not _link(draft, target, link)]
        if len(left) == len(pending):
            names = ", ".join(f"{link} -> {target}" for target, link in left[:4])
            raise _refused(
                draft,
                f"links to files the bundle does not provide ({names}): the image's own files"
                " are not known when the provider is configured",
            )
        pending = left


def _link(draft: Draft, target: str, link: str) -> bool:
    """Make one link if its target is known; whether it was."""
    nodes = {node.path for node in draft.nodes}
    if target in draft.mounts:
        _add_mount(draft, draft.mounts[target], link)
        return True
    node = target if target in nodes else draft.aliases.get(target)
    if node is None:
        return False
    if link in draft.mounts or link in nodes or draft.aliases.get(link, node) != node:
        raise _refused(draft, f"link {link} would hide another file or node")
    if any(char in link for char in (",", "\n", "\x00")):
        raise _refused(draft, f"link {link!r} holds a character Podman cannot carry")
    draft.aliases[link] = node
    return True


# --- chmod -----------------------------------------------------------------------------------


def _modes(draft: Draft, mode: str, paths: list[str]) -> None:
    try:
        wanted = int(mode, 8)
    except ValueError:
        raise _refused(draft, f"chmod mode {mode!r} is not octal") from None
    if wanted != CHMOD_MODE:
        raise _refused(draft, f"chmod mode {mode} is not the 0755 runc gives device directories")
    shown = {node.path for node in draft.nodes} | set(draft.aliases)
    for path in paths:
        runtime = any(path == top or path.startswith(f"{top}/") for top in RUNTIME_DEV_TREES)
        below_dev = path == "/dev" or path.startswith("/dev/")
        if not below_dev or runtime or path in shown or posixpath.normpath(path) != path:
            raise _refused(
                draft,
                f"chmod of {path!r}: only directories below /dev that hold device nodes (made"
                " 0755 by the runtime) can be reproduced",
            )


def library_path(folders: Iterable[str]) -> str:
    """The `LD_LIBRARY_PATH` value for these folders (in order, each once)."""
    return ":".join(dict.fromkeys(folders))
