"""Release metadata of the five distributions: one version each, LICENSE, URLs,
classifiers, consistent dependency bounds, the console commands, the Podman wheel tag.
"""

from __future__ import annotations

import ast
import re
import subprocess
import sys
import sysconfig
import tomllib
import zipfile
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[1]
TESTKIT = "ficc-testkit"  # never released


def _released() -> list[str]:
    """noxfile.py's DISTRIBUTIONS (in dependency order), read without importing nox."""
    tree = ast.parse((ROOT / "noxfile.py").read_text())
    (value,) = [
        node.value
        for node in tree.body
        if isinstance(node, ast.Assign)
        and [getattr(t, "id", None) for t in node.targets] == ["DISTRIBUTIONS"]
    ]
    names: list[str] = ast.literal_eval(value)
    return names


DISTRIBUTIONS = _released()


def test_every_package_but_the_test_kit_is_a_released_distribution() -> None:
    packages = {p.parent.name for p in (ROOT / "packages").glob("*/pyproject.toml")}
    assert sorted(DISTRIBUTIONS) == sorted(packages - {TESTKIT})


def project(name: str) -> dict[str, Any]:
    with open(ROOT / "packages" / name / "pyproject.toml", "rb") as file:
        document: dict[str, Any] = tomllib.load(file)["project"]
    return document


@pytest.mark.parametrize("name", DISTRIBUTIONS)
def test_each_distribution_carries_the_license_urls_and_classifiers(name: str) -> None:
    meta = project(name)
    assert meta["license"] == "Apache-2.0"
    assert meta["license-files"] == ["LICENSE"]
    assert (ROOT / "packages" / name / "LICENSE").read_bytes() == (ROOT / "LICENSE").read_bytes()
    assert "Apache License" in (ROOT / "LICENSE").read_text()[:200]
    assert set(meta["urls"]) == {"Homepage", "Documentation", "Changelog", "Source", "Issues"}
    assert meta["urls"]["Changelog"].endswith(f"packages/{name}/CHANGELOG.md")
    assert "Programming Language :: Python :: 3 :: Only" in meta["classifiers"]
    assert "Operating System :: POSIX :: Linux" in meta["classifiers"]


@pytest.mark.parametrize("name", DISTRIBUTIONS)
def test_the_version_lives_only_in_pyproject(name: str) -> None:
    assert re.fullmatch(r"\d+\.\d+\.\d+", project(name)["version"])
    sources = (ROOT / "packages" / name / "src").rglob("*.py")
    assert [p for p in sources if "__version__" in p.read_text()] == []


def test_dependency_bounds_are_ranges_and_agree() -> None:
    bounds: dict[str, set[str]] = {}
    for name in DISTRIBUTIONS:
        for requirement in project(name)["dependencies"]:
            match = re.fullmatch(r"([a-z0-9-]+)(>=[0-9.]+,<[0-9.]+)", requirement)
            assert match is not None, f"{name}: {requirement} is not a >=,< range"
            dependency, spec = match.groups()
            bounds.setdefault(dependency, set()).add(spec)
    assert {d: len(s) for d, s in bounds.items() if len(s) > 1} == {}


def _imported_distributions(name: str) -> set[str]:
    """The distributions whose modules `name`'s own source imports, other than itself."""
    owners = {  # the most specific first
        "ficc.hoststate": "ficc-hoststate",
        "ficc.execution.host": "ficc-executor-host",
        "ficc.execution.provider": "ficc-provider-sdk",
        "ficc.execution": "ficc-protocol",
    }
    found: set[str] = set()
    for source in (ROOT / "packages" / name / "src").rglob("*.py"):
        for node in ast.walk(ast.parse(source.read_text())):
            if isinstance(node, ast.Import):
                modules = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                # `from ficc.execution import provider` imports ficc.execution.provider
                modules = [f"{node.module}.{alias.name}" for alias in node.names]
            else:
                continue
            for module in modules:
                top = module.split(".")[0]
                if top in sys.stdlib_module_names or top == "ficc_provider_podman":
                    continue
                owned = [o for m, o in owners.items() if f"{module}.".startswith(f"{m}.")]
                found.add(owned[0] if owned else top)
    return found - {name}


@pytest.mark.parametrize("name", DISTRIBUTIONS)
def test_every_distribution_a_package_imports_is_a_declared_dependency(name: str) -> None:
    """A wheel must not rely on another distribution pulling in what it imports itself."""
    declared = {re.split(r"[<>=]", r)[0] for r in project(name)["dependencies"]}
    assert _imported_distributions(name) - declared == set()


def _our_dependencies(name: str) -> set[str]:
    """Every distribution of this repository that installing `name` installs too."""
    needed: set[str] = set()
    for requirement in project(name)["dependencies"]:
        dependency = re.split(r"[<>=]", requirement)[0]
        if dependency in DISTRIBUTIONS and dependency not in needed:
            needed |= {dependency, *_our_dependencies(dependency)}
    return needed


