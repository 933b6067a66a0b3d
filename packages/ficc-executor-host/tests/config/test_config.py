"""Configuration: real files with real owners and modes, the schema, every cross-field rule."""

from __future__ import annotations

import copy
import json
import os
import pwd
import re
import shutil
import stat
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ficc.execution.host.config.host import (
    check_accounts,
    check_directories,
    check_host,
    check_metrics_textfile,
)
from ficc.execution.host.config.load import MAX_CONFIG_BYTES, load_config, parse_config
from ficc.execution.host.config.model import Config
from ficc.execution.host.config.trusted import open_trusted_directory
from ficc.execution.host.core.errors import HostError

NOBODY = 65534
DOCS = Path(__file__).resolve().parents[4] / "docs" / "configuration.md"


needs_root = pytest.mark.root("the checks are about files owned by root")


@pytest.fixture
def trusted_dir() -> Iterator[Path]:
    """A root-owned 0700 directory whose ancestors are root-owned and not world-writable.

    /tmp is sticky and world-writable, which the loader refuses on purpose, so the
    directory is made under /run.
    """
    path = Path(tempfile.mkdtemp(prefix="ficc-t-config-", dir="/run"))
    os.chmod(path, 0o700)
    yield path
    shutil.rmtree(path)


def document(root: str = "/srv/ficc") -> dict[str, Any]:
    """A complete valid configuration as a JSON-shaped dict."""
    return {
        "installation_id": "0123456789abcdef0123456789abcdef",
        "deployment_id": "1123456789abcdef0123456789abcdef",
        "node_id": "2123456789abcdef0123456789abcdef",
        "mode": "voluntary",
        "transport_uid": 990,
        "local_owner_uids": [1000, 1001],
        "maximum_lease_seconds": 600,
        "state_dir": f"{root}/state",
        "socket_dir": f"{root}/sockets",
        "supervisor": "auto",
        "slots": [
            {
                "id": f"slot-{i}",
                "class": "small",
                "generation": 1,
                "path": f"{root}/slots/{i}",
                "uid": 2000 + i,
                "gid": 2000 + i,
                "storage_bytes": 10 * 2**30,
                "storage_inodes": 100_000,
                "filesystem_uuid": f"{i:08x}-1111-4222-8333-444455556666",
            }
            for i in range(3)
        ],
        "ceiling": {
            "cpu_millis": 2000,
            "memory_bytes": 8 * 2**30,
            "swap_bytes": 0,
            "processes": 512,
            "slots": 3,
            "devices": ["render0", "video0"],
            "projects": ["3123456789abcdef0123456789abcdef"],
            "runtimes": ["podman"],
        },
        "initial_offer": {
            "control": "paused",
            "cpu_millis": 1000,
            "memory_bytes": 4 * 2**30,
            "swap_bytes": 0,
            "processes": 256,
            "slots": 2,
            "devices": ["render0"],
            "projects": ["3123456789abcdef0123456789abcdef"],
            "runtimes": ["podman"],
        },
        "providers": [
            {
                "id": "podman",
                "package_digest": "sha256:" + "ab" * 32,
                "configuration": {"images": [{"name": "busybox", "digest": "sha256:" + "cd" * 32}]},
            }
        ],
    }


def to_toml(doc: dict[str, Any]) -> str:
    """Write the subset of TOML these documents need: top-level keys with inline values."""

    def value(item: Any) -> str:
        if isinstance(item, bool):
            return "true" if item else "false"
        if isinstance(item, int):
            return str(item)
        if isinstance(item, str):
            return json.dumps(item)
        if isinstance(item, list):
            return "[" + ", ".join(value(x) for x in item) + "]"
        assert isinstance(item, dict)
        return "{ " + ", ".join(f"{k} = {value(v)}" for k, v in item.items()) + " }"

    return "".join(f"{key} = {value(item)}\n" for key, item in doc.items())


def write_file(path: Path, data: bytes, mode: int = 0o600, uid: int = 0) -> Path:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        os.write(fd, data)
        os.fchown(fd, uid, 0)
        os.fchmod(fd, mode)
    finally:
        os.close(fd)
    return path


