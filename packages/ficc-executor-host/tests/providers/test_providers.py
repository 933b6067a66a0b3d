"""Provider pinning, loading and batch calls, against a real installed distribution.

The test provider (tests-integration/providers/ficc-test-provider) is built into a
wheel with hatchling once per session and installed with pip, as root, into a fresh
site directory per test; discovery is pointed at that directory with `path=[...]`.
Tampering is done to the installed files the way an attacker or a careless edit
would; a "re-release" (files changed AND RECORD rewritten to match) stands in for a
different build of the same distribution.
"""

from __future__ import annotations

import base64
import hashlib
import importlib.util
import json
import os
import py_compile
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ficc.execution import provider as sdk
from ficc.execution.host.cli import commands
from ficc.execution.host.core.errors import HostError
from ficc.execution.host.providers import (
    MAX_BATCH,
    RowResult,
    call,
    call_grouped,
    compute_digest,
    group,
    load_provider,
)
from ficc.execution.host.providers import loader as loader_module
from ficc_testkit import wheels
from ficc_testkit.contexts import sample_context, with_check

ROOT = Path(__file__).resolve().parents[4]
PROVIDER_SOURCE = ROOT / "tests-integration" / "providers" / "ficc-test-provider"
MODULE = "ficc_test_provider"
PACKAGE = f"{MODULE}/__init__.py"

pytestmark = pytest.mark.slow("each test builds or installs a real provider distribution")

needs_root = pytest.mark.root("ownership checks need root-owned installs")


# ---- building and installing the real distribution ------------------------------------


def _pip(*args: str) -> None:
    subprocess.run(
        [sys.executable, "-m", "pip", "--disable-pip-version-check", "-q", *args],
        check=True,
        umask=0o022,
    )


@pytest.fixture(scope="session")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("wheel")
    return wheels.build_wheel(PROVIDER_SOURCE, out)


def install(wheel: Path, prefix: Path, *extra: str) -> Path:
    """Install under `prefix` like a system or virtualenv install; return site-packages."""
    return wheels.install_into(wheel, prefix, *extra)


@pytest.fixture
def site(wheel: Path, tmp_path: Path) -> Path:
    return install(wheel, tmp_path / "prefix")


@pytest.fixture(autouse=True)
def forget_provider() -> Iterator[None]:
    """Each test imports the provider afresh through the loader, never from a cache."""
    yield
    for name in [m for m in sys.modules if m == MODULE or m.startswith(MODULE + ".")]:
        del sys.modules[name]
    sys.meta_path[:] = [f for f in sys.meta_path if not isinstance(f, loader_module._PinnedFinder)]


def digest_of(site: Path) -> str:
    return compute_digest("test", [str(site)]).digest


def refused(code: str) -> Any:
    return pytest.raises(HostError, match=f"^{code}:")


def rerelease(site: Path, relpath: str, content: bytes) -> None:
    """Change an installed file and rewrite RECORD to match: a different build."""
    (site / relpath).write_bytes(content)
    (record,) = site.glob("*.dist-info/RECORD")
    encoded = base64.urlsafe_b64encode(hashlib.sha256(content).digest()).rstrip(b"=").decode()
    lines = [
        f"{relpath},sha256={encoded},{len(content)}" if line.startswith(relpath + ",") else line
        for line in record.read_text().splitlines()
    ]
    record.write_text("\n".join(lines) + "\n")


def marker_code(marker: Path) -> bytes:
    return f"\nopen({str(marker)!r}, 'w').write('tampered code ran')\n".encode()


def imported() -> bool:
    return MODULE in sys.modules


# ---- digest -------------------------------------------------------------------------


def test_digest_is_stable_and_describes_the_distribution(site: Path) -> None:
    first = compute_digest("test", [str(site)])
    second = compute_digest("test", [str(site)])
    assert first.digest == second.digest
    assert first.digest.startswith("sha256:")
    assert len(first.digest) == 7 + 64
    assert (first.name, first.version) == ("ficc-test-provider", "0.1.0")
    assert first.distribution.entry_point == MODULE
    assert PACKAGE in {f.path for f in first.files}
    assert not any("__pycache__" in f.path for f in first.files)
    assert first.import_roots == {MODULE}
    assert not imported()