def test_a_provider_installs_the_contract_without_the_daemon() -> None:
    """A provider needs the provider SDK and the plan types, never the root daemon."""
    assert _our_dependencies("ficc-provider-podman") == {"ficc-provider-sdk", "ficc-protocol"}
    assert _our_dependencies("ficc-provider-sdk") == {"ficc-protocol"}
    assert "ficc-provider-sdk" in _our_dependencies("ficc-executor-host")


def test_the_console_commands_are_declared() -> None:
    assert project("ficc-executor-host")["scripts"] == {
        "ficc-executor": "ficc.execution.host.commands:console_main"
    }
    assert project("ficc-hoststate")["scripts"] == {
        "ficc-hoststate": "ficc.hoststate.cli:console_main"
    }


def test_the_guides_install_lines_install_every_console_command() -> None:
    """docs/operations.md, "Installing": the `pip install` lines name the wheel of every
    released distribution, so every command its table lists (`ficc-hoststate` too) is
    there after the install."""
    guide = (ROOT / "docs" / "operations.md").read_text()
    section = guide.split("### Installing", 1)[1].split("\n### ", 1)[0]
    named = set(re.findall(r"\b(ficc_[a-z_]+)-\*\.whl", section))
    installed = {
        wheel
        for line in section.replace("\\\n", " ").splitlines()  # continued lines joined
        if "pip install" in line
        for wheel in re.findall(r"\b(ficc_[a-z_]+)-\*\.whl", line)
    }
    assert installed == named == {name.replace("-", "_") for name in DISTRIBUTIONS}


def test_the_podman_wheel_is_tagged_for_any_python_on_this_platform(tmp_path: Path) -> None:
    """It holds a static executable but no CPython extension: py3-none-<platform>."""
    subprocess.run(
        [sys.executable, "-m", "hatchling", "build", "-t", "wheel", "-d", str(tmp_path)],
        cwd=ROOT / "packages" / "ficc-provider-podman",
        check=True,
        capture_output=True,
    )
    (wheel,) = tmp_path.glob("*.whl")
    platform = sysconfig.get_platform().replace("-", "_").replace(".", "_")
    version = project("ficc-provider-podman")["version"]
    assert wheel.name == f"ficc_provider_podman-{version}-py3-none-{platform}.whl"
    with zipfile.ZipFile(wheel) as archive:
        names = archive.namelist()
        wheel_file = archive.read(next(n for n in names if n.endswith(".dist-info/WHEEL")))
    assert f"Tag: py3-none-{platform}" in wheel_file.decode()
    assert "Root-Is-Purelib: false" in wheel_file.decode()
    assert not [n for n in names if n.endswith(".so")]
    assert any(n.endswith("_bin/ficc-barrier") for n in names)
    assert any(n.endswith(".dist-info/licenses/LICENSE") for n in names)


def test_the_64_bit_count_is_defined_once() -> None:
    """`Count`, `Positive` and their bound live in ficc-protocol's plan module; every
    other distribution uses them instead of spelling the bound again."""
    spelt = re.compile(r"2\s*\*\*\s*63|1\s*<<\s*63|9223372036854775807")
    home = ROOT / "packages" / "ficc-protocol" / "src" / "ficc" / "execution" / "plan.py"
    again = [
        f"{path.relative_to(ROOT)}:{number}"
        for name in DISTRIBUTIONS
        for path in sorted((ROOT / "packages" / name / "src").rglob("*.py"))
        for number, line in enumerate(path.read_text().splitlines(), 1)
        if spelt.search(line) and path != home
    ]
    assert again == []
    assert spelt.search(home.read_text())


@pytest.mark.parametrize("name", DISTRIBUTIONS)
def test_every_source_file_of_a_distribution_is_in_its_wheel(name: str) -> None:
    """A module added beside the listed ones (the protocol lists its files one by one,
    since the host and the SDK share its namespace folder) ships in the wheel too."""
    package = ROOT / "packages" / name
    with (package / "pyproject.toml").open("rb") as file:
        build = tomllib.load(file)["tool"]["hatch"]["build"]["targets"]["wheel"]
    included = [package / entry for entry in build["only-include"]]
    sources = [p for p in (package / "src").rglob("*") if p.suffix in (".py", ".typed")]
    missing = [
        str(p.relative_to(package))
        for p in sources
        if "__pycache__" not in p.parts and not any(p == i or i in p.parents for i in included)
    ]
    assert missing == []


MODULE_MOST_LINES = 700
CLASS_MOST_LINES = 550


def test_no_module_or_class_grows_past_what_a_newcomer_reads_in_one_sitting() -> None:
    """Every module of every distribution's `src` stays within 700 lines and every class
    within 550: a file that grows past it is split along a seam, not allowed to grow."""
    too_long = []
    for path in sorted((ROOT / "packages").glob("*/src/**/*.py")):
        text = path.read_text()
        name = path.relative_to(ROOT)
        if text.count("\n") > MODULE_MOST_LINES:
            too_long.append(f"{name}: {text.count(chr(10))} lines")
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, ast.ClassDef):
                lines = (node.end_lineno or node.lineno) - node.lineno + 1
                if lines > CLASS_MOST_LINES:
                    too_long.append(f"{name}: class {node.name} {lines} lines")
    assert too_long == []
