"""Markers that say what a test needs from the machine.

A marked test that the machine cannot run is skipped with its reason, except under
`FICC_CI=1`, where it fails: the CI run is the place the real tests must run, and a
skip there would hide that they did not.
"""

from __future__ import annotations

import os
import shutil

import pytest

#: marker name -> (what it means, a check that returns why the test cannot run or None)
MARKERS = {
    "root": "root(reason): needs root (real accounts, root-owned files, cgroups, mounts)",
    "podman": "podman(reason): needs root, podman and runc",
}
#: not a need of the machine but of time: real builds, installs or long loops, left out
#: of the fast lane (`nox -s unit`) and run by the package sessions and CI.
SLOW = "slow(reason): takes seconds (real builds, installs, long loops); not in the fast lane"


def _missing(name: str) -> str | None:
    """Why a test with marker `name` cannot run on this machine, or None if it can."""
    if os.geteuid() != 0:
        return "not root"
    if name == "podman":
        absent = [tool for tool in ("podman", "runc") if shutil.which(tool) is None]
        if absent:
            return f"{' and '.join(absent)} not installed (tools/dev setup installs them)"
    return None


def pytest_configure(config: pytest.Config) -> None:
    """Declare the markers, so `--strict-markers` and `-m` know them."""
    for text in [*MARKERS.values(), SLOW]:
        config.addinivalue_line("markers", text)


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item: pytest.Item) -> None:
    """Skip (or under FICC_CI=1 fail) a marked test before its fixtures run."""
    for name in MARKERS:
        marker = item.get_closest_marker(name)
        if marker is None:
            continue
        missing = _missing(name)
        if missing is None:
            continue
        why = marker.args[0] if marker.args else marker.kwargs.get("reason", f"needs {name}")
        text = f"{why} ({missing})"
        if os.environ.get("FICC_CI") == "1":
            pytest.fail(f"FICC_CI=1 and this test cannot run here: {text}", pytrace=False)
        pytest.skip(text)
