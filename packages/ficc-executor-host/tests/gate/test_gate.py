"""Tests of the live-process evidence reader (procfs) and the payload gate.

Most tests judge REAL processes: a plain `sleep` as root, `setpriv` as a real
non-root account, `unshare`, and a small spawner (SPAWNER below) that builds a
complete confined process with ctypes: new mnt/pid/net/ipc/uts namespaces, a
read-only tmpfs root with bind mounts, a test cgroup, rlimits, an empty bounding set,
NoNewPrivs, an allow-all seccomp filter and a slot UID, then executes a static
busybox copy used as the "barrier". The complete process passes every check; each
variant removes exactly one control and must fail with exactly that check's code, so
every check is shown to discriminate on its own.
"""

from __future__ import annotations

import contextlib
import json
import os
import platform
import shutil
import stat
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ficc.execution.host.core.errors import HostError
from ficc.execution.host.gate import checks as gate
from ficc.execution.host.gate import reader as gate_reader
from ficc.execution.host.gate.checks import (
    CgroupRequirement,
    Expectation,
    FdAllowance,
    GeneratedMount,
    PreparedMount,
    RlimitCeiling,
)
from ficc.execution.host.linux import evidence as evidencelib
from ficc.execution.host.linux import procfs, procparse, seccomp
from ficc.execution.host.linux.evidence import FileIdentity
from ficc.execution.host.service import bpfdevices, cgroups
from ficc.execution.host.service.interface import DeviceRule
from ficc.execution.provider import tasks
from ficc_testkit.accounts import temporary_account
from ficc_testkit.waits import wait_for

HIERARCHIES = ("pids", "devices", "unified")
BUSYBOX = "/bin/busybox"

requires_root = pytest.mark.root(
    "real-process gate tests need root (they create users, cgroups and namespaces)"
)

# ---------------------------------------------------------------- pure parsers

STATUS_SAMPLE = b"""Name:\tsleep
Umask:\t0022
State:\tS (sleeping)
Uid:\t1001\t1002\t1003\t1004
Gid:\t2001\t2002\t2003\t2004
Groups:\t5 27 100
NoNewPrivs:\t1
Seccomp:\t2
Seccomp_filters:\t3
CapInh:\t0000000000000000
CapPrm:\t0000000000000001
CapEff:\t0000000000000002
CapBnd:\t000001ffffffffff
CapAmb:\t0000000000000000
"""


def test_parse_status_reads_all_four_ids_and_every_capability_set() -> None:
    status = procparse.parse_status(STATUS_SAMPLE)
    assert status.uid == evidencelib.Ids(1001, 1002, 1003, 1004)
    assert status.gid == evidencelib.Ids(2001, 2002, 2003, 2004)
    assert status.groups == (5, 27, 100)
    assert status.capabilities == evidencelib.Capabilities(
        effective=2, permitted=1, bounding=0x1FFFFFFFFFF, inheritable=0, ambient=0
    )
    assert (status.no_new_privs, status.seccomp, status.seccomp_filters) == (1, 2, 3)


@pytest.mark.parametrize(
    "broken",
    [
        STATUS_SAMPLE.replace(b"Uid:\t1001\t1002\t1003\t1004", b"Uid:\t1001\t1002\t1003"),
        STATUS_SAMPLE.replace(b"CapEff:\t0000000000000002\n", b""),
        STATUS_SAMPLE.replace(b"CapBnd:\t000001ffffffffff", b"CapBnd:\tzz"),
        STATUS_SAMPLE.replace(b"NoNewPrivs:\t1\n", b""),
        STATUS_SAMPLE.replace(b"Seccomp:\t2", b"Seccomp:\t-1"),
        STATUS_SAMPLE.replace(b"Gid:\t2001", b"Gid:\t-2001"),
        b"\xff\xfe",
    ],
)
def test_parse_status_refuses_missing_or_malformed_fields(broken: bytes) -> None:
    with pytest.raises(HostError) as refused:
        procparse.parse_status(broken)
    assert refused.value.code == "gate_evidence"


def _stat_line(comm: bytes, start_time: int, state: bytes = b"S") -> bytes:
    # Fields 3..52 after the comm; field 22 (index 19 after the comm) is starttime.
    rest = [state] + [b"0"] * 49
    rest[19] = str(start_time).encode()
    return b"4242 (" + comm + b") " + b" ".join(rest) + b"\n"


@pytest.mark.parametrize(
    "comm", [b"sleep", b"a) b", b") 1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 16 17 18 19 20", b"(x)"]
)
def test_parse_stat_finds_start_time_past_a_hostile_comm(comm: bytes) -> None:
    parsed = procparse.parse_stat(_stat_line(comm, 987654))
    assert parsed == evidencelib.Stat(state="S", start_time=987654)


def test_parse_stat_on_a_recorded_line() -> None:
    recorded = (
        b"11375 (python) R 11374 11375 11374 0 -1 4194304 1 0 0 0 0 0 0 0 20 0 1 0 "
        b"47869 6000000 900 18446744073709551615 1 1 0 0 0 0 0 16781312 2 0 0 0 17 1 0 "
        b"0 0 0 0 0 0 0 0 0 0 0 0\n"
    )
    assert procparse.parse_stat(recorded) == evidencelib.Stat(state="R", start_time=47869)


@pytest.mark.parametrize(
    "broken", [b"", b"12 sleep S 1", b"12 (sleep) S 1 2 3", b"1 (x) " + b"a " * 30]
)
def test_parse_stat_refuses_truncated_lines(broken: bytes) -> None:
    with pytest.raises(HostError) as refused:
        procparse.parse_stat(broken)
    assert refused.value.code == "gate_evidence"


MOUNTINFO_SAMPLE = (
    b"36 35 98:0 /mnt1 /mnt2 rw,noatime master:1 - ext3 /dev/root rw,errors=continue\n"
    b"40 36 0:45 / /with\\040space\\011tab ro,nosuid,nodev shared:7 master:2 - tmpfs "
    b"tmp\\134fs ro,size=64k\n"
    b"41 36 254:0 /srv/in\\012put /data ro,nosuid,nodev,relatime - ext4 /dev/vda rw\n"
)


def test_parse_mountinfo_fields_optional_fields_and_octal_escapes() -> None:
    first, second, third = procparse.parse_mountinfo(MOUNTINFO_SAMPLE)
    assert first == evidencelib.Mount(
        mount_id=36,
        parent_id=35,
        major=98,
        minor=0,
        root="/mnt1",
        mount_point="/mnt2",
        mount_options=("rw", "noatime"),
        optional_fields=("master:1",),
        fs_type="ext3",
        source="/dev/root",
        super_options=("rw", "errors=continue"),
    )
    assert second.mount_point == "/with space\ttab"
    assert second.optional_fields == ("shared:7", "master:2")
    assert second.source == "tmp\\fs"
    assert second.super_options == ("ro", "size=64k")
    assert (third.major, third.minor, third.root) == (254, 0, "/srv/in\nput")
    assert third.optional_fields == ()


@pytest.mark.parametrize(
    "broken",
    [
        b"36 35 98:0 /mnt1 /mnt2 rw ext3 /dev/root rw\n",
        b"36 35 98-0 /mnt1 /mnt2 rw - ext3 /dev/root rw\n",
        b"36 35 98:0 /mnt1 /mnt2 rw - ext3 /dev/root\n",
        b"36 35 98:0 /mnt\xff /mnt2 rw - ext3 /dev/root rw\n",
    ],
)
def test_parse_mountinfo_refuses_malformed_lines(broken: bytes) -> None:
    with pytest.raises(HostError) as refused:
        procparse.parse_mountinfo(broken)
    assert refused.value.code == "gate_evidence"


def test_the_daemons_own_mount_table_is_read_each_time_and_parsed_when_it_changed() -> None:
    """Each start looks up where the daemon sees the cgroup hierarchies in its own
    mount table: read every time, parsed again only when its bytes changed."""
    with open("/proc/self/mountinfo", "rb") as own:
        expected = procparse.parse_mountinfo(own.read())
    procfs._own_mount_table.cache_clear()
    assert procfs.own_mounts(os.getpid()) == expected
    assert procfs.own_mounts(os.getpid()) == expected
    assert procfs._own_mount_table.cache_info().hits == 1
    other = procfs._own_mount_table(b"36 35 98:0 / /elsewhere rw - tmpfs src rw\n")
    assert [m.mount_point for m in other] == ["/elsewhere"]
    assert procfs.own_mounts(os.getpid()) == expected  # the new bytes are parsed again
    assert procfs._own_mount_table.cache_info().misses == 3


def _escape(path: str) -> bytes:
    out = bytearray()
    for byte in path.encode():
        out += b"\\%03o" % byte if byte in b" \t\n\\" else bytes([byte])
    return bytes(out)


PROPERTY_EXAMPLES = 5000 if os.environ.get("FICC_SOAK") == "1" else 200


@pytest.mark.soak
@settings(max_examples=PROPERTY_EXAMPLES, deadline=None)
@given(st.text(st.characters(blacklist_categories=("Cs",), blacklist_characters="\0"), min_size=1))
def test_mountinfo_escapes_round_trip(name: str) -> None:
    path = "/" + name
    line = b"1 0 0:1 / " + _escape(path) + b" rw - tmpfs src rw\n"
    (mount,) = procparse.parse_mountinfo(line)
    assert mount.mount_point == path