def write_config(directory: Path, doc: dict[str, Any], name: str = "host.json") -> Path:
    return write_file(directory / name, json.dumps(doc).encode())


def refusal(call: Callable[[], object]) -> HostError:
    with pytest.raises(HostError) as excinfo:
        call()
    return excinfo.value


def parse(doc: dict[str, Any]) -> Config:
    return parse_config(json.dumps(doc).encode(), ".json")


# --- loading real files ----------------------------------------------------------------


@needs_root
def test_a_valid_json_file_loads(trusted_dir: Path) -> None:
    config = load_config(str(write_config(trusted_dir, document())))
    assert config.transport_uid == 990
    assert config.slots[2].slot_class == "small"
    assert config.initial_offer.control == "paused"
    assert config.providers[0].configuration["images"][0]["name"] == "busybox"


@needs_root
def test_toml_and_json_give_the_same_config(trusted_dir: Path) -> None:
    doc = document()
    from_json = load_config(str(write_config(trusted_dir, doc)))
    toml_path = write_file(trusted_dir / "host.toml", to_toml(doc).encode())
    assert load_config(str(toml_path)) == from_json


@needs_root
def test_a_file_of_exactly_the_size_limit_loads(trusted_dir: Path) -> None:
    data = json.dumps(document()).encode()
    data += b" " * (MAX_CONFIG_BYTES - len(data))
    assert len(data) == MAX_CONFIG_BYTES
    load_config(str(write_file(trusted_dir / "host.json", data)))


@needs_root
def test_one_byte_over_the_size_limit_is_refused(trusted_dir: Path) -> None:
    data = json.dumps(document()).encode()
    data += b" " * (MAX_CONFIG_BYTES + 1 - len(data))
    path = write_file(trusted_dir / "host.json", data)
    error = refusal(lambda: load_config(str(path)))
    assert error.code == "config_unsafe_file"
    assert "bytes" in error.message


@needs_root
@pytest.mark.parametrize("mode", [0o640, 0o604, 0o400, 0o700, 0o4600, 0o660])
def test_a_mode_other_than_0600_is_refused(trusted_dir: Path, mode: int) -> None:
    path = write_file(trusted_dir / "host.json", json.dumps(document()).encode(), mode=mode)
    error = refusal(lambda: load_config(str(path)))
    assert error.code == "config_unsafe_file"
    assert "chmod 0600" in error.message


@needs_root
def test_a_file_owned_by_another_user_is_refused(trusted_dir: Path) -> None:
    path = write_file(trusted_dir / "host.json", json.dumps(document()).encode(), uid=NOBODY)
    error = refusal(lambda: load_config(str(path)))
    assert error.code == "config_unsafe_file"
    assert f"UID {NOBODY}" in error.message


@needs_root
def test_a_hard_linked_file_is_refused(trusted_dir: Path) -> None:
    path = write_config(trusted_dir, document())
    os.link(path, trusted_dir / "second-name.json")
    error = refusal(lambda: load_config(str(path)))
    assert error.code == "config_unsafe_file"
    assert "2 hard links" in error.message


@needs_root
def test_a_fifo_is_refused_without_blocking(trusted_dir: Path) -> None:
    path = trusted_dir / "host.json"
    os.mkfifo(path, 0o600)
    error = refusal(lambda: load_config(str(path)))
    assert error.code == "config_unsafe_file"
    assert "regular" in error.message


@needs_root
def test_a_device_node_is_refused(trusted_dir: Path) -> None:
    path = trusted_dir / "host.json"
    try:
        os.mknod(path, stat.S_IFCHR | 0o600, os.makedev(1, 3))  # like /dev/null
    except PermissionError:
        pytest.skip("this root cannot mknod (no CAP_MKNOD), so there is no device to refuse")
    error = refusal(lambda: load_config(str(path)))
    assert error.code == "config_unsafe_file"


@needs_root
def test_a_directory_is_refused(trusted_dir: Path) -> None:
    (trusted_dir / "host.json").mkdir(mode=0o600)
    assert refusal(lambda: load_config(str(trusted_dir / "host.json"))).code == (
        "config_unsafe_file"
    )


