"""The public surface of each controller-facing module is deliberate and pinned.

A name joins or leaves a module's `__all__` only by changing this file too, every
public name the module defines is in `__all__` (a helper is private or lives in the
executor's module), and every public class, function, method and property says what
it is for.
"""

from __future__ import annotations

import ast
import importlib
import inspect
import pathlib
from typing import Any

import pytest

EXPORTS: dict[str, list[str]] = {
    "plan": [
        "EMPTY_DIGEST", "MAX_ROWS", "PLAN_MAX_BYTES", "U63_MAX", "Count", "Digest", "Identity",
        "InputObject", "Job", "Limits", "Name", "Output", "Payload", "Plan", "PlanTooLarge",
        "Positive", "Runtime", "decode_plan", "digest_of", "encode_plan", "plan_digest",
    ],
    "protocol": [
        "ACKNOWLEDGED_MAX", "ACTIONS", "COLLECT_MAX_BYTES", "Control", "INPUT_CHUNK_LEGACY_BYTES",
        "INPUT_CHUNK_MAX_BYTES",
        "PROTOCOL_VERSION", "SENDERS", "ZERO_ID", "AnyRequest", "CheckSlotsRequest",
        "CollectRequest", "Fence",
        "InputStatusRequest", "InputWrite", "InputWriteRequest", "MetricsRequest", "ObjectName",
        "ObjectRef",
        "ObserveRequest", "OfferLimits", "PrepareAttempt", "PrepareRequest", "Read",
        "ReconcileAbsentRequest", "RejectAbsentRequest", "ReleaseRequest", "RenewRequest",
        "Renewal", "Request", "Resources", "Sender", "SetOfferRequest", "SnapshotRequest",
        "StartRequest", "StopRequest", "decode_request", "encode_request", "explain",
        "may_send", "validate_request",
    ],
    "wire": [
        "DETAIL_MAX", "METRICS_MAX_CHARS", "REASONS", "SLOTS_MAX", "SLOT_MESSAGE_MAX", "TERMINAL",
        "AnyReply", "AttemptResult",
        "AttemptRow",
        "AttemptStatus",
        "AttemptsReply", "Capacity", "Control", "DaemonInfo", "Error", "ErrorReply", "ErrorRow",
        "InputResult", "InputRow", "InputsReply", "MetricsReply", "Offer", "OfferReply",
        "Outcome",
        "PayloadUsage",
        "ProviderInfo", "ReadResult", "ReadRow", "ReadsReply", "Reply", "RunningVersion",
        "SlotClass", "SlotState", "SlotsReply", "SnapshotReply", "State", "Usage", "decode_reply",
        "encode_reply", "error_reply",
        "error_row",
        "read_envelope",
    ],
    "frames": ["HEADER", "REPLY_MAX", "REQUEST_MAX", "FrameDecoder", "FrameError", "encode_frame"],
    "client": [
        "Client", "ClientError", "ConnectFailed", "PeerCheck", "PeerCredentials", "PeerNotRoot",
        "Refused", "ReplyInvalid", "ReplyMismatch", "ReplyTooLarge", "ReplyTruncated",
        "RequestInvalid", "Timeout", "peer_credentials", "require_root_peer",
    ],
    "errors": ["ErrorCode", "ProtocolError"],
}  # fmt: skip

EXECUTOR_ONLY = [
    "receive_request",
    "ReceivedInputWrite",
    "ReceivedInputWriteRequest",
    "encode_frame_into",
    "read_frame",
    "write_frame",
    "check_rules",
    "check_plans",
    "CheckedIdentity",
    "CheckedDigest",
    "Chars",
    "PlanFault",
    "plan_digests",
    "canonical_b64decode",
]


def _module(name: str) -> Any:
    return importlib.import_module(f"ficc.execution.{name}")


def _defined_names(module: Any) -> set[str]:
    """Every top-level name the module's own source binds (classes, functions, constants)."""
    tree = ast.parse(pathlib.Path(module.__file__).read_text())
    names: set[str] = set()
    for node in tree.body:
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            names.add(node.name)
        elif isinstance(node, ast.Assign):
            for target in node.targets:
                names.update(n.id for n in ast.walk(target) if isinstance(n, ast.Name))
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            names.add(node.target.id)
    return {n for n in names if not n.startswith("_")}


@pytest.mark.parametrize("name", sorted(EXPORTS))
def test_each_module_exports_exactly_its_pinned_names(name: str) -> None:
    module = _module(name)
    assert sorted(module.__all__) == sorted(EXPORTS[name])
    assert len(set(module.__all__)) == len(module.__all__)
    for export in module.__all__:
        assert hasattr(module, export), export


@pytest.mark.parametrize("name", sorted(EXPORTS))
def test_every_public_name_a_module_defines_is_exported(name: str) -> None:
    module = _module(name)
    assert _defined_names(module) - set(module.__all__) == set()


@pytest.mark.parametrize("name", sorted(EXPORTS))
def test_star_import_gives_the_pinned_names(name: str) -> None:
    namespace: dict[str, Any] = {}
    exec(f"from ficc.execution.{name} import *", namespace)
    assert sorted(k for k in namespace if k != "__builtins__") == sorted(EXPORTS[name])


@pytest.mark.parametrize("name", sorted(EXPORTS))
def test_no_executor_only_name_is_reachable_from_a_controller_module(name: str) -> None:
    module = _module(name)
    assert [n for n in EXECUTOR_ONLY if hasattr(module, n)] == []


def _undocumented(owner: str, obj: Any) -> list[str]:
    missing: list[str] = []
    if not (inspect.getdoc(obj) or "").strip() or (inspect.isclass(obj) and obj.__doc__ is None):
        missing.append(owner)
    if inspect.isclass(obj):
        for attr, value in vars(obj).items():
            if attr.startswith("_"):
                continue
            if inspect.isfunction(value) or isinstance(value, property | staticmethod):
                target = value.__func__ if isinstance(value, staticmethod) else value
                if not (target.__doc__ or "").strip():
                    missing.append(f"{owner}.{attr}")
    return missing


@pytest.mark.parametrize("name", sorted(EXPORTS))
def test_every_public_class_and_function_has_a_docstring(name: str) -> None:
    module = _module(name)
    missing: list[str] = []
    for export in module.__all__:
        obj = getattr(module, export)
        if inspect.isclass(obj) or inspect.isfunction(obj):
            missing += _undocumented(export, obj)
    assert missing == []


def test_the_executor_module_has_what_the_executor_imports() -> None:
    executor = importlib.import_module("ficc.execution._executor")
    for export in executor.__all__:
        assert hasattr(executor, export), export
