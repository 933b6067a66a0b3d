"""A closed device policy for cgroup v2: a tiny eBPF program, built and read back here.

cgroup v2 has no `devices.allow` file; the kernel asks a BPF_PROG_TYPE_CGROUP_DEVICE
program attached to the cgroup instead (this is what systemd and runc do too). The
program is generated from the device rules, so it has one fixed shape that
`decode` can read back from the kernel's copy (`xlated` instructions): the controls
the gate sees come from the kernel, not from what we meant to load.

Shape, with r1 = struct bpf_cgroup_dev_ctx {u32 access_type; u32 major; u32 minor}:

    r2 = type (access_type & 0xffff)   r3 = access (access_type >> 16)
    r4 = major                         r5 = minor
    if r3 == MKNOD: return 1           (creating nodes grants no access)
    per rule: if r2 == CHAR && r4 == M [&& r5 == m]: return 1
    return 0

Attached with BPF_F_ALLOW_MULTI so a runtime can attach its own, stricter program
below it; the kernel allows an access only if every program on the path allows it.
The bpf(2) plumbing (`query`, `xlated`, `attach_program`) is shared with
`systemd_devices`, which reads back the program systemd attaches for its units.
"""

from __future__ import annotations

import ctypes
import os
import platform
import struct

from ficc.execution.host.core.codes import HostCode
from ficc.execution.host.core.errors import HostError
from ficc.execution.host.service.interface import DeviceAccess, DeviceRule

_SYSCALL = {"x86_64": 321, "aarch64": 280}
_PROG_LOAD, _PROG_ATTACH, _PROG_GET_FD_BY_ID, _OBJ_GET_INFO_BY_FD, _PROG_QUERY = 5, 8, 13, 15, 16
_PROG_TYPE_CGROUP_DEVICE = 15
PROG_TYPE = _PROG_TYPE_CGROUP_DEVICE
"""BPF_PROG_TYPE_CGROUP_DEVICE, as `xlated` reports it."""
_CGROUP_DEVICE = 6
_F_ALLOW_MULTI = 2
_F_QUERY_EFFECTIVE = 1
_MAX_PROGRAMS = 64
_DEV_CHAR = 2
_ACC_MKNOD = 1
_ATTR_SIZE = 128
_INFO_SIZE = 256

# Instruction opcodes (linux/bpf.h): load word, and/rsh/mov with an immediate, jne, exit.
_LDX_W, _AND_K, _RSH_K, _MOV_K, _JNE_K, _EXIT = 0x61, 0x57, 0x77, 0xB7, 0x55, 0x95

Instruction = tuple[int, int, int, int, int]  # opcode, dst, src, offset, immediate


def _insn(code: int, dst: int = 0, src: int = 0, off: int = 0, imm: int = 0) -> Instruction:
    return (code, dst, src, off, imm)


_PROLOGUE = [
    _insn(_LDX_W, 2, 1, 0),
    _insn(_AND_K, 2, imm=0xFFFF),
    _insn(_LDX_W, 3, 1, 0),
    _insn(_RSH_K, 3, imm=16),
    _insn(_LDX_W, 4, 1, 4),
    _insn(_LDX_W, 5, 1, 8),
    _insn(_JNE_K, 3, off=2, imm=_ACC_MKNOD),
    _insn(_MOV_K, 0, imm=1),
    _insn(_EXIT),
]
_ALLOW = [_insn(_MOV_K, 0, imm=1), _insn(_EXIT)]
_DENY = [_insn(_MOV_K, 0, imm=0), _insn(_EXIT)]


def program(devices: list[DeviceRule]) -> list[Instruction]:
    """The filter allowing exactly `devices` (plus mknod of anything)."""
    insns = list(_PROLOGUE)
    for device in devices:
        if device.minor is None:
            insns += [
                _insn(_JNE_K, 2, off=3, imm=_DEV_CHAR),
                _insn(_JNE_K, 4, off=2, imm=device.major),
            ]
        else:
            insns += [
                _insn(_JNE_K, 2, off=4, imm=_DEV_CHAR),
                _insn(_JNE_K, 4, off=3, imm=device.major),
                _insn(_JNE_K, 5, off=2, imm=device.minor),
            ]
        insns += _ALLOW
    return insns + _DENY


def encode(insns: list[Instruction]) -> bytes:
    return b"".join(
        struct.pack("<BBhi", code, dst | (src << 4), off, imm) for code, dst, src, off, imm in insns
    )


def decode(raw: bytes) -> list[DeviceAccess] | None:
    """Read the rules back from a program of our shape; None for any other program."""
    if len(raw) % 8:
        return None
    insns = []
    for index in range(0, len(raw), 8):
        code, regs, off, imm = struct.unpack_from("<BBhi", raw, index)
        insns.append((code, regs & 0xF, regs >> 4, off, imm))
    if insns[: len(_PROLOGUE)] != _PROLOGUE or insns[-2:] != _DENY:
        return None
    rules = [DeviceAccess("c", None, None, "m"), DeviceAccess("b", None, None, "m")]
    body = insns[len(_PROLOGUE) : -2]
    while body:
        if body[:1] == [_insn(_JNE_K, 2, off=3, imm=_DEV_CHAR)] and body[3:4] == _ALLOW[1:]:
            block, minor = body[:4], None
        elif body[:1] == [_insn(_JNE_K, 2, off=4, imm=_DEV_CHAR)] and len(body) >= 5:
            block, minor = body[:5], body[2][4]
            if block[2][:4] != (_JNE_K, 5, 0, 2):
                return None
        else:
            return None
        major = block[1]
        if major[:4] != (_JNE_K, 4, 0, len(block) - 2) or block[-2:] != _ALLOW:
            return None
        rules.append(DeviceAccess("c", major[4], minor, "rwm"))
        body = body[len(block) :]
    return rules


