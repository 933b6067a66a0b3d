"""Pure parsers of /proc files, bytes in and records out (unit-tested on recorded
samples): status, stat, cgroup, limits, mountinfo, fdinfo, the v1 devices list."""

from __future__ import annotations

import re
import stat

from ficc.execution.host.linux.evidence import (
    MAX_MOUNTS,
    RLIMIT_LABELS,
    Capabilities,
    CgroupEntry,
    DeviceAccess,
    Ids,
    Mount,
    Rlimit,
    Stat,
    Status,
    malformed,
)


def _text(data: bytes, what: str) -> str:
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise malformed(what, "not UTF-8") from exc


def _status_fields(data: bytes) -> dict[str, str]:
    fields: dict[str, str] = {}
    for line in _text(data, "status").splitlines():
        key, sep, value = line.partition(":")
        if sep:
            fields[key] = value.strip()
    return fields


def _int_list(value: str, what: str) -> tuple[int, ...]:
    try:
        numbers = tuple(int(part) for part in value.split())
    except ValueError as exc:
        raise malformed("status", f"{what} is not a list of integers") from exc
    if any(number < 0 for number in numbers):
        raise malformed("status", f"{what} has a negative id")
    return numbers


def _ids(fields: dict[str, str], key: str) -> Ids:
    numbers = _int_list(fields.get(key, ""), key)
    if len(numbers) != 4:
        raise malformed("status", f"{key} has {len(numbers)} fields, expected 4")
    return Ids(*numbers)


def _hex(fields: dict[str, str], key: str) -> int:
    value = fields.get(key)
    if value is None or not re.fullmatch(r"[0-9a-f]{1,16}", value):
        raise malformed("status", f"{key} is missing or not a hex mask")
    return int(value, 16)


def _decimal(fields: dict[str, str], key: str) -> int:
    value = fields.get(key)
    if value is None or not value.isdigit():
        raise malformed("status", f"{key} is missing or not a number")
    return int(value)


def parse_status(data: bytes) -> Status:
    """Parse /proc/PID/status; every field the gate needs must be present."""
    fields = _status_fields(data)
    return Status(
        uid=_ids(fields, "Uid"),
        gid=_ids(fields, "Gid"),
        groups=_int_list(fields.get("Groups", ""), "Groups"),
        capabilities=Capabilities(
            effective=_hex(fields, "CapEff"),
            permitted=_hex(fields, "CapPrm"),
            bounding=_hex(fields, "CapBnd"),
            inheritable=_hex(fields, "CapInh"),
            ambient=_hex(fields, "CapAmb"),
        ),
        no_new_privs=_decimal(fields, "NoNewPrivs"),
        seccomp=_decimal(fields, "Seccomp"),
        seccomp_filters=(
            _decimal(fields, "Seccomp_filters") if "Seccomp_filters" in fields else None
        ),
    )


def parse_stat(data: bytes) -> Stat:
    """Parse state and start time (field 22) of /proc/PID/stat.

    The command name (field 2) is in parentheses and may itself contain ") " and
    spaces, so the fields after it are found from the LAST ')'.
    """
    close = data.rfind(b")")
    if close < 0 or b"(" not in data[:close]:
        raise malformed("stat", "no command name in parentheses")
    rest = data[close + 1 :].split()
    # rest[0] is field 3 (state); field 22 (starttime) is rest[19].
    if len(rest) < 20 or not rest[19].isdigit():
        raise malformed("stat", "too few fields after the command name")
    return Stat(state=_text(rest[0], "stat"), start_time=int(rest[19]))


def parse_cgroup(data: bytes) -> tuple[CgroupEntry, ...]:
    """Parse every line of /proc/PID/cgroup (v1 hierarchies and the v2 line)."""
    entries = []
    for line in _text(data, "cgroup").splitlines():
        if not line:
            continue
        hierarchy, sep1, rest = line.partition(":")
        controllers, sep2, path = rest.partition(":")
        if not (sep1 and sep2 and hierarchy.isdigit() and path.startswith("/")):
            raise malformed("cgroup", f"line {line!r}")
        entries.append(
            CgroupEntry(
                hierarchy_id=int(hierarchy),
                controllers=tuple(controllers.split(",")) if controllers else (),
                path=path,
            )
        )
    if not entries:
        raise malformed("cgroup", "no lines")
    return tuple(entries)


def parse_namespace_link(kind: str, link: str) -> int:
    """`mnt:[4026531840]` -> 4026531840 (the nsfs inode)."""
    match = re.fullmatch(rf"{re.escape(kind)}:\[([0-9]+)\]", link)
    if match is None:
        raise malformed("namespaces", f"{kind} link is {link!r}")
    return int(match.group(1))


_LIMIT_LINE = re.compile(r"(Max [a-z ]+?)\s{2,}(\S+)\s+(\S+)(?:\s+\S+)?\s*")


def _limit_value(value: str) -> int | None:
    if value == "unlimited":
        return None
    if not value.isdigit():
        raise malformed("limits", f"value {value!r}")
    return int(value)


