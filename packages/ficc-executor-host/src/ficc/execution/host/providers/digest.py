"""The distribution digest an administrator pins, computed without importing anything.

A provider runs with administrator authority, so the host must know exactly which
bytes it is about to execute. The digest is the SHA-256 of canonical JSON (sorted
keys, compact separators, UTF-8) of::

    {"name": normalized distribution name, "version": ..., "entry_point": value,
     "metadata_sha256": SHA-256 of the METADATA bytes,
     "files": [{"path": RECORD path, "size": bytes, "sha256": hex}, ...]}

Every file is re-hashed from disk through directory descriptors opened with
O_NOFOLLOW; RECORD is only used to know which files exist and is itself checked
against the disk (a disagreement means someone edited the installation).

Refused, each with a stable code:
- `provider_missing` / `provider_ambiguous`: zero or several distributions register
  the entry-point name (a second copy could shadow the pinned one at import time).
- `provider_unsupported`: not an unpacked wheel-style install (no RECORD, a zip, a
  namespace-only package, limits exceeded).
- `provider_editable`: an editable install (direct_url.json says so, or RECORD lists
  a `.pth` file): the code lives in a source tree the pin does not cover.
- `provider_tampered`: a listed file is missing or differs from RECORD, a file inside
  a package directory is not listed, or a console script is declared but not listed.
- `provider_unsafe`: a symlink, hard link, special file, setuid/setgid file, a file or
  directory writable by group or others, or one not owned by root (by root or the
  current user when not running as root).

Records of the install, not of the release, are left out of the digest, so one
release pins as one digest wherever its wheel was installed from (a path, an index, a
cache, directly or as a dependency): the `.dist-info` files `RECORD` (its rows for the
files below differ per install; every file it lists is hashed on its own),
`direct_url.json` (the install source), `INSTALLER` and `REQUESTED`. They are still
opened and checked like every other file, and RECORD is still read to know which files
exist.

Bytecode caches (`__pycache__/*.pyc`) are excluded from the digest, listed or not:
pip writes them with install-time timestamps (so they would make the pin change on
every reinstall) and RECORD carries no hash for them. They are still checked for
owner, mode and links, and the loader never executes them (it compiles from the
verified sources; see loader.py).

Files RECORD lists outside the site directory (`../../../bin/x` scripts of a virtualenv
or prefix) are hashed too; the directories above the site directory are trusted as part
of the interpreter installation and are not checked for symlinks. (`pip install
--target` records console scripts at such paths but puts them elsewhere, so a provider
with scripts installed that way is refused as tampered: install into a prefix or venv.)

Console scripts are written by the installer, not shipped in the wheel, and their start
names the interpreter they were installed for: `#!/opt/ficc/venv/bin/python`, or, for a
long path or one with spaces, a three-line `#!/bin/sh` preamble that `exec`s it. So that
one release pins as one digest in every venv and prefix, a script is hashed with that
interpreter part replaced by `#!python` (the line a wheel's own scripts carry) when all
of these hold: RECORD lists it outside the site directory in a `bin` directory; its
name is a `[console_scripts]` or `[gui_scripts]` entry of the verified entry_points.txt;
and it starts with exactly one of those two forms, naming one absolute path (no
arguments, nothing a shell would expand, nothing Python would read as code or as an
encoding declaration). Everything after the interpreter part stays in
the digest, so an edited script body changes the pin. Anything else (another first
line, a script entry_points.txt does not declare, a file the wheel ships for `bin`) is
hashed byte for byte. Scripts are opened, checked for owner, mode and links, and
compared with RECORD like every other file, and a script entry_points.txt declares but
RECORD does not list is refused as tampered (a pin taken there would not cover it). The
interpreter path itself is not pinned: only root can change the script (see the checks
above), and root chooses the interpreter anyway.
"""

from __future__ import annotations

import base64
import configparser
import csv
import email.parser
import errno
import hashlib
import io
import json
import os
import re
import stat
import sys
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path

from ficc.execution.host.core.codes import HostCode
from ficc.execution.host.core.errors import HostError

GROUP = "ficc.executor"

