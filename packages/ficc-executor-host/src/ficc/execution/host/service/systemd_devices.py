"""systemd's own cgroup v2 device program, read back from the kernel and decoded.

On cgroup v2 there is no `devices.list`: for `DevicePolicy=strict` plus `DeviceAllow=`
systemd attaches a BPF_PROG_TYPE_CGROUP_DEVICE program to the unit's cgroup, and the
kernel asks it about every open and mknod of a device node. Before a payload is
released the systemd backend reads that program back (the kernel's `xlated` copy, not
what systemd meant to load) and turns it into `DeviceAccess` rules, which must equal
the planned ones exactly (`cgroups.expected_devices`).

Why a shape decoder and not an interpreter. The question is "does the program allow
exactly these rules, for every (type, major, minor, access)?", over 2 x 2^20 x 2^20 x 7
inputs. An interpreter answers it only by running every class of inputs (each constant
the program compares a register with, plus one it does not): some 10^5 runs for a long
allow list, too slow for the start path in Python. A program made only of the blocks
below, each an AND of equality tests ending in "allow", means "allow iff some block
matches", so decoding it block by block IS its semantics, for all inputs. The decoder
accepts nothing else: every instruction must be one of the expected opcodes with the
expected registers, every failing test must jump exactly to the next block, and every
block must jump exactly to the allow exit. Anything else (another systemd version, a
tampered or foreign program, a kernel whose `xlated` copy rewrote the code) is a
refusal (`service_devices_unenforceable`), never a guess. The tests run exactly that
class-by-class interpreter as an independent oracle: on the captured programs and on
every single-field tampering of them, whatever the decoder accepts it reads right.

The shapes are exactly those systemd 252 (Debian bookworm) emits in
src/core/bpf-devices.c for `DevicePolicy=strict` with an allow list, with
r1 = struct bpf_cgroup_dev_ctx {u32 access_type; u32 major; u32 minor}:

    r2 = *(u32 *)(r1 + 0); w2 &= 0xffff          device type (1 block, 2 char)
    r3 = *(u32 *)(r1 + 0); w3 >>= 16             access (1 mknod, 2 read, 4 write)
    r4 = *(u32 *)(r1 + 4); r5 = *(u32 *)(r1 + 8) major, minor
    one block per DeviceAllow= entry, in any order:
      [w1 = w3; w1 &= ACCESS; if r1 != r3 goto next]   absent when ACCESS is rwm
      if r2 != TYPE goto next
      [if r4 != MAJOR goto next [if r5 != MINOR goto next]]
      goto allow
    r0 = 0; goto +1                                    nothing matched: deny
    allow: r0 = 1; exit

(`char-*`: no major test; `char-NAME`: no minor test; a node path: both.) The test
vectors under tests/vectors/ are programs captured from real systemd 252 in unified
mode (tools/systemd/unified.py) and the unit tests run the decoder on them.

Which programs count. The kernel runs, for a process in cgroup C, the programs
attached to C and those of every ancestor attached with BPF_F_ALLOW_MULTI, and allows
an access only if every one of them allows it. So:
  - the unit's own cgroup must carry exactly one program, systemd's, attached with
    BPF_F_ALLOW_MULTI (then a program attached below it, e.g. by the payload's runtime
    in the delegated subtree, is added to it rather than replacing it); a second
    program there (a stale one, someone else's) is a refusal, since we could not say
    which rules are ours;
  - that program must be among the unit's effective programs (nothing overrides it);
  - further effective programs belong to ancestors (the slice, a container around
    systemd). They are accepted without decoding: each can only deny more, never
    allow what the unit's program denies, so the unit's program bounds the policy from
    above. The price: an ancestor that denies a prepared device is not detected here
    (the payload then fails to open it, which is safe).
"""

from __future__ import annotations

import struct
from typing import Literal

from ficc.execution.host.core.codes import HostCode
from ficc.execution.host.core.errors import HostError
from ficc.execution.host.service import bpfdevices
from ficc.execution.host.service.interface import DeviceAccess

_PROG_TYPE_CGROUP_DEVICE = 15
_F_ALLOW_MULTI = 2
_KINDS: dict[int, Literal["b", "c"]] = {1: "b", 2: "c"}
_FULL_ACCESS = 7

# Opcodes (linux/bpf.h): 32-bit ldx, alu32 and/rsh/mov, jmp jne (imm, reg), ja, exit.
_LDX_W, _AND32_K, _RSH32_K, _MOV32_X, _MOV64_K = 0x61, 0x54, 0x74, 0xBC, 0xB7
_JNE_K, _JNE_X, _JA, _EXIT = 0x55, 0x5D, 0x05, 0x95

Instruction = tuple[int, int, int, int, int]  # opcode, dst, src, offset, immediate

_PROLOGUE: list[Instruction] = [
    (_LDX_W, 2, 1, 0, 0),
    (_AND32_K, 2, 0, 0, 0xFFFF),
    (_LDX_W, 3, 1, 0, 0),
    (_RSH32_K, 3, 0, 0, 16),
    (_LDX_W, 4, 1, 4, 0),
    (_LDX_W, 5, 1, 8, 0),
]
_EPILOGUE: list[Instruction] = [
    (_MOV64_K, 0, 0, 0, 0),
    (_JA, 0, 0, 1, 0),
    (_MOV64_K, 0, 0, 0, 1),
    (_EXIT, 0, 0, 0, 0),
]


class NotSystemdShape(Exception):
    """The program is not one systemd 252 emits for a strict allow list."""


def instructions(raw: bytes) -> list[Instruction]:
    if not raw or len(raw) % 8:
        raise NotSystemdShape(f"{len(raw)} bytes are not whole instructions")
    insns = []
    for index in range(0, len(raw), 8):
        code, regs, off, imm = struct.unpack_from("<BBhi", raw, index)
        insns.append((code, regs & 0xF, regs >> 4, off, imm))
    return insns


