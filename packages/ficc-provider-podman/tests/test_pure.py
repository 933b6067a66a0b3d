"""Pure parts of the Podman provider: configuration, argv, device results."""

from __future__ import annotations

import copy
import os
import shutil
import threading
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from ficc_provider_podman import container, observe
from ficc_provider_podman import driver as podman_driver
from ficc_provider_podman.account import SlotAccount, processes_by_uid, processes_of
from ficc_provider_podman.config import Config, load
from ficc_provider_podman.errors import ProviderError
from ficc_provider_podman.observe import parse_device_results

SHA = "sha256:" + "a" * 64

#: a loaded configuration names root-owned files only
root_files = pytest.mark.root("the configuration it loads must name root-owned files")


def _valid(tmp_path: Path) -> dict[str, Any]:
    archive = tmp_path / "image.tar"
    archive.write_bytes(b"not read at configure time")
    archive.chmod(0o644)
    return {
        "images": [
            {"digest": SHA, "archive": str(archive), "archive_sha256": SHA, "image_id": SHA}
        ],
        "devices": [{"name": "full", "path": "/dev/full"}],
    }


@root_files
def test_a_valid_configuration_loads_with_defaults(tmp_path: Path) -> None:
    config = load(_valid(tmp_path))
    assert config.podman == "/usr/bin/podman"
    assert config.runtime_devices == ["/dev/null", "/dev/random", "/dev/urandom"]


@pytest.mark.parametrize(
    "change",
    [
        {"surprise": 1},
        {"runtime": "crun"},
        {"podman": "podman"},
        {"nofile": 20001},
        {
            "devices": [
                {"name": "full", "path": "/dev/full"},
                {"name": "full2", "path": "/dev/full"},
            ]
        },
        {"storage_target": "/.ficc"},
        {"images": []},
    ],
)
def test_bad_configurations_are_refused(tmp_path: Path, change: dict[str, Any]) -> None:
    data = {**_valid(tmp_path), **change}
    with pytest.raises(ProviderError) as refused:
        load(data)
    assert refused.value.code == "podman_config"


def test_an_archive_others_may_write_is_refused(tmp_path: Path) -> None:
    data = _valid(tmp_path)
    os.chmod(data["images"][0]["archive"], 0o666)
    with pytest.raises(ProviderError, match="writable only by root"):
        load(data)


def test_a_symlinked_archive_is_refused(tmp_path: Path) -> None:
    data = _valid(tmp_path)
    link = tmp_path / "link.tar"
    link.symlink_to(data["images"][0]["archive"])
    data = copy.deepcopy(data)
    data["images"][0]["archive"] = str(link)
    with pytest.raises(ProviderError, match="symbolic link"):
        load(data)


def _argv(config: Config, tmp_path: Path) -> list[str]:
    paths = container.AttemptPaths(str(tmp_path / "attempt"))
    devices = container.plan_devices(config, ["full"])
    return container.run_argv(
        config,
        SlotAccount(1234, 1234, str(tmp_path / "slot")),
        paths,
        attempt_id="0" * 32,
        image_id=SHA,
        barrier="/opt/ficc/barrier",
        devices=devices,
        payload=["/bin/echo", "hi"],
        processes=50000,
    )


@root_files
def test_the_argv_isolates_and_never_asks_podman_for_limits(tmp_path: Path) -> None:
    argv = _argv(load(_valid(tmp_path)), tmp_path)
    assert argv[:2] == ["/usr/bin/env", "-i"]
    for flag in (
        "--network=none",
        "--read-only",
        "--cap-drop=all",
        "no-new-privileges",
        "--cgroupns=private",
        "--ipc=private",
        "--uts=private",
        "--pid=private",
        "--pull=never",
        "--log-driver=passthrough",
        "core=0:0",
        "nproc=20000:20000",
    ):
        assert flag in argv
    # Rootless on cgroup v1: ignored or refused, so never passed (the service limits).
    assert not any(a.startswith(("--memory", "--pids-limit", "--cgroup-parent")) for a in argv)
    entry = argv.index("--entrypoint")
    assert argv[entry + 1] == container.BARRIER_TARGET
    image = argv.index("a" * 64)
    assert argv[image + 1 : image + 5] == [
        "/.ficc/control/release",
        "ficc-release-v1\n",
        "--devices",
        container.DEVICE_RESULTS,
    ]
    assert argv[-3:] == ["--", "/bin/echo", "hi"]


