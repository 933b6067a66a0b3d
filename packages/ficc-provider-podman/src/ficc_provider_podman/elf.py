"""The SONAME of a shared library, read from its ELF dynamic section (bounded, pure).

A vendor's device spec mounts a driver library under its full versioned name
(`libcuda.so.550.54.15`) and asks a hook to run `ldconfig` in the container, which
links the name programs load (`libcuda.so.1`, the library's DT_SONAME) to that file.
The provider reproduces that link itself (hooks.py), so it must know the SONAME
exactly: this reads it from the host's file the way the dynamic loader would find it
(PT_DYNAMIC, DT_STRTAB mapped through the PT_LOAD segments, DT_SONAME), touching only
the headers, the dynamic section and one string. Anything that is not a well-formed
shared object answers None, as `ldconfig` skips what it cannot read.
"""

from __future__ import annotations

import os
import struct

MAGIC = b"\x7fELF"
ET_DYN = 3
PT_LOAD = 1
PT_DYNAMIC = 2
DT_NULL = 0
DT_STRTAB = 5
DT_STRSZ = 10
DT_SONAME = 14
MAX_PROGRAM_HEADERS = 256
MAX_DYNAMIC_ENTRIES = 4096
MAX_SONAME = 255


class _Layout:
    """Field formats of one ELF class and byte order."""

    def __init__(self, elf_class: int, data: int) -> None:
        order = "<" if data == 1 else ">"
        wide = elf_class == 2
        self.header = struct.Struct(order + ("16xHHIQQQIHHHHHH" if wide else "16xHHIIIIIHHHHHH"))
        self.program = struct.Struct(order + ("IIQQQQQQ" if wide else "IIIIIIII"))
        self.dynamic = struct.Struct(order + ("qQ" if wide else "iI"))
        self.wide = wide


def _segment(layout: _Layout, raw: bytes) -> tuple[int, int, int, int]:
    """(type, file offset, virtual address, size in the file) of a program header."""
    fields = layout.program.unpack(raw)
    if layout.wide:
        kind, _flags, offset, vaddr, _paddr, filesz = fields[:6]
    else:
        kind, offset, vaddr, _paddr, filesz = fields[:5]
    return kind, offset, vaddr, filesz


def soname_of_fd(fd: int) -> str | None:
    """The DT_SONAME of the shared object open at `fd`, or None."""
    ident = os.pread(fd, 16, 0)
    if len(ident) < 16 or ident[:4] != MAGIC or ident[4] not in (1, 2) or ident[5] not in (1, 2):
        return None
    layout = _Layout(ident[4], ident[5])
    head = os.pread(fd, layout.header.size, 0)
    if len(head) < layout.header.size:
        return None
    kind, _machine, _version, _entry, phoff, _shoff, _flags, _ehsize, phentsize, phnum = (
        layout.header.unpack(head)[:10]
    )
    if kind != ET_DYN or phentsize != layout.program.size or not 0 < phnum <= MAX_PROGRAM_HEADERS:
        return None
    table = os.pread(fd, phentsize * phnum, phoff)
    if len(table) < phentsize * phnum:
        return None
    segments = [_segment(layout, table[i : i + phentsize]) for i in range(0, len(table), phentsize)]
    dynamic = next((s for s in segments if s[0] == PT_DYNAMIC), None)
    if dynamic is None:
        return None
    tags = _dynamic_tags(fd, layout, dynamic[1], dynamic[3])
    if DT_SONAME not in tags or DT_STRTAB not in tags:
        return None
    strtab = _file_offset(tags[DT_STRTAB], [s for s in segments if s[0] == PT_LOAD])
    if strtab is None or tags[DT_SONAME] >= tags.get(DT_STRSZ, 1 << 62):
        return None
    raw = os.pread(fd, MAX_SONAME + 1, strtab + tags[DT_SONAME])
    name, nul, _ = raw.partition(b"\x00")
    if not nul or not name or b"/" in name:
        return None
    try:
        return name.decode("ascii")
    except UnicodeDecodeError:
        return None


def _dynamic_tags(fd: int, layout: _Layout, offset: int, size: int) -> dict[int, int]:
    """The first value of each tag of the dynamic section, up to DT_NULL."""
    step = layout.dynamic.size
    count = min(size // step, MAX_DYNAMIC_ENTRIES)
    raw = os.pread(fd, count * step, offset)
    tags: dict[int, int] = {}
    for index in range(len(raw) // step):
        tag, value = layout.dynamic.unpack_from(raw, index * step)
        if tag == DT_NULL:
            break
        tags.setdefault(tag, value)
    return tags


def _file_offset(address: int, loads: list[tuple[int, int, int, int]]) -> int | None:
    """Where the virtual `address` is in the file, through the segment that loads it."""
    for _kind, offset, vaddr, filesz in loads:
        if vaddr <= address < vaddr + filesz:
            return address - vaddr + offset
    return None