@needs_root
def test_a_symlinked_file_is_refused(trusted_dir: Path) -> None:
    real = write_config(trusted_dir, document(), name="real.json")
    (trusted_dir / "host.json").symlink_to(real)
    error = refusal(lambda: load_config(str(trusted_dir / "host.json")))
    assert error.code == "config_unsafe_file"
    assert "symbolic link" in error.message


@needs_root
def test_a_symlinked_directory_in_the_path_is_refused(trusted_dir: Path) -> None:
    (trusted_dir / "real").mkdir(mode=0o700)
    write_config(trusted_dir / "real", document())
    (trusted_dir / "link").symlink_to(trusted_dir / "real")
    error = refusal(lambda: load_config(str(trusted_dir / "link" / "host.json")))
    assert error.code == "config_unsafe_file"
    assert "symbolic link" in error.message


@needs_root
@pytest.mark.parametrize("mode", [0o770, 0o702, 0o1777])
def test_an_ancestor_writable_by_others_is_refused(trusted_dir: Path, mode: int) -> None:
    inner = trusted_dir / "etc"
    inner.mkdir()
    path = write_config(inner, document())
    os.chmod(inner, mode)
    error = refusal(lambda: load_config(str(path)))
    assert error.code == "config_unsafe_file"
    if mode & 0o1002:  # shared (world-writable or sticky, like /tmp): move, never chmod it
        assert "chmod" not in error.message
        assert "move it below a directory only root can write" in error.message
    else:
        assert f"chmod go-w {inner}" in error.message


@needs_root
def test_an_ancestor_owned_by_another_user_is_refused(trusted_dir: Path) -> None:
    inner = trusted_dir / "etc"
    inner.mkdir(mode=0o755)
    path = write_config(inner, document())
    os.chown(inner, NOBODY, 0)
    error = refusal(lambda: load_config(str(path)))
    assert error.code == "config_unsafe_file"
    assert f"owned by UID {NOBODY}" in error.message


@needs_root
def test_a_file_under_a_sticky_shared_directory_is_refused() -> None:
    """A sticky world-writable directory such as /tmp: strict means no exception for it.

    The shared directory is made here rather than taken from $TMPDIR, which a CI runner
    may point at a private directory.
    """
    shared = Path(tempfile.mkdtemp(prefix="ficc-t-shared-", dir="/run"))
    try:
        os.chmod(shared, 0o1777)
        inner = shared / "inner"
        inner.mkdir(mode=0o700)
        path = write_config(inner, document())
        error = refusal(lambda: load_config(str(path)))
        assert error.code == "config_unsafe_file"
        assert str(shared) in error.message
    finally:
        shutil.rmtree(shared)


@needs_root
def test_a_missing_file_is_refused(trusted_dir: Path) -> None:
    assert refusal(lambda: load_config(str(trusted_dir / "nope.json"))).code == "config_missing"
    assert refusal(lambda: load_config(str(trusted_dir / "no" / "x.json"))).code == (
        "config_missing"
    )


@pytest.mark.parametrize("path", ["host.json", "etc/host.json", "/etc/../etc/host.json"])
def test_a_relative_or_unnormalized_path_is_refused(path: str) -> None:
    assert refusal(lambda: load_config(path)).code == "config_unsafe_file"


@needs_root
@pytest.mark.parametrize("name", ["host.yaml", "host", "host.JSON"])
def test_an_unknown_extension_is_refused(trusted_dir: Path, name: str) -> None:
    path = write_config(trusted_dir, document(), name=name)
    error = refusal(lambda: load_config(str(path)))
    assert error.code == "config_invalid"
    assert ".json or .toml" in error.message


# --- schema ----------------------------------------------------------------------------


def _set(path: str, value: Any) -> Callable[[dict[str, Any]], None]:
    """A mutation that sets `a.b[2].c` in the document (or deletes it for `...`)."""
    parts = [int(p) if p.isdigit() else p for p in re.findall(r"[^.\[\]]+", path)]

    def mutate(doc: dict[str, Any]) -> None:
        target: Any = doc
        for part in parts[:-1]:
            target = target[part]
        if value is ...:
            del target[parts[-1]]
        else:
            target[parts[-1]] = value

    return mutate