def test_digest_is_stable_across_a_reinstall_of_the_same_wheel(wheel: Path, site: Path) -> None:
    before = digest_of(site)
    install(wheel, site.parents[2], "--upgrade", "--force-reinstall")
    elsewhere = install(wheel, site.parents[3] / "other")
    assert digest_of(site) == before
    assert digest_of(elsewhere) == before


def test_one_wheel_installed_from_two_paths_pins_as_one_digest(wheel: Path, tmp_path: Path) -> None:
    """pip records the install source (direct_url.json, INSTALLER, REQUESTED, and their
    RECORD rows); none of that is part of the release, so none of it is in the pin."""
    sites = []
    for where in ("a", "b/c"):
        copy = tmp_path / "from" / where / wheel.name
        copy.parent.mkdir(parents=True)
        shutil.copyfile(wheel, copy)
        sites.append(install(copy, tmp_path / "prefix" / where))
    records = [next(s.glob("*.dist-info/direct_url.json")).read_text() for s in sites]
    assert records[0] != records[1]  # the two installs really do differ in their source
    (sites[1] / next(sites[1].glob("*.dist-info")).name / "REQUESTED").unlink()
    _drop_record_row(sites[1], "REQUESTED")
    first, second = (compute_digest("test", [str(s)]) for s in sites)
    assert first.digest == second.digest
    covered = {f.path.rsplit("/", 1)[-1] for f in first.files}
    assert not covered & {"direct_url.json", "INSTALLER", "REQUESTED", "RECORD"}
    assert {"METADATA", "entry_points.txt", "WHEEL"} <= covered


def test_uv_s_record_of_one_install_is_not_in_the_pin(site: Path) -> None:
    """uv writes `uv_cache.json` (with a timestamp) into each install and lists it in
    RECORD: it describes the install, not the release, like pip's direct_url.json."""
    before = digest_of(site)
    (dist_info,) = site.glob("*.dist-info")
    written = b'{"timestamp":{"secs_since_epoch":1796000000,"nanos":1}}'
    (dist_info / "uv_cache.json").write_bytes(written)
    encoded = base64.urlsafe_b64encode(hashlib.sha256(written).digest()).rstrip(b"=").decode()
    with open(dist_info / "RECORD", "a", encoding="utf-8") as record:
        record.write(f"{dist_info.name}/uv_cache.json,sha256={encoded},{len(written)}\n")
    assert digest_of(site) == before


def _drop_record_row(site: Path, name: str) -> None:
    """Remove one dist-info file's row from RECORD (pip omits REQUESTED for dependencies)."""
    (record,) = site.glob("*.dist-info/RECORD")
    kept = [
        line
        for line in record.read_text().splitlines()
        if line.split(",", 1)[0].rsplit("/", 1)[-1] != name
    ]
    record.write_text("\n".join(kept) + "\n")


def test_one_changed_byte_changes_the_digest(site: Path) -> None:
    before = digest_of(site)
    source = (site / PACKAGE).read_bytes()
    rerelease(site, PACKAGE, source.replace(b"API_VERSION = 1", b"API_VERSION = 1 "))
    assert digest_of(site) != before


def test_cli_prints_the_library_digest(site: Path, capsys: pytest.CaptureFixture[str]) -> None:
    expected = digest_of(site)
    assert commands.main(["provider-digest", "test", "--path", str(site)]) == 0
    table = capsys.readouterr().out
    assert "ficc-test-provider" in table
    assert "0.1.0" in table
    assert "test = ficc_test_provider" in table
    assert table.splitlines()[-1].split() == ["package_digest", expected]
    quiet = subprocess.run(
        [
            sys.executable,
            "-m",
            "ficc.execution.host.commands",
            "provider-digest",
            "test",
            "--quiet",
            "--path",
            str(site),
        ],
        capture_output=True,
        text=True,
        check=True,
    )
    assert quiet.stdout == expected + "\n"