MAX_FILES = 10_000
MAX_RECORD_BYTES = 4 * 1024 * 1024
MAX_SMALL_FILE_BYTES = 1024 * 1024  # METADATA, entry_points.txt, direct_url.json
MAX_TOTAL_BYTES = 2 * 1024 * 1024 * 1024
_CHUNK = 1024 * 1024

_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
_FILE_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC


@dataclass(frozen=True)
class ProviderDistribution:
    """The one installed distribution that registers an entry-point name."""

    entry_name: str
    entry_point: str  # the entry-point value, e.g. "ficc_provider_podman"
    dist_info: Path  # the .dist-info directory
    site_dir: Path  # the directory the distribution is installed into


@dataclass(frozen=True)
class InstalledFile:
    path: str  # as written in RECORD, relative to the site directory
    size: int  # of the hashed bytes (a console script's with its interpreter as `#!python`)
    sha256: str  # hex


@dataclass(frozen=True)
class DistributionDigest:
    """What the host verified; `digest` is what an administrator pins."""

    distribution: ProviderDistribution
    name: str  # normalized
    version: str
    metadata_sha256: str
    files: tuple[InstalledFile, ...]
    import_roots: frozenset[str]  # top-level packages / modules this distribution installs
    digest: str  # "sha256:<hex>"

    def verified_paths(self) -> frozenset[str]:
        """Absolute, normalized paths of every hashed file (the loader's allow-list)."""
        site = self.distribution.site_dir
        return frozenset(os.path.normpath(site / f.path) for f in self.files)


def normalize_name(name: str) -> str:
    """PEP 503 normalization, so `Foo_Bar` and `foo-bar` pin identically."""
    return re.sub(r"[-_.]+", "-", name).lower()


def find_distribution(name: str, path: Sequence[str] | None = None) -> ProviderDistribution:
    """Find the single distribution registering `name` in group `ficc.executor`.

    `path` defaults to sys.path; tests pass an isolated site directory. Duplicate
    sys.path entries are not a second distribution, a second copy elsewhere is.
    """
    search = list(sys.path if path is None else path)
    found: dict[Path, ProviderDistribution] = {}
    for dist in metadata.distributions(path=search):
        for entry in dist.entry_points:
            if entry.group != GROUP or entry.name != name:
                continue
            dist_info = getattr(dist, "_path", None)
            if not isinstance(dist_info, Path):
                raise HostError(
                    HostCode.PROVIDER_UNSUPPORTED,
                    f"provider {name!r} comes from a distribution that is not an unpacked "
                    "directory install; install its wheel with pip into site-packages",
                )
            dist_info = Path(os.path.abspath(dist_info))
            found[dist_info] = ProviderDistribution(name, entry.value, dist_info, dist_info.parent)
    if not found:
        raise HostError(
            HostCode.PROVIDER_MISSING,
            f"no installed distribution registers {name!r} in entry-point group {GROUP!r}; "
            "install the provider or fix the provider id in the configuration",
        )
    if len(found) > 1:
        places = ", ".join(sorted(str(p) for p in found))
        raise HostError(
            HostCode.PROVIDER_AMBIGUOUS,
            f"several distributions register {name!r} in {GROUP!r} ({places}); "
            "uninstall all but the one you intend to pin",
        )
    return next(iter(found.values()))