SCHEMA_CASES = [
    ("colour", "blue", "unknown field `colour`"),
    ("slots[1].colour", "red", "slots[1]"),
    ("ceiling.gpus", 1, "ceiling"),
    ("providers[0].package", "x", "providers[0]"),
    ("node_id", ..., "missing required field `node_id`"),
    ("installation_id", "0123456789ABCDEF0123456789ABCDEF", "installation_id"),
    ("deployment_id", "0123", "deployment_id"),
    ("mode", "shared", "mode"),
    ("supervisor", "openrc", "supervisor"),
    ("transport_uid", True, "transport_uid"),
    ("transport_uid", "990", "transport_uid"),
    ("transport_uid", -1, "transport_uid"),
    ("transport_uid", 2**32 - 1, "transport_uid"),
    ("maximum_lease_seconds", 0, "maximum_lease_seconds"),
    ("maximum_lease_seconds", 86_401, "maximum_lease_seconds"),
    ("maximum_lease_seconds", 60.0, "maximum_lease_seconds"),
    ("state_dir", "srv/ficc/state", "state_dir"),
    ("slots[2].path", "/srv/x\nbad", "slots[2].path"),
    ("slots", [], "slots"),
    ("slots[0].generation", 0, "slots[0].generation"),
    ("slots[0].class", "Small", "slots[0].class"),
    ("slots[0].storage_bytes", 0, "slots[0].storage_bytes"),
    ("ceiling.cpu_millis", -1, "ceiling.cpu_millis"),
    ("ceiling.cpu_millis", 2**63, "ceiling.cpu_millis"),
    ("ceiling.projects[0]", "not-an-id", "ceiling.projects[0]"),
    ("initial_offer.control", "on", "initial_offer.control"),
    ("initial_offer.control", ..., "control"),
    ("providers[0].package_digest", "sha256:" + "AB" * 32, "providers[0].package_digest"),
    ("providers[0].configuration", [], "providers[0].configuration"),
    ("providers", [], "providers"),
    # `$` would match before a trailing newline; the patterns are anchored with \A and \Z
    ("installation_id", "0123456789abcdef0123456789abcdef\n", "installation_id"),
    ("state_dir", "/srv/ficc/state\n", "state_dir"),
    ("slots[0].id", "slot-0\n", "slots[0].id"),
    ("providers[0].package_digest", "sha256:" + "ab" * 32 + "\n", "package_digest"),
]


@pytest.mark.parametrize(("key", "value", "named"), SCHEMA_CASES)
def test_the_schema_refuses_and_names_the_key(key: str, value: Any, named: str) -> None:
    doc = document()
    _set(key, value)(doc)
    error = refusal(lambda: parse(doc))
    assert error.code == "config_invalid"
    assert named in error.message


@pytest.mark.parametrize(
    ("misspelt", "meant"),
    [
        ("installation_idd", "installation_id"),
        ("slots[0].storage_byte", "storage_bytes"),
        ("slots[1].clas", "class"),
        ("initial_offer.contrl", "control"),
        ("providers[0].package_digets", "package_digest"),
    ],
)
def test_a_misspelt_key_is_refused_with_the_key_it_was_meant_to_be(
    misspelt: str, meant: str
) -> None:
    """The refusal names the closest key of the same object: the usual cause of an
    unknown key is a typing slip, and the operator should not have to find it."""
    doc = document()
    _set(misspelt, 1)(doc)
    error = refusal(lambda: parse(doc))
    assert error.code == "config_invalid"
    assert f"did you mean {meant!r}?" in error.message


def test_an_unknown_key_like_no_known_one_gets_no_suggestion() -> None:
    doc = document()
    _set("ceiling.gpus", 1)(doc)
    error = refusal(lambda: parse(doc))
    assert "did you mean" not in error.message
    assert "remove it or correct its spelling" in error.message


def test_a_schema_refusal_starts_with_the_key_path() -> None:
    doc = document()
    doc["slots"][2]["uid"] = -5
    assert refusal(lambda: parse(doc)).message.startswith("slots[2].uid: ")


