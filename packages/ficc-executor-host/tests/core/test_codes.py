"""One error model: every code the host raises is an `ErrorCode` or a `HostCode` member.

A code spelt as a string literal is a new code nobody inventoried the day it is
misspelt; as a member it is a type error. The source walk below finds every function
and class of the host with a `code` parameter and refuses a literal in that place, and
a literal compared with an error's `code`.
"""

from __future__ import annotations

import ast
import pathlib
import re

import pytest

from ficc.execution import host
from ficc.execution.errors import ErrorCode
from ficc.execution.host.core.codes import HostCode

SOURCE = pathlib.Path(host.__file__).parent
CODE_PARAMETERS = {"code", "failed_code"}


def _modules() -> list[tuple[pathlib.Path, ast.Module]]:
    return [(path, ast.parse(path.read_text())) for path in sorted(SOURCE.rglob("*.py"))]


def _callee(call: ast.Call) -> str | None:
    func = call.func
    return func.id if isinstance(func, ast.Name) else getattr(func, "attr", None)


def _takes_a_code(modules: list[tuple[pathlib.Path, ast.Module]]) -> dict[str, tuple[int, str]]:
    """Name -> (position, keyword) of its code argument, for every function, method and
    class (through `__init__`) of the host that takes one."""
    found: dict[str, tuple[int, str]] = {}
    for _, tree in modules:
        for node in ast.walk(tree):
            if isinstance(node, ast.ClassDef):
                inits = [f for f in node.body if isinstance(f, ast.FunctionDef)]
                targets = [(node.name, f) for f in inits if f.name == "__init__"]
                bases = {getattr(b, "id", None) for b in node.bases}
                if not targets and bases & {"HostError", *found}:
                    found[node.name] = (0, "code")  # inherits HostError's signature
            elif isinstance(node, ast.FunctionDef):
                targets = [(node.name, node)]
            else:
                continue
            for name, function in targets:
                params = [a.arg for a in [*function.args.posonlyargs, *function.args.args]]
                if params and params[0] in {"self", "cls"}:
                    params = params[1:]
                for index, param in enumerate(params):
                    if param in CODE_PARAMETERS:
                        found[name] = (index, param)
    return found


def _literal_codes(node: ast.AST) -> list[str]:
    values = node.elts if isinstance(node, ast.Tuple | ast.List | ast.Set) else [node]
    return [v.value for v in values if isinstance(v, ast.Constant) and isinstance(v.value, str)]


def _code_literals() -> list[str]:
    modules = _modules()
    takes = _takes_a_code(modules)
    assert {"HostError", "storage_refusal", "open_trusted_directory"} <= set(takes)
    found: list[str] = []
    for path, tree in modules:
        where = path.relative_to(SOURCE)
        for node in ast.walk(tree):
            if isinstance(node, ast.Call) and _callee(node) in takes:
                index, keyword = takes[str(_callee(node))]
                args = [node.args[index]] if len(node.args) > index else []
                args += [k.value for k in node.keywords if k.arg == keyword]
                found += [f"{where}:{node.lineno} {v!r}" for a in args for v in _literal_codes(a)]
            elif isinstance(node, ast.Compare):
                sides = [node.left, *node.comparators]
                if any(isinstance(s, ast.Attribute) and s.attr == "code" for s in sides):
                    literals = [v for s in sides for v in _literal_codes(s)]
                    found += [f"{where}:{node.lineno} {v!r}" for v in literals]
    return found


def test_no_code_is_a_string_literal_in_the_host() -> None:
    assert _code_literals() == []


def test_the_walk_finds_a_literal_code(monkeypatch: pytest.MonkeyPatch) -> None:
    """The walk is not blind: a literal planted in a parsed module is found."""
    planted = ast.parse(
        'def f(error):\n    if error.code == "not_found":\n        raise HostError("x", "m")\n'
    )
    real = _modules

    def with_planted() -> list[tuple[pathlib.Path, ast.Module]]:
        return [*real(), (SOURCE / "planted.py", planted)]

    monkeypatch.setitem(globals(), "_modules", with_planted)
    assert _code_literals() == ["planted.py:2 'not_found'", "planted.py:3 'x'"]


def test_host_codes_and_protocol_codes_are_disjoint_names() -> None:
    assert {c.value for c in HostCode} & {c.value for c in ErrorCode} == set()
    for code in HostCode:
        assert re.fullmatch(r"[a-z][a-z0-9_]*", code.value)
        assert code.name == code.value.upper()
