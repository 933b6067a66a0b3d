"""The host's layers, as the README's architecture table states them, held by its code.

Each layer is a folder of the same name (the few top-level modules are the stable public
paths, placed in a layer by the table). Each module belongs to exactly one layer; it
imports only from its own layer and from the layers listed before it (lazy imports
inside functions included); and `core` stays pure: no `os`, `socket`, `sqlite3`,
`asyncio` or `ctypes`.
"""

from __future__ import annotations

import ast
import pathlib
import re
import subprocess
import sys

import pytest

from ficc.execution import host

SOURCE = pathlib.Path(host.__file__).parent
README = pathlib.Path(__file__).parents[1] / "README.md"
HOST = "ficc.execution.host"
IMPURE = {"os", "socket", "sqlite3", "asyncio", "ctypes"}


def module_name(path: pathlib.Path) -> str:
    """`ledger`, `service.systemd`; a package is its `__init__` (the root is `""`)."""
    parts = list(path.relative_to(SOURCE).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def imports_of(tree: ast.Module, modules: set[str]) -> tuple[set[str], set[str]]:
    """(host modules, other top-level modules) that `tree` imports, anywhere in it."""
    own: set[str] = set()
    other: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [f"{node.module}.{alias.name}" for alias in node.names] + [node.module]
        else:
            continue
        for name in names:
            if name == HOST or name.startswith(HOST + "."):
                rest = name[len(HOST) + 1 :]
                while rest and rest not in modules:
                    rest = rest.rpartition(".")[0]
                own.add(rest)
            else:
                other.add(name.split(".")[0])
    return own, other


def layers_of_readme(text: str) -> list[tuple[str, list[str]]]:
    """The table between `<!-- layers -->` and `<!-- /layers -->`: (layer, modules)."""
    body = text.split("<!-- layers -->", 1)[1].split("<!-- /layers -->", 1)[0]
    rows = [line for line in body.strip().splitlines() if line.startswith("|")][2:]
    table = []
    for row in rows:
        layer, modules, _what = (cell.strip() for cell in row.strip("|").split("|", 2))
        table.append((layer, re.findall(r"`([a-z_]+)/?`", modules)))
    return table


def violations(
    graph: dict[str, tuple[set[str], set[str]]], table: list[tuple[str, list[str]]]
) -> list[str]:
    """Every module without a layer or in two, every import that goes to a later layer,
    and every impure import of `core`."""
    rank: dict[str, int] = {}
    found: list[str] = []
    for index, (_, entries) in enumerate(table):
        for entry in entries:
            members = [m for m in graph if m == entry or m.startswith(entry + ".")]
            if not members:
                found.append(f"{entry}: in the table, not in the source")
            for member in members:
                if member in rank:
                    found.append(f"{member}: in two layers")
                rank[member] = index
    rank.setdefault("", 0)  # the package itself: a docstring
    for module in sorted(graph):
        if module not in rank:
            found.append(f"{module}: in no layer of the table")
            continue
        own, other = graph[module]
        for target in sorted(own):
            if rank.get(target, -1) > rank[module]:
                layer, target_layer = table[rank[module]][0], table[rank[target]][0]
                found.append(f"{module} ({layer}) imports {target} ({target_layer})")
        if table[rank[module]][0] == "core":
            found += [f"{module} (core) imports {name}" for name in sorted(other & IMPURE)]
    return found


def _source_graph() -> dict[str, tuple[set[str], set[str]]]:
    paths = sorted(SOURCE.rglob("*.py"))
    modules = {module_name(path) for path in paths}
    return {module_name(p): imports_of(ast.parse(p.read_text()), modules) for p in paths}


@pytest.fixture(scope="module")
def table() -> list[tuple[str, list[str]]]:
    if not README.exists():
        pytest.skip(f"{README} is not part of this tree")
    return layers_of_readme(README.read_text())


def test_every_module_is_in_one_layer_and_imports_only_from_the_layers_before_it(
    table: list[tuple[str, list[str]]],
) -> None:
    assert [layer for layer, _ in table][:2] == ["core", "linux"]
    assert violations(_source_graph(), table) == []


def test_a_wrong_way_import_an_impure_core_and_a_missing_module_are_each_found() -> None:
    table = [("core", ["a"]), ("linux", ["b"]), ("cli", ["c", "gone"])]
    graph = {
        "": (set(), set()),
        "a": ({"c"}, {"os", "msgspec"}),
        "b": ({"a"}, {"os"}),
        "c": ({"a", "b"}, set()),
        "d": (set(), set()),
    }
    assert violations(graph, table) == [
        "gone: in the table, not in the source",
        "a (core) imports c (cli)",
        "a (core) imports os",
        "d: in no layer of the table",
    ]


def test_lazy_imports_count() -> None:
    tree = ast.parse("def f():\n    from ficc.execution.host.service import bpfdevices\n")
    own, _ = imports_of(tree, {"service", "service.bpfdevices"})
    assert own == {"service.bpfdevices", "service"}


PUBLIC_TOP_LEVEL = {"sdk", "commands", "conformance"}


def test_each_layer_is_its_folder_and_the_top_level_holds_only_public_paths(
    table: list[tuple[str, list[str]]],
) -> None:
    folders = sorted(p.parent.name for p in SOURCE.glob("*/__init__.py"))
    assert folders == sorted(layer for layer, _ in table)
    for layer, entries in table:
        assert layer in entries, f"the {layer} row does not list its folder `{layer}/`"
    top = {p.stem for p in SOURCE.glob("*.py")} - {"__init__"}
    assert top == PUBLIC_TOP_LEVEL


def test_importing_the_configuration_model_loads_no_kernel_adapter() -> None:
    """`Config` is read by tools, the demo and the test kit; it must not drag in the
    /proc readers, seccomp's ctypes or SQLite."""
    probe = (
        "import sys, ficc.execution.host.config.model\n"
        "print(' '.join(sorted(m for m in sys.modules if m.startswith('ficc.execution.host.')"
        " or m in ('ctypes', 'sqlite3'))))"
    )
    loaded = subprocess.run(
        [sys.executable, "-I", "-c", probe], check=True, capture_output=True, text=True
    ).stdout.split()
    assert "ficc.execution.host.config.model" in loaded
    assert not {"ctypes", "sqlite3", "ficc.execution.host.linux.procfs"} & set(loaded)
    assert not [m for m in loaded if m.startswith(("ficc.execution.host.storage",))]
