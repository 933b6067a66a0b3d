"""systemd's cgroup v2 device program: the decoder on programs captured from real
systemd 252 (tests/vectors/systemd_devices.json, see tools/systemd/unified.py), and the
read-back on this machine's kernel (real v2 cgroups, real enforcement).

The decoder's claim is semantic ("this program allows exactly these rules"), so it is
checked against `run`, a small independent interpreter of the same instructions: a
program that only compares registers with constants behaves the same for every value
it does not mention, so evaluating it on the constants it mentions plus one value it
does not, for both device types and every access set, covers every input.
"""

from __future__ import annotations

import itertools
import json
import os
import secrets
import struct
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

import service_support
from ficc.execution.host.core.errors import HostError
from ficc.execution.host.service import bpfdevices, cgroups, systemd
from ficc.execution.host.service import systemd_devices as sd
from ficc.execution.host.service.interface import DeviceAccess, DeviceRule
from service_support import NULL, OPENER, py

slot = service_support.slot
VECTORS = json.loads((Path(__file__).parents[1] / "vectors" / "systemd_devices.json").read_text())
CASES = {case["name"]: case for case in VECTORS["cases"]}
ZERO = DeviceRule("/dev/zero", 1, 5)


def raw_of(name: str) -> bytes:
    return bytes.fromhex(CASES[name]["xlated"])


def planned(name: str) -> list[DeviceAccess]:
    return cgroups.expected_devices([DeviceRule(**d) for d in CASES[name]["devices"]])


def key(rules: list[DeviceAccess]) -> list[tuple[str, int, int, str]]:
    return sorted(
        (r.kind, -1 if r.major is None else r.major, -1 if r.minor is None else r.minor, r.access)
        for r in rules
    )


# --- an independent interpreter (the oracle) -------------------------------------------


class Unrunnable(Exception):
    pass


def run(insns: list[sd.Instruction], kind: int, major: int, minor: int, access: int) -> bool:
    """Execute a device program on one request; Unrunnable if it leaves the subset."""
    ctx = {0: (access << 16) | kind, 4: major, 8: minor}
    regs: dict[int, int] = {}
    pc = 0
    mask32, mask64 = (1 << 32) - 1, (1 << 64) - 1
    while 0 <= pc < len(insns):
        code, dst, src, off, imm = insns[pc]
        pc += 1
        if code == 0x61 and src == 1 and off in ctx:
            regs[dst] = ctx[off]
        elif code in (0x54, 0x57) and dst in regs:
            regs[dst] &= imm & (mask32 if code == 0x54 else mask64)
        elif code in (0x74, 0x77) and dst in regs and 0 <= imm < 32:
            regs[dst] >>= imm
        elif code == 0xBC and src in regs:
            regs[dst] = regs[src] & mask32
        elif code == 0xB7:
            regs[dst] = imm & mask64
        elif code in (0x55, 0x5D) and dst in regs and off >= 0:
            other = imm & mask64 if code == 0x55 else regs.get(src)
            if other is None:
                raise Unrunnable(f"register r{src} read before it is set")
            pc += off if regs[dst] != other else 0
        elif code == 0x05 and off >= 0:
            pc += off
        elif code == 0x95 and 0 in regs:
            return regs[0] == 1
        else:
            raise Unrunnable(f"instruction {insns[pc - 1]} at {pc - 1}")
    raise Unrunnable("ran off the program")


def allowed(rules: list[DeviceAccess], kind: int, major: int, minor: int, access: int) -> bool:
    masks = {"r": 2, "w": 4, "m": 1}
    return any(
        {"b": 1, "c": 2}[rule.kind] == kind
        and rule.major in (None, major)
        and rule.minor in (None, minor)
        and access & ~sum(masks[a] for a in rule.access) == 0
        for rule in rules
    )