@pytest.mark.parametrize(
    ("data", "suffix"),
    [
        (b'{"mode": "managed", "mode": "voluntary"}', ".json"),
        (b'{"maximum_lease_seconds": NaN}', ".json"),
        (b'{"a": 1', ".json"),
        (b"[1, 2]", ".json"),
        (b"\xff\xfe{}", ".json"),
        (b"mode = 'managed'\nmode = 'voluntary'\n", ".toml"),
        (b"mode = ", ".toml"),
        (b"[" * 100_000, ".json"),  # nested too deeply for the parser: no traceback
        (b"a = " + b"[" * 100_000, ".toml"),
    ],
)
def test_malformed_documents_are_refused(data: bytes, suffix: str) -> None:
    assert refusal(lambda: parse_config(data, suffix)).code == "config_invalid"


def test_a_toml_date_in_provider_configuration_is_refused() -> None:
    doc = document()
    text = to_toml(doc).replace(
        "configuration = { images = [", "configuration = { since = 2024-01-01, images = ["
    )
    error = refusal(lambda: parse_config(text.encode(), ".toml"))
    assert error.code == "config_invalid"
    assert "providers[0].configuration.since" in error.message


# --- cross-field rules -----------------------------------------------------------------

RULE_CASES: list[tuple[str, Callable[[dict[str, Any]], None], str, str]] = [
    ("transport is root", _set("transport_uid", 0), "config_invalid", "transport_uid"),
    ("owner is root", _set("local_owner_uids[1]", 0), "config_invalid", "local_owner_uids[1]"),
    ("slot uid is root", _set("slots[1].uid", 0), "config_invalid", "slots[1].uid"),
    ("slot gid is root", _set("slots[1].gid", 0), "config_invalid", "slots[1].gid"),
    ("owner is transport", _set("local_owner_uids[0]", 990), "config_conflict", "owner"),
    ("owner listed twice", _set("local_owner_uids[1]", 1000), "config_conflict", "uids[1]"),
    ("slot is transport", _set("slots[0].uid", 990), "config_conflict", "slots[0].uid"),
    ("slot is owner", _set("slots[2].uid", 1001), "config_conflict", "slots[2].uid"),
    ("slots share a uid", _set("slots[2].uid", 2000), "config_conflict", "slots[2].uid"),
    ("slots share a gid", _set("slots[1].gid", 2000), "config_conflict", "slots[1].gid"),
    ("slots share an id", _set("slots[2].id", "slot-0"), "config_conflict", "slots[2].id"),
    ("trailing slash", _set("state_dir", "/srv/ficc/state/"), "config_invalid", "state_dir"),
    ("dot-dot", _set("socket_dir", "/srv/ficc/x/../s"), "config_invalid", "socket_dir"),
    ("double slash", _set("slots[0].path", "/srv//a"), "config_invalid", "slots[0].path"),
    ("leading //", _set("state_dir", "//srv/state"), "config_invalid", "state_dir"),
    ("root dir", _set("state_dir", "/"), "config_invalid", "state_dir"),
    ("socket in state", _set("socket_dir", "/srv/ficc/state/s"), "config_conflict", "socket_dir"),
    ("state in slot", _set("state_dir", "/srv/ficc/slots/1/st"), "config_conflict", "state_dir"),
    ("same slot path", _set("slots[2].path", "/srv/ficc/slots/0"), "config_conflict", "slots["),
    ("slot = sockets", _set("slots[0].path", "/srv/ficc/sockets"), "config_conflict", "[0].path"),
    ("offer over cpu", _set("initial_offer.cpu_millis", 2001), "config_conflict", "cpu_millis"),
    ("offer over mem", _set("initial_offer.memory_bytes", 2**40), "config_conflict", "memory"),
    ("offer over swap", _set("initial_offer.swap_bytes", 1), "config_conflict", "swap_bytes"),
    ("offer over procs", _set("initial_offer.processes", 513), "config_conflict", "processes"),
    ("offer over slots", _set("initial_offer.slots", 4), "config_conflict", "slots"),
    ("ceiling slots", _set("ceiling.slots", 4), "config_conflict", "ceiling.slots"),
    ("offer device", _set("initial_offer.devices", ["sound0"]), "config_conflict", "devices[0]"),
    ("offer project", _set("initial_offer.projects", ["4" * 32]), "config_conflict", "projects"),
    ("offer runtime", _set("initial_offer.runtimes", ["lxc"]), "config_conflict", "runtimes[0]"),
    ("device twice", _set("ceiling.devices", ["a0", "a0"]), "config_invalid", "devices[1]"),
    ("runtime twice", _set("ceiling.runtimes", ["podman"] * 2), "config_invalid", "runtimes[1]"),
    ("unknown runtime", _set("ceiling.runtimes", ["podman", "lxc"]), "config_conflict", "[1]"),
    (
        "provider twice",
        lambda doc: doc["providers"].append(copy.deepcopy(doc["providers"][0])),
        "config_conflict",
        "providers[1].id",
    ),
]