def parse_limits(data: bytes) -> tuple[Rlimit, ...]:
    """Parse /proc/PID/limits; an unknown limit label is malformed (fail closed)."""
    lines = _text(data, "limits").splitlines()
    if not lines or not lines[0].startswith("Limit"):
        raise malformed("limits", "missing header")
    limits = []
    for line in lines[1:]:
        match = _LIMIT_LINE.fullmatch(line)
        if match is None or match.group(1) not in RLIMIT_LABELS:
            raise malformed("limits", f"line {line!r}")
        limits.append(
            Rlimit(
                name=RLIMIT_LABELS[match.group(1)],
                soft=_limit_value(match.group(2)),
                hard=_limit_value(match.group(3)),
            )
        )
    return tuple(limits)


_OCTAL_ESCAPE = re.compile(rb"\\([0-7]{3})")


def unescape_mount_field(field: bytes) -> str:
    r"""Undo the kernel's octal escapes (`\040` space, `\011`, `\012`, `\134`)."""
    raw = _OCTAL_ESCAPE.sub(lambda m: bytes([int(m.group(1), 8) & 0xFF]), field)
    return _text(raw, "mountinfo")


def _parse_mount_line(line: bytes) -> Mount:
    fields = line.split(b" ")
    try:
        separator = fields.index(b"-", 6)
    except ValueError as exc:
        raise malformed("mountinfo", "no ' - ' separator") from exc
    if separator + 4 != len(fields):
        raise malformed("mountinfo", "wrong number of fields after the separator")
    mount_id, parent_id, device = fields[0], fields[1], fields[2]
    major, colon, minor = device.partition(b":")
    if not (colon and all(x.isdigit() for x in (mount_id, parent_id, major, minor))):
        raise malformed("mountinfo", "bad ids or device")
    return Mount(
        mount_id=int(mount_id),
        parent_id=int(parent_id),
        major=int(major),
        minor=int(minor),
        root=unescape_mount_field(fields[3]),
        mount_point=unescape_mount_field(fields[4]),
        mount_options=tuple(_text(fields[5], "mountinfo").split(",")),
        optional_fields=tuple(_text(f, "mountinfo") for f in fields[6:separator]),
        fs_type=unescape_mount_field(fields[separator + 1]),
        source=unescape_mount_field(fields[separator + 2]),
        super_options=tuple(unescape_mount_field(fields[separator + 3]).split(",")),
    )


def parse_mountinfo(data: bytes) -> tuple[Mount, ...]:
    """Parse /proc/PID/mountinfo (see proc(5)); paths are unescaped, strict UTF-8."""
    lines = [line for line in data.split(b"\n") if line]
    if len(lines) > MAX_MOUNTS:
        raise malformed("mountinfo", f"more than {MAX_MOUNTS} mounts")
    return tuple(_parse_mount_line(line) for line in lines)


def find_mount(data: bytes, mount_id: int) -> Mount | None:
    """The entry of /proc/PID/mountinfo with this mount ID, parsing no other line (a
    line elsewhere that is not UTF-8 does not matter to the one asked for)."""
    prefix = b"%d " % mount_id
    for line in data.split(b"\n"):
        if line.startswith(prefix):
            return _parse_mount_line(line)
    return None


def parse_fdinfo(data: bytes) -> tuple[int | None, int | None]:
    """(flags, mnt_id) from /proc/PID/fdinfo/N; flags are octal in the kernel text."""
    flags = mnt_id = None
    for line in _text(data, "fdinfo").splitlines():
        key, _, value = line.partition(":")
        value = value.strip()
        if key == "flags" and re.fullmatch(r"[0-7]+", value):
            flags = int(value, 8)
        elif key == "mnt_id" and value.isdigit():
            mnt_id = int(value)
    return flags, mnt_id


def _device_number(value: str) -> int | None:
    if value == "*":
        return None
    if not value.isdigit():
        raise malformed("devices.list", f"device number {value!r}")
    return int(value)


def parse_devices_list(data: bytes) -> tuple[DeviceAccess, ...]:
    """Parse a cgroup v1 devices.list: `TYPE MAJOR:MINOR ACCESS` per line."""
    rules = []
    for line in _text(data, "devices.list").splitlines():
        parts = line.split(" ")
        major, colon, minor = parts[1].partition(":") if len(parts) == 3 else ("", "", "")
        if not colon:
            raise malformed("devices.list", f"line {line!r}")
        try:
            rules.append(
                DeviceAccess(parts[0], _device_number(major), _device_number(minor), parts[2])
            )
        except ValueError as exc:
            raise malformed("devices.list", f"line {line!r}") from exc
    return tuple(rules)


def file_kind(mode: int) -> str:
    kinds = (
        (stat.S_ISREG, "file"),
        (stat.S_ISDIR, "dir"),
        (stat.S_ISCHR, "chr"),
        (stat.S_ISBLK, "blk"),
        (stat.S_ISFIFO, "fifo"),
        (stat.S_ISSOCK, "socket"),
        (stat.S_ISLNK, "link"),
    )
    return next((name for test, name in kinds if test(mode)), "other")