def points(insns: list[sd.Instruction]) -> Iterator[tuple[int, int, int, int]]:
    """Every class of request: (type, major, minor, access)."""
    constants = {imm for _c, _d, _s, _o, imm in insns if 0 <= imm < 1 << 20}
    numbers = sorted(constants | {0, 4242, (1 << 20) - 1})
    return itertools.product((1, 2), numbers, numbers, range(1, 8))


def same_semantics(insns: list[sd.Instruction], rules: list[DeviceAccess]) -> bool:
    return all(run(insns, *p) == allowed(rules, *p) for p in points(insns))


# --- the decoder on the captured programs ------------------------------------------------


def test_vectors_are_captured_from_systemd_252() -> None:
    assert VECTORS["systemd"].startswith("systemd 252 ")
    assert {case["attach_flags"] for case in CASES.values()} == {2}  # BPF_F_ALLOW_MULTI
    assert {case["prog_type"] for case in CASES.values()} == {15}  # CGROUP_DEVICE


@pytest.mark.parametrize("name", sorted(CASES))
def test_decoder_reads_exactly_the_planned_rules(name: str) -> None:
    assert key(sd.decode(raw_of(name))) == key(planned(name))


@pytest.mark.parametrize("name", sorted(CASES))
def test_decoded_rules_are_what_the_program_does(name: str) -> None:
    insns = sd.instructions(raw_of(name))
    assert same_semantics(insns, planned(name))
    assert not same_semantics(insns, planned(name)[1:])  # the oracle can tell


def _mutants(raw: bytes) -> Iterator[tuple[int, bytes]]:
    """Every instruction with one field changed: the opcode swapped for another of the
    subset (or the cgroupfs shape's 64-bit ones), a register, the offset or the value."""
    opcodes = [0x61, 0x54, 0x57, 0x74, 0x77, 0xBC, 0xB7, 0x55, 0x5D, 0x05, 0x95, 0x15]
    for index in range(0, len(raw), 8):
        code, regs, off, imm = struct.unpack_from("<BBhi", raw, index)
        changed = [(c, regs, off, imm) for c in opcodes if c != code]
        changed += [(code, regs ^ bit, off, imm) for bit in (0x01, 0x02, 0x10, 0x20)]
        changed += [(code, regs, off + d, imm) for d in (-1, 1)]
        changed += [(code, regs, off, imm + d) for d in (-1, 1, 1 << 16)]
        for fields in changed:
            insn = struct.pack("<BBhi", *fields)
            yield index // 8, raw[:index] + insn + raw[index + 8 :]


@pytest.mark.parametrize("name", ["null", "null-zero-pts"])
def test_every_single_field_tampering_is_refused_or_decoded_truthfully(name: str) -> None:
    """No changed program passes as the planned policy; any it accepts it reads right."""
    accepted = 0
    for index, mutant in _mutants(raw_of(name)):
        insns = sd.instructions(mutant)
        try:
            rules = sd.decode(mutant)
        except sd.NotSystemdShape:
            continue
        accepted += 1
        assert key(rules) != key(planned(name)), f"tampered instruction {index} passed"
        assert same_semantics(insns, rules), f"instruction {index}: wrong rules {rules}"
    assert accepted  # e.g. another minor: a different, truthfully decoded policy


def test_foreign_and_broken_programs_are_refused() -> None:
    raw = raw_of("null")
    ours = bpfdevices.encode(bpfdevices.program([NULL]))
    block = raw[6 * 8 : 10 * 8]  # the /dev/null block, copied in front of the epilogue
    appended = raw[:-32] + block + raw[-32:]
    for program in (ours, raw[:-8], raw + raw[-8:], raw[:-1], b"", raw[:48] + raw[-32:], appended):
        with pytest.raises(sd.NotSystemdShape):
            sd.decode(program)


# --- on this machine's kernel (a real v2 cgroup) -----------------------------------------


needs_kernel = pytest.mark.root("loading device programs needs root")