@root_files
def test_devices_split_into_allowed_and_refused(tmp_path: Path) -> None:
    config = load(
        {
            **_valid(tmp_path),
            "devices": [
                {"name": "full", "path": "/dev/full"},
                {"name": "zero", "path": "/dev/zero"},
            ],
        }
    )
    devices = container.plan_devices(config, ["full"])
    assert [d["path"] for d in devices.prepared] == [
        "/dev/null",
        "/dev/random",
        "/dev/urandom",
        "/dev/full",
    ]
    assert {d["name"] for d in devices.prepared} == {"runtime", "full"}
    assert devices.negative == ["/dev/zero", "/dev/tty"]
    assert devices.mapped == []


@root_files
def test_a_volume_path_podman_cannot_parse_is_refused(tmp_path: Path) -> None:
    config = load(_valid(tmp_path))
    with pytest.raises(ValueError, match="podman -v"):
        _argv(config, tmp_path / "a:b")


def test_device_results_parse_exactly_the_expected_devices() -> None:
    parsed = parse_device_results(b"0 /dev/null\n1 /dev/zero\n", ["/dev/null", "/dev/zero"])
    assert parsed == [{"path": "/dev/null", "opened": True}, {"path": "/dev/zero", "opened": False}]
    for bad in (b"0 /dev/null\n", b"0 /dev/null\n0 /dev/null\n1 /dev/zero\n", b"x /dev/null\n"):
        with pytest.raises(ProviderError) as refused:
            parse_device_results(bad, ["/dev/null", "/dev/zero"])
        assert refused.value.code == "runtime_report"


CID = "0123456789abcdef" * 4


def _conmon_exit(tmp_path: Path, status: bytes | None, cid: bytes = CID.encode()) -> Path:
    """A run directory with Podman's --cidfile and a runtime directory where conmon
    wrote `status` for that container (None: not yet)."""
    run, runtime = tmp_path / "run", tmp_path / "runtime"
    run.mkdir()
    (run / container.CONTAINER_ID).write_bytes(cid)
    exits = runtime / "libpod" / "tmp" / "exits"
    exits.mkdir(parents=True)
    if status is not None:
        (exits / CID).write_bytes(status)
    return tmp_path


def test_the_container_exit_is_read_where_conmon_writes_it(tmp_path: Path) -> None:
    base = _conmon_exit(tmp_path, b"137")
    assert observe.container_exit_status(str(base / "run"), str(base / "runtime")) == 137


@pytest.mark.parametrize(
    "cid", [b"", CID[:20].encode(), CID.upper().encode(), b"../" + CID[3:].encode()]
)
def test_a_container_id_podman_has_not_fully_written_is_not_yet_an_exit(
    tmp_path: Path, cid: bytes
) -> None:
    """Podman creates the --cidfile, then writes the ID: anything but a whole ID is read
    as "not yet", and the wrapper's status is the fallback."""
    base = _conmon_exit(tmp_path, b"0", cid=cid)
    assert observe.container_exit_status(str(base / "run"), str(base / "runtime")) is None


def test_no_exit_file_yet_is_no_exit(tmp_path: Path) -> None:
    base = _conmon_exit(tmp_path, None)
    assert observe.container_exit_status(str(base / "run"), str(base / "runtime")) is None
    shutil.rmtree(base / "runtime" / "libpod")
    assert observe.container_exit_status(str(base / "run"), str(base / "runtime")) is None


def test_a_link_below_the_runtime_directory_is_never_followed(tmp_path: Path) -> None:
    """Everything below the runtime directory belongs to the slot account: a link
    there (to a file of the account's choosing) is refused, not read."""
    base = _conmon_exit(tmp_path, b"0")
    libpod = base / "runtime" / "libpod"
    libpod.rename(base / "elsewhere")
    libpod.symlink_to(base / "elsewhere")
    with pytest.raises(ProviderError) as refused:
        observe.container_exit_status(str(base / "run"), str(base / "runtime"))
    assert refused.value.code == "runtime_report"
    libpod.unlink()
    (base / "elsewhere").rename(libpod)
    exit_file = libpod / "tmp" / "exits" / CID
    exit_file.unlink()
    exit_file.symlink_to(base / "run" / container.CONTAINER_ID)
    with pytest.raises(ProviderError):
        observe.container_exit_status(str(base / "run"), str(base / "runtime"))


