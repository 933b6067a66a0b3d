"""One pin per release wherever it is installed, console scripts included.

An installer writes each console script itself, with the interpreter it installed for in
the first line (or, for a long path or one with spaces, in a `#!/bin/sh` preamble), so
the same wheel gives different script bytes in every venv. The digest hashes such a
script with that interpreter part as `#!python`; everything after it stays pinned.

The wheel is the repository's test provider, built from a temporary copy that also
declares a `[gui_scripts]` entry (so both sections are covered), installed with pip into
`--prefix` directories and into virtual environments made with `python -m venv`.
"""

from __future__ import annotations

import base64
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from ficc.execution.host.core.errors import HostError
from ficc.execution.host.providers import compute_digest
from ficc_testkit import wheels

ROOT = Path(__file__).resolve().parents[4]
PROVIDER_SOURCE = ROOT / "tests-integration" / "providers" / "ficc-test-provider"
CONSOLE = "ficc-test-provider"
GUI = "ficc-test-provider-gui"
GUI_SCRIPTS = f'\n[project.gui-scripts]\n{GUI} = "ficc_test_provider:main"\n'
SCRIPTS_TABLE = re.compile(r"^\[project\.scripts\]\n(?:#.*\n)*ficc-test-provider = .*\n", re.M)

pytestmark = pytest.mark.slow("each test builds or installs a real provider distribution")

needs_root = pytest.mark.root("ownership checks need root-owned installs")


# ---- building and installing ------------------------------------------------------------


def _build_variant(tmp: Path, edit: Any) -> Path:
    """The test provider's wheel, built from a copy whose pyproject.toml `edit` rewrote."""
    source = tmp / "source"
    shutil.copytree(PROVIDER_SOURCE, source)
    pyproject = source / "pyproject.toml"
    pyproject.write_text(edit(pyproject.read_text()))
    return wheels.build_wheel(source, tmp / "wheel")


@pytest.fixture(scope="session")
def script_wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A wheel with one `[console_scripts]` and one `[gui_scripts]` entry."""
    return _build_variant(tmp_path_factory.mktemp("scripts"), lambda text: text + GUI_SCRIPTS)


@pytest.fixture(scope="session")
def plain_wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The same provider without any script."""

    def without_scripts(text: str) -> str:
        edited = SCRIPTS_TABLE.sub("", text)
        assert edited != text, "the test provider no longer declares its console script"
        return edited

    return _build_variant(tmp_path_factory.mktemp("plain"), without_scripts)


