"""`ficc-executor check-config`, run as the real console command against real files.

A real configuration file (root, 0600) under /run, real state, socket and slot
directories, real accounts, and the test provider installed from its wheel into a
prefix: check-config must pass, and each way serve would refuse (or start with a
provider unavailable) must give the same message serve gives.
"""

from __future__ import annotations

import json
import os
import pwd
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from ficc.execution.host.cli import provision
from ficc.execution.host.config.load import parse_config
from ficc.execution.host.daemon.root import open_ledger
from ficc.execution.host.providers import compute_digest
from ficc.execution.host.storage import slotfs
from ficc_testkit import wheels
from ficc_testkit.accounts import account_command

ROOT = Path(__file__).resolve().parents[4]
PROVIDER_SOURCE = ROOT / "tests-integration" / "providers" / "ficc-test-provider"
COMMAND = Path(sys.executable).parent / "ficc-executor"
TRANSPORT_UID, OWNER_UID = 1, 2  # `daemon` and `bin`: present on every Debian host
SLOT_ACCOUNT = f"ficc-t-chk-{os.getpid() % 100000}"
SLOT_BYTES, SLOT_INODES = 16 << 20, 1_000

pytestmark = pytest.mark.root("needs root: the configuration must be root-owned")


@pytest.fixture(scope="module")
def provider_site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The test provider built into a wheel and installed into a root-owned prefix."""
    out = tmp_path_factory.mktemp("wheel")
    site = wheels.install_into(wheels.build_wheel(PROVIDER_SOURCE, out), out / "prefix")
    return site


@pytest.fixture(scope="module")
def slot_account() -> Iterator[pwd.struct_passwd]:
    """The slot's real account (its own group, no login)."""
    account_command("useradd", "--system", "--user-group", "--no-create-home",
             "--shell", "/usr/sbin/nologin", SLOT_ACCOUNT)  # fmt: skip
    try:
        yield pwd.getpwnam(SLOT_ACCOUNT)
    finally:
        account_command("userdel", SLOT_ACCOUNT)


@pytest.fixture
def host(provider_site: Path, slot_account: pwd.struct_passwd) -> Iterator[Path]:
    """A root-owned directory tree under /run holding everything a configuration names,
    the slot a real filesystem of its own."""
    base = Path(tempfile.mkdtemp(prefix="ficc-t-check-", dir="/run"))
    os.chmod(base, 0o755)
    (base / "state").mkdir(mode=0o700)
    (base / "sockets").mkdir()
    os.chmod(base / "sockets", 0o711)
    (base / "slots").mkdir()
    (base / "images").mkdir(mode=0o700)
    (base / "etc").mkdir(mode=0o755)
    try:
        provision.create_image_slot(
            str(base / "images" / "a.img"), str(base / "slots" / "a"), SLOT_BYTES, SLOT_INODES
        )
        yield base
    finally:
        provision.remove_slot(str(base / "slots" / "a"))
        shutil.rmtree(base)


def _slot_uuid(path: Path) -> str:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        found = slotfs.filesystem_uuid(fd, slotfs.mount_of(fd, str(path)))
    finally:
        os.close(fd)
    assert found is not None
    return found


def document(base: Path, digest: str, configuration: dict[str, Any]) -> dict[str, Any]:
    allowance = {"cpu_millis": 1000, "memory_bytes": 1 << 30, "swap_bytes": 0, "processes": 64,
                 "slots": 1, "devices": [], "projects": [], "runtimes": ["test"]}  # fmt: skip
    return {
        "installation_id": "0123456789abcdef0123456789abcdef",
        "deployment_id": "1123456789abcdef0123456789abcdef",
        "node_id": "2123456789abcdef0123456789abcdef",
        "mode": "voluntary",
        "transport_uid": TRANSPORT_UID,
        "local_owner_uids": [OWNER_UID],
        "maximum_lease_seconds": 600,
        "state_dir": str(base / "state"),
        "socket_dir": str(base / "sockets"),
        "supervisor": "cgroupfs",
        "slots": [
            {
                "id": "a",
                "class": "small",
                "generation": 1,
                "path": str(base / "slots/a"),
                "uid": pwd.getpwnam(SLOT_ACCOUNT).pw_uid,
                "gid": pwd.getpwnam(SLOT_ACCOUNT).pw_gid,
                "storage_bytes": SLOT_BYTES,
                "storage_inodes": SLOT_INODES,
                "filesystem_uuid": _slot_uuid(base / "slots/a"),
            }
        ],
        "ceiling": allowance,
        "initial_offer": {**allowance, "control": "active"},
        "providers": [{"id": "test", "package_digest": digest, "configuration": configuration}],
    }


