"""The payload's system-call filter, read from the live process and judged by content.

`Seccomp: 2` in /proc/PID/status says only that some filter is installed; a filter
that allows everything satisfies it. So the gate reads the filters themselves and runs
them over a fixed list of calls that no payload may make:

- `read_filters` attaches to the barrier with ptrace (PTRACE_SEIZE, then
  PTRACE_INTERRUPT, so no signal is sent and the process only pauses), reads every
  filter of the process with PTRACE_SECCOMP_GET_FILTER (the classic BPF program as it
  was installed; the daemon needs CAP_SYS_ADMIN and must not run under seccomp
  itself), and detaches. The process goes on exactly where it was.
- `evaluate` is a classic-BPF interpreter for the instructions seccomp accepts
  (loads from `struct seccomp_data`, ALU, jumps, scratch memory, returns); the kernel
  runs every filter and the action of highest precedence wins, and so does this.
- `allowed_calls` runs the MUST_DENY calls of the host's architecture through the
  filters, each with all-zero and all-one arguments, and returns those not denied.
  Denied means KILL_PROCESS, KILL_THREAD, TRAP or ERRNO (or an action the kernel does
  not know, which it treats as kill); ALLOW, LOG, TRACE and USER_NOTIF are not denials.

The list is the dangerous calls that Podman's default profile denies to a container
with no capabilities: loading kernel code (kexec, modules, bpf), swap, quotas, the
system clock, process accounting, keyrings, perf events, userfaultfd,
open_by_handle_at, and on x86 iopl/ioperm. On x86_64 each is checked in the native,
x32 and i386 ABIs (a 64-bit process can enter each of them); on aarch64 in the native
ABI (32-bit compat calls are not checked).
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import os
import platform
import struct
import threading
import time
from typing import Annotated

import msgspec

U32 = Annotated[int, msgspec.Meta(ge=0, le=0xFFFF_FFFF)]
Instruction = tuple[int, int, int, int]
"""A classic BPF instruction: code, jt, jf, k."""

AUDIT_ARCH_X86_64 = 0xC000003E
AUDIT_ARCH_I386 = 0x40000003
AUDIT_ARCH_AARCH64 = 0xC00000B7
X32_BIT = 0x40000000

_X86_64 = {
    "kexec_load": 246, "kexec_file_load": 320, "init_module": 175, "finit_module": 313,
    "delete_module": 176, "swapon": 167, "swapoff": 168, "open_by_handle_at": 304,
    "bpf": 321, "perf_event_open": 298, "acct": 163, "settimeofday": 164,
    "clock_settime": 227, "userfaultfd": 323, "add_key": 248, "request_key": 249,
    "quotactl": 179, "iopl": 172, "ioperm": 173,
}  # fmt: skip
_X32 = {**_X86_64, "kexec_load": 528}
_I386 = {
    "kexec_load": 283, "init_module": 128, "finit_module": 350, "delete_module": 129,
    "swapon": 87, "swapoff": 115, "open_by_handle_at": 342, "bpf": 357,
    "perf_event_open": 336, "acct": 51, "settimeofday": 79, "clock_settime": 264,
    "userfaultfd": 374, "add_key": 286, "request_key": 287, "quotactl": 131,
    "iopl": 110, "ioperm": 101,
}  # fmt: skip
_GENERIC = {
    "kexec_load": 104, "kexec_file_load": 294, "init_module": 105, "finit_module": 273,
    "delete_module": 106, "swapon": 224, "swapoff": 225, "open_by_handle_at": 265,
    "bpf": 280, "perf_event_open": 241, "acct": 89, "settimeofday": 170,
    "clock_settime": 112, "userfaultfd": 282, "add_key": 217, "request_key": 218,
    "quotactl": 60,
}  # fmt: skip

MUST_DENY: dict[str, list[tuple[str, int, int]]] = {
    "x86_64": [
        *((name, AUDIT_ARCH_X86_64, nr) for name, nr in _X86_64.items()),
        *((f"{name} (x32)", AUDIT_ARCH_X86_64, nr | X32_BIT) for name, nr in _X32.items()),
        *((f"{name} (i386)", AUDIT_ARCH_I386, nr) for name, nr in _I386.items()),
    ],
    "aarch64": [(name, AUDIT_ARCH_AARCH64, nr) for name, nr in _GENERIC.items()],
}
"""Per machine: (name, AUDIT_ARCH_*, system-call number) that every filter must deny."""

_ARGS = (0, 0xFFFF_FFFF_FFFF_FFFF)
_RET_ACTION_FULL = 0xFFFF0000
_NOT_DENIED = frozenset({0x7FFF0000, 0x7FFC0000, 0x7FF00000, 0x7FC00000})
"""ALLOW, LOG, TRACE, USER_NOTIF."""
_MAX_INSNS = 4096


class SeccompFilters(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """Every filter of a process (innermost first, as the kernel numbers them)."""

    machine: str
    programs: tuple[tuple[tuple[U32, U32, U32, U32], ...], ...]


# --- the interpreter -------------------------------------------------------------------


class BadProgram(ValueError):
    """An instruction seccomp would not have accepted: the filter cannot be judged."""


class FiltersUnreadable(Exception):
    """The filters of the process could not be read (the message says why and what to
    do); the evidence records it and the gate refuses."""


def seccomp_data(nr: int, arch: int, arg: int) -> bytes:
    """struct seccomp_data {int nr; u32 arch; u64 instruction_pointer; u64 args[6]}."""
    return struct.pack("<iIQ6Q", nr if nr < 2**31 else nr - 2**32, arch, 0, *([arg] * 6))


def evaluate(program: tuple[Instruction, ...] | list[Instruction], data: bytes) -> int:
    """Run one classic BPF program over `data`; its 32-bit return value."""
    a = x = 0
    memory = [0] * 16
    pc = 0
    while 0 <= pc < len(program):
        code, jt, jf, k = program[pc]
        pc += 1
        cls = code & 0x07
        if cls == 0x06:  # RET
            return (a if code & 0x18 == 0x10 else k) & 0xFFFF_FFFF
        if cls in (0x00, 0x01):  # LD, LDX
            value = _load(code, k, data, memory)
            if cls == 0x00:
                a = value
            else:
                x = value
        elif cls == 0x02:  # ST
            memory[_slot(k)] = a
        elif cls == 0x03:  # STX
            memory[_slot(k)] = x
        elif cls == 0x04:  # ALU
            a = _alu(code, a, x if code & 0x08 else k)
        elif cls == 0x05:  # JMP
            pc += _jump((code, jt, jf, k), a, x)
        elif code == 0x07:  # MISC TAX
            x = a
        elif code == 0x87:  # MISC TXA
            a = x
        else:
            raise BadProgram(f"instruction {code:#x} at {pc - 1}")
    raise BadProgram("the program runs past its end without a return")


def _slot(k: int) -> int:
    if k >= 16:
        raise BadProgram(f"scratch memory slot {k}")
    return k


def _load(code: int, k: int, data: bytes, memory: list[int]) -> int:
    mode = code & 0xE0
    if mode == 0x00:  # IMM
        return k
    if mode == 0x60:  # MEM
        return memory[_slot(k)]
    if mode == 0x80:  # LEN
        return len(data)
    if mode == 0x20 and code & 0x18 == 0x00 and k % 4 == 0 and k + 4 <= len(data):
        return int(struct.unpack_from("<I", data, k)[0])
    raise BadProgram(f"load {code:#x} {k}")


def _alu(code: int, a: int, operand: int) -> int:
    op = code & 0xF0
    if op in (0x30, 0x90) and operand == 0:
        raise BadProgram("division by zero")
    results = {
        0x00: lambda: a + operand,
        0x10: lambda: a - operand,
        0x20: lambda: a * operand,
        0x30: lambda: a // operand,
        0x40: lambda: a | operand,
        0x50: lambda: a & operand,
        0x60: lambda: a << (operand & 31),
        0x70: lambda: a >> (operand & 31),
        0x80: lambda: -a,
        0x90: lambda: a % operand,
        0xA0: lambda: a ^ operand,
    }
    if op not in results:
        raise BadProgram(f"ALU operation {code:#x}")
    return results[op]() & 0xFFFF_FFFF


def _jump(insn: Instruction, a: int, x: int) -> int:
    code, jt, jf, k = insn
    op = code & 0xF0
    if op == 0x00:
        return k
    operand = x if code & 0x08 else k
    tests = {
        0x10: a == operand,
        0x20: a > operand,
        0x30: a >= operand,
        0x40: bool(a & operand),
    }
    if op not in tests:
        raise BadProgram(f"jump {code:#x}")
    return jt if tests[op] else jf


def action(filters: SeccompFilters, data: bytes) -> int:
    """The action the kernel takes: of every filter's result, the one of highest
    precedence (the lowest action as a signed 32-bit number)."""
    results = [evaluate(program, data) for program in filters.programs]

    def signed(value: int) -> int:
        full = value & _RET_ACTION_FULL
        return full - 2**32 if full >= 2**31 else full

    return min(results, key=signed) & _RET_ACTION_FULL


_JUDGED: dict[SeccompFilters, tuple[str, ...]] = {}
_JUDGED_MAX = 32
_judged_lock = threading.Lock()


def allowed_calls(filters: SeccompFilters) -> list[str]:
    """The MUST_DENY calls (of the filters' machine) that the filters do not deny.

    The answer depends on the programs alone, and every container of one runtime gets
    the same programs, so an answer is kept (for the last few distinct filter sets) and
    not worked out again: interpreting a few hundred instructions for every call of the
    list costs tens of milliseconds in this interpreter, on every start.
    """
    with _judged_lock:
        known = _JUDGED.get(filters)
    if known is None:
        known = tuple(_judge(filters))
        with _judged_lock:
            while len(_JUDGED) >= _JUDGED_MAX:
                del _JUDGED[next(iter(_JUDGED))]
            _JUDGED[filters] = known
    return list(known)


def _judge(filters: SeccompFilters) -> list[str]:
    calls = MUST_DENY.get(filters.machine)
    if calls is None:
        raise BadProgram(f"no list of calls to deny for machine {filters.machine!r}")
    if not filters.programs:
        return [name for name, _arch, _nr in calls]
    return [
        name
        for name, arch, nr in calls
        if any(action(filters, seccomp_data(nr, arch, arg)) in _NOT_DENIED for arg in _ARGS)
    ]


# --- reading the filters of a live process ------------------------------------------------

_PTRACE_DETACH, _PTRACE_SEIZE, _PTRACE_INTERRUPT, _PTRACE_SECCOMP_GET_FILTER = (
    17,
    0x4206,
    0x4207,
    0x420C,
)
_WALL = 0x40000000


def _ptrace(libc: ctypes.CDLL, request: int, pid: int, addr: int, data: object) -> int:
    ctypes.set_errno(0)
    result = int(
        libc.ptrace(ctypes.c_long(request), ctypes.c_long(pid), ctypes.c_void_p(addr), data)
    )
    if result < 0:
        number = ctypes.get_errno()
        raise OSError(number, os.strerror(number))
    return result


def read_filters(pid: int, *, timeout: float = 2.0) -> SeccompFilters:
    """Every seccomp filter of `pid`, read through ptrace (see the module docstring)."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.ptrace.restype = ctypes.c_long
    try:
        _ptrace(libc, _PTRACE_SEIZE, pid, 0, None)
    except OSError as error:
        raise _unreadable(pid, f"ptrace attach failed ({error.strerror})") from error
    try:
        _ptrace(libc, _PTRACE_INTERRUPT, pid, 0, None)
        _wait_stopped(pid, timeout)
        programs = []
        for index in range(64):
            try:
                count = _ptrace(libc, _PTRACE_SECCOMP_GET_FILTER, pid, index, None)
            except OSError as error:
                if error.errno == errno.ENOENT:
                    break
                raise
            if not 0 < count <= _MAX_INSNS:
                raise _unreadable(pid, f"filter {index} has {count} instructions")
            buffer = ctypes.create_string_buffer(count * 8)
            _ptrace(libc, _PTRACE_SECCOMP_GET_FILTER, pid, index, buffer)
            programs.append(tuple(struct.iter_unpack("<HBBI", buffer.raw)))
    except OSError as error:
        raise _unreadable(pid, f"{error.strerror}") from error
    finally:
        # A process that exited cannot be detached; the gate's start-time check says so.
        with contextlib.suppress(OSError):
            _ptrace(libc, _PTRACE_DETACH, pid, 0, None)
    return SeccompFilters(machine=platform.machine(), programs=tuple(programs))


def _wait_stopped(pid: int, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while True:
        waited, _status = os.waitpid(pid, os.WNOHANG | _WALL)
        if waited == pid:
            return
        if time.monotonic() >= deadline:
            raise OSError(errno.ETIMEDOUT, "the process did not stop for inspection")
        time.sleep(0.001)


def _unreadable(pid: int, detail: str) -> FiltersUnreadable:
    return FiltersUnreadable(
        f"the system-call filter of process {pid} cannot be read ({detail}); the payload "
        "is not released: the daemon needs CAP_SYS_ADMIN and CAP_SYS_PTRACE, must not run "
        "under seccomp itself, and no one else may trace the payload",
    )