# --- the bpf(2) system call ----------------------------------------------------------


def _bpf(command: int, attr: ctypes.Array[ctypes.c_char]) -> int:
    number = _SYSCALL.get(platform.machine())
    if number is None:
        raise HostError(HostCode.SERVICE_DEVICES_UNENFORCEABLE, "no bpf(2) number for this CPU")
    libc = ctypes.CDLL(None, use_errno=True)
    result = int(libc.syscall(number, command, attr, len(attr)))
    if result < 0:
        error = ctypes.get_errno()
        raise OSError(error, os.strerror(error))
    return result


def _attr(*fields: tuple[int, str, int]) -> ctypes.Array[ctypes.c_char]:
    """A zeroed bpf_attr with (offset, struct format, value) fields filled in."""
    attr = ctypes.create_string_buffer(_ATTR_SIZE)
    for offset, fmt, value in fields:
        struct.pack_into(fmt, attr, offset, value)
    return attr


def attach(cgroup_dir: str, devices: list[DeviceRule]) -> None:
    """Load the filter for `devices` and attach it to the v2 cgroup directory."""
    attach_program(cgroup_dir, encode(program(devices)))


def attach_program(cgroup_dir: str, raw: bytes, flags: int = _F_ALLOW_MULTI) -> None:
    """Load a device program (encoded instructions) and attach it with `flags`."""
    code = ctypes.create_string_buffer(raw, len(raw))
    license_text = ctypes.create_string_buffer(b"GPL")
    log = ctypes.create_string_buffer(65536)
    load = _attr(
        (0, "<I", _PROG_TYPE_CGROUP_DEVICE),
        (4, "<I", len(code.raw) // 8),
        (8, "<Q", ctypes.addressof(code)),
        (16, "<Q", ctypes.addressof(license_text)),
        (24, "<I", 1),
        (28, "<I", len(log)),
        (32, "<Q", ctypes.addressof(log)),
    )
    try:
        prog = _bpf(_PROG_LOAD, load)
    except OSError as error:
        raise HostError(
            HostCode.SERVICE_DEVICES_UNENFORCEABLE,
            f"the kernel refused the device filter ({error}): {log.value.decode(errors='replace')}",
        ) from error
    try:
        target = os.open(cgroup_dir, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
        try:
            _bpf(
                _PROG_ATTACH,
                _attr(
                    (0, "<I", target),
                    (4, "<I", prog),
                    (8, "<I", _CGROUP_DEVICE),
                    (12, "<I", flags),
                ),
            )
        finally:
            os.close(target)
    except OSError as error:
        raise HostError(
            HostCode.SERVICE_DEVICES_UNENFORCEABLE, f"attaching the device filter failed: {error}"
        ) from error
    finally:
        os.close(prog)


def attached(cgroup_dir: str) -> list[list[DeviceAccess] | None]:
    """The decoded rules of every device program attached directly to the cgroup."""
    _flags, ids = query(cgroup_dir)
    return [decode(xlated(prog_id)[1]) for prog_id in ids]


def query(cgroup_dir: str, *, effective: bool = False) -> tuple[int, list[int]]:
    """(attach flags, program IDs) of the cgroup's device programs: those attached to
    the directory itself, or (`effective`) every one the kernel runs for it, its
    ancestors' included (the kernel then reports no attach flags: 0)."""
    ids = (ctypes.c_uint32 * _MAX_PROGRAMS)()
    target = os.open(cgroup_dir, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        request = _attr(
            (0, "<I", target),
            (4, "<I", _CGROUP_DEVICE),
            (8, "<I", _F_QUERY_EFFECTIVE if effective else 0),
            (16, "<Q", ctypes.addressof(ids)),
            (24, "<I", _MAX_PROGRAMS),
        )
        _bpf(_PROG_QUERY, request)
    finally:
        os.close(target)
    flags, _ids, count = struct.unpack_from("<IQI", request, 12)
    return flags, [ids[index] for index in range(count)]


def xlated(prog_id: int) -> tuple[int, bytes]:
    """(program type, the kernel's copy of its instructions) of a loaded program."""
    prog = _bpf(_PROG_GET_FD_BY_ID, _attr((0, "<I", prog_id)))
    try:
        info = ctypes.create_string_buffer(_INFO_SIZE)
        request = _attr((0, "<I", prog), (4, "<I", _INFO_SIZE), (8, "<Q", ctypes.addressof(info)))
        _bpf(_OBJ_GET_INFO_BY_FD, request)
        length = struct.unpack_from("<I", info, 20)[0]
        code = ctypes.create_string_buffer(length)
        info = ctypes.create_string_buffer(_INFO_SIZE)
        struct.pack_into("<I", info, 20, length)
        struct.pack_into("<Q", info, 32, ctypes.addressof(code))
        request = _attr((0, "<I", prog), (4, "<I", _INFO_SIZE), (8, "<Q", ctypes.addressof(info)))
        _bpf(_OBJ_GET_INFO_BY_FD, request)
        return struct.unpack_from("<I", info, 0)[0], code.raw[:length]
    finally:
        os.close(prog)
