"""The character rules and cross-field rules of a plan, checked per batch.

Private to ficc-protocol and the executor: a controller uses `ficc.execution.plan`,
whose public decoding paths apply these rules for it.

msgspec checks a `Meta(pattern=...)` by calling Python's `re` once per value, about
0.3 us each; one 64-row `prepare` carries some 2,500 plan strings, so per-value
patterns cost more than decoding the whole frame. The plan's string types therefore
carry their lengths in `Meta` (checked by msgspec in C) plus a `Chars` rule, and
`check_plans` applies each rule to all the values of a batch at once.
"""

from __future__ import annotations

import hashlib
import operator
import re
import typing
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass
from itertools import chain, repeat
from operator import attrgetter, itemgetter, methodcaller
from typing import TYPE_CHECKING, Annotated, Any, Literal

import msgspec

if TYPE_CHECKING:
    from ficc.execution.plan import InputObject, Plan


@dataclass(frozen=True, eq=False)
class Chars:
    """A character rule: `pattern` is the rule; `screen` checks many values at once.

    `screen` never passes a value that breaks `pattern` (given the type's length bounds),
    but may refuse good ones (it errs on the safe side for, say, non-ASCII output paths):
    only then is `pattern` run value by value, to accept them or to name the first bad one.
    Patterns are anchored with \\A and \\Z (not ^ and $: `$` also matches before a newline).
    """

    pattern: str
    screen: Callable[[list[str]], bool]

    def matches(self, value: str) -> bool:
        return re.search(self.pattern, value) is not None

    def complaint(self) -> str:
        """The words msgspec uses for a pattern mismatch (so `explain` names the pattern)."""
        return f"Expected `str` matching regex {self.pattern!r}"


def _utf8(values: Iterable[str]) -> bytes:
    return "".join(values).encode("utf-8", "surrogatepass")


def _only(allowed: str, first: str | None = None) -> Callable[[list[str]], bool]:
    """Every character in `allowed`, and each value's first one in `first`."""
    table, initials = allowed.encode(), (first or "").encode()

    def screen(values: list[str]) -> bool:
        if _utf8(values).translate(None, table):
            return False
        try:
            return first is None or not _utf8(map(itemgetter(0), values)).translate(None, initials)
        except IndexError:  # an empty value: let the exact pattern refuse it
            return False

    return screen


def _prefixed_hex(prefix: str, digits: int) -> Callable[[list[str]], bool]:
    """`prefix` then `digits` lowercase hex characters, for values of exactly that length."""
    size = len(prefix) + digits
    residue = prefix.encode().translate(None, _HEX.encode())

    def screen(values: list[str]) -> bool:
        joined = "".join(values)
        if len(joined) != size * len(values):
            return False
        if any(joined[k::size] != c * len(values) for k, c in enumerate(prefix)):
            return False
        # With each prefix in place, only the prefixes' non-hex characters may remain.
        return _utf8([joined]).translate(None, _HEX.encode()) == residue * len(values)

    return screen


def _no_nul(values: list[str]) -> bool:
    return "\x00" not in "".join(values)


_CONTROLS = bytes([*range(0x20), 0x7F])
_NOT_CONTROLS = bytes(b for b in range(256) if b not in _CONTROLS)
# Each value sits between newlines; none of these may then appear.
_BAD_PATH_PARTS = ("\n\n", "\n/", "/\n", "//", "\n./", "\n.\n", "/./", "/.\n", "\n../",
                   "\n..\n", "/../", "/..\n")  # fmt: skip


def _relative_paths(values: list[str]) -> bool:
    """No control character, no empty, `.` or `..` component, no leading/trailing `/`."""
    text = "\n" + "\n".join(values) + "\n"
    data = _utf8([text])
    # Newlines are only ours; C1 controls are UTF-8 0xC2 0x80-0x9F: any 0xC2 goes slow.
    if data.translate(None, _NOT_CONTROLS) != b"\n" * (len(values) + 1) or b"\xc2" in data:
        return False
    return not any(map(text.__contains__, _BAD_PATH_PARTS))


_HEX = "0123456789abcdef"
_LOWER = "abcdefghijklmnopqrstuvwxyz"
_UPPER = _LOWER.upper()
_DIGITS = "0123456789"

