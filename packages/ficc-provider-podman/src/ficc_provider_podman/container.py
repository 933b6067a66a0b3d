"""The container of one attempt: the `podman run` command line and what it must look like.

Pure: from the configuration, the slot account, the attempt's paths and the plan, it
builds the argv the host runs inside the attempt's service (as the slot account) and
the parts of the prepare result that describe the container to the payload gate:
bind mounts with their recorded identities, the targets the runtime generates
itself, and the devices: the runtime's nodes and the bundles the plan holds (their
nodes, links, files and environment; bundles.py), the other devices of their kinds
shown and refused.

Isolation (docs/providers.md) and how each flag is realised rootless on this host:
- `--network=none`, `--read-only`, `--cap-drop=all`, `no-new-privileges`, Podman's
  default seccomp profile, private IPC/UTS/PID/cgroup namespaces.
- User mapping: rootless Podman with no subuid range maps container root to the slot
  account, so the payload runs with the slot's host UID/GID in all four fields.
- Resource limits: rootless Podman on cgroup v1 ignores `--memory`/`--pids-limit` and
  cannot create cgroups, so `--cgroup-parent` fails. None is passed: the container
  stays in the host's service cgroup, whose limits and device policy apply to it.
- `--ulimit core=0:0 nofile=N:N nproc=P:P` (N, P <= 20000).
- The barrier is the entrypoint, bind-mounted read-only from the installed package;
  the attempt's control directory (release marker) is mounted read-only.
- `--rm`: `podman run` removes the container before it returns (inside the service,
  whose main process the host leaves a few seconds to end by itself after the exit),
  so release starts no Podman when removal.py can prove it from the slot's files.
- `--log-driver=passthrough`: the container's stdout and stderr ARE the host's log
  files given to the service (no copy by conmon, nothing in Podman's storage).
- The environment: `env -i` gives Podman exactly HOME, XDG_RUNTIME_DIR, TMPDIR and
  PATH of the slot's Podman directories, whatever environment the service has.
- The exit status, two ways. conmon writes the container's status the moment it
  reaps the container (`--cidfile` names the container, see observe.py); `podman
  run` itself returns it only after tearing the container down and a wait that
  polls. And `podman run` exits with the container's status (125-127 for Podman's
  own failures, when no container ran): a minimal `/bin/sh` wrapper records that in
  the provider's run directory, inside the service, because an attached run removes
  conmon's file as it exits. The wrapper's file is made at prepare, so a full slot
  cannot lose it.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from ficc_provider_podman import bundles as bundleslib
from ficc_provider_podman.account import SlotAccount
from ficc_provider_podman.bundle import FileMount
from ficc_provider_podman.config import MAX_ULIMIT, OCI_DEFAULT_DEVICES, Config

ENV = "/usr/bin/env"
SHELL = "/bin/sh"
BARRIER_TARGET = "/.ficc/barrier"
CONTROL_TARGET = "/.ficc/control"
RELEASE_MARKER = "release"
RELEASE_CONTENT = "ficc-release-v1\n"
"""The exact bytes of the host's release marker (gate.RELEASE_CONTENT)."""
DEVICE_RESULTS = "/run/.ficc-devices"
"""Written by the barrier inside the container (a private tmpfs) before it waits."""
RUNTIME_DEVICE_NAME = "runtime"
"""Name of prepared devices that Podman itself needs, serving no plan device."""
EXIT_STATUS = "exit-status"
CONTAINER_ID = "container-id"
"""The `--cidfile` Podman writes in the provider's run directory at create."""

_WRAPPER = (
    'exit_file=$0; "$@"; status=$?; '
    'printf "%-3s\\n" "$status" 1<> "$exit_file.tmp" && mv -f "$exit_file.tmp" "$exit_file"; '
    'exit "$status"'
)
"""`1<>` overwrites the 4 bytes of the file prepare made (`EXIT_STATUS_BLANK`) in place:
no block and no inode is allocated, so the status is recorded even when the payload
filled the slot's filesystem."""
EXIT_STATUS_BLANK = b"    "

_NSE = ["nosuid", "nodev", "noexec"]
_UNSAFE_IN_VOLUME = (":", ",", "\n", "\x00")


RUN = "run"
"""The slot account's directory in the provider's part (Podman's `--cidfile`, the
run wrapper's exit status)."""
INPUTS = "inputs"
ENVIRONMENT = "environment"
STATE = "state.json"