@pytest.mark.parametrize(
    ("mutate", "code", "named"),
    [pytest.param(m, c, n, id=i) for i, m, c, n in RULE_CASES],
)
def test_each_cross_field_rule_refuses_and_names_the_key(
    mutate: Callable[[dict[str, Any]], None], code: str, named: str
) -> None:
    doc = document()
    parse(doc)  # the unmutated document is valid, so the mutation is what is refused
    mutate(doc)
    error = refusal(lambda: parse(doc))
    assert error.code == code
    assert named in error.message
    assert "; " in error.message  # and says what to do


def test_sibling_paths_sharing_a_prefix_are_not_nested() -> None:
    doc = document()
    doc["slots"][0]["path"] = "/srv/ficc/slots/1-extra"
    doc["slots"][1]["path"] = "/srv/ficc/slots/1"
    doc["slots"][2]["path"] = "/srv/ficc/slots/1.x"
    doc["state_dir"] = "/srv/ficc-state"
    parse(doc)


def test_no_local_owners_and_no_offered_devices_are_valid() -> None:
    doc = document()
    doc["mode"] = "managed"
    doc["local_owner_uids"] = []
    doc["initial_offer"]["devices"] = []
    assert parse(doc).local_owner_uids == ()


def test_the_documented_examples_are_valid_and_agree() -> None:
    if not DOCS.exists():
        pytest.skip(f"{DOCS} is not in this source tree (an sdist ships no docs)")
    text = DOCS.read_text()
    json_block = re.search(r"```json\n(.*?)```", text, re.DOTALL)
    toml_block = re.search(r"```toml\n(.*?)```", text, re.DOTALL)
    assert json_block is not None
    assert toml_block is not None
    from_json = parse_config(json_block[1].encode(), ".json")
    assert parse_config(toml_block[1].encode(), ".toml") == from_json


# --- the host's directories ------------------------------------------------------------


@pytest.fixture
def host_root(trusted_dir: Path) -> Path:
    (trusted_dir / "state").mkdir(mode=0o700)
    (trusted_dir / "sockets").mkdir()
    os.chmod(trusted_dir / "sockets", 0o711)
    (trusted_dir / "slots").mkdir(mode=0o755)
    for i in range(3):
        (trusted_dir / "slots" / str(i)).mkdir(mode=0o755)
    return trusted_dir


@needs_root
def test_check_directories_accepts_real_root_owned_directories(host_root: Path) -> None:
    # check_host's slot filesystem and account checks: test_slotfs.py, on real mounts
    check_directories(parse(document(str(host_root))))


def _mutated(root: Path, key: str, value: Any) -> Config:
    doc = document(str(root))
    _set(key, value)(doc)
    return parse(doc)


@needs_root
def test_check_host_refuses_a_missing_slot_directory(host_root: Path) -> None:
    os.rmdir(host_root / "slots" / "1")
    error = refusal(lambda: check_host(parse(document(str(host_root)))))
    assert error.code == "host_path_missing"
    assert error.message.startswith("slots[1].path: ")
    # the advice is to make the slot's filesystem, never a plain directory
    assert "ficc-executor provision-slot --image IMAGE --mount PATH" in error.message
    assert "create it" not in error.message


