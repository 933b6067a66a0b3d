"""The repository is self-contained: nothing in it points at a file outside it, at a
design or requirements text a user never sees, or at a tracker issue; package READMEs
(shown on a package index) link to the docs by absolute URL, not by a relative path."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
THIS = Path(__file__).resolve()

# Built from pieces so this file does not match itself.
FORBIDDEN = {
    "a path to the requirements outside the repository": re.compile("shared" + "/spec"),
    "the design text": re.compile(r"\bDES" + r"IGN\b"),
    "the quality text": re.compile(r"\bQUAL" + r"ITY(\.md)?\b"),
    "a document that does not exist": re.compile("DAE" + r"MON\.md"),
    "the requirements text": re.compile(
        r"\bthe se" + r"ed\b|\bse" + r"ed's\b|\(se" + r"ed:|se" + r"ed-(hoststate|executor)"
    ),
    "a tracker issue": re.compile(r"\b[Ii]ss" + r"ues? \d+\b|\(iss" + r"ue \d"),
}


def tracked_text_files() -> list[Path]:
    if not (ROOT / ".git").exists():
        pytest.skip("not a git checkout: the tracked files are unknown")
    names = subprocess.run(
        ["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True
    ).stdout.split(b"\0")
    files = []
    for name in filter(None, names):
        path = ROOT / name.decode()
        if path.resolve() == THIS or path.name == "LICENSE" or not path.is_file():
            continue
        data = path.read_bytes()
        if b"\0" not in data[:8192]:
            files.append(path)
    return files


def test_nothing_refers_outside_the_repository() -> None:
    found = []
    for path in tracked_text_files():
        text = path.read_text(errors="replace")
        for number, line in enumerate(text.splitlines(), 1):
            for what, pattern in FORBIDDEN.items():
                if pattern.search(line):
                    found.append(f"{path.relative_to(ROOT)}:{number}: {what}: {line.strip()}")
    assert found == []


def test_package_readmes_link_to_the_docs_by_absolute_url() -> None:
    for readme in sorted((ROOT / "packages").glob("*/README.md")):
        links = re.findall(r"\]\(([^)]+)\)", readme.read_text())
        relative = [link for link in links if not re.match(r"[a-z]+://|#", link)]
        assert relative == [], f"{readme.relative_to(ROOT)}: relative links break on an index"