@dataclass(frozen=True)
class AttemptPaths:
    """The host's attempt layout (`S/ficc/<attempt>/...`) and the provider's own."""

    attempt_dir: str

    @property
    def provider(self) -> str:
        return f"{self.attempt_dir}/provider"

    @property
    def storage(self) -> str:
        return f"{self.attempt_dir}/storage"

    @property
    def control(self) -> str:
        return f"{self.attempt_dir}/control"

    @property
    def inputs(self) -> str:
        return f"{self.provider}/{INPUTS}"

    @property
    def run(self) -> str:
        return f"{self.provider}/{RUN}"

    @property
    def env_file(self) -> str:
        return f"{self.provider}/{ENVIRONMENT}"

    @property
    def state_file(self) -> str:
        return f"{self.provider}/{STATE}"

    @property
    def exit_file(self) -> str:
        return f"{self.run}/{EXIT_STATUS}"

    @property
    def cid_file(self) -> str:
        return f"{self.run}/{CONTAINER_ID}"


@dataclass(frozen=True)
class Devices:
    """Which nodes the service allows (prepared) and what the runner must see."""

    prepared: list[dict[str, Any]]
    positive: list[str]
    negative: list[str]
    mapped: list[str]
    """Nodes passed with --device (configured ones; runc adds the OCI defaults)."""
    aliases: list[tuple[str, str]] = field(default_factory=list)
    """(node, alias): a node bound at a second path too (a vendor hook's link)."""
    mounts: list[FileMount] = field(default_factory=list)
    """The granted devices' read-only file mounts (driver libraries and tools)."""
    environment: dict[str, str] = field(default_factory=dict)
    """The granted devices' environment."""


def container_name(attempt_id: str) -> str:
    return f"ficc-{attempt_id}"


def device_node(path: str) -> tuple[int, int]:
    st = os.stat(path, follow_symlinks=False)
    return os.major(st.st_rdev), os.minor(st.st_rdev)


def plan_devices(
    config: Config, requested: list[str], resolved: bundleslib.Bundles | None = None
) -> Devices:
    """Runtime devices and the granted bundles' nodes are allowed; every other node the
    container shows (the runtime's defaults, the other devices of the granted kinds,
    their links) is not, unless it has the numbers of an allowed node (then it opens
    too, and is neither)."""
    grant = (resolved or bundleslib.resolve(config)).grant(requested)
    granted = [*grant.own, *grant.shared]
    entries = [(RUNTIME_DEVICE_NAME, path, *device_node(path)) for path in config.runtime_devices]
    entries += [(name, node.path, node.major, node.minor) for name, node in granted]
    prepared = [{"name": n, "path": p, "major": a, "minor": b} for n, p, a, b in entries]
    allowed = {path for _, path, _, _ in entries}
    numbers = {(major, minor) for _, _, major, minor in entries}
    shown = [node for _, node in granted] + grant.others
    mapped = [node.path for node in shown if node.path not in OCI_DEFAULT_DEVICES]
    refused = [p for p in OCI_DEFAULT_DEVICES if p not in allowed and device_node(p) not in numbers]
    refused += [n.path for n in grant.others if n.path not in allowed and n.numbers not in numbers]
    refused += [alias for node in grant.others for alias in node.aliases]
    return Devices(
        prepared=prepared,
        positive=sorted(allowed),
        negative=list(dict.fromkeys(refused)),
        mapped=list(dict.fromkeys(mapped)),
        aliases=[(node.path, alias) for node in shown for alias in node.aliases],
        mounts=grant.mounts,
        environment=grant.environment,
    )


def _volume(source: str, target: str, options: str) -> list[str]:
    if any(char in source for char in _UNSAFE_IN_VOLUME):
        raise ValueError(f"path {source!r} cannot be given to podman -v")
    return ["-v", f"{source}:{target}:{options}"]


def _alias(node: str, alias: str) -> list[str]:
    """A device node bound at a second path (`--device` cannot carry the `:` of
    `/dev/dri/by-path/pci-0000:...`; `--mount` can)."""
    if any(char in f"{node}{alias}" for char in _UNSAFE_IN_VOLUME[1:]):
        raise ValueError(f"device link {alias!r} cannot be given to podman --mount")
    return ["--mount", f"type=bind,source={node},destination={alias},nosuid,noexec"]