@needs_root
def test_check_host_refuses_a_symlinked_slot_directory(host_root: Path) -> None:
    os.rmdir(host_root / "slots" / "1")
    (host_root / "slots" / "1").symlink_to(host_root / "slots" / "0")
    error = refusal(lambda: check_host(parse(document(str(host_root)))))
    assert error.code == "host_path_unsafe"
    assert "symbolic link" in error.message


@needs_root
def test_check_host_refuses_a_file_as_slot_directory(host_root: Path) -> None:
    os.rmdir(host_root / "slots" / "2")
    write_file(host_root / "slots" / "2", b"")
    error = refusal(lambda: check_host(parse(document(str(host_root)))))
    assert error.code == "host_path_unsafe"
    assert "not a directory" in error.message


@needs_root
def test_check_host_refuses_a_slot_directory_owned_by_its_slot(host_root: Path) -> None:
    os.chown(host_root / "slots" / "0", 2000, 2000)
    error = refusal(lambda: check_host(parse(document(str(host_root)))))
    assert error.code == "host_path_unsafe"
    assert error.message.startswith("slots[0].path: ")


@needs_root
def test_check_host_refuses_a_group_writable_slot_directory(host_root: Path) -> None:
    os.chmod(host_root / "slots" / "2", 0o775)
    assert refusal(lambda: check_host(parse(document(str(host_root))))).code == ("host_path_unsafe")


@needs_root
@pytest.mark.parametrize(("name", "mode"), [("state", 0o755), ("state", 0o711), ("sockets", 0o700)])
def test_check_host_requires_exact_modes_of_state_and_socket_dirs(
    host_root: Path, name: str, mode: int
) -> None:
    os.chmod(host_root / name, mode)
    error = refusal(lambda: check_host(parse(document(str(host_root)))))
    assert error.code == "host_path_unsafe"
    assert "chmod 07" in error.message


@needs_root
@pytest.mark.parametrize(
    ("shared", "key", "home"),
    [
        ("state", "state_dir", "/var/lib/ficc-executor"),
        ("sockets", "socket_dir", "/run/ficc-executor"),
        ("slots", "slots[0].path", "/srv/ficc/slots"),
    ],
)
def test_a_path_below_a_shared_directory_is_moved_to_its_usual_home(
    host_root: Path, shared: str, key: str, home: str
) -> None:
    """The advice for a path below a directory like /tmp names where that kind of
    directory usually lives, and never suggests loosening or tightening /tmp itself."""
    below = host_root / "shared"
    below.mkdir()
    os.chmod(below, 0o1777)
    moved = below / shared
    moved.mkdir(mode=0o700 if shared == "state" else 0o711 if shared == "sockets" else 0o755)
    if key.startswith("slots["):  # check_slots opens each slot path this way first
        error = refusal(lambda: open_trusted_directory(str(moved), key, "host_path_unsafe"))
    else:
        doc = document(str(host_root))
        _set(key, str(moved))(doc)
        error = refusal(lambda: check_directories(parse(doc)))
    assert error.code == "host_path_unsafe"
    assert error.message.startswith(f"{key}: ")
    assert f"move it below a directory only root can write (for example {home})" in error.message
    assert "chmod" not in error.message


# --- property: the sorted nesting check agrees with the obvious pairwise one -----------

_EXAMPLES = 3000 if os.environ.get("FICC_SOAK") == "1" else 200
_component = st.sampled_from(["a", "b", "a-b", "a.b", "ab", "a0"])
_path = st.lists(_component, min_size=1, max_size=3).map(lambda parts: "/" + "/".join(parts))


def _nested_pair_exists(paths: list[str]) -> bool:
    return any(
        i != j and (p == q or q.startswith(p + "/"))
        for i, p in enumerate(paths)
        for j, q in enumerate(paths)
    )