def test_parse_limits_on_a_recorded_sample() -> None:
    sample = (
        b"Limit                     Soft Limit           Hard Limit           Units     \n"
        b"Max cpu time              unlimited            unlimited            seconds   \n"
        b"Max core file size        0                    unlimited            bytes     \n"
        b"Max processes             96364                96364                processes \n"
        b"Max open files            20000                20000                files     \n"
        b"Max nice priority         0                    0                    \n"
        b"Max realtime timeout      unlimited            unlimited            us        \n"
    )
    limits = {limit.name: limit for limit in procparse.parse_limits(sample)}
    assert limits["core"] == evidencelib.Rlimit("core", 0, None)
    assert limits["nproc"] == evidencelib.Rlimit("nproc", 96364, 96364)
    assert limits["nofile"] == evidencelib.Rlimit("nofile", 20000, 20000)
    assert limits["nice"] == evidencelib.Rlimit("nice", 0, 0)
    assert limits["cpu"] == evidencelib.Rlimit("cpu", None, None)


def test_parse_limits_refuses_unknown_labels() -> None:
    sample = (
        b"Limit  Soft Limit  Hard Limit  Units\nMax wormholes             1        1        holes\n"
    )
    with pytest.raises(HostError) as refused:
        procparse.parse_limits(sample)
    assert refused.value.code == "gate_evidence"


def test_parse_cgroup_v1_and_v2_lines() -> None:
    entries = procparse.parse_cgroup(
        b"9:name=systemd:/\n2:cpu,cpuacct:/ficc/a b\n0::/ficc/attempt-1\n"
    )
    assert entries == (
        evidencelib.CgroupEntry(9, ("name=systemd",), "/"),
        evidencelib.CgroupEntry(2, ("cpu", "cpuacct"), "/ficc/a b"),
        evidencelib.CgroupEntry(0, (), "/ficc/attempt-1"),
    )
    with pytest.raises(HostError):
        procparse.parse_cgroup(b"0::relative\n")


def test_parse_namespace_links() -> None:
    assert procparse.parse_namespace_link("mnt", "mnt:[4026531832]") == 4026531832
    with pytest.raises(HostError):
        procparse.parse_namespace_link("mnt", "net:[4026531832]")


def test_parse_devices_list() -> None:
    assert procparse.parse_devices_list(b"c 1:3 rwm\nc *:* m\nb 8:* r\n") == (
        evidencelib.DeviceAccess("c", 1, 3, "rwm"),
        evidencelib.DeviceAccess("c", None, None, "m"),
        evidencelib.DeviceAccess("b", 8, None, "r"),
    )
    for broken in (b"c 1:3\n", b"x 1:3 r\n", b"c 1-3 r\n", b"c 1:3 rwx\n", b"c a:3 r\n"):
        with pytest.raises(HostError):
            procparse.parse_devices_list(broken)


def test_parse_fdinfo_flags_are_octal() -> None:
    assert procparse.parse_fdinfo(b"pos:\t0\nflags:\t0100002\nmnt_id:\t24\nino:\t3\n") == (
        0o100002,
        24,
    )