@pytest.fixture
def group() -> Iterator[Path]:
    """A fresh cgroup in this machine's v2 tree (no controllers needed for BPF)."""
    unified = next(h.mount for h in cgroups.discover().hierarchies if h.version == 2)
    path = Path(unified) / f"ficc-t-sdbpf-{os.getpid()}-{secrets.token_hex(3)}"
    path.mkdir()
    try:
        yield path
    finally:
        for child in sorted(path.glob("**/"), reverse=True):
            child.rmdir()


@needs_kernel
@pytest.mark.parametrize("name", sorted(CASES))
def test_captured_program_reads_back_from_the_kernel(group: Path, name: str) -> None:
    bpfdevices.attach_program(str(group), raw_of(name))
    _flags, ids = bpfdevices.query(str(group))
    assert bpfdevices.xlated(ids[0]) == (15, raw_of(name))
    assert key(sd.read_back(str(group))) == key(planned(name))


@needs_kernel
def test_kernel_enforces_the_read_back_policy(group: Path, slot: tuple[int, int]) -> None:
    """systemd's program for /dev/null: null opens, zero is refused by the kernel; the
    v1 device cgroup of the child allows everything, so only the program denies."""
    bpfdevices.attach_program(str(group), raw_of("null"))
    assert key(sd.read_back(str(group))) == key(cgroups.expected_devices([NULL]))
    child = subprocess.Popen(
        py("import sys; sys.stdin.read(1)\n" + OPENER),
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        env={},
        user=slot[0],
        group=slot[1],
        extra_groups=[],
    )
    try:
        (group / "cgroup.procs").write_text(str(child.pid))
        out, _ = child.communicate(b"g", timeout=60)
        assert json.loads(out) == {"null": "ok", "zero": "EPERM"}
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()


def _refused(group: Path) -> str:
    with pytest.raises(HostError) as refusal:
        sd.read_back(str(group))
    assert refusal.value.code == "service_devices_unenforceable"
    return refusal.value.message


@needs_kernel
def test_a_second_program_on_the_unit_is_refused(group: Path) -> None:
    bpfdevices.attach_program(str(group), raw_of("null"))
    bpfdevices.attach(str(group), [NULL])
    assert "2 device programs" in _refused(group)


@needs_kernel
def test_no_program_and_a_foreign_program_are_refused(group: Path) -> None:
    assert "0 device programs" in _refused(group)
    bpfdevices.attach(str(group), [NULL])
    assert "not systemd 252's shape" in _refused(group)


@needs_kernel
def test_an_overridable_program_is_refused(group: Path) -> None:
    """BPF_F_ALLOW_OVERRIDE: a program attached below would replace it, not add to it."""
    bpfdevices.attach_program(str(group), raw_of("null"), flags=1)
    assert "flags 1" in _refused(group)


@needs_kernel
def test_ancestor_programs_are_accepted_they_only_restrict(group: Path) -> None:
    """The parent's program runs too (effective list) and can only deny more."""
    bpfdevices.attach(str(group), [ZERO])
    unit = group / "unit"
    unit.mkdir()
    bpfdevices.attach_program(str(unit), raw_of("null"))
    _flags, effective = bpfdevices.query(str(unit), effective=True)
    assert len(effective) == 2
    assert key(sd.read_back(str(unit))) == key(cgroups.expected_devices([NULL]))


@needs_kernel
def test_backend_gate_refuses_and_observers_see_none(group: Path) -> None:
    """How SystemdService uses it on v2: the start gate (strict) gets the refusal with
    its reason, `controls` (not strict) reports devices None (unverifiable)."""
    bpfdevices.attach(str(group), [NULL])
    with pytest.raises(HostError) as refusal:
        systemd._unit_devices(str(group), strict=True)
    assert refusal.value.code == "service_devices_unenforceable"
    assert systemd._unit_devices(str(group), strict=False) is None
    unit = group / "unit"
    unit.mkdir()
    bpfdevices.attach_program(str(unit), raw_of("null"))
    read = systemd._unit_devices(str(unit), strict=True)
    assert read is not None
    assert key(read) == key(cgroups.expected_devices([NULL]))