def write(base: Path, doc: dict[str, Any], mode: int = 0o600) -> Path:
    path = base / "etc" / "host.json"
    path.unlink(missing_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as out:
        json.dump(doc, out)
    os.chmod(path, mode)
    return path


def run(*argv: str | Path) -> subprocess.CompletedProcess[str]:
    """The real console command; the timeout is a hang guard, not a timing assertion."""
    return subprocess.run(
        [str(COMMAND), *map(str, argv)], capture_output=True, text=True, check=False, timeout=120
    )


def check(config: Path, site: Path, *extra: str) -> subprocess.CompletedProcess[str]:
    return run("check-config", "--config", config, "--provider-path", site, *extra)


def pin(site: Path) -> str:
    return compute_digest("test", [str(site)]).digest


def test_a_good_configuration_passes(host: Path, provider_site: Path) -> None:
    config = write(host, document(host, pin(provider_site), {}))
    result = check(config, provider_site)
    assert result.returncode == 0, result.stderr
    assert "provider test: available" in result.stdout
    assert result.stdout.splitlines()[-1] == f"{config}: ok"
    assert "ledger: none yet (serve creates it on its first start)" in result.stdout
    shown = json.loads(check(config, provider_site, "--json").stdout)
    assert shown == {
        "config": str(config),
        "result": "ok",
        "error": None,
        "ledger": "none yet (serve creates it on its first start)",
        "providers": [{"id": "test", "available": True, "error": None}],
    }
    assert os.listdir(host / "state") == []  # nothing created: check-config opens no ledger
    assert os.listdir(host / "sockets") == []


def test_a_provider_whose_configure_fails_is_reported_unavailable(
    host: Path, provider_site: Path
) -> None:
    config = write(host, document(host, pin(provider_site), {"argv": "not a list"}))
    result = check(config, provider_site)
    assert result.returncode == 4
    assert (
        "provider test: unavailable: provider_configure_failed: provider 'test' refused its "
        in (result.stderr)
    )
    assert "'argv' must be a non-empty list of strings" in result.stderr
    allowed = check(config, provider_site, "--allow-unavailable-providers", "--json")
    assert allowed.returncode == 0
    (provider,) = json.loads(allowed.stdout)["providers"]
    assert provider["available"] is False
    assert provider["error"]["code"] == "provider_configure_failed"


def test_a_provider_that_does_not_match_its_pin_is_reported_unavailable(
    host: Path, provider_site: Path
) -> None:
    config = write(host, document(host, "sha256:" + "0" * 64, {}))
    result = check(config, provider_site, "--json")
    assert result.returncode == 4
    document_ = json.loads(result.stdout)
    assert document_["result"] == "provider_unavailable"
    assert document_["providers"][0]["error"]["code"] == "provider_digest_mismatch"


def _serve_refusal(config: Path, site: Path) -> dict[str, Any]:
    """What `serve` logs when it refuses to start (its last JSON line)."""
    served = run("serve", "--config", config, "--provider-path", site)
    assert served.returncode == 1
    line: dict[str, Any] = json.loads(served.stderr.splitlines()[-1])
    assert (line["level"], line["event"]) == ("error", "refused")
    return line


@pytest.mark.parametrize("problem", ["mode", "account", "ledger", "installation"])
def test_check_config_refuses_what_serve_refuses_with_the_same_message(
    host: Path, provider_site: Path, problem: str
) -> None:
    doc = document(host, pin(provider_site), {})
    mode = 0o600
    if problem == "mode":
        mode = 0o644
    elif problem == "account":
        doc["local_owner_uids"] = [_unused_uid()]
    elif problem == "ledger":
        (host / "state" / "ledger.created").write_text("0" * 32 + "\n")
    else:  # a ledger of another installation in state_dir
        other = {**doc, "installation_id": "f" * 32}
        open_ledger(parse_config(json.dumps(other).encode(), ".json")).close()
    config = write(host, doc, mode)
    result = check(config, provider_site)
    assert result.returncode == 1
    code, _, message = result.stderr.strip().partition(": ")
    assert code == {"mode": "config_unsafe_file", "account": "account_missing",
                    "ledger": "ledger_missing",
                    "installation": "ledger_installation_mismatch"}[problem]  # fmt: skip
    refused = _serve_refusal(config, provider_site)
    assert (refused["code"], refused["message"]) == (code, message)
    shown = json.loads(check(config, provider_site, "--json").stdout)
    assert shown["result"] == "refused"
    assert shown["error"] == {"code": code, "message": message}


def test_an_intact_ledger_passes_and_one_a_daemon_holds_is_reported_as_serve_would_refuse(
    host: Path, provider_site: Path
) -> None:
    """With the ledger held by a running daemon, serve would refuse (ledger_busy): the
    check says so (exit 5) instead of passing, and still checks the rest."""
    doc = document(host, pin(provider_site), {})
    config = write(host, doc)
    ledger = open_ledger(parse_config(json.dumps(doc).encode(), ".json"))  # holds its lock
    try:
        held = check(config, provider_site)
        assert held.returncode == 5, held.stdout + held.stderr
        assert "ledger: held by a running daemon: serve would refuse to start now" in held.stdout
        assert "provider test: available" in held.stdout
        assert "(ledger_busy)" in held.stdout.splitlines()[-1]
        shown = json.loads(check(config, provider_site, "--json").stdout)
        assert shown["result"] == "ledger_busy"
        refused = _serve_refusal(config, provider_site)
        assert refused["code"] == "ledger_busy"
    finally:
        ledger.close()
    free = check(config, provider_site)
    assert free.returncode == 0, free.stderr
    assert "ledger: ok" in free.stdout.splitlines()


def _unused_uid() -> int:
    import pwd  # noqa: PLC0415 - only this helper needs it

    uid = 3_999_000
    while True:
        try:
            pwd.getpwuid(uid)
        except KeyError:
            return uid
        uid += 1


def test_the_unit_runs_check_config_before_serve() -> None:
    unit = ROOT / "packages" / "ficc-executor-host" / "packaging" / "ficc-executor-host.service"
    settings = [line.partition("=") for line in unit.read_text().splitlines()]
    pre = [value for key, _, value in settings if key == "ExecStartPre"]
    start = [value for key, _, value in settings if key == "ExecStart"]
    assert len(pre) == 1
    assert " check-config --config /etc/ficc/executor-host.toml" in pre[0]
    assert "--allow-unavailable-providers" in pre[0]
    assert start[0].split(" serve ")[0] == pre[0].split(" check-config ")[0]  # same interpreter