def decode(raw: bytes) -> list[DeviceAccess]:
    """The rules of a program of systemd's shape (see the module docstring), in
    program order; NotSystemdShape for anything else."""
    insns = instructions(raw)
    if insns[: len(_PROLOGUE)] != _PROLOGUE:
        raise NotSystemdShape("the prologue is not systemd's")
    if len(insns) < len(_PROLOGUE) + len(_EPILOGUE) or insns[-len(_EPILOGUE) :] != _EPILOGUE:
        raise NotSystemdShape("the epilogue is not systemd's deny-then-allow exit")
    allow = len(insns) - 2
    rules = []
    start = len(_PROLOGUE)
    while start < len(insns) - len(_EPILOGUE):
        rule, start = _block(insns, start, allow)
        rules.append(rule)
    if not rules:
        raise NotSystemdShape("the program allows nothing (no allow-list block)")
    return rules


def _block(insns: list[Instruction], start: int, allow: int) -> tuple[DeviceAccess, int]:
    """One allow-list block at `start`: (its rule, the index of the next block)."""
    end = _block_end(insns, start, allow)
    access, first = _FULL_ACCESS, start
    if insns[start][0] == _MOV32_X:
        access, first = _access_mask(insns[start : start + 3], start, end), start + 3
    tests = insns[first : end - 1]
    if [dst for _code, dst, _src, _off, _imm in tests] not in ([2], [2, 4], [2, 4, 5]):
        raise NotSystemdShape(f"block at {start} does not test type[, major[, minor]]")
    for position, (code, _dst, src, off, imm) in enumerate(tests, first):
        if code != _JNE_K or src != 0 or position + 1 + off != end or imm < 0:
            raise NotSystemdShape(f"test at {position} is not `if rN != K goto next block`")
    values = [imm for _code, _dst, _src, _off, imm in tests] + [None, None]
    kind = _KINDS.get(values[0] or 0)
    if kind is None:
        raise NotSystemdShape(f"block at {start} tests device type {values[0]}")
    return DeviceAccess(kind, values[1], values[2], _access_text(access)), end


def _block_end(insns: list[Instruction], start: int, allow: int) -> int:
    """The index after the block's `goto allow`: its first jump-always (a block is at
    most 7 instructions)."""
    for index in range(start, min(start + 7, len(insns) - len(_EPILOGUE))):
        code, dst, src, off, imm = insns[index]
        if code == _JA:
            if (dst, src, imm) != (0, 0, 0) or index + 1 + off != allow:
                raise NotSystemdShape(f"jump at {index} does not go to the allow exit")
            return index + 1
    raise NotSystemdShape(f"block at {start} does not end with a jump to the allow exit")


def _access_mask(prefix: list[Instruction], start: int, end: int) -> int:
    """MASK of the prefix `w1 = w3; w1 &= MASK; if r1 != r3 goto next block`."""
    move, mask, test = prefix
    if move != (_MOV32_X, 1, 3, 0, 0) or mask[:4] != (_AND32_K, 1, 0, 0):
        raise NotSystemdShape(f"the access test at {start} is not systemd's")
    if not 0 < mask[4] < _FULL_ACCESS:
        raise NotSystemdShape(f"access mask {mask[4]} at {start} is not a partial rwm set")
    if test[:3] != (_JNE_X, 1, 3) or test[4] != 0 or start + 3 + test[3] != end:
        raise NotSystemdShape(f"the access test at {start} does not skip to the next block")
    return mask[4]


def _access_text(mask: int) -> str:
    return "".join(letter for bit, letter in ((2, "r"), (4, "w"), (1, "m")) if mask & bit)


# --- reading the program back from the kernel ------------------------------------------


def read_back(cgroup_dir: str) -> list[DeviceAccess]:
    """The device rules systemd's program enforces on the unit cgroup `cgroup_dir` (a v2
    directory), refused (`service_devices_unenforceable`) unless exactly one program of
    systemd's shape is attached there, with BPF_F_ALLOW_MULTI, and is in force."""
    try:
        flags, own = bpfdevices.query(cgroup_dir)
        _flags, effective = bpfdevices.query(cgroup_dir, effective=True)
        programs = [bpfdevices.xlated(prog_id) for prog_id in own]
    except OSError as error:
        raise _refusal(cgroup_dir, f"reading its device programs failed ({error})") from error
    if len(own) != 1:
        raise _refusal(cgroup_dir, f"{len(own)} device programs are attached, not systemd's one")
    if flags != _F_ALLOW_MULTI:
        raise _refusal(cgroup_dir, f"the program is attached with flags {flags}, not ALLOW_MULTI")
    if own[0] not in effective:
        raise _refusal(cgroup_dir, "the attached program is not among the effective ones")
    prog_type, raw = programs[0]
    if prog_type != _PROG_TYPE_CGROUP_DEVICE:
        raise _refusal(cgroup_dir, f"program {own[0]} has type {prog_type}")
    try:
        return decode(raw)
    except NotSystemdShape as error:
        raise _refusal(
            cgroup_dir, f"program {own[0]} is not systemd 252's shape: {error}"
        ) from error


def _refusal(cgroup_dir: str, problem: str) -> HostError:
    return HostError(
        HostCode.SERVICE_DEVICES_UNENFORCEABLE,
        f"the device policy of {cgroup_dir} cannot be verified: {problem}; this host's "
        "systemd must attach exactly its own DevicePolicy=strict program (systemd 252 "
        "shape) to the unit, or use a cgroup v1 (hybrid) host",
    )