def test_read_bounded_refuses_symlinks_and_oversized_files(tmp_path: Path) -> None:
    (tmp_path / "big").write_bytes(b"x" * (evidencelib.MAX_PROC_FILE_BYTES + 1))
    (tmp_path / "fits").write_bytes(b"x" * evidencelib.MAX_PROC_FILE_BYTES)
    (tmp_path / "link").symlink_to(tmp_path / "fits")
    dir_fd = os.open(tmp_path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        assert len(procfs.read_bounded(dir_fd, "fits", 1)) == evidencelib.MAX_PROC_FILE_BYTES
        for name in ("big", "link"):
            with pytest.raises(HostError) as refused:
                procfs.read_bounded(dir_fd, name, 1)
            assert refused.value.code == "gate_evidence"
    finally:
        os.close(dir_fd)


def test_mount_point_identity_never_follows_a_link(tmp_path: Path) -> None:
    (tmp_path / "real").mkdir()
    (tmp_path / "real" / "file").write_text("x")
    (tmp_path / "link").symlink_to(tmp_path / "real")
    (tmp_path / "real" / "last").symlink_to(tmp_path / "real" / "file")
    root_fd = os.open(tmp_path, os.O_PATH | os.O_DIRECTORY)
    try:
        assert procfs.mount_point_identity(root_fd, "/real/file") == _identity(
            tmp_path / "real" / "file"
        )
        assert procfs.mount_point_identity(root_fd, "/") == _identity(tmp_path)
        assert procfs.mount_point_identity(root_fd, "/link/file") is None
        assert procfs.mount_point_identity(root_fd, "/real/../real/file") is None
        assert procfs.mount_point_identity(root_fd, "/missing") is None
        # A final symlink is stat'ed itself (O_PATH|O_NOFOLLOW), never its target.
        link = os.lstat(tmp_path / "real" / "last")
        last = procfs.mount_point_identity(root_fd, "/real/last")
        assert last == FileIdentity(link.st_dev, link.st_ino)
    finally:
        os.close(root_fd)


# ---------------------------------------------------------------- pure gate rules

SLOT = 4321
BARRIER = FileIdentity(dev=65024, ino=77)
LOG = FileIdentity(dev=65024, ino=78)


ALLOW, ERRNO_EPERM, KILL_PROCESS = 0x7FFF0000, 0x00050001, 0x80000000


def deny_program(lists: dict[int, list[int]]) -> tuple[tuple[int, int, int, int], ...]:
    """A filter shaped like a runtime's: EPERM for the listed calls of each AUDIT_ARCH,
    ALLOW for the rest, KILL for another architecture (the spawner builds the same)."""
    size = sum(4 + len(nrs) for nrs in lists.values()) + 2
    insns: list[tuple[int, int, int, int]] = []
    for arch, nrs in lists.items():
        insns += [(0x20, 0, 0, 4), (0x15, 0, len(nrs) + 2, arch), (0x20, 0, 0, 0)]
        for nr in nrs:
            insns.append((0x15, size - 2 - len(insns), 0, nr))
        insns.append((0x06, 0, 0, ALLOW))
    insns += [(0x06, 0, 0, KILL_PROCESS), (0x06, 0, 0, ERRNO_EPERM)]
    return tuple(insns)


def must_deny(machine: str = "x86_64") -> dict[int, list[int]]:
    lists: dict[int, list[int]] = {}
    for _name, arch, nr in seccomp.MUST_DENY[machine]:
        lists.setdefault(arch, []).append(nr)
    return lists


def filters(*programs: tuple[tuple[int, int, int, int], ...]) -> seccomp.SeccompFilters:
    return seccomp.SeccompFilters(machine="x86_64", programs=programs)


def _evidence(**changes: Any) -> evidencelib.Evidence:
    """A recorded-shape evidence record that passes `_expectation()`."""
    ids = evidencelib.Ids(SLOT, SLOT, SLOT, SLOT)
    base = evidencelib.Evidence(
        pid=99,
        start_time=5,
        status=evidencelib.Status(
            uid=ids,
            gid=ids,
            groups=(),
            capabilities=evidencelib.Capabilities(0, 0, 0, 0, 0),
            no_new_privs=1,
            seccomp=2,
            seccomp_filters=1,
        ),
        cgroups=(
            evidencelib.CgroupEntry(8, ("pids",), "/ficc/attempt-1/payload"),
            evidencelib.CgroupEntry(0, (), "/ficc/attempt-1"),
        ),
        namespaces={kind: 100 + i for i, kind in enumerate(evidencelib.NAMESPACE_KINDS)},
        reference_namespaces={kind: (1,) for kind in evidencelib.NAMESPACE_KINDS},
        syscall_filters=filters(deny_program(must_deny())),
        limits=(evidencelib.Rlimit("core", 0, 0), evidencelib.Rlimit("nofile", 64, 64)),
        fds=(
            evidencelib.FdEntry(0, "/dev/null", "chr", 6, 3, gate.DEV_NULL, 0o100000, 24),
            evidencelib.FdEntry(1, "pipe:[77]", "fifo", 13, 9, 0, 1, 14),
            evidencelib.FdEntry(2, "/srv/log", "file", LOG.dev, LOG.ino, 0, 1, 27),
        ),
        mounts=(
            evidencelib.Mount(
                1,
                0,
                0,
                55,
                "/",
                "/",
                ("ro", "nosuid", "nodev"),
                (),
                "tmpfs",
                "tmpfs",
                ("ro",),
                FileIdentity(55, 1),
            ),
            evidencelib.Mount(
                2,
                1,
                254,
                0,
                "/srv/barrier",
                "/barrier",
                ("ro", "nosuid", "nodev"),
                (),
                "ext4",
                "/dev/vda",
                ("rw",),
                BARRIER,
            ),
        ),
        exe=evidencelib.Exe(BARRIER, "/barrier"),
        devices=(
            evidencelib.DeviceAccess("c", 1, 3, "rw"),
            evidencelib.DeviceAccess("c", None, None, "m"),
        ),
    )
    return msgspec.structs.replace(base, **changes)


def _expectation(**changes: Any) -> Expectation:
    base = Expectation(
        uid=SLOT,
        gid=SLOT,
        barrier=BARRIER,
        cgroups=(
            CgroupRequirement("pids", "/ficc/attempt-1"),
            CgroupRequirement("", "/ficc/attempt-1"),
        ),
        rlimits=(RlimitCeiling("nofile", 64),),
        fds=(FdAllowance(0), FdAllowance(1, files=(LOG,)), FdAllowance(2, files=(LOG,))),
        mounts=(PreparedMount("/barrier", 254, 0, read_only=True, identity=BARRIER),),
        generated=(GeneratedMount("/", ("tmpfs",), read_only=True),),
        devices=(
            evidencelib.DeviceAccess("c", 1, 3, "rwm"),
            evidencelib.DeviceAccess("c", None, None, "m"),
        ),
    )
    return msgspec.structs.replace(base, **changes)


def _deny_lists() -> dict[str, list[int]]:
    """The calls every payload filter must deny, per AUDIT_ARCH (as JSON keys)."""
    lists: dict[str, list[int]] = {}
    for _name, arch, nr in seccomp.MUST_DENY[platform.machine()]:
        lists.setdefault(str(arch), []).append(nr)
    return lists


def test_the_syscall_filter_is_judged_by_its_content() -> None:
    """Seccomp mode 2 alone is not enough: an allow-all filter, one that lets a single
    dangerous call through (in any ABI), one that cannot be read or judged, all fail."""
    expectation = _expectation()
    allow_all = filters(((0x06, 0, 0, ALLOW),))
    verdict = gate.check(_evidence(syscall_filters=allow_all), expectation)
    assert _codes(verdict) == {"gate_seccomp"}
    assert "kexec_load" in verdict.failures[0].message
    for name, arch, nr in seccomp.MUST_DENY["x86_64"]:
        lists = must_deny()
        lists[arch] = [n for n in lists[arch] if n != nr]
        one_open = gate.check(_evidence(syscall_filters=filters(deny_program(lists))), expectation)
        assert [f.code for f in one_open.failures] == ["gate_seccomp"], name
        assert name in one_open.failures[0].message
    # Stacked filters: the kernel takes the strictest result, so a later allow-all
    # filter does not undo a complete one.
    stacked = filters(((0x06, 0, 0, ALLOW),), deny_program(must_deny()))
    assert gate.check(_evidence(syscall_filters=stacked), expectation).ok
    unreadable = _evidence(syscall_filters=None, syscall_filters_error="EPERM")
    assert _codes(gate.check(unreadable, expectation)) == {"gate_seccomp"}
    foreign = filters(((0x20, 0, 0, 2),))  # a load off the word grid, then no return
    assert _codes(gate.check(_evidence(syscall_filters=foreign), expectation)) == {"gate_seccomp"}
    no_filters = filters()
    assert _codes(gate.check(_evidence(syscall_filters=no_filters), expectation)) == {
        "gate_seccomp"
    }


def test_a_deny_by_argument_filter_is_checked_with_zero_and_full_arguments() -> None:
    """A filter that denies bpf only when its first argument is 0 lets bpf through
    with other arguments: the evaluation with all-one arguments finds it."""
    lists = must_deny()
    arch = seccomp.AUDIT_ARCH_X86_64
    lists[arch] = [n for n in lists[arch] if n != 321]
    by_argument = (
        (0x20, 0, 0, 4),
        (0x15, 0, 4, arch),
        (0x20, 0, 0, 0),
        (0x15, 0, 2, 321),
        (0x20, 0, 0, 16),  # A = low word of args[0]
        (0x15, 1, 0, 0),  # == 0: EPERM
        (0x06, 0, 0, ALLOW),
        (0x06, 0, 0, ERRNO_EPERM),
    )
    stacked = filters(deny_program(lists), by_argument)
    verdict = gate.check(_evidence(syscall_filters=stacked), _expectation())
    assert [f.code for f in verdict.failures] == ["gate_seccomp"]
    assert "bpf," in verdict.failures[0].message or "bpf " in verdict.failures[0].message


def test_a_filter_set_judged_before_is_not_interpreted_again(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Every container of a runtime has the same filters: the second judgement of the
    same programs is the first one's answer, without running the interpreter; other
    programs are judged afresh."""
    evaluated: list[int] = []
    real = seccomp.evaluate

    def counting(program: Any, data: bytes) -> int:
        evaluated.append(1)
        return real(program, data)

    monkeypatch.setattr(seccomp, "evaluate", counting)
    monkeypatch.setattr(seccomp, "_JUDGED", {})  # nothing judged by earlier tests
    lists = must_deny()
    arch = seccomp.AUDIT_ARCH_X86_64
    lists[arch] = [n for n in lists[arch] if n != 321]
    one_open = filters(deny_program(lists), ((0x06, 0, 0, ALLOW),))
    first = seccomp.allowed_calls(one_open)
    assert first == ["bpf"]
    assert evaluated
    evaluated.clear()
    assert seccomp.allowed_calls(one_open) == first
    assert evaluated == []
    assert seccomp.allowed_calls(filters(deny_program(must_deny()))) == []
    assert evaluated


def _codes(verdict: gate.Verdict) -> set[str]:
    return {failure.code for failure in verdict.failures}


def test_recorded_shape_passes_and_verdict_is_ok() -> None:
    assert gate.check(_evidence(), _expectation()) == gate.Verdict(ok=True, failures=())


def _with_mount(index: int, **changes: Any) -> evidencelib.Evidence:
    mounts = list(_evidence().mounts)
    mounts[index] = msgspec.structs.replace(mounts[index], **changes)
    return _evidence(mounts=tuple(mounts))


@pytest.mark.parametrize(
    ("evidence", "expectation", "code"),
    [
        # A cgroup path that shares a STRING prefix but is another cgroup.
        (
            _evidence(
                cgroups=(
                    evidencelib.CgroupEntry(8, ("pids",), "/ficc/attempt-10"),
                    evidencelib.CgroupEntry(0, (), "/ficc/attempt-1"),
                )
            ),
            None,
            "gate_cgroup",
        ),
        (
            _evidence(
                cgroups=(
                    evidencelib.CgroupEntry(0, (), "/ficc/attempt-1/../x"),
                    evidencelib.CgroupEntry(8, ("pids",), "/ficc/attempt-1"),
                )
            ),
            None,
            "gate_cgroup",
        ),
        (
            _evidence(cgroups=(evidencelib.CgroupEntry(0, (), "/ficc/attempt-1"),)),
            None,
            "gate_cgroup",
        ),
        (
            _evidence(status=msgspec.structs.replace(_evidence().status, groups=(0,))),
            None,
            "gate_gid",
        ),
        (
            _evidence(status=msgspec.structs.replace(_evidence().status, seccomp_filters=0)),
            None,
            "gate_seccomp",
        ),
        (
            _evidence(
                status=msgspec.structs.replace(
                    _evidence().status, capabilities=evidencelib.Capabilities(0, 0, 0, 0, 1 << 21)
                )
            ),
            None,
            "gate_capabilities",
        ),
        (
            _evidence(
                limits=(evidencelib.Rlimit("core", 0, None), evidencelib.Rlimit("nofile", 64, 64))
            ),
            None,
            "gate_rlimit",
        ),
        (_evidence(limits=(evidencelib.Rlimit("core", 0, 0),)), None, "gate_rlimit"),
        (
            _evidence(
                limits=(evidencelib.Rlimit("core", 0, 0), evidencelib.Rlimit("nofile", 64, None))
            ),
            None,
            "gate_rlimit",
        ),
        (
            _evidence(namespaces={**_evidence().namespaces, "user": 1}),
            _expectation(user_namespace=True),
            "gate_namespace",
        ),
        (_evidence(reference_namespaces={}), None, "gate_namespace"),
        # A named FIFO on disk is not an anonymous pipe.
        (
            _evidence(fds=(evidencelib.FdEntry(1, "/tmp/fifo", "fifo", 1, 2, 0, 1, 1),)),
            None,
            "gate_fd",
        ),
        (
            _evidence(fds=(evidencelib.FdEntry(1, "socket:[5]", "socket", 8, 5, 0, 2, 8),)),
            None,
            "gate_fd",
        ),
        (
            _evidence(
                fds=(evidencelib.FdEntry(0, "/dev/zero", "chr", 6, 4, os.makedev(1, 5), 0, 24),)
            ),
            None,
            "gate_fd",
        ),
        (
            _evidence(
                fds=(evidencelib.FdEntry(0, "/srv/log", "file", LOG.dev, LOG.ino, 0, 1, 27),)
            ),
            None,
            "gate_fd",
        ),
        (
            _evidence(fds=(evidencelib.FdEntry(3, "", "unknown", None, None, None, None, None),)),
            None,
            "gate_fd",
        ),
        (_with_mount(1, mount_options=("rw", "nosuid", "nodev")), None, "gate_mount"),
        (_with_mount(1, mount_options=("ro", "nodev")), None, "gate_mount"),
        (_with_mount(1, minor=1), None, "gate_mount"),
        (_with_mount(1, identity=FileIdentity(65024, 78)), None, "gate_mount"),
        (_with_mount(1, identity=None), None, "gate_mount"),
        # A prepared target cannot be satisfied by a generated rule for the same path.
        (
            _with_mount(1, fs_type="tmpfs", major=0, minor=77, identity=FileIdentity(77, 1)),
            _expectation(
                generated=(
                    GeneratedMount("/", ("tmpfs",), read_only=True),
                    GeneratedMount("/barrier", ("tmpfs",)),
                )
            ),
            "gate_mount",
        ),
        (_evidence(mounts=_evidence().mounts[:1]), None, "gate_mount"),
        (_with_mount(0, mount_options=("ro", "nodev")), None, "gate_mount"),
        (_with_mount(0, fs_type="ext4"), None, "gate_mount"),
        (
            _with_mount(0, mount_options=("rw", "nosuid", "nodev"), super_options=("rw",)),
            None,
            "gate_mount",
        ),
        (_evidence(exe=evidencelib.Exe(None, "")), None, "gate_exe"),
        (_evidence(devices=None), None, "gate_device"),
        (
            _evidence(devices=(evidencelib.DeviceAccess("a", None, None, "rwm"),)),
            None,
            "gate_device",
        ),
        (_evidence(devices=(evidencelib.DeviceAccess("c", 1, None, "rw"),)), None, "gate_device"),
        (_evidence(devices=(evidencelib.DeviceAccess("c", None, None, "r"),)), None, "gate_device"),
        (_evidence(devices=(evidencelib.DeviceAccess("b", 1, 3, "r"),)), None, "gate_device"),
        (_evidence(devices=(evidencelib.DeviceAccess("c", 1, 5, "r"),)), None, "gate_device"),
    ],
)
def test_each_pure_rule_refuses_with_its_own_code(
    evidence: evidencelib.Evidence, expectation: Expectation | None, code: str
) -> None:
    verdict = gate.check(evidence, expectation or _expectation())
    assert not verdict.ok
    assert _codes(verdict) == {code}
    assert all("not released" in failure.message for failure in verdict.failures)


def test_prepared_root_field_and_generated_subtree() -> None:
    expectation = _expectation(
        mounts=(PreparedMount("/barrier", 254, 0, True, BARRIER, root="/srv/barrier"),),
        generated=(
            GeneratedMount("/", ("tmpfs",), read_only=True),
            GeneratedMount("/proc", ("proc",), subtree=True, required_options=("nosuid",)),
        ),
    )
    proc = evidencelib.Mount(
        3, 1, 0, 60, "/", "/proc/sys", ("ro", "nosuid"), (), "proc", "proc", ("rw",), None
    )
    assert gate.check(_evidence(mounts=(*_evidence().mounts, proc)), expectation).ok
    procx = msgspec.structs.replace(proc, mount_point="/procx")
    assert _codes(gate.check(_evidence(mounts=(*_evidence().mounts, procx)), expectation)) == {
        "gate_mount"
    }
    assert _codes(gate.check(_with_mount(1, root="/other"), expectation)) == {"gate_mount"}


@pytest.mark.parametrize(
    "build",
    [
        lambda: GeneratedMount("/", ("tmpfs",), subtree=True),
        lambda: GeneratedMount("relative", ("tmpfs",)),
        lambda: GeneratedMount("/a/../b", ("tmpfs",)),
        lambda: GeneratedMount("/a", ()),
        lambda: PreparedMount("/a", 1, 1, True, required_options=("suid",)),
        lambda: CgroupRequirement("pids", "ficc"),
        lambda: RlimitCeiling("wormholes", 1),
        lambda: _expectation(fds=(FdAllowance(1), FdAllowance(1))),
        lambda: _expectation(devices=(evidencelib.DeviceAccess("a", None, None, "rwm"),)),
        lambda: evidencelib.DeviceAccess("c", 1, 3, "rwx"),
        lambda: evidencelib.DeviceAccess("c", 1, 3, "rr"),
    ],
)
def test_invalid_expectations_are_refused_when_built(build: Callable[[], object]) -> None:
    with pytest.raises(ValueError):
        build()


def test_expectation_rejects_root_slot_ids_on_decode() -> None:
    raw = msgspec.json.encode(_expectation())
    assert msgspec.json.decode(raw, type=Expectation) == _expectation()
    with pytest.raises(msgspec.ValidationError):
        msgspec.json.decode(raw.replace(b'"uid":4321', b'"uid":0'), type=Expectation)


# ---------------------------------------------------------------- real processes

SPAWNER = r"""
import ctypes, json, os, resource, sys, traceback

opts = json.loads(sys.argv[1])
libc = ctypes.CDLL(None, use_errno=True)
MS_RDONLY, MS_NOSUID, MS_NODEV, MS_REMOUNT, MS_BIND = 1, 2, 4, 32, 4096
MS_REC, MS_PRIVATE = 16384, 1 << 18
NAMESPACES = 0x20000 | 0x20000000 | 0x40000000 | 0x08000000 | 0x04000000


def ok(result, what):
    if result != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"{what}: {os.strerror(err)}")


def mount(source, target, fstype, flags, data=None):
    enc = lambda s: None if s is None else s.encode()
    ok(libc.mount(enc(source), enc(target), enc(fstype), ctypes.c_ulong(flags), enc(data)),
       f"mount {target}")


def prctl(option, arg):
    ok(libc.prctl(ctypes.c_int(option), ctypes.c_ulong(arg), ctypes.c_ulong(0),
                  ctypes.c_ulong(0), ctypes.c_ulong(0)), f"prctl {option}")


class SockFilter(ctypes.Structure):
    _fields_ = [("code", ctypes.c_ushort), ("jt", ctypes.c_ubyte), ("jf", ctypes.c_ubyte),
                ("k", ctypes.c_uint)]


class SockFprog(ctypes.Structure):
    _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.POINTER(SockFilter))]


