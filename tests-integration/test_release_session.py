"""`nox -s release -- DIST VERSION`, run for real in a clone of this repository.

The session must refuse a dirty tree, a version its pyproject.toml does not carry, a
CHANGELOG without the release's heading and a tag that exists; and, with all in order,
build the wheel and sdist into dist/, run the distribution's tests against the
installed wheel and tag the commit. ficc-hoststate is released here because it needs
no other distribution and its tests are the quickest.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
NAME, VERSION = "ficc-hoststate", "0.1.0"
GIT_IDENTITY = {
    "GIT_AUTHOR_NAME": "release test",
    "GIT_AUTHOR_EMAIL": "release-test@localhost",
    "GIT_COMMITTER_NAME": "release test",
    "GIT_COMMITTER_EMAIL": "release-test@localhost",
}

pytestmark = pytest.mark.slow


def _nox() -> str:
    """The nox that runs this suite (`tools/dev` keeps it in its virtual environment)."""
    venv = Path(os.environ.get("FICC_DEV_VENV", ROOT / ".venv"))
    found = venv / "bin" / "nox"
    if found.exists():
        return str(found)
    on_path = shutil.which("nox")
    if on_path is not None:
        return on_path
    reason = f"no nox in {venv}/bin or on PATH: run `tools/dev setup` first"
    if os.environ.get("FICC_CI") == "1":
        pytest.fail(f"FICC_CI=1 and this test cannot run here: {reason}", pytrace=False)
    pytest.skip(reason)


def _git(clone: Path, *args: str) -> str:
    return subprocess.run(
        ["git", *args],
        cwd=clone,
        check=True,
        capture_output=True,
        text=True,
        env={**os.environ, **GIT_IDENTITY},
    ).stdout


def _release(clone: Path, *posargs: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("NOX", "VIRTUAL_ENV"))}
    return subprocess.run(
        [_nox(), "-f", str(clone / "noxfile.py"), "-s", "release", "--", *posargs],
        cwd=clone,
        capture_output=True,
        text=True,
        env={**env, **GIT_IDENTITY},
        timeout=1800,
        check=False,
    )


@pytest.fixture(scope="module")
def clone(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A clone of this repository's committed HEAD."""
    where = tmp_path_factory.mktemp("release") / "repo"
    subprocess.run(["git", "clone", "-q", str(ROOT), str(where)], check=True)
    return where


def _date_the_release(clone: Path) -> None:
    changelog = clone / "packages" / NAME / "CHANGELOG.md"
    text = changelog.read_text()
    dated, count = re.subn(
        rf"^## {re.escape(VERSION)} \(unreleased\)$", f"## {VERSION} (2026-12-01)", text,
        flags=re.MULTILINE,
    )  # fmt: skip
    assert count == 1, "the CHANGELOG has no unreleased heading for this version"
    changelog.write_text(dated)
    _git(clone, "commit", "-qam", f"{NAME} {VERSION}")


def test_the_release_session_refuses_then_releases(clone: Path) -> None:
    unreleased = _release(clone, NAME, VERSION)
    assert unreleased.returncode != 0
    assert f"has no '## {VERSION}' heading" in unreleased.stderr + unreleased.stdout

    wrong = _release(clone, NAME, "9.9.9")
    assert wrong.returncode != 0
    assert f"says version {VERSION}, not 9.9.9" in wrong.stderr + wrong.stdout

    unknown = _release(clone, "ficc-nothing", VERSION)
    assert unknown.returncode != 0
    assert "is not a distribution here" in unknown.stderr + unknown.stdout

    _date_the_release(clone)
    (clone / "stray.txt").write_text("not committed\n")
    dirty = _release(clone, NAME, VERSION)
    assert dirty.returncode != 0
    assert "the working tree is not clean" in dirty.stderr + dirty.stdout
    (clone / "stray.txt").unlink()
    assert not _git(clone, "tag", "--list")  # nothing was tagged by a refusal

    released = _release(clone, NAME, VERSION)
    assert released.returncode == 0, released.stdout[-4000:] + released.stderr[-4000:]
    assert re.search(r"\d+ passed", released.stdout + released.stderr)  # the tests ran
    tag = f"{NAME}-v{VERSION}"
    assert _git(clone, "tag", "--list").split() == [tag]
    assert _git(clone, "rev-list", "-n1", tag) == _git(clone, "rev-parse", "HEAD")
    built = sorted(p.name for p in (clone / "dist").iterdir())
    assert built == [
        f"ficc_hoststate-{VERSION}-py3-none-any.whl",
        f"ficc_hoststate-{VERSION}.tar.gz",
    ]

    again = _release(clone, NAME, VERSION)
    assert again.returncode != 0
    assert f"tag {tag} exists already" in again.stderr + again.stdout