@pytest.mark.parametrize("status", [b"-1", b"256", b"", b"1 2", b"x" * 17])
def test_an_exit_status_out_of_range_is_refused(tmp_path: Path, status: bytes) -> None:
    base = _conmon_exit(tmp_path, status)
    with pytest.raises(ProviderError) as refused:
        observe.container_exit_status(str(base / "run"), str(base / "runtime"))
    assert refused.value.code == "runtime_report"


HOST_MOUNTINFO = (
    "22 1 254:0 / / rw,relatime shared:1 - ext4 /dev/vda rw\n"
    "23 22 0:5 / /dev rw,nosuid shared:2 - devtmpfs udev rw,size=10m\n"
    "24 23 0:21 / /dev/pts rw,nosuid,noexec shared:3 - devpts devpts rw\n"
)
CONTAINER_MOUNTINFO = (
    "500 400 0:60 / / rw,relatime - overlay overlay rw\n"
    "501 500 0:61 / /dev rw,nosuid - tmpfs tmpfs rw,size=64k\n"
    "502 501 0:62 / /dev/shm rw,nosuid,nodev - tmpfs shm rw\n"
)


@pytest.mark.parametrize(
    ("mountinfo", "expected"),
    [(HOST_MOUNTINFO, "devtmpfs"), (CONTAINER_MOUNTINFO, "tmpfs"), ("", "devtmpfs")],
)
def test_device_nodes_are_expected_from_the_hosts_own_dev(mountinfo: str, expected: str) -> None:
    """Bound device nodes carry the type of the host's /dev: devtmpfs on a machine,
    tmpfs on a host that is itself a container (the systemd test container)."""
    assert container.host_dev_fs_type(mountinfo) == expected
    devices = container.Devices(prepared=[], positive=[], negative=[], mapped=[])
    rules = {r["target"]: r for r in container.generated_targets(devices, expected)}
    assert rules["/dev/null"]["fs_types"] == [expected]
    assert rules["/proc/kcore"]["fs_types"] == [expected]
    assert rules["/dev"]["fs_types"] == ["tmpfs"]  # the container's own /dev, not the host's


def test_the_live_dev_type_is_read_from_this_process_mount_table() -> None:
    with open("/proc/self/mountinfo", encoding="utf-8") as table:
        assert container.host_dev_fs_type() == container.host_dev_fs_type(table.read())


@root_files
def test_rows_of_different_slots_run_at_the_same_time_and_keep_their_order(
    tmp_path: Path,
) -> None:
    """Two slots' rows meet at a barrier: they can pass only if they run together. The
    two rows of one slot run one after another, in order."""
    driver = podman_driver.configure(_valid(tmp_path))
    meeting = threading.Barrier(2, timeout=30)
    order: list[int] = []

    def row(context: Any) -> dict[str, Any]:
        if context.n < 2:
            meeting.wait()
        order.append(context.n)
        return {"n": context.n}

    # only the slot's uid and the row's number matter here: stand-ins for typed contexts
    contexts = [SimpleNamespace(slot=SimpleNamespace(uid=1000 + n % 2), n=n) for n in range(4)]
    replies = driver._per_slot(contexts, row)
    assert [r["n"] for r in replies] == [0, 1, 2, 3]
    assert order.index(0) < order.index(2)
    assert order.index(1) < order.index(3)


def test_one_walk_of_proc_finds_each_accounts_processes() -> None:
    me = os.getuid()
    found = processes_by_uid({me, 2**31})
    assert os.getpid() in found[me]
    assert 2**31 not in found
    assert os.getpid() in processes_of(me)


@root_files
def test_one_observe_call_walks_proc_once_for_all_its_rows(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    driver = podman_driver.configure(_valid(tmp_path))
    walks: list[set[int]] = []

    def walk(uids: set[int]) -> dict[int, list[int]]:
        walks.append(set(uids))
        return {}

    monkeypatch.setattr(podman_driver.accounts, "processes_by_uid", walk)
    monkeypatch.setattr(podman_driver.accounts, "processes_of", lambda uid: walk({uid}))
    # stand-ins for typed contexts: observe reads only the slot, the attempt and its
    # directory
    contexts = [
        SimpleNamespace(
            slot=SimpleNamespace(uid=1000 + n, gid=1000, path=str(tmp_path)),
            attempt_id=f"{n:032x}",
            attempt_directory="/x",
        )
        for n in range(3)
    ]
    replies = driver.observe(contexts)  # type: ignore[arg-type]
    assert [r["error"] for r in replies] == ["not_prepared"] * 3  # no state: each row refused
    assert walks == [{1000, 1001, 1002}]
