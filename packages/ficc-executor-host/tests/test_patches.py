"""A test that patches a host module patches the module that defines the name.

Modules import names from each other (`from ficc.execution.host.cli.serve import
checked_config`); patching such a name where it is merely imported changes nothing the
code under test calls, and the test then proves nothing. This walk finds every
`monkeypatch.setattr(module, "name", ...)` in the tests whose module is a host module and
refuses it unless that module defines `name` itself (or imported it as a whole module).
"""

from __future__ import annotations

import ast
import importlib
import importlib.util
import pathlib
import types

TESTS = pathlib.Path(__file__).parent
HOST = "ficc.execution.host"
USED_WHERE_IMPORTED = {
    ("ficc.execution.host.runner.starting", "observation_of"): (
        "the start pipeline calls its own import; the test changes only what starts read"
    ),
}
"""Patches of an imported name that are meant: the patched module is the one whose
calls the test changes, and no other."""


def _defined(module: str) -> set[str]:
    """Top-level names a module defines, or binds to a whole module by `import x` (a
    patch of `module.os` changes what that module calls), but not the names it takes
    from another module with `from x import y`."""
    spec = importlib.util.find_spec(module)
    assert spec is not None
    assert spec.origin is not None
    tree = ast.parse(pathlib.Path(spec.origin).read_text())
    names: set[str] = set()
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, ast.Assign):
            for target in node.targets:
                names.update(n.id for n in ast.walk(target) if isinstance(n, ast.Name))
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            names.add(node.target.id)
        elif isinstance(node, ast.Import):
            names.update((a.asname or a.name).split(".")[0] for a in node.names)
    return names


def _host_modules(tree: ast.Module) -> dict[str, str]:
    """Local name -> host module, for `from ficc.execution.host.X import Y [as Z]` where
    Y is a module."""
    bound: dict[str, str] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith(HOST):
            parent = importlib.import_module(node.module)
            for alias in node.names:
                if not isinstance(
                    getattr(parent, alias.name, None), (types.ModuleType, type(None))
                ):
                    continue  # a class or a function, not a module
                if importlib.util.find_spec(f"{node.module}.{alias.name}") is not None:
                    bound[alias.asname or alias.name] = f"{node.module}.{alias.name}"
    return bound


def misplaced_patches(source: str) -> list[str]:
    tree = ast.parse(source)
    modules = _host_modules(tree)
    found = []
    for node in ast.walk(tree):
        if not (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute)
            and node.func.attr == "setattr"
            and len(node.args) >= 2
            and isinstance(node.args[0], ast.Name)
            and isinstance(node.args[1], ast.Constant)
        ):
            continue
        module = modules.get(node.args[0].id)
        name = node.args[1].value
        if module is None or (module, name) in USED_WHERE_IMPORTED:
            continue
        if name not in _defined(module):
            found.append(f"line {node.lineno}: {module} does not define {name}")
    return found


def test_every_patched_name_is_patched_where_it_is_defined() -> None:
    found = {
        path.name: problems
        for path in sorted(TESTS.rglob("*.py"))
        if (problems := misplaced_patches(path.read_text()))
    }
    assert found == {}


def test_a_patch_of_an_imported_name_is_found() -> None:
    source = (
        "from ficc.execution.host.cli import commands\n"
        "def test(monkeypatch):\n"
        "    monkeypatch.setattr(commands, 'checked_config', None)\n"
        "    monkeypatch.setattr(commands, 'main', None)\n"
    )
    assert misplaced_patches(source) == [
        "line 3: ficc.execution.host.cli.commands does not define checked_config"
    ]