def _file(file: FileMount) -> list[str]:
    """A granted device's file, read-only, nosuid and nodev (and noexec when asked)."""
    return _volume(file.source, file.target, "ro,nosuid,nodev" + (",noexec" * file.noexec))


def mounts(
    config: Config, paths: AttemptPaths, barrier: str, files: Sequence[FileMount] = ()
) -> list[dict[str, Any]]:
    """The bind mounts, with the identity of each source recorded now (prepare), and the
    granted devices' `files` with the identity recorded when they were configured (the
    host checks both against the real files before it accepts the result)."""
    entries = [
        (barrier, BARRIER_TARGET, True),
        (paths.control, CONTROL_TARGET, True),
        (paths.inputs, config.inputs_target, True),
        (paths.storage, config.storage_target, False),
    ]
    result = []
    for source, target, read_only in entries:
        st = os.stat(source, follow_symlinks=False)
        result.append(
            {
                "source": source,
                "target": target,
                "read_only": read_only,
                "identity": {"device": st.st_dev, "inode": st.st_ino},
            }
        )
    for file in files:
        result.append(
            {
                "source": file.source,
                "target": file.target,
                "read_only": True,
                "identity": {"device": file.device, "inode": file.inode},
            }
        )
    return result


def generated_targets(devices: Devices, dev_fs: str = "devtmpfs") -> list[dict[str, Any]]:
    """What rootless Podman + runc mount themselves (recorded from a real container);
    `dev_fs` is the type of the host's /dev (`host_dev_fs_type`)."""

    def rule(
        target: str,
        fs_types: list[str],
        options: list[str],
        *,
        read_only: bool | None = None,
        subtree: bool = False,
    ) -> dict[str, Any]:
        return {
            "target": target,
            "fs_types": fs_types,
            "subtree": subtree,
            "read_only": read_only,
            "required_options": options,
        }

    host_files = ["ext4", "xfs", "btrfs", "tmpfs"]
    rules = [
        rule("/", ["overlay"], [], read_only=True),
        rule("/dev", ["tmpfs"], ["nosuid", "noexec"]),
        rule("/dev/pts", ["devpts"], ["nosuid", "noexec"]),
        rule("/dev/mqueue", ["mqueue"], _NSE),
        rule("/dev/shm", ["tmpfs"], _NSE),  # noqa: S108 (a path inside the container)
        rule("/proc", ["proc"], _NSE, subtree=True),
        rule("/sys", ["sysfs"], _NSE, read_only=True),
        rule("/sys/fs/cgroup", ["tmpfs", "cgroup", "cgroup2"], _NSE, subtree=True),
        *(
            rule(t, ["tmpfs"], ["nosuid", "nodev"], read_only=False)
            for t in ("/tmp", "/run", "/var/tmp")  # noqa: S108 (paths inside the container)
        ),
        *(rule(t, host_files, _NSE, read_only=True) for t in ("/etc/hosts", "/etc/hostname")),
        # Masked paths: an empty read-only tmpfs over directories, /dev/null over files.
        *(
            rule(t, ["tmpfs"], [], read_only=True)
            for t in ("/proc/acpi", "/proc/scsi", "/sys/firmware", "/sys/dev/block")
        ),
        *(
            rule(t, [dev_fs], [])
            for t in (
                "/proc/kcore",
                "/proc/keys",
                "/proc/latency_stats",
                "/proc/timer_list",
                "/proc/timer_stats",
                "/proc/sched_debug",
            )
        ),
    ]
    # Rootless runc cannot mknod: every device node is a bind mount of the host's node,
    # of the file system it lives on (the host's /dev, or where the administrator made
    # it). The device policy of the service, not the mount, decides whether it opens.
    types = node_fs_types([*devices.mapped, *(node for node, _ in devices.aliases)])
    rules += [rule(path, [dev_fs], []) for path in OCI_DEFAULT_DEVICES]
    rules += [rule(path, [types.get(path, dev_fs)], []) for path in devices.mapped]
    rules += [rule(alias, [types.get(node, dev_fs)], []) for node, alias in devices.aliases]
    return rules