def install_seccomp(kind):
    # allow-all: one RET ALLOW. deny: EPERM for opts["deny"] (per AUDIT_ARCH, the calls
    # every payload filter must deny), ALLOW for the rest, KILL for other architectures:
    # the shape of a real runtime's profile.
    if kind == "allow-all":
        insns = [(0x06, 0, 0, 0x7FFF0000)]  # BPF_RET|BPF_K, ALLOW
    else:
        blocks = list(opts["deny"].items())
        size = sum(4 + len(nrs) for _arch, nrs in blocks) + 2
        insns = []
        for arch, nrs in blocks:
            insns.append((0x20, 0, 0, 4))  # A = arch
            insns.append((0x15, 0, len(nrs) + 2, int(arch)))  # not this arch: next block
            insns.append((0x20, 0, 0, 0))  # A = nr
            for nr in nrs:
                insns.append((0x15, size - 1 - len(insns) - 1, 0, nr))  # jeq nr -> EPERM
            insns.append((0x06, 0, 0, 0x7FFF0000))  # ALLOW
        insns.append((0x06, 0, 0, 0x80000000))  # KILL_PROCESS: another architecture
        insns.append((0x06, 0, 0, 0x00050001))  # ERRNO(EPERM)
        assert len(insns) == size
    program = (SockFilter * len(insns))(*(SockFilter(*insn) for insn in insns))
    prog = SockFprog(len(insns), program)
    ok(libc.prctl(ctypes.c_int(22), ctypes.c_ulong(2), ctypes.byref(prog),
                  ctypes.c_ulong(0), ctypes.c_ulong(0)), "PR_SET_SECCOMP")


def build_root(root):
    mount(None, "/", None, MS_REC | MS_PRIVATE)
    mount("tmpfs", root, "tmpfs", MS_NOSUID | MS_NODEV, "mode=0755")
    for source, target, read_only in opts["binds"]:
        inside = root + target
        if os.path.isdir(source):
            os.mkdir(inside)
        else:
            open(inside, "w").close()
        mount(source, inside, None, MS_BIND)
        mount(None, inside, None,
              MS_REMOUNT | MS_BIND | MS_NOSUID | MS_NODEV | (MS_RDONLY if read_only else 0))
    for target, flags in opts.get("extra_tmpfs", []):
        os.mkdir(root + target)
        mount("tmpfs", root + target, "tmpfs", flags)
    mount(None, root, None, MS_REMOUNT | MS_BIND | MS_RDONLY | MS_NOSUID | MS_NODEV)


def child():
    if opts["root"]:
        build_root(opts["root"])
    for fd, path in enumerate(opts["stdio"]):
        opened = os.open(path, os.O_RDWR if fd else os.O_RDONLY)
        os.dup2(opened, fd)
        os.close(opened)
    if opts["extra_fd"]:
        os.dup2(os.open(opts["extra_fd"], os.O_RDONLY), 5)
    last_cap = int(open("/proc/sys/kernel/cap_last_cap").read())
    if opts["root"]:
        os.chroot(opts["root"])
        os.chdir("/")
    for name, (soft, hard) in opts["rlimits"].items():
        resource.setrlimit(getattr(resource, "RLIMIT_" + name.upper()), (soft, hard))
    if opts["drop_bounding"]:
        for cap in range(last_cap + 1):
            prctl(24, cap)  # PR_CAPBSET_DROP
    if opts["nnp"]:
        prctl(38, 1)  # PR_SET_NO_NEW_PRIVS
    if opts["seccomp"]:
        install_seccomp(opts["seccomp"])
    if opts["uid"] is not None:
        os.setgroups([])
        os.setresgid(opts["gid"], opts["gid"], opts["gid"])
        os.setresuid(opts["uid"], opts["uid"], opts["uid"])
    os.execv(opts["exe"], opts["argv"])


for procs in opts["cgroups"]:
    with open(procs, "w") as handle:
        handle.write(str(os.getpid()))
if opts["unshare"]:
    ok(libc.unshare(ctypes.c_int(NAMESPACES)), "unshare")
read_end, write_end = os.pipe2(os.O_CLOEXEC)
pid = os.fork()
if pid == 0:
    os.close(read_end)
    try:
        child()
    except BaseException:
        os.write(write_end, traceback.format_exc().encode())
    os._exit(127)
os.close(write_end)
error = b""
while chunk := os.read(read_end, 65536):  # EOF: the child executed (CLOEXEC pipe)
    error += chunk