def test_provider_digest_json(site: Path, capsys: pytest.CaptureFixture[str]) -> None:
    verified = compute_digest("test", [str(site)])
    assert commands.main(["provider-digest", "test", "--path", str(site), "--json"]) == 0
    shown = json.loads(capsys.readouterr().out)
    assert shown == {
        "id": "test",
        "distribution": "ficc-test-provider",
        "version": verified.version,
        "entry_point": verified.distribution.entry_point,
        "location": str(site),
        "files": len(verified.files),
        "package_digest": verified.digest,
    }


def test_provider_digest_json_reports_a_refusal_as_json(
    site: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["provider-digest", "absent", "--path", str(site), "--json"]
    assert commands.main(argv) == 1
    shown = capsys.readouterr()
    error = json.loads(shown.out)["error"]
    assert error["code"] == "provider_missing"
    assert "install the provider" in error["message"]
    assert shown.err.startswith("provider_missing: ")


def test_python_m_ficc_execution_reaches_provider_digest(site: Path) -> None:
    shown = subprocess.run(
        [
            sys.executable,
            "-m",
            "ficc.execution",
            "provider-digest",
            "test",
            "--quiet",
            "--path",
            str(site),
        ],
        capture_output=True,
        text=True,
        check=True,
    )
    assert shown.stdout == digest_of(site) + "\n"


def test_cli_refusal_exits_nonzero_with_the_code(
    site: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert commands.main(["provider-digest", "absent", "--path", str(site)]) == 1
    assert capsys.readouterr().err.startswith("provider_missing: ")


def test_missing_entry_point(site: Path) -> None:
    with refused("provider_missing"):
        compute_digest("absent", [str(site)])


def test_two_distributions_registering_the_name_are_ambiguous(wheel: Path, site: Path) -> None:
    other = install(wheel, site.parents[3] / "other")
    with refused("provider_ambiguous"):
        compute_digest("test", [str(site), str(other)])
    # The same directory listed twice is still one distribution.
    assert compute_digest("test", [str(site), str(site)]).digest == digest_of(site)


# ---- tampering is refused before anything is imported ---------------------------------


def test_tampered_file_is_refused_before_import(site: Path, tmp_path: Path) -> None:
    pin = digest_of(site)
    marker = tmp_path / "tampered-code-ran"
    tampered = (site / PACKAGE).read_bytes() + marker_code(marker)
    (site / PACKAGE).write_bytes(tampered)

    with refused("provider_tampered"):
        load_provider("test", pin, {}, [str(site)])
    assert not marker.exists()
    assert not imported()

    # Positive control: the tampered code does run once it is imported. An
    # administrator who reviews and re-pins it (RECORD made consistent) gets it loaded.
    rerelease(site, PACKAGE, tampered)
    with refused("provider_digest_mismatch") as mismatch:
        load_provider("test", pin, {}, [str(site)])
    assert pin in str(mismatch.value)
    assert "provider-digest" in str(mismatch.value)
    assert not marker.exists()
    assert not imported()
    load_provider("test", digest_of(site), {}, [str(site)])
    assert marker.read_text() == "tampered code ran"
    assert imported()


def test_genuine_provider_import_runs_its_module_code(
    site: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Control for the tests above: the genuine module's import-time marker fires."""
    marker = tmp_path / "imported"
    monkeypatch.setenv("FICC_TEST_PROVIDER_IMPORT_MARKER", str(marker))
    with refused("provider_digest_mismatch"):
        load_provider("test", "sha256:" + "0" * 64, {}, [str(site)])
    assert not marker.exists()
    loaded = load_provider("test", digest_of(site), {}, [str(site)])
    assert marker.exists()
    assert Path(loaded.module.__file__ or "") == site / PACKAGE


def test_missing_listed_file_is_refused(site: Path) -> None:
    (site / PACKAGE).unlink()
    with refused("provider_tampered"):
        compute_digest("test", [str(site)])


@pytest.mark.parametrize(
    "extra", [f"{MODULE}/extra.py", f"{MODULE}/sub/__init__.py", "x.dist-info/hook.pth"]
)
def test_unlisted_file_is_refused(site: Path, extra: str) -> None:
    if extra.startswith("x.dist-info"):
        (dist_info,) = site.glob("*.dist-info")
        extra = f"{dist_info.name}/hook.pth"
    path = site / extra
    path.parent.mkdir(exist_ok=True)
    path.write_text("print('unlisted')\n")
    with refused("provider_tampered"):
        compute_digest("test", [str(site)])


def test_record_that_disagrees_with_disk_is_refused(site: Path) -> None:
    (record,) = site.glob("*.dist-info/RECORD")
    text = record.read_text()
    rows = [r for r in text.splitlines() if r.startswith(PACKAGE + ",")]
    record.write_text(text.replace(rows[0], rows[0].rsplit(",", 1)[0] + ",1"))
    with refused("provider_tampered"):
        compute_digest("test", [str(site)])


def test_planted_bytecode_is_never_executed(site: Path, tmp_path: Path) -> None:
    """A pyc whose header matches the source runs under a plain import, not ours."""
    marker = tmp_path / "bytecode-ran"
    source = site / PACKAGE
    real = source.stat()
    evil = marker_code(marker)
    evil_source = tmp_path / "evil.py"
    evil_source.write_bytes(evil + b"#" * (real.st_size - len(evil)))
    os.utime(evil_source, ns=(real.st_atime_ns, real.st_mtime_ns))
    cache = importlib.util.cache_from_source(str(source))
    Path(cache).parent.mkdir(exist_ok=True)
    py_compile.compile(str(evil_source), cfile=cache, doraise=True)
    pin = digest_of(site)  # caches are not part of the digest

    plain = [sys.executable, "-B", "-c", f"import {MODULE}"]
    subprocess.run(plain, check=True, env={**os.environ, "PYTHONPATH": str(site)})
    assert marker.exists(), "control: a plain import does use the planted bytecode"
    marker.unlink()

    loaded = load_provider("test", pin, {}, [str(site)])
    assert not marker.exists()
    assert loaded.module.API_VERSION == 1


def test_shadowing_copy_earlier_on_sys_path_is_never_imported(
    site: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    marker = tmp_path / "shadow-ran"
    shadow = tmp_path / "shadow"
    (shadow / MODULE).mkdir(parents=True)
    (shadow / PACKAGE).write_bytes(marker_code(marker))
    monkeypatch.syspath_prepend(str(shadow))
    loaded = load_provider("test", digest_of(site), {}, [str(site)])
    assert not marker.exists()
    assert Path(loaded.module.__file__ or "") == site / PACKAGE


def test_already_imported_provider_is_refused(site: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.syspath_prepend(str(site))
    __import__(MODULE)
    with refused("provider_already_imported"):
        load_provider("test", digest_of(site), {}, [str(site)])


# ---- unsafe files --------------------------------------------------------------------


@pytest.mark.parametrize("target", [PACKAGE, MODULE, "dist-info"])
def test_group_writable_file_or_directory_is_refused(site: Path, target: str) -> None:
    path = next(site.glob("*.dist-info")) if target == "dist-info" else site / target
    path.chmod(path.stat().st_mode | 0o020)
    with refused("provider_unsafe"):
        compute_digest("test", [str(site)])


def test_symlinked_file_is_refused(site: Path) -> None:
    (site / MODULE / "link.py").symlink_to(site / PACKAGE)
    with refused("provider_unsafe"):
        compute_digest("test", [str(site)])


def test_symlinked_listed_file_is_refused(site: Path, tmp_path: Path) -> None:
    moved = tmp_path / "moved.py"
    shutil.move(site / PACKAGE, moved)
    (site / PACKAGE).symlink_to(moved)
    with refused("provider_unsafe"):
        compute_digest("test", [str(site)])


def test_symlinked_package_directory_is_refused(site: Path, tmp_path: Path) -> None:
    moved = tmp_path / "moved"
    shutil.move(site / MODULE, moved)
    (site / MODULE).symlink_to(moved)
    with refused("provider_unsafe"):
        compute_digest("test", [str(site)])


def test_fifo_in_place_of_a_listed_file_is_refused(site: Path) -> None:
    (site / PACKAGE).unlink()
    os.mkfifo(site / PACKAGE, 0o644)
    with refused("provider_unsafe"):
        compute_digest("test", [str(site)])


def test_hard_linked_file_is_refused(site: Path, tmp_path: Path) -> None:
    os.link(site / PACKAGE, tmp_path / "second-name.py")
    with refused("provider_unsafe"):
        compute_digest("test", [str(site)])


@needs_root
def test_file_not_owned_by_root_is_refused(site: Path) -> None:
    os.chown(site / PACKAGE, 65534, 0)
    with refused("provider_unsafe"):
        compute_digest("test", [str(site)])


def test_editable_install_is_refused(tmp_path: Path) -> None:
    source = tmp_path / "source"
    shutil.copytree(PROVIDER_SOURCE, source)
    prefix = tmp_path / "editable"
    isolation = [] if importlib.util.find_spec("hatchling") is None else ["--no-build-isolation"]
    _pip(
        "install",
        "--no-deps",
        "--ignore-installed",
        *isolation,
        "--prefix",
        str(prefix),
        "-e",
        str(source),
    )
    (target,) = prefix.glob("lib/python3*/site-packages")
    with refused("provider_editable"):
        compute_digest("test", [str(target)])
    assert not imported()


def test_files_outside_the_site_directory_are_verified(site: Path) -> None:
    """RECORD lists the console script as ../../../bin/...: it is hashed and checked too."""
    verified = compute_digest("test", [str(site)])
    assert "../../../bin/ficc-test-provider" in {f.path for f in verified.files}

    script = site.parents[2] / "bin" / "ficc-test-provider"
    script.write_bytes(script.read_bytes() + b"# edited\n")
    with refused("provider_tampered"):
        compute_digest("test", [str(site)])
    script.unlink()
    script.symlink_to(sys.executable)
    with refused("provider_unsafe"):
        compute_digest("test", [str(site)])


# ---- the provider contract ------------------------------------------------------------


def test_api_version_2_is_refused(site: Path) -> None:
    source = (site / PACKAGE).read_bytes()
    rerelease(site, PACKAGE, source.replace(b"API_VERSION = 1", b"API_VERSION = 2"))
    with refused("provider_api_version"):
        load_provider("test", digest_of(site), {}, [str(site)])


def test_driver_missing_a_method_is_refused(site: Path) -> None:
    source = (site / PACKAGE).read_bytes()
    rerelease(site, PACKAGE, source + b"\ndel Driver.collect\n")
    with refused("provider_invalid") as refusal:
        load_provider("test", digest_of(site), {}, [str(site)])
    assert "collect" in str(refusal.value)


def test_configure_refusing_its_configuration(site: Path) -> None:
    with refused("provider_configure_failed"):
        load_provider("test", digest_of(site), {"argv": "not a list"}, [str(site)])


def test_sys_exit_in_configure_is_a_refusal_not_the_end_of_the_host(site: Path) -> None:
    """`sys.exit()` in a provider's configure() is the provider's refusal (the daemon
    must still start and recover), never the daemon's exit."""
    source = (site / PACKAGE).read_bytes()
    exits = source + b"\ndef configure(configuration):\n    raise SystemExit('bad key typo')\n"
    rerelease(site, PACKAGE, exits)
    with refused("provider_configure_failed") as refusal:
        load_provider("test", digest_of(site), {}, [str(site)])
    assert "bad key typo" in str(refusal.value)


def test_the_stated_minimum_limits_are_read_once_at_load(site: Path) -> None:
    stated = {"memory_bytes": 64 << 20, "processes": 48}
    loaded = load_provider("test", digest_of(site), {"minimum_limits": stated}, [str(site)])
    assert loaded.minimums == sdk.MinimumLimits(memory_bytes=64 << 20, processes=48)


def test_a_provider_without_minimum_limits_states_none_and_loads(site: Path) -> None:
    """A provider written before the statement existed loads as before."""
    source = (site / PACKAGE).read_bytes()
    rerelease(site, PACKAGE, source + b"\ndel Driver.minimum_limits\n")
    assert load_provider("test", digest_of(site), {}, [str(site)]).minimums is None


@pytest.mark.parametrize(
    ("stated", "code"),
    [
        ({"memory_bytes": "64M"}, "provider_invalid"),
        ({"memory_bytes": 0}, "provider_invalid"),
        ({"gpus": 1}, "provider_invalid"),
    ],
)
def test_a_minimum_limits_statement_the_sdk_would_not_build_is_refused(
    site: Path, stated: object, code: str
) -> None:
    with refused(code) as refusal:
        load_provider("test", digest_of(site), {"minimum_limits": stated}, [str(site)])
    assert "sdk.MinimumLimits" in str(refusal.value)


def test_a_minimum_limits_that_raises_makes_the_provider_unavailable(site: Path) -> None:
    source = (site / PACKAGE).read_bytes()
    broken = b"\ndef _broken(self):\n    raise RuntimeError('no runtime here')\n"
    rerelease(site, PACKAGE, source + broken + b"Driver.minimum_limits = _broken\n")
    with refused("provider_configure_failed") as refusal:
        load_provider("test", digest_of(site), {}, [str(site)])
    assert "no runtime here" in str(refusal.value)


def test_sys_exit_at_import_is_a_refusal_not_the_end_of_the_host(site: Path) -> None:
    source = (site / PACKAGE).read_bytes()
    rerelease(site, PACKAGE, source + b"\nimport sys\n\nsys.exit(3)\n")
    with refused("provider_import_failed"):
        load_provider("test", digest_of(site), {}, [str(site)])


def test_loaded_test_provider_runs_a_real_unconfined_child(site: Path) -> None:
    argv = ["/bin/sh", "-c", "exit 7"]
    loaded = load_provider("test", digest_of(site), {"argv": argv}, [str(site)])
    driver = loaded.driver
    checks: list[str] = []
    contexts = [with_check(sample_context(), lambda i=i: checks.append(f"a{i}")) for i in (1, 2)]

    prepared = call(driver, "prepare", contexts)
    assert checks == ["a1", "a2"]
    assert [r.reply and r.reply["argv"] for r in prepared] == [argv] * 2
    assert set(prepared[0].reply or {}) == {
        "argv", "barrier", "devices", "mounts", "generated_targets",
        "positive_devices", "negative_devices",
    }  # fmt: skip
    assert [r.reply for r in call(driver, "observe", contexts)] == [{"phase": "waiting"}] * 2
    started = call(driver, "start", contexts[:1])
    assert started[0].ok
    deadline = time.monotonic() + 30
    while (phase := call(driver, "observe", contexts[:1])[0].reply or {})["phase"] != "finished":
        assert time.monotonic() < deadline, "the child never finished"
        os.waitid(os.P_PID, (started[0].reply or {})["pid"], os.WEXITED | os.WNOWAIT)
    assert phase == {"phase": "finished", "exit_code": 7}
    assert all(r.ok for r in call(driver, "stop", contexts))
    assert all(r.ok for r in call(driver, "release", contexts))


# ---- the batch adapter -----------------------------------------------------------------


class ScriptedDriver:
    """A pure-logic stand-in: each method replies from a script keyed by row value."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, list[dict[str, Any]]]] = []

    def _reply(self, method: str, contexts: list[dict[str, Any]]) -> Any:
        self.calls.append((method, contexts))
        behaviour = contexts[0].get("behaviour", "echo")
        if behaviour == "raise":
            raise RuntimeError("runtime exploded " + "x" * 10_000)
        if behaviour == "exit":
            raise SystemExit(3)
        if behaviour == "short":
            return [{"n": c["n"]} for c in contexts][:-1]
        if behaviour == "not-a-list":
            return {"n": 1}
        if behaviour == "bad-row":
            return [{"n": c["n"]} if c["n"] % 2 else ["no"] for c in contexts]
        if behaviour == "refuse-even":
            return [
                {"n": c["n"]} if c["n"] % 2 else {"error": "barrier_changed", "message": "m"}
                for c in contexts
            ]
        if behaviour == "refuse-badly":
            return [{"error": code, "message": 7} for code in ("Not A Name", 42, "ok")][
                : len(contexts)
            ]
        return [{"n": c["n"]} for c in contexts]

    def __getattr__(self, method: str) -> Any:
        return lambda contexts: self._reply(method, contexts)


def rows(behaviour: str, *numbers: int) -> list[dict[str, Any]]:
    return [{"behaviour": behaviour, "n": n} for n in numbers]


def test_good_batch_returns_one_reply_per_row_in_order() -> None:
    results = call(ScriptedDriver(), "observe", rows("echo", 3, 1, 2))
    assert [r.reply for r in results] == [{"n": 3}, {"n": 1}, {"n": 2}]


@pytest.mark.parametrize(
    ("behaviour", "code"),
    [("raise", "provider_error"), ("exit", "provider_error"),
     ("short", "provider_malformed"), ("not-a-list", "provider_malformed")],
)  # fmt: skip
def test_failure_fails_every_row_of_that_batch(behaviour: str, code: str) -> None:
    results = call(ScriptedDriver(), "start", rows(behaviour, 1, 2, 3))
    assert [(r.ok, r.code) for r in results] == [(False, code)] * 3
    assert all(len(r.message or "") <= 512 for r in results)


def test_non_dict_row_fails_only_that_row() -> None:
    results = call(ScriptedDriver(), "collect", rows("bad-row", 1, 2, 3))
    assert [(r.reply, r.code) for r in results] == [
        ({"n": 1}, None), (None, "provider_malformed"), ({"n": 3}, None),
    ]  # fmt: skip


def test_a_provider_refusal_row_fails_that_row_with_its_own_code() -> None:
    """`{"error": CODE, "message": TEXT}` is the provider refusing one row: it must never
    be mistaken for a successful reply (a start refusal would otherwise be ignored)."""
    results = call(ScriptedDriver(), "start", rows("refuse-even", 1, 2, 3))
    assert [(r.ok, r.reply, r.code, r.message) for r in results] == [
        (True, {"n": 1}, None, None),
        (False, None, "barrier_changed", "m"),
        (True, {"n": 3}, None, None),
    ]


def test_a_refusal_with_a_code_that_is_not_a_name_is_a_provider_error() -> None:
    results = call(ScriptedDriver(), "stop", rows("refuse-badly", 1, 2, 3))
    assert [(r.ok, r.code) for r in results] == [
        (False, "provider_error"), (False, "provider_error"), (False, "ok"),
    ]  # fmt: skip
    assert all(r.message for r in results)


def test_grouped_calls_confine_a_failure_to_its_group() -> None:
    driver = ScriptedDriver()
    mixed = rows("echo", 1) + rows("raise", 2) + rows("echo", 3) + rows("raise", 4)
    results = call_grouped(
        mixed,
        key=lambda row: row["behaviour"],
        invoke=lambda _key, batch: call(driver, "stop", batch),
    )
    assert [(r.reply, r.code) for r in results] == [
        ({"n": 1}, None), (None, "provider_error"), ({"n": 3}, None), (None, "provider_error"),
    ]  # fmt: skip
    assert [[c["n"] for c in contexts] for _, contexts in driver.calls] == [[1, 3], [2, 4]]


def test_check_callable_is_passed_through_untouched() -> None:
    def check() -> None:
        pass

    driver = ScriptedDriver()
    context = {"behaviour": "echo", "n": 1, "check": check}
    call(driver, "prepare", [context])
    passed = driver.calls[0][1][0]
    assert passed["check"] is check
    assert passed is not context  # a shallow copy: the provider cannot edit our dict


@pytest.mark.parametrize("size", [0, MAX_BATCH + 1])
def test_batch_size_outside_1_to_64_is_refused(size: int) -> None:
    with refused("provider_batch_size"):
        call(ScriptedDriver(), "probe", rows("echo", *range(size)))


def test_unknown_method_is_refused() -> None:
    with refused("provider_method"):
        call(ScriptedDriver(), "configure", rows("echo", 1))


EXAMPLES = 2_000 if os.environ.get("FICC_SOAK") == "1" else 100


@pytest.mark.soak
@settings(max_examples=EXAMPLES, deadline=None)
@given(st.lists(st.sampled_from("abc"), max_size=200))
def test_group_preserves_order_and_bounds_batches(keys: list[str]) -> None:
    groups = group(keys, key=lambda k: k)
    assert sorted(i for g in groups for i in g.indices) == list(range(len(keys)))
    assert all(1 <= len(g.indices) <= MAX_BATCH for g in groups)
    assert all(list(g.indices) == sorted(g.indices) for g in groups)
    assert all(keys[i] == g.key for g in groups for i in g.indices)
    firsts = [g.indices[0] for g in groups]
    assert firsts == sorted(firsts)
    echoed = call_grouped(
        keys, key=lambda k: k, invoke=lambda _k, batch: [RowResult({"k": k}) for k in batch]
    )
    assert [r.reply for r in echoed] == [{"k": k} for k in keys]


class _RefusingDriver:
    """Refuses the second row: by returning the refusal, or (wrongly) by raising it."""

    def __init__(self, raising: bool) -> None:
        self.raising = raising

    def probe(self, contexts: list[sdk.Context]) -> list[sdk.Reply]:
        replies = []
        for index, _ in enumerate(contexts):
            if index == 1 and self.raising:
                raise sdk.Refused("image_unknown", "that image is not configured")
            if index == 1:
                replies.append(sdk.refusal("image_unknown", "that image is not configured"))
            else:
                replies.append(sdk.reply(sdk.ProbeReply(ok=True)))
        return replies


def test_refused_is_returned_for_one_row_never_raised() -> None:
    """What Refused's docstring tells a provider: `refusal()` refuses one row, while a
    raised Refused (like any raise) fails every row of the call."""
    rows = [sample_context(), sample_context(), sample_context()]
    returned = call(_RefusingDriver(raising=False), "probe", rows)
    assert [(r.ok, r.code) for r in returned] == [
        (True, None),
        (False, "image_unknown"),
        (True, None),
    ]
    raised = call(_RefusingDriver(raising=True), "probe", rows)
    assert [r.code for r in raised] == ["provider_error"] * 3
    doc = " ".join((sdk.Refused.__doc__ or "").split())
    assert "`refusal(code, message)`" in doc
    assert "fails every row of its call" in doc


_OLD_PATH = """
import warnings
from ficc.execution import provider
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    from ficc.execution.host import sdk
    from ficc.execution.host.sdk import Refused
assert Refused is provider.Refused
assert sdk.__all__ == provider.__all__
assert all(getattr(sdk, name) is getattr(provider, name) for name in provider.__all__)
(warning,) = [w for w in caught if w.category is DeprecationWarning]
print(warning.message)
"""


def test_the_old_sdk_path_is_the_same_contract_and_says_where_it_moved() -> None:
    """A provider written against `ficc.execution.host.sdk` keeps loading for the 0.1
    releases, with the same objects, and is told to import `ficc.execution.provider`."""
    done = subprocess.run(
        [sys.executable, "-c", _OLD_PATH], capture_output=True, text=True, check=False
    )
    assert done.returncode == 0, done.stderr
    assert "import ficc.execution.provider instead" in done.stdout
    assert "goes away in ficc-executor-host 0.2" in done.stdout