@pytest.mark.soak
@settings(max_examples=_EXAMPLES, deadline=None)
@given(st.lists(_path, min_size=3, max_size=8))
def test_the_nesting_rule_matches_a_pairwise_check(paths: list[str]) -> None:
    doc = document()
    doc["state_dir"], doc["socket_dir"] = paths[0], paths[1]
    doc["slots"] = [
        {
            **doc["slots"][0],
            "id": f"s{i}",
            "uid": 5000 + i,
            "gid": 5000 + i,
            "path": path,
            "filesystem_uuid": f"{i:08x}-0000-4000-8000-000000000000",
        }
        for i, path in enumerate(paths[2:])
    ]
    doc["ceiling"]["slots"] = doc["initial_offer"]["slots"] = 1
    if _nested_pair_exists(paths):
        assert refusal(lambda: parse(doc)).code == "config_conflict"
    else:
        parse(doc)


# --- messages an operator can act on ----------------------------------------------------


@pytest.mark.parametrize(
    ("path", "value", "expected"),
    [
        (["mode"], "x", 'mode: \'x\' is not one of "managed", "voluntary";'),
        (["supervisor"], "bad", 'supervisor: \'bad\' is not one of "auto", "cgroupfs", "systemd";'),
        (
            ["initial_offer", "control"],
            "nope",
            "initial_offer.control: 'nope' is not one of "
            '"active", "draining", "paused", "stopped";',
        ),
        (["installation_id"], "zz", "installation_id: expected an identity (32 lowercase"),
        (["state_dir"], "rel", "state_dir: expected an absolute path (starting with /"),
        (["slots", 0, "id"], "Bad!", "slots[0].id: expected a name (a lowercase letter"),
        (["providers", 0, "package_digest"], "md5:x", "package_digest: expected a digest (sha256:"),
        (
            ["slots", 0, "filesystem_uuid"],
            "3F1D7C52-9A0E-4B8E-A1F4-0C2D5E6F7A80",
            "slots[0].filesystem_uuid: expected a filesystem UUID (xxxxxxxx-xxxx-",
        ),
    ],
)
def test_schema_messages_name_the_type_or_list_the_choices(
    path: list[str | int], value: str, expected: str
) -> None:
    doc = document()
    target: Any = doc
    for step in path[:-1]:
        target = target[step]
    target[path[-1]] = value
    error = refusal(lambda: parse(doc))
    assert error.code == "config_invalid"
    assert expected in error.message
    assert "regex" not in error.message
    assert "\\" not in error.message


def test_transport_and_owner_accounts_must_exist() -> None:
    existing = parse(document())  # UIDs 990, 1000, 1001: not necessarily accounts here
    missing = 3_999_000
    while True:
        try:
            pwd.getpwuid(missing)
        except KeyError:
            break
        missing += 1
    doc = document()
    doc["local_owner_uids"] = [missing]
    config = parse(doc)
    with_transport = msgspec.structs.replace(config, transport_uid=0)  # root always exists
    error = refusal(lambda: check_accounts(with_transport))
    assert error.code == "account_missing"
    assert error.message.startswith(f"local_owner_uids[0]: UID {missing} has no account")
    assert f"useradd --system --uid {missing} " in error.message  # the account the key names
    real = msgspec.structs.replace(existing, transport_uid=0, local_owner_uids=(os.geteuid(),))
    check_accounts(real)


# --- metrics_textfile -------------------------------------------------------------------


@needs_root
def test_metrics_textfile_is_optional_and_must_be_a_prom_file_in_a_root_directory(
    trusted_dir: Path,
) -> None:
    assert parse(document()).metrics_textfile is None
    check_metrics_textfile(parse(document()))  # absent: nothing to check
    doc = document()
    doc["metrics_textfile"] = str(trusted_dir / "ficc.prom")
    check_metrics_textfile(parse(doc))
    doc["metrics_textfile"] = str(trusted_dir / "ficc.txt")
    error = refusal(lambda: check_metrics_textfile(parse(doc)))
    assert (error.code, error.message.split(":")[0]) == ("config_invalid", "metrics_textfile")
    shared = trusted_dir / "shared"
    shared.mkdir()
    os.chmod(shared, 0o1777)
    doc["metrics_textfile"] = str(shared / "ficc.prom")
    error = refusal(lambda: check_metrics_textfile(parse(doc)))
    assert error.code == "host_path_unsafe"
    assert "move it below a directory only root can write" in error.message