IDENTITY = Chars(r"\A[0-9a-f]{32}\Z", _only(_HEX))
DIGEST = Chars(r"\Asha256:[0-9a-f]{64}\Z", _prefixed_hex("sha256:", 64))
NAME = Chars(r"\A[a-z][a-z0-9_.-]{0,79}\Z", _only(_LOWER + _DIGITS + "_.-", _LOWER))
EXEC_STRING = Chars(r"\A[^\x00]*\Z", _no_nul)
ENV_NAME = Chars(
    r"\A[A-Za-z_][A-Za-z0-9_]{0,127}\Z",
    _only(_LOWER + _UPPER + _DIGITS + "_", _LOWER + _UPPER + "_"),
)
INPUT_NAME = Chars(
    r"\A[A-Za-z0-9][A-Za-z0-9_.-]{0,127}\Z",
    _only(_LOWER + _UPPER + _DIGITS + "_.-", _LOWER + _UPPER + _DIGITS),
)
# Relative, normalized (no empty, `.` or `..` component, no leading or trailing `/`),
# no C0/C1 control characters.
_COMPONENT = r"(?!\.\.?(?:/|\Z))[^/\x00-\x1f\x7f-\x9f]+"
OUTPUT_PATH = Chars(rf"\A{_COMPONENT}(?:/{_COMPONENT})*\Z", _relative_paths)


def lengths(rule: Chars, min_length: int, max_length: int | None = None) -> msgspec.Meta:
    """The Meta of a plan string: lengths for msgspec, the pattern for JSON Schema only."""
    return msgspec.Meta(
        min_length=min_length, max_length=max_length, extra_json_schema={"pattern": rule.pattern}
    )


EMPTY_DIGEST = "sha256:" + hashlib.sha256(b"").hexdigest()
"""The digest of zero bytes: the only digest an empty object may declare."""

CheckedIdentity = Annotated[str, lengths(IDENTITY, 32, 32), IDENTITY]
"""An `Identity` whose pattern `check_rules` checks per batch, for hot rows."""
CheckedDigest = Annotated[str, lengths(DIGEST, 71, 71), DIGEST]
"""A `Digest` whose pattern `check_rules` checks per batch, for hot rows."""


class PlanFault(ValueError):
    """The first broken rule in a batch of plans: which plan, and msgspec-style words.

    `error` reads like a msgspec.ValidationError ("... - at `$.job.name`", paths from
    the plan's root) so that callers report it exactly like any other decoding error.
    """

    def __init__(self, index: int, error: str) -> None:
        super().__init__(error)
        self.index = index
        self.error = error


def check_plans(plans: Sequence[Plan]) -> None:
    """Apply every `Chars` rule and every rule across fields to a batch of decoded plans.

    Fast path: each rule screens all the batch's values at once. Only if a screen
    fails are the plans walked one by one, in order, to raise PlanFault for the first
    real violation (or to find the screen was merely cautious).
    """
    from ficc.execution.plan import Plan  # noqa: PLC0415 (plan imports this module)

    plans = list(plans)
    if _screen(plans, Plan) and _cross_fields_hold(plans):
        return
    for index, plan in enumerate(plans):
        error = _first_break(plan, Plan, "$") or _cross_field_break(plan)
        if error is not None:
            raise PlanFault(index, error)


def check_rules(objects: Sequence[Any], cls: type) -> None:
    """Apply the `Chars` rules of struct type `cls` to a batch of decoded `objects`.

    For request rows outside a plan (a lease's fence, for example); `check_plans` does
    this and more for plans. Raises PlanFault for the first value that breaks its rule.
    """
    objects = list(objects)
    if _screen(objects, cls):
        return
    for index, obj in enumerate(objects):
        error = _first_break(obj, cls, "$")
        if error is not None:
            raise PlanFault(index, error)


@dataclass(frozen=True)
class _Field:
    """One field of a struct that holds strings under a rule, or structs that do."""

    name: str
    get: Callable[[Any], Any]
    kind: Literal["str", "strs", "dict", "struct", "structs"]
    rule: Chars | None = None  # of the value(s)
    key_rule: Chars | None = None  # of a dict's keys
    struct: type | None = None


def _rule_of(annotation: Any) -> Chars | None:
    metadata = getattr(annotation, "__metadata__", ())
    return next((m for m in metadata if isinstance(m, Chars)), None)


def _bare(annotation: Any) -> Any:
    return getattr(annotation, "__origin__", annotation) if _annotated(annotation) else annotation


def _annotated(annotation: Any) -> bool:
    return hasattr(annotation, "__metadata__")