print(json.dumps({"pid": pid, "error": error.decode()}), flush=True)
os.waitpid(pid, 0)
"""


class Payload:
    """A spawned process tree; `pid` is the host PID of the exec'd payload."""

    def __init__(self, runner: subprocess.Popen[bytes], pid: int) -> None:
        self.runner = runner
        self.pid = pid

    def kill(self) -> None:
        """Kill the payload and reap the tree, so /proc/PID is really gone."""
        with contextlib.suppress(ProcessLookupError):
            os.kill(self.pid, 9)
        # The runner is the payload itself (exec) or its parent, which reaps it and exits.
        try:
            self.runner.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.runner.kill()
            self.runner.wait(timeout=30)


def _identity(path: str | Path) -> FileIdentity:
    result = os.stat(path)
    return FileIdentity(result.st_dev, result.st_ino)


class World:
    """Everything a real gate test needs, cleaned up at teardown."""

    def __init__(self, base: Path, uid: int, gid: int, cgroup: str) -> None:
        self.base = base
        self.uid = uid
        self.gid = gid
        self.cgroup = cgroup
        self.payloads: list[Payload] = []
        self.barrier = base / "barrier"
        shutil.copy2(BUSYBOX, self.barrier)
        self.data = base / "data"
        self.data.mkdir()
        shutil.copy2(BUSYBOX, self.data / "busybox")  # same bytes, another inode
        self.log = base / "log"
        self.log.touch()
        self.evidence_dir = base / "attempt"
        self.evidence_dir.mkdir(mode=0o700)
        self.root = base / "root"
        self.root.mkdir()
        for path in (base, self.barrier, self.data, self.data / "busybox", self.log):
            path.chmod(0o755 if path != self.log else 0o666)

    def cgroup_procs(self) -> list[str]:
        return [f"/sys/fs/cgroup/{name}{self.cgroup}/cgroup.procs" for name in HIERARCHIES]

    def allow_device(self, rule: str) -> None:
        Path(f"/sys/fs/cgroup/devices{self.cgroup}/devices.allow").write_text(rule)

    def join_cgroups(self, pid: int) -> None:
        for procs in self.cgroup_procs():
            Path(procs).write_text(str(pid))

    def confined(self, **changes: Any) -> Payload:
        """Spawn the complete confined payload, minus whatever `changes` turns off."""
        opts: dict[str, Any] = {
            "uid": self.uid,
            "gid": self.gid,
            "cgroups": self.cgroup_procs(),
            "unshare": True,
            "root": str(self.root),
            "binds": [[str(self.barrier), "/barrier", True], [str(self.data), "/data", True]],
            "extra_tmpfs": [],
            "stdio": ["/dev/null", str(self.log), str(self.log)],
            "extra_fd": None,
            "rlimits": {"core": [0, 0], "nofile": [64, 64], "nproc": [64, 64]},
            "drop_bounding": True,
            "nnp": True,
            "seccomp": "deny",
            "deny": _deny_lists(),
            "exe": "/barrier",
            "argv": ["sleep", "1000"],
        }
        opts.update(changes)
        runner = subprocess.Popen(
            [sys.executable, "-c", SPAWNER, json.dumps(opts)],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
        )
        assert runner.stdout is not None
        report = json.loads(runner.stdout.readline() or b'{"pid": 0, "error": "no report"}')
        payload = Payload(runner, report["pid"])
        self.payloads.append(payload)
        assert report["error"] == "", report["error"]
        return payload

    def command(self, argv: list[str], *, exe: str, pass_fds: tuple[int, ...] = ()) -> Payload:
        """Run a real command; wait (bounded poll) until the payload PID runs `exe`."""
        runner = subprocess.Popen(
            argv,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            pass_fds=pass_fds,
        )
        payload = Payload(runner, runner.pid)
        self.payloads.append(payload)
        target = _identity(exe)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            pid = _descendant_running(runner.pid, target)
            if pid is not None:
                payload.pid = pid
                return payload
            time.sleep(0.005)  # polling a condition with a deadline, not a race fix
        raise AssertionError(f"{argv} never executed {exe}")

    def expectation(self, **changes: Any) -> Expectation:
        barrier = os.stat(self.barrier)
        data = os.stat(self.data)
        log = _identity(self.log)
        base = Expectation(
            uid=self.uid,
            gid=self.gid,
            barrier=FileIdentity(barrier.st_dev, barrier.st_ino),
            cgroups=(
                CgroupRequirement("pids", self.cgroup),
                CgroupRequirement("devices", self.cgroup),
                CgroupRequirement("", self.cgroup),
            ),
            rlimits=(RlimitCeiling("nofile", 64), RlimitCeiling("nproc", 64)),
            fds=(
                FdAllowance(0, pipe=False),
                FdAllowance(1, files=(log,)),
                FdAllowance(2, files=(log,)),
            ),
            mounts=(
                PreparedMount(
                    "/barrier",
                    os.major(barrier.st_dev),
                    os.minor(barrier.st_dev),
                    read_only=True,
                    identity=FileIdentity(barrier.st_dev, barrier.st_ino),
                ),
                PreparedMount(
                    "/data",
                    os.major(data.st_dev),
                    os.minor(data.st_dev),
                    read_only=True,
                    identity=FileIdentity(data.st_dev, data.st_ino),
                ),
            ),
            generated=(GeneratedMount("/", ("tmpfs",), read_only=True),),
            devices=(evidencelib.DeviceAccess("c", 1, 3, "rwm"),),
        )
        return msgspec.structs.replace(base, **changes)

    def evidence_fd(self) -> int:
        return os.open(self.evidence_dir, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)


def _descendant_running(pid: int, target: FileIdentity) -> int | None:
    """`pid` or a child of it whose executable is `target` (children via procfs)."""
    candidates = [pid]
    try:
        children = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
    except OSError:
        children = []
    candidates += [int(child) for child in children]
    for candidate in candidates:
        try:
            if _identity(f"/proc/{candidate}/exe") == target:
                return candidate
        except OSError:
            continue
    return None


@pytest.fixture(scope="module")
def slot_account() -> Iterator[tuple[int, int]]:
    with temporary_account("ficc-gate-") as account:
        yield account.uid, account.gid


@pytest.fixture
def world(slot_account: tuple[int, int]) -> Iterator[World]:
    if not Path(BUSYBOX).is_file():
        pytest.skip("the barrier stand-in is a static busybox: apt-get install -y busybox-static")
    name = f"/ficc-gate-test-{uuid.uuid4().hex[:12]}"
    made = []
    for hierarchy in HIERARCHIES:
        path = Path(f"/sys/fs/cgroup/{hierarchy}{name}")
        path.mkdir()
        made.append(path)
    base = Path(tempfile.mkdtemp(prefix="ficc-gate-"))
    built = None
    try:
        # A closed device policy: nothing but /dev/null.
        (made[1] / "devices.deny").write_text("a")
        built = World(base, *slot_account, name)
        built.allow_device("c 1:3 rwm")
        yield built
    finally:
        for payload in built.payloads if built else []:
            payload.kill()
        for path in made:
            path.rmdir()
        shutil.rmtree(base)


def _inspect(
    world: World, payload: Payload, expectation: Expectation, **hooks: Any
) -> gate.Verdict:
    dir_fd = world.evidence_fd()
    try:
        return gate.inspect_and_check(payload.pid, expectation, dir_fd, **hooks)
    finally:
        os.close(dir_fd)


PRIVILEGE_CODES = {"gate_uid", "gate_gid", "gate_capabilities", "gate_no_new_privs"}


@requires_root
def test_unconfined_root_process_is_refused(world: World) -> None:
    """The contract's 'an unconfined test provider must be refused', on a real `sleep`."""
    payload = world.command(["sleep", "1000"], exe="/bin/sleep")
    verdict = gate.check(gate_reader.read_evidence(payload.pid), world.expectation())
    assert not verdict.ok
    assert {
        *PRIVILEGE_CODES,
        "gate_seccomp",
        "gate_namespace",
        "gate_cgroup",
        "gate_exe",
        "gate_mount",
        "gate_device",
    } <= _codes(verdict)


@requires_root
def test_setpriv_drop_passes_privilege_checks_but_not_seccomp_or_namespaces(
    world: World,
) -> None:
    payload = world.command(
        [
            "setpriv",
            f"--reuid={world.uid}",
            f"--regid={world.gid}",
            "--clear-groups",
            "--inh-caps=-all",
            "--bounding-set=-all",
            "--no-new-privs",
            "sleep",
            "1000",
        ],
        exe="/bin/sleep",
    )
    world.join_cgroups(payload.pid)
    codes = _codes(gate.check(gate_reader.read_evidence(payload.pid), world.expectation()))
    assert not codes & {*PRIVILEGE_CODES, "gate_cgroup", "gate_device"}
    assert {"gate_seccomp", "gate_namespace"} <= codes


@requires_root
def test_unshare_namespaces_pass_the_namespace_check(world: World) -> None:
    if shutil.which("unshare") is None:
        pytest.skip("unshare(1) is not installed (util-linux)")
    argv = ["unshare", "--mount", "--pid", "--fork", "--net", "--ipc", "--uts", "sleep", "1000"]
    payload = world.command(argv, exe="/bin/sleep")
    assert payload.pid != payload.runner.pid
    evidence = gate_reader.read_evidence(payload.pid)
    codes = _codes(gate.check(evidence, world.expectation()))
    assert "gate_namespace" not in codes
    assert codes >= PRIVILEGE_CODES
    # The user namespace is still the daemon's: refused once the plan says it is used.
    user = gate.check(evidence, world.expectation(user_namespace=True))
    assert [f.message for f in user.failures if f.code == "gate_namespace"] == [
        f"user namespace {evidence.namespaces['user']} is the daemon's own; {gate.ADVICE}"
    ]


