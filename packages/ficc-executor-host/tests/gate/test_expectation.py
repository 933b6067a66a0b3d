"""The prepare result's validation and the gate Expectation built from it.

Real files where identities matter (/dev/null, /dev/zero, the system shell as a
root-owned barrier, a temporary directory as a mount source); everything else is pure.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import msgspec
import pytest

from ficc.execution import plan as planlib
from ficc.execution.host.core.errors import HostError
from ficc.execution.host.gate import checks as gate
from ficc.execution.host.gate import reader as gate_reader
from ficc.execution.host.gate.expectation import (
    PrepareResult,
    build_expectation,
    check_device_opens,
    check_prepare_result,
    decode_prepare_result,
    device_rules,
)
from ficc.execution.host.linux import evidence as evidencelib
from ficc.execution.host.service.interface import ServiceHandle
from ficc_testkit.plans import make_plan

SHA = "sha256:" + "a" * 64
BARRIER = os.path.realpath("/bin/sh")
SERVICE = "/ficc/ficc-work-x"


def plan(devices: tuple[str, ...] = ("null",)) -> planlib.Plan:
    return make_plan(
        package_digest=SHA, image_digest=SHA, cpu_millis=500, memory_bytes=1 << 28,
        storage_bytes=1 << 20, storage_inodes=100, devices=devices,
    )  # fmt: skip


def identity(path: str) -> dict[str, int]:
    st = os.stat(path)
    return {"device": st.st_dev, "inode": st.st_ino}


def reply(**changes: Any) -> dict[str, Any]:
    """A good prepare reply as a provider would send it (plain JSON-like values)."""
    base: dict[str, Any] = {
        "argv": [BARRIER, "-c", "exit 0"],
        "barrier": {"path": BARRIER, "identity": identity(BARRIER)},
        "devices": [{"name": "null", "path": "/dev/null", "major": 1, "minor": 3}],
        "mounts": [],
        "generated_targets": [{"target": "/proc", "fs_types": ["proc"], "subtree": True}],
        "positive_devices": ["/dev/null"],
        "negative_devices": ["/dev/zero"],
    }
    base.update(changes)
    return base


def checked(data: dict[str, Any], for_plan: planlib.Plan | None = None) -> PrepareResult:
    result = decode_prepare_result(data)
    check_prepare_result(result, for_plan or plan())
    return result


def refused() -> Any:
    return pytest.raises(HostError, match=r"^provider_malformed:")


# --- decoding and checking ---------------------------------------------------------------


def test_a_good_reply_decodes_and_checks() -> None:
    result = checked(reply())
    assert result.devices[0].path == "/dev/null"
    assert result.generated_targets[0].required_options == ["nosuid", "nodev"]
    assert device_rules(result)[0].major == 1


@pytest.mark.parametrize(
    "bad",
    [
        {"surprise": 1},
        {"argv": []},
        {"argv": "not a list"},
        {"barrier": {"path": BARRIER}},
        {"barrier": BARRIER},
        {"devices": [{"name": "null", "path": "/dev/null", "major": 1}]},
        {"mounts": [{"source": "/tmp", "target": "/x", "read_only": True}]},
        {"generated_targets": [{"target": "/proc", "fs_types": []}]},
        {
            "generated_targets": [
                {"target": "/proc", "fs_types": ["proc"], "required_options": ["rw"]}
            ]
        },
        {"positive_devices": ["relative"]},
    ],
)
def test_malformed_replies_are_refused_at_decode(bad: dict[str, Any]) -> None:
    with refused():
        decode_prepare_result(reply(**bad))


def test_relative_program_is_refused() -> None:
    with refused():
        checked(reply(argv=["sh", "-c", "true"]))


def test_barrier_must_be_the_recorded_root_owned_file(tmp_path: Path) -> None:
    other = identity("/dev/null")
    with refused():
        checked(reply(barrier={"path": BARRIER, "identity": other}))
    with refused():
        checked(reply(barrier={"path": "/bin/sh", "identity": identity(BARRIER)}))  # a link
    writable = tmp_path / "barrier"
    writable.write_bytes(b"#!/bin/sh\n")
    writable.chmod(0o777)
    with refused():
        checked(reply(barrier={"path": str(writable), "identity": identity(str(writable))}))


def test_devices_must_serve_plan_devices_and_match_the_real_node() -> None:
    with refused():  # not a device of the plan
        checked(reply(), plan(devices=()))
    wrong_minor = [{"name": "null", "path": "/dev/null", "major": 1, "minor": 5}]
    with refused():
        checked(reply(devices=wrong_minor))
    not_a_node = [{"name": "null", "path": BARRIER, "major": 1, "minor": 3}]
    with refused():
        checked(reply(devices=not_a_node, positive_devices=[]))
    twice = [
        {"name": "null", "path": "/dev/null", "major": 1, "minor": 3},
        {"name": "gpu", "path": "/dev/null", "major": 1, "minor": 3},
    ]
    with refused():
        checked(reply(devices=twice), plan(devices=("null", "gpu")))


def test_runtime_devices_are_only_the_shared_pseudo_devices() -> None:
    runtime = [
        {"name": "runtime", "path": "/dev/zero", "major": 1, "minor": 5},
        {"name": "null", "path": "/dev/null", "major": 1, "minor": 3},
    ]
    result = checked(reply(devices=runtime, negative_devices=[]), plan(devices=("null",)))
    assert [d.name for d in result.devices] == ["runtime", "null"]
    disguised = [{"name": "runtime", "path": "/dev/kmsg", "major": 1, "minor": 11}]
    with refused():
        checked(reply(devices=disguised, positive_devices=[], negative_devices=[]))


def test_positive_and_negative_devices_must_agree_with_the_prepared_ones() -> None:
    with refused():
        checked(reply(positive_devices=["/dev/zero"], negative_devices=[]))
    with refused():
        checked(reply(negative_devices=["/dev/null"]))


def test_mount_source_must_have_the_recorded_identity(tmp_path: Path) -> None:
    source = str(tmp_path)
    good = {"source": source, "target": "/data", "read_only": True, "identity": identity(source)}
    assert checked(reply(mounts=[good])).mounts[0].target == "/data"
    with refused():
        checked(reply(mounts=[{**good, "identity": identity("/dev/null")}]))
    with refused():
        checked(reply(mounts=[good, good]))
    with refused():
        checked(reply(mounts=[{**good, "target": "/data/../etc"}]))


@pytest.mark.parametrize(
    ("opened", "ok"),
    [
        ({"/dev/null": True, "/dev/zero": False}, True),
        ({"/dev/null": True, "/dev/zero": False, "/dev/full": True}, True),
        ({"/dev/null": False, "/dev/zero": False}, False),  # the prepared node was refused
        ({"/dev/null": True, "/dev/zero": True}, False),  # the policy is not closed
        ({"/dev/null": True}, False),  # a negative device was never tried
        (None, False),  # no ready-phase results at all
    ],
)
def test_device_open_results_must_agree_with_the_prepared_policy(
    opened: dict[str, bool] | None, ok: bool
) -> None:
    result = checked(reply())
    if ok:
        check_device_opens(result, opened)
    else:
        with pytest.raises(HostError, match=r"^gate_device:"):
            check_device_opens(result, opened)


def test_no_device_expectations_need_no_results() -> None:
    check_device_opens(checked(reply(positive_devices=[], negative_devices=[])), None)


# --- the expectation -----------------------------------------------------------------------


def handle(version: int = 1) -> ServiceHandle:
    keys = ["memory", "pids", "cpu,cpuacct", "devices", "freezer", "unified"]
    if version == 2:
        keys = ["unified"]
    cgroups = {key: f"/sys/fs/cgroup/{key}{SERVICE}" for key in keys}
    return msgspec.convert(
        {
            "name": "ficc-work-x",
            "backend": "cgroupfs",
            "cgroup_version": version,
            "cgroups": cgroups,
            "main_pid": None,
            "main_start_ticks": None,
        },
        ServiceHandle,
    )


def expectation(version: int = 1, **changes: Any) -> gate.Expectation:
    logs = (evidencelib.FileIdentity(1, 2), evidencelib.FileIdentity(1, 3))
    return build_expectation(
        uid=1000,
        gid=1001,
        result=checked(reply(**changes)),
        handle=handle(version),
        service_cgroup=SERVICE,
        processes=64,
        log_files=logs,
        nofile=512,
    )


def test_expectation_binds_slot_barrier_cgroups_and_limits() -> None:
    built = expectation()
    barrier = os.stat(BARRIER)
    assert (built.uid, built.gid) == (1000, 1001)
    assert built.barrier == evidencelib.FileIdentity(barrier.st_dev, barrier.st_ino)
    assert {(c.controller, c.path) for c in built.cgroups} == {
        ("memory", SERVICE),
        ("pids", SERVICE),
        ("cpu", SERVICE),
        ("devices", SERVICE),
        ("freezer", SERVICE),
        ("", SERVICE),
    }
    assert {(r.name, r.maximum) for r in built.rlimits} == {("nofile", 512), ("nproc", 64)}
    assert built.user_namespace
    assert built.cgroup_namespace


def test_expectation_allows_only_null_stdin_and_the_host_log_files() -> None:
    fds = {f.fd: f for f in expectation().fds}
    assert set(fds) == {0, 1, 2}
    assert not fds[0].pipe
    assert fds[0].files == ()
    assert fds[1].files == (evidencelib.FileIdentity(1, 2), evidencelib.FileIdentity(1, 3))


def test_expectation_device_policy_is_the_closed_policy_on_v1_and_v2() -> None:
    for version in (1, 2):
        devices = expectation(version).devices
        assert devices is not None
        assert {(d.type, d.major, d.minor, d.access) for d in devices} == {
            ("c", None, None, "m"),
            ("b", None, None, "m"),
            ("c", 1, 3, "rwm"),
        }
    assert [c.controller for c in expectation(2).cgroups] == [""]


def test_expectation_mounts_carry_recorded_identities(tmp_path: Path) -> None:
    source = str(tmp_path)
    st = os.stat(source)
    mount = {"source": source, "target": "/data", "read_only": True, "identity": identity(source)}
    built = expectation(mounts=[mount])
    (prepared,) = built.mounts
    assert (prepared.target, prepared.read_only) == ("/data", True)
    assert (prepared.major, prepared.minor) == (os.major(st.st_dev), os.minor(st.st_dev))
    assert prepared.identity == evidencelib.FileIdentity(st.st_dev, st.st_ino)
    (generated,) = built.generated
    assert (generated.target, generated.fs_types, generated.subtree) == ("/proc", ("proc",), True)


def test_an_unconfined_process_fails_the_built_expectation() -> None:
    """The builder's output is usable by the real gate: this test process is refused."""
    verdict = gate.check(gate_reader.read_evidence(os.getpid()), expectation())
    codes = {failure.code for failure in verdict.failures}
    assert not verdict.ok
    assert {"gate_uid", "gate_namespace", "gate_exe", "gate_cgroup"} <= codes