def node_fs_types(paths: Sequence[str], mountinfo: str | None = None) -> dict[str, str]:
    """The file system type each node lives on (its st_dev's mount), from the provider's
    own mount table; a node not found is left out (the caller assumes the host's /dev,
    which then fails the gate closed if wrong)."""
    if not paths:
        return {}
    if mountinfo is None:
        with open("/proc/self/mountinfo", encoding="utf-8") as table:
            mountinfo = table.read()
    by_device: dict[str, str] = {}
    for line in mountinfo.splitlines():
        fields, _, tail = line.partition(" - ")
        parts = fields.split()
        if len(parts) > 2 and tail.split()[:1]:
            by_device[parts[2]] = tail.split()[0]
    found = {}
    for path in paths:
        try:
            st = os.stat(path, follow_symlinks=False)
        except OSError:
            continue
        key = f"{os.major(st.st_dev)}:{os.minor(st.st_dev)}"
        if key in by_device:
            found[path] = by_device[key]
    return found


def host_dev_fs_type(mountinfo: str | None = None) -> str:
    """The file system type of the host's /dev, where bind-mounted device nodes (and the
    /dev/null masking /proc files) come from: devtmpfs on most hosts, tmpfs where /dev
    is populated by a container engine (a host that is itself a container). Read from
    the provider's own mount table, which is the daemon's: the runtime binds from it.
    A host without a /dev mount falls back to devtmpfs, which then matches nothing and
    fails the gate closed."""
    if mountinfo is None:
        with open("/proc/self/mountinfo", encoding="utf-8") as table:
            mountinfo = table.read()
    found = "devtmpfs"
    for line in mountinfo.splitlines():
        fields, _, tail = line.partition(" - ")
        parts = fields.split()
        if len(parts) > 4 and parts[4] == "/dev" and tail.split()[:1]:
            found = tail.split()[0]  # the last mount on /dev is the visible one
    return found


def isolation_flags(config: Config, nproc: int) -> list[str]:
    """The `podman run` flags that give the isolation the host's gate checks.

    One list, so the P6 baseline (a bare `podman run` "with the same flags") can never
    drift from what a real attempt runs with.
    """
    return [
        "--pull=never",
        "--network=none",
        "--read-only",
        "--cap-drop=all",
        "--security-opt",
        "no-new-privileges",
        "--cgroupns=private",
        "--ipc=private",
        "--uts=private",
        "--pid=private",
        "--log-driver=passthrough",
        "--ulimit",
        "core=0:0",
        "--ulimit",
        f"nofile={config.nofile}:{config.nofile}",
        "--ulimit",
        f"nproc={nproc}:{nproc}",
    ]


def run_argv(
    config: Config,
    account: SlotAccount,
    paths: AttemptPaths,
    *,
    attempt_id: str,
    image_id: str,
    barrier: str,
    devices: Devices,
    payload: list[str],
    processes: int,
) -> list[str]:
    """The argv the host runs in the attempt's service, as the slot account."""
    nproc = min(processes, MAX_ULIMIT)
    run = [
        "run",
        "--rm",
        "--name",
        container_name(attempt_id),
        "--cidfile",
        paths.cid_file,
        *isolation_flags(config, nproc),
        "--env-file",
        paths.env_file,
        "--workdir",
        config.storage_target,
        "--entrypoint",
        BARRIER_TARGET,
        *_volume(barrier, BARRIER_TARGET, "ro,nosuid,nodev"),
        *_volume(paths.control, CONTROL_TARGET, "ro,nosuid,nodev,noexec"),
        *_volume(paths.inputs, config.inputs_target, "ro,nosuid,nodev,noexec"),
        *_volume(paths.storage, config.storage_target, "rw,nosuid,nodev"),
        *(argument for path in devices.mapped for argument in ("--device", f"{path}:{path}")),
        *(argument for node, alias in devices.aliases for argument in _alias(node, alias)),
        *(argument for file in devices.mounts for argument in _file(file)),
        image_id.removeprefix("sha256:"),
        f"{CONTROL_TARGET}/{RELEASE_MARKER}",
        RELEASE_CONTENT,
        "--devices",
        DEVICE_RESULTS,
        *devices.positive,
        *devices.negative,
        "--",
        *payload,
    ]
    environment = [f"{key}={value}" for key, value in account.environment().items()]
    wrapper = [SHELL, "-c", _WRAPPER, paths.exit_file]
    # Rootless notices (no subuid range, "/" not shared) would otherwise open every
    # job's stderr; the exit status still tells Podman's failures (125-127) apart.
    podman = account.podman(config, log_level="fatal")
    return [ENV, "-i", *environment, *wrapper, *podman, *run]