@requires_root
def test_complete_confinement_passes_every_check_and_may_be_released(world: World) -> None:
    payload = world.confined()
    verdict = _inspect(world, payload, world.expectation())
    assert verdict == gate.Verdict(ok=True, failures=(), evidence_file=gate.EVIDENCE_FILE)
    evidence = msgspec.json.decode(
        (world.evidence_dir / gate.EVIDENCE_FILE).read_bytes(), type=evidencelib.Evidence
    )
    assert evidence.status.seccomp == 2
    assert evidence.status.seccomp_filters == 1
    assert [m.mount_point for m in evidence.mounts] == ["/", "/barrier", "/data"]
    assert evidence.exe.identity == _identity(world.barrier)

    dir_fd = world.evidence_fd()
    try:
        gate.write_release_marker(dir_fd, "release", group=world.gid)
        with pytest.raises(HostError) as again:
            gate.write_release_marker(dir_fd, "release", group=world.gid)
    finally:
        os.close(dir_fd)
    assert again.value.code == "release_marker_failed"
    marker = os.lstat(world.evidence_dir / "release")
    assert (marker.st_uid, marker.st_gid, stat.S_IMODE(marker.st_mode)) == (0, world.gid, 0o640)
    assert (stat.S_ISREG(marker.st_mode), marker.st_nlink) == (True, 1)
    assert sorted(os.listdir(world.evidence_dir)) == [gate.EVIDENCE_FILE, "release"]
    assert (world.evidence_dir / "release").read_bytes() == gate.RELEASE_CONTENT


MS_NOSUID, MS_NODEV = 2, 4


@requires_root
@pytest.mark.parametrize(
    ("spawn", "expect", "code"),
    [
        ({"seccomp": False}, {}, "gate_seccomp"),
        ({"seccomp": "allow-all"}, {}, "gate_seccomp"),
        ({"deny": "all-but-bpf"}, {}, "gate_seccomp"),
        ({"nnp": False}, {}, "gate_no_new_privs"),
        ({"drop_bounding": False}, {}, "gate_capabilities"),
        ({"cgroups": "devices-only"}, {}, "gate_cgroup"),
        (
            {"rlimits": {"core": [1024, 1024], "nofile": [64, 64], "nproc": [64, 64]}},
            {},
            "gate_rlimit",
        ),
        ({"rlimits": {"core": [0, 0], "nofile": [64, 128], "nproc": [64, 64]}}, {}, "gate_rlimit"),
        ({"extra_fd": "/etc/hostname"}, {}, "gate_fd"),
        ({"stdio": ["/dev/null", "/dev/null", "/etc/hostname"]}, {}, "gate_fd"),
        # A copy of the barrier (same bytes, another inode) is not the barrier.
        ({"exe": "/data/busybox"}, {}, "gate_exe"),
        ({"binds": "rw-data"}, {}, "gate_mount"),
        ({"binds": "other-data"}, {}, "gate_mount"),
        ({"extra_tmpfs": [["/scratch", MS_NODEV]]}, {}, "gate_mount"),
        ({}, {"user_namespace": True}, "gate_namespace"),
        ({}, {"uid": 4242}, "gate_uid"),
        ({}, {"gid": 4242}, "gate_gid"),
        ({"allow_device": "c 1:5 rwm"}, {}, "gate_device"),
    ],
    ids=[
        "no-seccomp",
        "allow-all-seccomp",
        "seccomp-allows-bpf",
        "no-nnp",
        "bounding-set-kept",
        "wrong-cgroup",
        "core-dumps",
        "nofile-above-plan",
        "extra-fd",
        "stderr-host-file",
        "barrier-copy",
        "rw-data-mount",
        "other-data-source",
        "scratch-tmpfs-suid",
        "shared-userns",
        "other-uid",
        "other-gid",
        "wider-device-policy",
    ],
)
def test_removing_one_control_fails_exactly_that_check(
    world: World, spawn: dict[str, Any], expect: dict[str, Any], code: str
) -> None:
    spawn = dict(spawn)
    barrier_bind = [str(world.barrier), "/barrier", True]
    if spawn.get("cgroups") == "devices-only":
        spawn["cgroups"] = [p for p in world.cgroup_procs() if "/devices/" in p]
    if spawn.get("binds") == "rw-data":
        spawn["binds"] = [barrier_bind, [str(world.data), "/data", False]]
    elif spawn.get("binds") == "other-data":
        other = world.base / "other"
        other.mkdir(mode=0o755)
        spawn["binds"] = [barrier_bind, [str(other), "/data", True]]
    if "allow_device" in spawn:
        world.allow_device(spawn.pop("allow_device"))
    if spawn.get("deny") == "all-but-bpf":
        drop = {(arch, nr) for name, arch, nr in seccomp.MUST_DENY[platform.machine()]
                if name.split()[0] == "bpf"}  # fmt: skip
        spawn["deny"] = {a: [n for n in nrs if (int(a), n) not in drop]
                         for a, nrs in _deny_lists().items()}  # fmt: skip
    payload = world.confined(**spawn)
    verdict = _inspect(world, payload, world.expectation(**expect))
    assert not verdict.ok
    assert _codes(verdict) == {code}, verdict.failures


@requires_root
def test_scratch_tmpfs_with_nosuid_nodev_passes_as_generated_target(world: World) -> None:
    payload = world.confined(extra_tmpfs=[["/scratch", MS_NOSUID | MS_NODEV]])
    rules = (
        GeneratedMount("/", ("tmpfs",), read_only=True),
        GeneratedMount("/scratch", ("tmpfs",), read_only=False),
    )
    assert _inspect(world, payload, world.expectation(generated=rules)).ok


@requires_root
def test_process_that_exits_after_the_first_read_is_refused(world: World) -> None:
    payload = world.command(["sleep", "1000"], exe="/bin/sleep")
    verdict = _inspect(world, payload, world.expectation(), after_first_read=payload.kill)
    assert _codes(verdict) == {"gate_process_changed"}
    assert verdict.evidence_file is None
    assert not (world.evidence_dir / gate.EVIDENCE_FILE).exists()


@requires_root
def test_process_that_exits_before_the_final_read_is_refused(world: World) -> None:
    payload = world.confined()
    verdict = _inspect(world, payload, world.expectation(), after_check=payload.kill)
    assert not verdict.ok
    assert _codes(verdict) == {"gate_process_changed"}
    assert verdict.evidence_file == gate.EVIDENCE_FILE


@requires_root
def test_zombie_is_refused_as_changed(world: World) -> None:
    payload = world.command(["sleep", "1000"], exe="/bin/sleep")
    os.kill(payload.pid, 9)
    # Not reaped: /proc/PID still exists with the same start time, state Z.
    deadline = time.monotonic() + 30
    while procparse.parse_stat(Path(f"/proc/{payload.pid}/stat").read_bytes()).state != "Z":
        assert time.monotonic() < deadline, "the killed process never became a zombie"
        time.sleep(0.005)
    with pytest.raises(HostError) as refused:
        gate_reader.read_evidence(payload.pid)
    assert refused.value.code == "gate_process_changed"


@requires_root
def test_evidence_is_written_before_any_assertion(
    world: World, monkeypatch: pytest.MonkeyPatch
) -> None:
    payload = world.command(["sleep", "1000"], exe="/bin/sleep")
    seen: list[dict[str, Any]] = []
    real_check = gate.check

    def spy(evidence: evidencelib.Evidence, expectation: Expectation) -> gate.Verdict:
        path = world.evidence_dir / gate.EVIDENCE_FILE
        seen.append(json.loads(path.read_bytes()))
        return real_check(evidence, expectation)

    monkeypatch.setattr(gate, "check", spy)
    verdict = _inspect(world, payload, world.expectation())
    assert not verdict.ok
    (written,) = seen
    assert written["pid"] == payload.pid
    assert written["status"]["uid"] == {"real": 0, "effective": 0, "saved": 0, "filesystem": 0}
    assert set(written["status"]["gid"]) == {"real", "effective", "saved", "filesystem"}
    info = os.lstat(world.evidence_dir / gate.EVIDENCE_FILE)
    assert (info.st_uid, stat.S_IMODE(info.st_mode)) == (0, 0o600)


@requires_root
@pytest.mark.parametrize("planted", ["symlink", "existing"])
def test_evidence_path_that_exists_or_is_a_symlink_is_refused(world: World, planted: str) -> None:
    victim = world.base / "victim"
    victim.write_bytes(b"untouched")
    if planted == "symlink":
        (world.evidence_dir / gate.EVIDENCE_FILE).symlink_to(victim)
    else:
        (world.evidence_dir / gate.EVIDENCE_FILE).write_bytes(b"old")
    payload = world.confined()
    verdict = _inspect(world, payload, world.expectation())
    assert _codes(verdict) == {"gate_evidence"}
    assert victim.read_bytes() == b"untouched"


@requires_root
def test_release_marker_refuses_a_symlink_and_a_bad_name(world: World) -> None:
    victim = world.base / "victim"
    victim.write_bytes(b"untouched")
    (world.evidence_dir / "release").symlink_to(victim)
    dir_fd = world.evidence_fd()
    try:
        with pytest.raises(HostError) as refused:
            gate.write_release_marker(dir_fd, "release", group=world.gid)
        with pytest.raises(HostError):
            gate.write_release_marker(dir_fd, "../release", group=world.gid)
    finally:
        os.close(dir_fd)
    assert refused.value.code == "release_marker_failed"
    assert victim.read_bytes() == b"untouched"


