"""The provider contract's public surface is deliberate, documented and light to import.

A name joins or leaves `__all__` only by changing this file too; every public name the
module defines is exported and says what it is for; and importing the contract loads
neither the daemon nor anything the daemon needs beyond msgspec and the plan types.
"""

from __future__ import annotations

import ast
import inspect
import pathlib
import subprocess
import sys
from typing import Any

from ficc.execution import provider

EXPORTS = [
    "API_VERSION", "MAX_BATCH", "METHODS", "BarrierSpec", "CollectReply", "Context",
    "DeviceOpen", "FileIdentity", "GeneratedTarget", "Identity", "InputCapability", "Logs",
    "MinimumLimits", "MountSpec", "Observation", "PrepareContext", "PrepareResult",
    "PreparedDevice", "ProbeReply", "Refusal", "Refused", "ReleaseReply", "Reply",
    "SLOT_FILES_STUCK", "Slot", "StartReply", "StopReply", "StorageBinding", "Supervisor",
    "decode_minimum_limits", "decode_reply", "refusal", "reply",
]  # fmt: skip


def test_the_contract_exports_exactly_its_pinned_names() -> None:
    assert sorted(provider.__all__) == sorted(EXPORTS)
    assert len(set(provider.__all__)) == len(provider.__all__)
    namespace: dict[str, Any] = {}
    exec("from ficc.execution.provider import *", namespace)
    assert sorted(k for k in namespace if k != "__builtins__") == sorted(EXPORTS)


def test_every_public_name_the_module_defines_is_exported() -> None:
    tree = ast.parse(pathlib.Path(provider.__file__).read_text())
    defined: set[str] = set()
    for node in tree.body:
        if isinstance(node, ast.FunctionDef | ast.ClassDef):
            defined.add(node.name)
        elif isinstance(node, ast.Assign):
            defined.update(
                n.id for t in node.targets for n in ast.walk(t) if isinstance(n, ast.Name)
            )
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            defined.add(node.target.id)
    assert {n for n in defined if not n.startswith("_")} - set(EXPORTS) == set()


def test_every_public_class_function_method_and_property_says_what_it_is_for() -> None:
    missing: list[str] = []
    for name in EXPORTS:
        value = getattr(provider, name)
        if not (inspect.isclass(value) or inspect.isfunction(value)):
            continue
        if not (value.__doc__ or "").strip():
            missing.append(name)
        if inspect.isclass(value):
            for attr, member in vars(value).items():
                if attr.startswith("_") or not (
                    inspect.isfunction(member) or isinstance(member, property)
                ):
                    continue
                if not (member.__doc__ or "").strip():
                    missing.append(f"{name}.{attr}")
    assert missing == []


_LOADED = """
import sys
import ficc.execution.provider
print("\\n".join(sorted(sys.modules)))
"""


def test_importing_the_contract_loads_no_part_of_the_daemon() -> None:
    """What a provider pays to import its contract: msgspec and the plan types, never the
    root daemon, its event loop or its stores (run in a fresh interpreter)."""
    loaded = subprocess.run(
        [sys.executable, "-I", "-c", _LOADED], capture_output=True, text=True, check=True
    ).stdout.split()
    assert "ficc.execution.plan" in loaded
    heavy = ("ficc.execution.host", "ficc.hoststate", "uvloop", "pybase64", "sqlite3", "asyncio")
    assert [m for m in loaded if m.startswith(heavy)] == []