def _mentions_rule(annotation: Any) -> bool:
    """Whether a Chars rule hides anywhere in `annotation` (e.g. in `X | None`)."""
    if _rule_of(annotation) is not None:
        return True
    return any(_mentions_rule(arg) for arg in typing.get_args(_bare(annotation)))


_FIELDS: dict[type, list[_Field]] = {}


def _fields(cls: type) -> list[_Field]:
    """The rule-bearing fields of a struct, read once from its annotations."""
    if cls in _FIELDS:
        return _FIELDS[cls]
    hints = typing.get_type_hints(cls, include_extras=True)
    found: list[_Field] = []
    for name in cls.__struct_fields__:  # type: ignore[attr-defined]
        hint, get = hints[name], attrgetter(name)
        bare = _bare(hint)
        origin, args = typing.get_origin(bare), typing.get_args(bare)
        if isinstance(bare, type) and issubclass(bare, msgspec.Struct):
            found.append(_Field(name, get, "struct", struct=bare))
        elif _rule_of(hint) is not None:
            found.append(_Field(name, get, "str", rule=_rule_of(hint)))
        elif origin is list and isinstance(args[0], type) and issubclass(args[0], msgspec.Struct):
            found.append(_Field(name, get, "structs", struct=args[0]))
        elif origin is list and _rule_of(args[0]) is not None:
            found.append(_Field(name, get, "strs", rule=_rule_of(args[0])))
        elif origin is dict:
            found.append(_Field(name, get, "dict", _rule_of(args[1]), _rule_of(args[0])))
        elif _mentions_rule(hint):
            raise TypeError(f"{cls.__name__}.{name}: a Chars rule inside an unsupported type")
    _FIELDS[cls] = found
    return found


def _collect(objects: list[Any], cls: type, into: dict[Chars, list[str]]) -> None:
    """Gather every ruled string of `objects` (all of type `cls`) by rule, in C loops."""
    for field in _fields(cls):
        values = map(field.get, objects)
        if field.kind == "struct":
            _collect(list(values), field.struct, into)  # type: ignore[arg-type]
        elif field.kind == "structs":
            _collect(list(chain.from_iterable(values)), field.struct, into)  # type: ignore[arg-type]
        elif field.kind == "str" and field.rule is not None:
            into.setdefault(field.rule, []).extend(values)
        elif field.kind == "strs" and field.rule is not None:
            into.setdefault(field.rule, []).extend(chain.from_iterable(values))
        elif field.kind == "dict":
            dicts = list(values)
            if field.key_rule is not None:
                into.setdefault(field.key_rule, []).extend(chain.from_iterable(dicts))
            if field.rule is not None:
                items = chain.from_iterable(map(dict.values, dicts))
                into.setdefault(field.rule, []).extend(items)


def _screen(objects: list[Any], cls: type) -> bool:
    gathered: dict[Chars, list[str]] = {}
    _collect(objects, cls, gathered)
    return all(rule.screen(values) for rule, values in gathered.items() if values)


def _first_break(obj: Any, cls: type, path: str) -> str | None:
    """The first value of `obj` (in field order) that breaks its rule, msgspec-style."""
    for field in _fields(cls):
        value, here = field.get(obj), f"{path}.{field.name}"
        rule = field.rule
        if field.kind == "struct":
            error = _first_break(value, field.struct, here)  # type: ignore[arg-type]
            if error is not None:
                return error
        elif field.kind == "structs":
            for i, item in enumerate(value):
                error = _first_break(item, field.struct, f"{here}[{i}]")  # type: ignore[arg-type]
                if error is not None:
                    return error
        elif field.kind == "str" and rule is not None and not rule.matches(value):
            return f"{rule.complaint()} - at `{here}`"
        elif field.kind == "strs" and rule is not None:
            for i, item in enumerate(value):
                if not rule.matches(item):
                    return f"{rule.complaint()} - at `{here}[{i}]`"
        elif field.kind == "dict":
            for key, item in value.items():
                if field.key_rule is not None and not field.key_rule.matches(key):
                    return f"{field.key_rule.complaint()} - at `key` in `{here}`"
                if rule is not None and not rule.matches(item):
                    return f"{rule.complaint()} - at `{here}[...]`"
    return None