def compute_digest(name: str, path: Sequence[str] | None = None) -> DistributionDigest:
    """Verify the distribution registering `name` and compute its digest. Imports nothing."""
    dist = find_distribution(name, path)
    site_fd = os.open(dist.site_dir, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        return _Verifier(dist, site_fd).run()
    finally:
        os.close(site_fd)


def _refuse(code: str, message: str) -> HostError:
    return HostError(
        code,
        message + "; review the installation, reinstall the provider "
        "wheel with pip as root, then re-run provider-digest",
    )


_INSTALL_RECORDS = frozenset(
    {"RECORD", "direct_url.json", "INSTALLER", "REQUESTED", "uv_cache.json"}
)
"""`.dist-info` files that describe one install rather than the release (not digested)."""


_SCRIPT_SECTIONS = ("console_scripts", "gui_scripts")
"""entry_points.txt sections whose entries installers turn into scripts in `bin`."""

_SCRIPT_INTERPRETER = b"#!python\n"
"""What a console script's interpreter part is hashed as: the line wheels ship scripts with."""

_INTERPRETER_FORMS = (
    # The /bin/sh preamble pip, installer and uv write for a long path or one with
    # spaces: Python reads its last two lines as one string, the shell runs the `exec`.
    re.compile(
        rb"#!/bin/sh\n"
        rb"'''exec' "
        rb"(?:/[\w@%+=:,./\x80-\xff-]*"  # unquoted: only characters a shell takes as-is
        rb'|"/[^"$`\\\n\']*"'  # double-quoted: nothing a shell expands inside
        rb"|'/[^'\n]*')"  # single-quoted (no quote in either, so Python's string holds)
        rb' "\$0" "\$@"\n'
        rb"' '''\n"
    ),
    re.compile(rb"#!/\S*\n"),  # the plain shebang: one absolute path, no arguments
)
"""The interpreter parts installers write, tried in order (the preamble starts like a
plain shebang, so it goes first); each names one absolute path and nothing else."""

_CODING = re.compile(rb"coding[:=]")
"""A source-encoding declaration, which Python honours in a script's first two lines: an
interpreter part that holds one would change how the pinned rest is read."""


def _is_bytecode_cache(relpath: str) -> bool:
    parts = relpath.split("/")
    return len(parts) >= 2 and parts[-2] == "__pycache__" and parts[-1].endswith(".pyc")


def _is_bin_file(relpath: str) -> bool:
    """A RECORD row outside the site directory in a `bin` directory: where installers put
    console scripts (`../../../bin/NAME` in a venv or prefix)."""
    parts = relpath.split("/")
    return parts[0] == ".." and len(parts) >= 2 and parts[-2] == "bin"


def _script_body(data: bytes) -> bytes | None:
    """A script after its installer-written interpreter part; None when it does not start
    with one, so that it is hashed whole rather than normalized."""
    for form in _INTERPRETER_FORMS:
        found = form.match(data)
        if found is not None and _CODING.search(found.group()) is None:
            return data[found.end() :]
    return None


def _record_hash(value: str) -> str | None:
    """RECORD's `sha256=<urlsafe b64>` as hex; None when RECORD has no hash."""
    if not value:
        return None
    algorithm, _, encoded = value.partition("=")
    if algorithm != "sha256":
        return None
    padded = encoded + "=" * (-len(encoded) % 4)
    try:
        return base64.urlsafe_b64decode(padded).hex()
    except ValueError:
        return ""  # never equal to a real hash: the file is refused as tampered


class _Verifier:
    """One verification pass over one distribution. Not reused."""

    def __init__(self, dist: ProviderDistribution, site_fd: int) -> None:
        self.dist = dist
        self.site_fd = site_fd
        self.dist_info_rel = dist.dist_info.name
        self.total = 0
        self.checked_dirs: set[str] = set()
        self.small: dict[str, bytes] = {}

    # ---- the pass -------------------------------------------------------------------

    def run(self) -> DistributionDigest:
        record = self._read_record()
        self._refuse_editable(record)
        files: list[InstalledFile] = []
        for relpath, (record_sha, record_size) in sorted(record.items()):
            checked = self._check_file(relpath, record_sha, record_size)
            if checked is not None and not self._is_install_record(relpath):
                files.append(checked)
        roots = self._import_roots(record)
        for root in [*sorted(roots.dirs), self.dist_info_rel]:
            self._refuse_unlisted(root, record)
        name, version, metadata_sha = self._metadata()
        self._confirm_entry_point()
        files = self._normalize_scripts(files)
        document = {
            "name": name,
            "version": version,
            "entry_point": self.dist.entry_point,
            "metadata_sha256": metadata_sha,
            "files": [{"path": f.path, "size": f.size, "sha256": f.sha256} for f in files],
        }
        canonical = json.dumps(
            document, sort_keys=True, separators=(",", ":"), ensure_ascii=False
        ).encode("utf-8")
        return DistributionDigest(
            distribution=self.dist,
            name=name,
            version=version,
            metadata_sha256=metadata_sha,
            files=tuple(files),
            import_roots=roots.names,
            digest="sha256:" + hashlib.sha256(canonical).hexdigest(),
        )

    def _is_install_record(self, relpath: str) -> bool:
        folder, _, name = relpath.rpartition("/")
        return folder == self.dist_info_rel and name in _INSTALL_RECORDS

    # ---- RECORD -----------------------------------------------------------------------

    def _read_record(self) -> dict[str, tuple[str | None, int | None]]:
        relpath = f"{self.dist_info_rel}/RECORD"
        try:
            fd = self._open_file(relpath)
        except HostError as error:
            if error.code != HostCode.PROVIDER_TAMPERED:
                raise
            raise HostError(
                HostCode.PROVIDER_UNSUPPORTED,
                f"{self.dist.dist_info} has no RECORD (not a wheel install); "
                "install the provider wheel with pip",
            ) from None
        try:
            data = self._read_bounded(fd, relpath, MAX_RECORD_BYTES)
        finally:
            os.close(fd)
        try:
            rows = list(csv.reader(io.StringIO(data.decode("utf-8"))))
        except (UnicodeDecodeError, csv.Error):
            raise _refuse(HostCode.PROVIDER_TAMPERED, "RECORD is not UTF-8 CSV") from None
        record: dict[str, tuple[str | None, int | None]] = {}
        for row in rows:
            if not row:
                continue
            if len(row) != 3 or not (row[2] == "" or row[2].isdigit()):
                raise _refuse(HostCode.PROVIDER_TAMPERED, f"RECORD row {row!r} is malformed")
            path, hash_value, size = row
            self._check_record_path(path)
            if path in record:
                raise _refuse(HostCode.PROVIDER_TAMPERED, f"RECORD lists {path!r} twice")
            record[path] = (_record_hash(hash_value), int(size) if size else None)
            if len(record) > MAX_FILES:
                raise HostError(
                    HostCode.PROVIDER_UNSUPPORTED, f"RECORD lists more than {MAX_FILES} files"
                )
        if relpath not in record:
            raise _refuse(HostCode.PROVIDER_TAMPERED, "RECORD does not list itself")
        return record

    def _check_record_path(self, path: str) -> None:
        parts = path.split("/")
        leading = 0
        while leading < len(parts) and parts[leading] == "..":
            leading += 1
        body = parts[leading:]
        if (
            not body
            or path.startswith("/")
            or "\x00" in path
            or "\\" in path
            or any(part in ("", ".", "..") for part in body)
        ):
            raise _refuse(
                HostCode.PROVIDER_TAMPERED, f"RECORD path {path!r} is not a plain relative path"
            )

    def _refuse_editable(self, record: dict[str, tuple[str | None, int | None]]) -> None:
        pth = [p for p in record if p.endswith(".pth")]
        if pth:
            raise HostError(
                HostCode.PROVIDER_EDITABLE,
                f"the provider installs path hooks {pth}; editable or path-hook installs "
                "cannot be pinned: install the provider wheel itself",
            )
        direct_url = f"{self.dist_info_rel}/direct_url.json"
        if direct_url not in record:
            return
        fd = self._open_file(direct_url)
        try:
            data = self._read_bounded(fd, direct_url, MAX_SMALL_FILE_BYTES)
        finally:
            os.close(fd)
        try:
            info = json.loads(data)
        except ValueError:
            raise _refuse(HostCode.PROVIDER_TAMPERED, "direct_url.json is not JSON") from None
        dir_info = info.get("dir_info") if isinstance(info, dict) else None
        if isinstance(dir_info, dict) and dir_info.get("editable"):
            raise HostError(
                HostCode.PROVIDER_EDITABLE,
                f"{self.dist.dist_info.name} is an editable install of {info.get('url')!r}; "
                "a pinned provider must be an installed wheel: pip install the built wheel",
            )

    # ---- files ------------------------------------------------------------------------

    def _check_file(
        self, relpath: str, record_sha: str | None, record_size: int | None
    ) -> InstalledFile | None:
        """Hash one listed file; None for bytecode caches (checked, not digested)."""
        fd = self._open_file(relpath)
        try:
            size = os.fstat(fd).st_size
            if _is_bytecode_cache(relpath):
                return None
            is_record = relpath == f"{self.dist_info_rel}/RECORD"
            if record_sha is None and not is_record:
                raise _refuse(HostCode.PROVIDER_TAMPERED, f"RECORD has no sha256 for {relpath!r}")
            kept_kind = relpath.startswith(self.dist_info_rel + "/") or _is_bin_file(relpath)
            keep = kept_kind and size <= MAX_SMALL_FILE_BYTES
            sha, data = self._hash(fd, relpath, size, keep)
        finally:
            os.close(fd)
        if not is_record and (record_sha != sha or record_size not in (None, size)):
            raise _refuse(
                HostCode.PROVIDER_TAMPERED,
                f"{relpath!r} on disk differs from the distribution's RECORD",
            )
        if data is not None:
            self.small[relpath] = data
        return InstalledFile(relpath, size, sha)

    def _hash(self, fd: int, relpath: str, size: int, keep: bool) -> tuple[str, bytes | None]:
        self.total += size
        if self.total > MAX_TOTAL_BYTES:
            raise HostError(
                HostCode.PROVIDER_UNSUPPORTED, f"the distribution exceeds {MAX_TOTAL_BYTES} bytes"
            )
        digest = hashlib.sha256()
        kept = bytearray()
        seen = 0
        while chunk := os.read(fd, _CHUNK):
            seen += len(chunk)
            if seen > size:
                break
            digest.update(chunk)
            if keep:
                kept += chunk
        if seen != size:
            raise _refuse(
                HostCode.PROVIDER_TAMPERED, f"{relpath!r} changed size while being hashed"
            )
        return digest.hexdigest(), bytes(kept) if keep else None

    def _read_bounded(self, fd: int, relpath: str, limit: int) -> bytes:
        size = os.fstat(fd).st_size
        if size > limit:
            raise HostError(
                HostCode.PROVIDER_UNSUPPORTED, f"{relpath!r} is larger than {limit} bytes"
            )
        return self._hash(fd, relpath, size, keep=True)[1] or b""

    # ---- opening without following links ----------------------------------------------

    def _open_file(self, relpath: str) -> int:
        """Open a listed file for reading; refuse anything but a safe regular file."""
        parts = relpath.split("/")
        if parts[0] == "..":
            parent, name = None, os.path.normpath(os.path.join(self.dist.site_dir, relpath))
        else:
            parent, name = self._open_dir("/".join(parts[:-1])), parts[-1]
        try:
            self._refuse_special(parent, name, relpath)
            fd = self._openat(parent, name, _FILE_FLAGS, relpath)
        finally:
            if parent not in (None, self.site_fd):
                os.close(parent)
        try:
            _check_safe(os.fstat(fd), relpath, directory=False)
        except BaseException:
            os.close(fd)
            raise
        return fd

    def _refuse_special(self, dir_fd: int | None, name: str, relpath: str) -> None:
        """Opening a device or FIFO can have effects of its own: look before opening."""
        try:
            info = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
        except FileNotFoundError:
            return  # _openat reports it as missing
        if not (stat.S_ISREG(info.st_mode) or stat.S_ISLNK(info.st_mode)):
            raise _refuse(HostCode.PROVIDER_UNSAFE, f"{relpath!r} is not a regular file")

    def _open_dir(self, reldir: str) -> int:
        """Walk `reldir` below the site directory one component at a time, no links."""
        fd = self.site_fd
        walked: list[str] = []
        for part in reldir.split("/") if reldir else []:
            walked.append(part)
            here = "/".join(walked)
            try:
                child = self._openat(fd, part, _DIR_FLAGS, here)
            finally:
                if fd != self.site_fd:
                    os.close(fd)
            fd = child
            if here not in self.checked_dirs:
                try:
                    _check_safe(os.fstat(fd), here, directory=True)
                except BaseException:
                    os.close(fd)
                    raise
                self.checked_dirs.add(here)
        return fd

    def _openat(self, dir_fd: int | None, name: str, flags: int, relpath: str) -> int:
        try:
            return os.open(name, flags, dir_fd=dir_fd)
        except FileNotFoundError:
            missing = f"{relpath!r} is listed in RECORD but missing"
            raise _refuse(HostCode.PROVIDER_TAMPERED, missing) from None
        except OSError as error:
            if error.errno in (errno.ELOOP, errno.ENOTDIR):  # a symlink where none may be
                linked = f"{relpath!r} is or passes through a symlink"
                raise _refuse(HostCode.PROVIDER_UNSAFE, linked) from None
            unreadable = f"cannot open {relpath!r}: {error.strerror}"
            raise _refuse(HostCode.PROVIDER_TAMPERED, unreadable) from None

    # ---- unlisted files -----------------------------------------------------------------

    def _import_roots(self, record: dict[str, tuple[str | None, int | None]]) -> _Roots:
        """The top-level packages (directories) and modules this distribution installs."""
        dirs: set[str] = set()
        names: set[str] = set()
        for relpath in record:
            parts = relpath.split("/")
            if parts[0] in ("..", self.dist_info_rel) or parts[0].endswith(".data"):
                continue
            if len(parts) == 1 and relpath.endswith(".py"):
                names.add(relpath[: -len(".py")])
            elif len(parts) == 1 and ".cpython-" in relpath and relpath.endswith(".so"):
                names.add(relpath.split(".")[0])
            elif len(parts) > 1 and f"{parts[0]}/__init__.py" in record:
                dirs.add(parts[0])
                names.add(parts[0])
        return _Roots(frozenset(dirs), frozenset(names))

    def _refuse_unlisted(self, root: str, record: dict[str, tuple[str | None, int | None]]) -> None:
        fd = self._open_dir(root)
        try:
            for relpath, mode in self._walk(fd, root):
                if stat.S_ISREG(mode) and (relpath in record or _is_bytecode_cache(relpath)):
                    continue
                raise _refuse(
                    HostCode.PROVIDER_TAMPERED,
                    f"{relpath!r} is inside the provider's package directories "
                    "but not listed in its RECORD",
                )
        finally:
            os.close(fd)

    def _walk(self, dir_fd: int, reldir: str) -> Iterator[tuple[str, int]]:
        """Every non-directory below dir_fd, checked for links, owner and mode."""
        names = sorted(os.listdir(dir_fd))
        if len(names) > MAX_FILES:
            raise HostError(
                HostCode.PROVIDER_UNSUPPORTED, f"{reldir!r} has more than {MAX_FILES} entries"
            )
        for name in names:
            relpath = f"{reldir}/{name}"
            info = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
            if stat.S_ISDIR(info.st_mode):
                child = self._openat(dir_fd, name, _DIR_FLAGS, relpath)
                try:
                    _check_safe(os.fstat(child), relpath, directory=True)
                    yield from self._walk(child, relpath)
                finally:
                    os.close(child)
            else:
                _check_safe(info, relpath, directory=False)
                yield relpath, info.st_mode

    # ---- metadata ---------------------------------------------------------------------

    def _metadata(self) -> tuple[str, str, str]:
        data = self.small.get(f"{self.dist_info_rel}/METADATA")
        if data is None:
            raise HostError(
                HostCode.PROVIDER_UNSUPPORTED, "the distribution has no METADATA in RECORD"
            )
        headers = email.parser.BytesParser().parsebytes(data, headersonly=True)
        name, version = headers.get("Name"), headers.get("Version")
        if not name or not version:
            raise _refuse(HostCode.PROVIDER_TAMPERED, "METADATA lacks Name or Version")
        return normalize_name(str(name)), str(version), hashlib.sha256(data).hexdigest()

    def _entry_points(self) -> configparser.ConfigParser:
        """The verified entry_points.txt bytes, parsed (importlib already parsed the file
        once to find the provider, so a failure here means it changed meanwhile)."""
        data = self.small.get(f"{self.dist_info_rel}/entry_points.txt")
        parser = configparser.ConfigParser(delimiters=("=",), interpolation=None)
        parser.optionxform = str  # type: ignore[assignment,method-assign]
        try:
            parser.read_string((data or b"").decode("utf-8"))
        except (configparser.Error, UnicodeDecodeError):
            raise _refuse(
                HostCode.PROVIDER_TAMPERED,
                "entry_points.txt changed while the provider was checked",
            ) from None
        return parser

    def _confirm_entry_point(self) -> None:
        """The value we pin must be the one in the verified entry_points.txt bytes."""
        value = self._entry_points().get(GROUP, self.dist.entry_name, fallback=None)
        if value is None or value.strip() != self.dist.entry_point:
            raise _refuse(
                HostCode.PROVIDER_TAMPERED,
                "entry_points.txt changed while the provider was checked",
            )

    # ---- console scripts --------------------------------------------------------------

    def _declared_scripts(self) -> frozenset[str]:
        """Names of the scripts an installer writes from the verified entry_points.txt."""
        parser = self._entry_points()
        return frozenset(
            name
            for section in _SCRIPT_SECTIONS
            if parser.has_section(section)
            for name in parser.options(section)
        )

    def _normalize_scripts(self, files: list[InstalledFile]) -> list[InstalledFile]:
        """Hash installer-written console scripts without their interpreter path, so the
        pin does not depend on where the release was installed; refuse a declared script
        RECORD does not list, whose absence a pin taken there could not show."""
        declared = self._declared_scripts()
        listed = {_name(f.path) for f in files if _is_bin_file(f.path)}
        missing = sorted(declared - listed)
        if missing:
            raise _refuse(
                HostCode.PROVIDER_TAMPERED,
                f"entry_points.txt declares the scripts {missing} but RECORD lists no file "
                "of that name in a bin directory",
            )
        return [self._normalized(f) if _name(f.path) in declared else f for f in files]

    def _normalized(self, file: InstalledFile) -> InstalledFile:
        """`file` hashed as `#!python` and its body, when it is a bin file that starts with
        an interpreter part an installer writes; otherwise unchanged (hashed whole)."""
        data = self.small.get(file.path) if _is_bin_file(file.path) else None
        body = None if data is None else _script_body(data)
        if body is None:
            return file
        normalized = _SCRIPT_INTERPRETER + body
        return InstalledFile(file.path, len(normalized), hashlib.sha256(normalized).hexdigest())


def _name(relpath: str) -> str:
    return relpath.rsplit("/", 1)[-1]


@dataclass(frozen=True)
class _Roots:
    dirs: frozenset[str]
    names: frozenset[str]


def _check_safe(info: os.stat_result, relpath: str, *, directory: bool) -> None:
    """Refuse what another account could change, and anything that is not plain."""
    kind = "directory" if directory else "regular file"
    expected = stat.S_ISDIR if directory else stat.S_ISREG
    if stat.S_ISLNK(info.st_mode):
        raise _refuse(HostCode.PROVIDER_UNSAFE, f"{relpath!r} is a symlink")
    if not expected(info.st_mode):
        raise _refuse(HostCode.PROVIDER_UNSAFE, f"{relpath!r} is not a {kind}")
    if info.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        raise _refuse(HostCode.PROVIDER_UNSAFE, f"{relpath!r} is writable by group or others")
    if not directory and info.st_mode & (stat.S_ISUID | stat.S_ISGID):
        raise _refuse(HostCode.PROVIDER_UNSAFE, f"{relpath!r} is setuid or setgid")
    if not directory and info.st_nlink != 1:
        raise _refuse(HostCode.PROVIDER_UNSAFE, f"{relpath!r} has {info.st_nlink} hard links")
    allowed = {0} if os.geteuid() == 0 else {0, os.geteuid()}
    if info.st_uid not in allowed:
        raise _refuse(
            HostCode.PROVIDER_UNSAFE, f"{relpath!r} is owned by uid {info.st_uid}, not root"
        )