def install_into_venv(wheel: Path, venv: Path) -> Path:
    """`python -m venv` at `venv`, the wheel installed by pip for that venv's interpreter
    (so the scripts name it); returns the venv's site-packages."""
    subprocess.run(
        [sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, umask=0o022
    )
    python = str(venv / "bin" / "python")
    wheels.pip("--python", python, "install", "--no-deps", "--no-index", str(wheel))
    (site,) = venv.glob("lib/python3*/site-packages")
    return site


@pytest.fixture
def site(script_wheel: Path, tmp_path: Path) -> Path:
    return install_into_venv(script_wheel, tmp_path / "venv")


def script(site: Path, name: str = CONSOLE) -> Path:
    return site.parents[2] / "bin" / name


def relpath(name: str = CONSOLE) -> str:
    """The script's path as RECORD lists it in a venv or prefix."""
    return f"../../../bin/{name}"


def digest_of(site: Path) -> str:
    return compute_digest("test", [str(site)]).digest


def refused(code: str) -> Any:
    return pytest.raises(HostError, match=f"^{code}:")


def _record_row(path: str, content: bytes) -> str:
    encoded = base64.urlsafe_b64encode(hashlib.sha256(content).digest()).rstrip(b"=").decode()
    return f"{path},sha256={encoded},{len(content)}"


def rewrite(site: Path, path: str, content: bytes) -> None:
    """Write a listed (or new) file and make RECORD agree: a different install or build."""
    target = site / path
    target.write_bytes(content)
    target.chmod(0o755)
    (record,) = site.glob("*.dist-info/RECORD")
    rows = [row for row in record.read_text().splitlines() if not row.startswith(path + ",")]
    record.write_text("\n".join([*rows, _record_row(path, content)]) + "\n")


def drop_record_row(site: Path, path: str) -> None:
    (record,) = site.glob("*.dist-info/RECORD")
    rows = record.read_text().splitlines()
    kept = [row for row in rows if not row.startswith(path + ",")]
    assert len(kept) == len(rows) - 1, f"RECORD does not list {path}"
    record.write_text("\n".join(kept) + "\n")


def interpreter_part(content: bytes) -> bytes:
    """What precedes the body pip writes (its body starts with the coding line)."""
    start, found, _ = content.partition(b"# -*- coding: utf-8 -*-\n")
    assert found, content
    return start


# ---- one release, one pin ---------------------------------------------------------------


def test_one_wheel_with_console_scripts_pins_as_one_digest_in_four_installs(
    script_wheel: Path, tmp_path: Path
) -> None:
    """Two prefixes and two venvs (one at a path with spaces, which pip writes as the
    /bin/sh preamble): the scripts name three interpreters, the pin is one."""
    sites = [
        wheels.install_into(script_wheel, tmp_path / "prefix-a"),
        wheels.install_into(script_wheel, tmp_path / "other" / "prefix-b"),
        install_into_venv(script_wheel, tmp_path / "venv-a"),
        install_into_venv(script_wheel, tmp_path / "a directory with spaces" / "venv-b"),
    ]
    for name in (CONSOLE, GUI):
        starts = [interpreter_part(script(s, name).read_bytes()) for s in sites]
        assert len(set(starts)) == 3, starts  # the two prefixes share pip's interpreter
        assert str(sites[2].parents[2] / "bin" / "python").encode() in starts[2]
        assert starts[3].startswith(b"#!/bin/sh\n'''exec' "), starts[3]
    pins = {wheels.provider_digest("test", s) for s in sites}
    assert len(pins) == 1, pins
    assert pins == {digest_of(sites[0])}


def test_only_the_installer_written_interpreter_path_is_left_out(site: Path) -> None:
    before = digest_of(site)
    body = script(site).read_bytes().split(b"\n", 1)[1]
    rewrite(site, relpath(), b"#!/usr/local/bin/python3.11\n" + body)
    assert digest_of(site) == before
    rewrite(site, relpath(), PREAMBLE % b"'/usr/local/bin/python3.11'" + body)
    assert digest_of(site) == before


PREAMBLE = b"#!/bin/sh\n'''exec' %s \"$0\" \"$@\"\n' '''\n"

NOT_AN_INTERPRETER_PATH = {
    "arguments": b"#!/usr/local/bin/python3.11 -E\n",
    "shell-expansion": PREAMBLE % b"/opt/$(id)/python",
    "python-code": PREAMBLE % b"\"/a'''; print(1) #\"",
    "encoding": b"#!/opt/coding:latin-1/python\n",
    "relative": b"#!bin/python\n",
}


@pytest.mark.parametrize("first", NOT_AN_INTERPRETER_PATH.values(), ids=NOT_AN_INTERPRETER_PATH)
def test_a_script_start_that_is_not_just_an_interpreter_path_is_pinned_whole(
    site: Path, first: bytes
) -> None:
    """Only an installer's interpreter part is read as `#!python`; one that also holds
    arguments, shell or Python code, or an encoding stays in the pin."""
    before = digest_of(site)
    body = script(site).read_bytes().split(b"\n", 1)[1]
    rewrite(site, relpath(), first + body)
    assert digest_of(site) != before


def test_an_edited_script_body_changes_the_digest_or_is_refused(site: Path) -> None:
    pin = digest_of(site)
    original = script(site).read_bytes()
    edited = original.replace(b"sys.exit(main())", b"sys.exit(main() or 0)")
    assert edited != original
    script(site).write_bytes(edited)
    with refused("provider_tampered"):
        compute_digest("test", [str(site)])
    rewrite(site, relpath(), edited)  # RECORD made to agree: a different release
    assert digest_of(site) != pin


def test_a_file_in_bin_entry_points_txt_does_not_declare_is_pinned_whole(site: Path) -> None:
    """Only declared console scripts are normalized: another listed file keeps its
    interpreter line in the pin, and an unlisted one is no part of the provider."""
    before = digest_of(site)
    extra = site.parents[2] / "bin" / "not-declared"
    extra.write_bytes(b"#!/bin/sh\necho not part of the provider\n")
    assert digest_of(site) == before
    rewrite(site, relpath("not-declared"), b"#!/usr/bin/python3\nprint('extra')\n")
    listed = digest_of(site)
    assert listed != before
    rewrite(site, relpath("not-declared"), b"#!/usr/local/bin/python3\nprint('extra')\n")
    assert digest_of(site) != listed


@pytest.mark.parametrize("name", [CONSOLE, GUI])
def test_a_declared_script_record_does_not_list_is_refused(site: Path, name: str) -> None:
    drop_record_row(site, relpath(name))
    with refused("provider_tampered") as refusal:
        compute_digest("test", [str(site)])
    assert name in str(refusal.value)
    assert "reinstall the provider wheel" in str(refusal.value)


# ---- scripts are checked like every file --------------------------------------------------


@pytest.mark.parametrize("name", [CONSOLE, GUI])
@pytest.mark.parametrize("loosened", [0o020, 0o002])
def test_a_script_writable_by_group_or_others_is_refused(
    site: Path, name: str, loosened: int
) -> None:
    path = script(site, name)
    path.chmod(path.stat().st_mode | loosened)
    with refused("provider_unsafe") as refusal:
        compute_digest("test", [str(site)])
    assert "writable by group or others" in str(refusal.value)


def test_a_hard_linked_script_is_refused(site: Path, tmp_path: Path) -> None:
    os.link(script(site), tmp_path / "second-name")
    with refused("provider_unsafe"):
        compute_digest("test", [str(site)])


def test_a_symlinked_script_is_refused(site: Path, tmp_path: Path) -> None:
    moved = tmp_path / "moved"
    shutil.move(script(site), moved)
    script(site).symlink_to(moved)
    with refused("provider_unsafe"):
        compute_digest("test", [str(site)])


@needs_root
def test_a_script_not_owned_by_root_is_refused(site: Path) -> None:
    os.chown(script(site, GUI), 65534, 0)
    with refused("provider_unsafe") as refusal:
        compute_digest("test", [str(site)])
    assert "not root" in str(refusal.value)


# ---- the documented digest ------------------------------------------------------------------


_INSTALL_RECORDS = {"RECORD", "direct_url.json", "INSTALLER", "REQUESTED", "uv_cache.json"}


def documented_digest(site: Path, scripts: set[str]) -> str:
    """The digest as docs/providers.md states it, computed here without the host's code:
    canonical JSON of name, version, entry point, METADATA's hash and every RECORD file
    but the install records and bytecode, console scripts with `#!python` first."""
    (dist_info,) = site.glob("*.dist-info")
    record = (dist_info / "RECORD").read_text().splitlines()
    files = []
    for path in sorted(row.rsplit(",", 2)[0] for row in record if row):
        name = path.rsplit("/", 1)[-1]
        if "__pycache__/" in path:
            continue
        if path.startswith(f"{dist_info.name}/") and name in _INSTALL_RECORDS:
            continue
        content = (site / path).read_bytes()
        if path.startswith("../") and name in scripts:
            content = b"#!python\n" + content[len(interpreter_part(content)) :]
        files.append({"path": path, "size": len(content), "sha256": _sha(content)})
    metadata = (dist_info / "METADATA").read_bytes()
    document = {
        "name": "ficc-test-provider",
        "version": "0.1.0",
        "entry_point": "ficc_test_provider",
        "metadata_sha256": _sha(metadata),
        "files": files,
    }
    canonical = json.dumps(document, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    return "sha256:" + _sha(canonical.encode())


def _sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def test_a_provider_without_scripts_pins_as_the_documented_document(
    plain_wheel: Path, tmp_path: Path
) -> None:
    """The format is unchanged for a provider without scripts: existing pins still hold."""
    site = install_into_venv(plain_wheel, tmp_path / "venv")
    assert not list((tmp_path / "venv" / "bin").glob("ficc-*"))
    assert digest_of(site) == documented_digest(site, set())


def test_a_provider_with_scripts_pins_as_the_documented_document(site: Path) -> None:
    assert digest_of(site) == documented_digest(site, {CONSOLE, GUI})