@requires_root
def test_evidence_is_synced_and_the_release_marker_is_not(
    world: World, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The evidence must outlive a crash of the machine; the marker only has to be
    visible to the barrier, and syncing it would delay every payload."""
    synced: list[int] = []
    real_fsync = os.fsync

    def fsync(fd: int) -> None:
        synced.append(fd)
        real_fsync(fd)

    monkeypatch.setattr(gate.os, "fsync", fsync)
    dir_fd = world.evidence_fd()
    try:
        gate.write_release_marker(dir_fd, "release", group=world.gid)
        assert synced == []
        gate.publish_file(dir_fd, "evidence-copy", b"{}", mode=0o600, gid=0)
        assert len(synced) == 2
        assert synced[-1] == dir_fd
    finally:
        os.close(dir_fd)
    marker = world.evidence_dir / "release"
    assert marker.read_bytes() == gate.RELEASE_CONTENT
    info = os.lstat(marker)
    assert (info.st_uid, info.st_gid, stat.S_IMODE(info.st_mode)) == (0, world.gid, 0o640)


@requires_root
def test_reader_refuses_a_pid_that_does_not_exist(world: World) -> None:
    payload = world.command(["sleep", "1000"], exe="/bin/sleep")
    payload.kill()
    with pytest.raises(HostError) as refused:
        gate_reader.read_evidence(payload.pid)
    assert refused.value.code == "gate_process_changed"


@requires_root
def test_descriptor_with_an_undecodable_name_is_recorded_and_refused(world: World) -> None:
    path = os.fsencode(world.base) + b"/host-\xff-secret"
    fd = os.open(path, os.O_CREAT | os.O_RDONLY, 0o600)
    try:
        payload = world.command(["sleep", "1000"], exe="/bin/sleep", pass_fds=(fd,))
    finally:
        os.close(fd)
    verdict = _inspect(world, payload, world.expectation())
    assert verdict.evidence_file == gate.EVIDENCE_FILE
    written = json.loads((world.evidence_dir / gate.EVIDENCE_FILE).read_bytes())
    (leaked,) = [entry for entry in written["fds"] if entry["fd"] == fd]
    assert leaked["target"].endswith("/host-\\xff-secret")
    assert any(
        f.code == "gate_fd" and repr(leaked["target"]) in f.message for f in verdict.failures
    )


# ---------------------------------------------------------------- a real container

PODMAN = ["podman", "--runtime", "runc", "--cgroup-manager=cgroupfs"]
NSE = ("nosuid", "nodev", "noexec")
# Podman's default device list; the provider's prepared devices would name these.
PODMAN_DEVICES = b"b *:* m\nc *:* m\nc 1:3 rwm\nc 1:5 rwm\nc 1:7 rwm\nc 1:8 rwm\nc 1:9 rwm\n"
PODMAN_DEVICES += b"c 5:0 rwm\nc 5:2 rwm\nc 10:200 rwm\nc 136:* rwm\n"


@pytest.fixture(scope="module")
def podman_image(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    rootfs = tmp_path_factory.mktemp("rootfs")
    for directory in ("data", "tmp", "etc"):
        (rootfs / directory).mkdir()
    archive = tmp_path_factory.mktemp("image") / "rootfs.tar"
    subprocess.run(["tar", "-C", rootfs, "-cf", archive, "."], check=True)
    name = f"localhost/ficc-gate-test-{uuid.uuid4().hex[:12]}:1"
    subprocess.run([*PODMAN, "import", archive, name], check=True, capture_output=True)
    yield name
    subprocess.run([*PODMAN, "rmi", "-f", name], check=False, capture_output=True)


def _prepared(target: str, source: str | Path, read_only: bool, options: tuple[str, ...]) -> Any:
    found = os.stat(source)
    return PreparedMount(
        target,
        os.major(found.st_dev),
        os.minor(found.st_dev),
        read_only,
        FileIdentity(found.st_dev, found.st_ino),
        required_options=options,
    )


def _remove_cgroup_tree(top: Path) -> None:
    """rmdir a cgroup and the children Podman made in it (conmon), deepest first.

    conmon may still be exiting after `podman rm` returns: wait (bounded) until each
    cgroup is empty, and kill what is left in it (our own container's processes).
    """
    if not top.is_dir():
        return
    for directory, _, _ in sorted(os.walk(top), key=lambda entry: -len(entry[0])):
        procs = Path(directory) / "cgroup.procs"
        deadline = time.monotonic() + 30
        while pids := procs.read_text().split():
            if time.monotonic() > deadline:
                for pid in pids:
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(int(pid), 9)
                deadline = time.monotonic() + 30
            time.sleep(0.01)  # polling the cgroup until its processes are gone
        os.rmdir(directory)


def podman_expectation(world: World, parent: str, uid: int) -> Expectation:
    """What a Podman payload must look like: the shape the daemon builds for it."""
    host_nodes = ("null", "zero", "full", "tty", "random", "urandom")
    mounts = (
        _prepared("/busybox", world.barrier, True, ("nosuid", "nodev")),
        _prepared("/data", world.data, True, ("nosuid", "nodev")),
        *(_prepared(f"/dev/{node}", f"/dev/{node}", False, ()) for node in host_nodes),
        # Podman masks these by bind-mounting /dev/null over them.
        *(_prepared(t, "/dev/null", False, ()) for t in ("/proc/keys", "/proc/timer_list")),
    )
    generated = (
        GeneratedMount("/", ("overlay",), read_only=True, required_options=()),
        GeneratedMount("/dev", ("tmpfs",), required_options=("nosuid", "noexec")),
        GeneratedMount("/dev/pts", ("devpts",), required_options=("nosuid", "noexec")),
        GeneratedMount("/dev/mqueue", ("mqueue",), required_options=NSE),
        GeneratedMount("/dev/shm", ("tmpfs",), required_options=NSE),
        GeneratedMount("/sys", ("sysfs",), read_only=True, required_options=NSE),
        GeneratedMount("/sys/fs/cgroup", ("tmpfs", "cgroup"), subtree=True, required_options=NSE),
        GeneratedMount("/proc", ("proc",), subtree=True, required_options=NSE),
        *(
            GeneratedMount(t, ("tmpfs",), read_only=True, required_options=())
            for t in ("/proc/acpi", "/sys/firmware", "/sys/dev/block")
        ),
        *(GeneratedMount(t, ("tmpfs",)) for t in ("/tmp", "/run", "/var/tmp")),
        *(
            GeneratedMount(
                t, ("ext4", "xfs", "btrfs", "tmpfs"), read_only=True, required_options=NSE
            )
            for t in ("/etc/hosts", "/etc/hostname")
        ),
    )
    return Expectation(
        uid=uid,
        gid=uid,
        barrier=_identity(world.barrier),
        cgroups=tuple(CgroupRequirement(c, parent) for c in ("pids", "memory", "devices", "")),
        rlimits=(RlimitCeiling("nofile", 64), RlimitCeiling("nproc", 64)),
        fds=(FdAllowance(0, pipe=False), FdAllowance(1), FdAllowance(2)),
        mounts=mounts,
        generated=generated,
        user_namespace=True,
        cgroup_namespace=True,
        devices=procparse.parse_devices_list(PODMAN_DEVICES),
    )


@pytest.mark.podman("the gate checks a real Podman container")
@pytest.mark.parametrize(
    ("flags", "code"),
    [
        ((), None),
        (("--security-opt", "seccomp=unconfined"), "gate_seccomp"),
        (("--cap-add", "CHOWN"), "gate_capabilities"),
        (("--ulimit", "core=4096:4096"), "gate_rlimit"),
        (("--pid", "host"), "gate_namespace"),
    ],
    ids=["isolated", "seccomp-unconfined", "cap-chown", "core-dumps", "host-pid"],
)
def test_real_podman_container_passes_and_weaker_ones_do_not(
    world: World, podman_image: str, flags: tuple[str, ...], code: str | None
) -> None:
    """The rules are practical: Podman with the design's flags passes; weaker fails."""
    parent = f"{world.cgroup}-podman"
    name = f"ficc-gate-test-{uuid.uuid4().hex[:12]}"
    uid = world.uid
    run = [
        *PODMAN, "run", "-d", "--name", name, "--network=none", "--read-only",
        "--cap-drop=all", "--security-opt", "no-new-privileges",
        "--ipc=private", "--uts=private", "--pid=private", "--cgroupns=private",
        f"--cgroup-parent={parent}", f"--uidmap=0:{uid}:1", f"--gidmap=0:{uid}:1",
        "--ulimit", "core=0:0", "--ulimit", "nofile=64:64", "--ulimit", "nproc=64:64",
        "-v", f"{world.barrier}:/busybox:ro,nosuid,nodev",
        "-v", f"{world.data}:/data:ro,nosuid,nodev",
        *flags, "--entrypoint", "/busybox", podman_image, "sleep", "1000",
    ]  # fmt: skip
    try:
        subprocess.run(run, check=True, capture_output=True)
        inspect = [*PODMAN, "inspect", "--format", "{{.State.Pid}}", name]
        pid = int(subprocess.run(inspect, check=True, capture_output=True).stdout)
        barrier = _identity(world.barrier)
        deadline = time.monotonic() + 30
        while _descendant_running(pid, barrier) != pid:  # runc init, then the barrier
            assert time.monotonic() < deadline, "the container never executed the barrier"
            time.sleep(0.005)
        dir_fd = world.evidence_fd()
        try:
            verdict = gate.inspect_and_check(pid, podman_expectation(world, parent, uid), dir_fd)
        finally:
            os.close(dir_fd)
    finally:
        subprocess.run([*PODMAN, "rm", "-f", "-t", "0", name], check=False, capture_output=True)
        for hierarchy in os.listdir("/sys/fs/cgroup"):
            _remove_cgroup_tree(Path(f"/sys/fs/cgroup/{hierarchy}{parent}"))
    if code is None:
        assert verdict.ok, verdict.failures
    else:
        assert _codes(verdict) == {code}, verdict.failures


# ---------------------------------------------------------------- cgroup v2 device policy

V2_NULL = (
    evidencelib.DeviceAccess("c", None, None, "m"),
    evidencelib.DeviceAccess("b", None, None, "m"),
    evidencelib.DeviceAccess("c", 1, 3, "rwm"),
)


def _v2(*programs: evidencelib.DeviceProgram, error: str | None = None) -> evidencelib.Evidence:
    """Evidence of a process without a v1 devices cgroup (a cgroup v2 host)."""
    return _evidence(devices=None, device_programs=programs or None, device_programs_error=error)


def test_the_v2_device_policy_is_judged_from_the_effective_programs() -> None:
    expectation = _expectation(devices=V2_NULL)
    ours = evidencelib.DeviceProgram(7, V2_NULL)
    assert gate.check(_v2(ours), expectation).ok
    # A foreign program beside a bounding one only denies more: still within the plan.
    assert gate.check(_v2(evidencelib.DeviceProgram(8, None), ours), expectation).ok
    wider = evidencelib.DeviceProgram(9, (*V2_NULL, evidencelib.DeviceAccess("c", 1, 5, "rwm")))
    verdict = gate.check(_v2(wider), expectation)
    assert _codes(verdict) == {"gate_device"}
    assert "c 1:5 rwm" in verdict.failures[0].message
    for refused in (
        _v2(evidencelib.DeviceProgram(8, None)),
        _v2(),
        _v2(error="bpf(2) refused: EPERM"),
    ):
        assert _codes(gate.check(refused, expectation)) == {"gate_device"}


@requires_root
def test_the_live_v2_device_program_of_a_process_is_read_back_and_judged() -> None:
    """On this machine's unified tree: a process in a cgroup carrying the host's own
    device program; its evidence names that program's rules, which the gate accepts
    for a plan of /dev/null and refuses for a plan of no device at all."""
    unified = next((h.mount for h in cgroups.discover().hierarchies if h.version == 2), None)
    if unified is None:
        pytest.skip("this host has no cgroup v2 hierarchy")
    group = Path(unified) / f"ficc-t-gate-bpf-{os.getpid()}-{uuid.uuid4().hex[:6]}"
    group.mkdir()
    sleeper = None
    try:
        bpfdevices.attach(str(group), [DeviceRule("/dev/null", 1, 3)])
        sleeper = subprocess.Popen(["sleep", "1000"], stdin=subprocess.DEVNULL)
        (group / "cgroup.procs").write_text(str(sleeper.pid))
        evidence = gate_reader.read_evidence(sleeper.pid)
        assert evidence.device_programs is not None, evidence.device_programs_error
        assert [p.rules for p in evidence.device_programs if p.rules] == [V2_NULL]
        as_v2 = msgspec.structs.replace(evidence, devices=None)
        plan_null = _expectation(devices=V2_NULL)
        assert "gate_device" not in _codes(gate.check(as_v2, plan_null))
        plan_none = _expectation(devices=V2_NULL[:2])
        assert "gate_device" in _codes(gate.check(as_v2, plan_none))
    finally:
        if sleeper is not None:
            sleeper.kill()
            sleeper.wait()
        group.rmdir()


FILTERED_READER = r"""
import ctypes, json, sys
from ficc.execution.host.linux import seccomp

class SockFilter(ctypes.Structure):
    _fields_ = [("code", ctypes.c_ushort), ("jt", ctypes.c_ubyte), ("jf", ctypes.c_ubyte),
                ("k", ctypes.c_uint)]

class SockFprog(ctypes.Structure):
    _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.POINTER(SockFilter))]

libc = ctypes.CDLL(None, use_errno=True)
libc.prctl(38, 1, 0, 0, 0)  # PR_SET_NO_NEW_PRIVS
program = (SockFilter * 1)(SockFilter(0x06, 0, 0, 0x7FFF0000))
assert libc.prctl(22, 2, ctypes.byref(SockFprog(1, program)), 0, 0) == 0
try:
    seccomp.read_filters(int(sys.argv[1]))
    print(json.dumps({"read": True}))
except seccomp.FiltersUnreadable as error:
    print(json.dumps({"read": False, "why": str(error)}))
"""


@requires_root
def test_filters_cannot_be_read_by_a_filtered_reader_or_of_a_gone_process(world: World) -> None:
    """Why the daemon must not run under seccomp (its systemd unit sets no seccomp-based
    option): the kernel refuses PTRACE_SECCOMP_GET_FILTER to a filtered process. The
    gate then refuses the payload; it never treats an unread filter as a good one."""
    payload = world.confined()
    assert seccomp.read_filters(payload.pid).programs  # an unfiltered reader reads it
    reader = subprocess.run(
        [sys.executable, "-c", FILTERED_READER, str(payload.pid)],
        capture_output=True,
        text=True,
        check=True,
    )
    report = json.loads(reader.stdout)
    assert report["read"] is False
    assert "Permission denied" in report["why"]
    gone = world.command(["sleep", "1000"], exe="/bin/sleep")
    pid = gone.pid
    gone.kill()
    with pytest.raises(seccomp.FiltersUnreadable):
        seccomp.read_filters(pid)
    unread = gate_reader.read_syscall_filters(pid, _evidence().status)
    assert unread[0] is None
    assert unread[1] is not None


# ---------------------------------------------------------------- the host-wide task scan


@pytest.mark.parametrize(
    ("data", "expected"),
    [
        (b"Name:\tx\nState:\tS (sleeping)\nTgid:\t1\nUid:\t1\t2\t3\t4\n", (b"S", (1, 2, 3, 4))),
        (b"Name:\tx\nState:\tZ (zombie)\nUid:\t0\t0\t0\t0\n", (b"Z", (0, 0, 0, 0))),
        (b"Name:\tx\nUid:\t1\t2\t3\t4\nState:\tS (sleeping)\n", None),  # Uid before State
        (b"Name:\tx\nState:\tS (sleeping)\n", None),  # no Uid
        (b"Name:\tx\nState:\tS (sleeping)\nUid:\t1\t2\t3\n", None),  # three values
        (b"Name:\tx\nState:\tS (sleeping)\nUid:\t1\t2\t3\t-4\n", None),
        (b"", None),
        # a name is not a line: the kernel escapes a newline in it
        (b"Name:\tState:\tZ\nState:\tS (sleeping)\nUid:\t1\t2\t3\t4\n", (b"S", (1, 2, 3, 4))),
        # the kernel writes one State line; were there two, the first would count
        (
            b"Name:\tx\nState:\tS (sleeping)\nState:\tZ (zombie)\nUid:\t1\t2\t3\t4\n",
            (b"S", (1, 2, 3, 4)),
        ),
    ],
)
def test_a_status_the_scan_cannot_read_is_none_which_counts_as_live(
    data: bytes, expected: tuple[bytes, tuple[int, ...]] | None
) -> None:
    assert tasks.state_and_uids(data) == expected


def test_the_scan_finds_this_process_by_its_uid() -> None:
    me = os.getuid()
    assert (me, os.getpid()) in tasks.live_tasks({me})
    assert all(uid == me or uid == -1 for uid, _ in tasks.live_tasks({me}))


_ONE_THREAD_AS = """
import ctypes, sys, threading
libc = ctypes.CDLL(None, use_errno=True)
uid, leader_exits = int(sys.argv[1]), sys.argv[2] == "leader-exits"
changed = threading.Event()
def worker():
    if libc.syscall(117, uid, uid, uid) != 0:  # setresuid(2) for this thread alone
        raise SystemExit(3)
    changed.set()
    sys.stdin.read()  # until the test closes stdin
thread = threading.Thread(target=worker)
thread.start()
changed.wait()
print("ready", flush=True)
if leader_exits:
    libc.syscall(60, 0)  # exit(2) of the main thread only: the leader becomes a zombie
thread.join()
"""


@requires_root
@pytest.mark.parametrize("leader", ["lives", "leader-exits"])
def test_the_scan_finds_a_thread_whose_credentials_differ_from_its_leaders(leader: str) -> None:
    """Credentials are per thread: a root process with one thread of a slot account's UID
    is the account's, and so is a process whose leader ended with that thread alive
    (its /proc/PID/status then shows the zombie leader's state and credentials)."""
    uid = 2**31 - 9
    child = subprocess.Popen(
        [sys.executable, "-c", _ONE_THREAD_AS, str(uid), leader],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
    )
    try:
        assert child.stdout is not None
        assert child.stdout.readline() == b"ready\n"
        if leader == "leader-exits":

            def leader_is_a_zombie() -> bool:
                return b"\nState:\tZ" in Path(f"/proc/{child.pid}/status").read_bytes()

            wait_for(leader_is_a_zombie, "the leader to end alone")
        assert tasks.live_uid_of(child.pid, {uid}) == uid
        assert (uid, child.pid) in tasks.live_tasks({uid})
    finally:
        child.kill()
        child.wait()
    assert tasks.live_uid_of(child.pid, {uid}) is None