_ARGV0 = attrgetter("job.payload.argv")
_DEVICES = attrgetter("job.limits.devices")
_INPUTS = attrgetter("job.inputs")
_OUTPUTS = attrgetter("job.outputs")
_ID, _NAME, _PATH = attrgetter("id"), attrgetter("name"), attrgetter("path")
_BYTES, _DIGEST = attrgetter("bytes"), attrgetter("digest")
_IS_ABSOLUTE = methodcaller("startswith", "/")


def _all_distinct(groups: list[list[Any]], key: Callable[[Any], Any] | None = None) -> bool:
    """Whether each group's values (or `key` of them) are distinct, without a Python loop."""
    keyed = groups if key is None else map(map, repeat(key), groups)
    return list(map(len, map(set, keyed))) == list(map(len, groups))


def _cross_fields_hold(plans: list[Plan]) -> bool:
    """The rules across fields for a whole batch at once (see `_cross_field_break`)."""
    inputs, outputs = list(map(_INPUTS, plans)), list(map(_OUTPUTS, plans))
    flat = list(chain.from_iterable(inputs))
    ids = list(map(_ID, flat))
    return (
        all(map(_IS_ABSOLUTE, map(itemgetter(0), map(_ARGV0, plans))))
        and _all_distinct(list(map(_DEVICES, plans)))
        # IDs distinct over the whole batch are distinct within each plan.
        and (len(set(ids)) == len(ids) or _all_distinct(inputs, _ID))
        and _all_distinct(inputs, _NAME)
        and _all_distinct(outputs, _NAME)
        and _all_distinct(outputs, _PATH)
        and _empty_objects_agree(flat)
    )


def _empty_objects_agree(inputs: list[InputObject]) -> bool:
    """0 bytes exactly when the digest is EMPTY_DIGEST (quick when neither occurs)."""
    sizes, digests = list(map(_BYTES, inputs)), list(map(_DIGEST, inputs))
    if 0 not in sizes and EMPTY_DIGEST not in digests:
        return True
    return list(map(operator.not_, sizes)) == list(map(EMPTY_DIGEST.__eq__, digests))


def _repeated(values: list[str], what: str) -> str | None:
    seen: set[str] = set()
    for value in values:
        if value in seen:
            return f"{what} {value!r} appears more than once"
        seen.add(value)
    return None


def _cross_field_break(plan: Plan) -> str | None:
    """The first rule across fields that `plan` breaks, msgspec-style, or None."""
    job = plan.job
    for i, item in enumerate(job.inputs):
        if (item.bytes == 0) != (item.digest == EMPTY_DIGEST):
            problem = "an object has 0 bytes exactly when its digest is SHA-256 of nothing"
            return f"{problem} - at `$.job.inputs[{i}]`"
    device = _repeated(job.limits.devices, "device")
    if device is not None:
        return f"{device} - at `$.job.limits`"
    if not job.payload.argv[0].startswith("/"):
        return "argv[0] must be an absolute path - at `$.job.payload`"
    for values, what in (
        ([i.id for i in job.inputs], "input id"),
        ([i.name for i in job.inputs], "input name"),
        ([o.name for o in job.outputs], "output name"),
        ([o.path for o in job.outputs], "output path"),
    ):
        repeated = _repeated(values, what)
        if repeated is not None:
            return f"{repeated} - at `$.job`"
    return None


# --- when a decoded struct checks itself ----------------------------------------------

_DEFERRED: ContextVar[bool] = ContextVar("ficc_execution_checks_deferred", default=False)


def checks_deferred() -> bool:
    """Whether a self-checking struct (a plan, a renewal) leaves its checks to its batch."""
    return _DEFERRED.get()


@contextmanager
def deferred_checks() -> Iterator[None]:
    """Decode a batch whose container checks every plan and renewal at once.

    Only the request decoders (and `decode_plan`) use this: each of them applies
    `check_plans` / `check_rules` to what it decoded before returning it, so the
    result is the same as each struct checking itself, at a fraction of the cost.
    """
    token = _DEFERRED.set(True)
    try:
        yield
    finally:
        _DEFERRED.reset(token)


__all__ = [
    "DIGEST",
    "EMPTY_DIGEST",
    "ENV_NAME",
    "EXEC_STRING",
    "IDENTITY",
    "INPUT_NAME",
    "NAME",
    "OUTPUT_PATH",
    "Chars",
    "CheckedDigest",
    "CheckedIdentity",
    "PlanFault",
    "check_plans",
    "check_rules",
    "checks_deferred",
    "deferred_checks",
    "lengths",
]
