"""Loading a configuration: the bounded, trusted read of its file, the strict decode
(JSON or TOML, no duplicate keys, no constants), refusals that name the key and the fix,
then the rules across fields."""

from __future__ import annotations

import difflib
import json
import posixpath
import re
import tomllib
import typing
from typing import Any

import msgspec
import msgspec.inspect

from ficc.execution.host.config.model import ABSOLUTE_PATH, Config
from ficc.execution.host.config.rules import check_rules
from ficc.execution.host.config.trusted import read_trusted_file, refuse
from ficc.execution.host.core.codes import HostCode
from ficc.execution.host.core.errors import HostError
from ficc.execution.host.core.records import UUID_PATTERN
from ficc.execution.plan import Digest, Identity, Name

MAX_CONFIG_BYTES = 1 << 20


def load_config(path: str) -> Config:
    """Read the configuration file at the absolute `path` safely, then parse it."""
    suffix = posixpath.splitext(path)[1]
    if suffix not in (".json", ".toml"):
        raise refuse(
            HostCode.CONFIG_INVALID, path, "the file name must end in .json or .toml", "rename it"
        )
    return parse_config(read_trusted_file(path, MAX_CONFIG_BYTES), suffix)


def parse_config(data: bytes, suffix: str) -> Config:
    """Decode JSON or TOML bytes into a `Config` and apply every cross-field rule."""
    raw = _decode_document(data, suffix)
    try:
        config = msgspec.convert(raw, Config)
    except msgspec.ValidationError as error:
        raise _schema_refusal(str(error)) from None
    check_rules(config)
    return config


def _decode_document(data: bytes, suffix: str) -> object:
    try:
        text = data.decode("utf-8")
        if suffix == ".toml":
            return tomllib.loads(text)
        if suffix == ".json":
            return json.loads(
                text, object_pairs_hook=_refuse_duplicate_keys, parse_constant=_refuse_constant
            )
    except (UnicodeDecodeError, ValueError) as error:  # JSONDecodeError, TOMLDecodeError
        problem = f"not valid {suffix[1:]}: {error}"
        raise refuse(HostCode.CONFIG_INVALID, "top level", problem, "fix the syntax") from None
    except RecursionError:
        problem = f"not valid {suffix[1:]}: nested too deeply"
        raise refuse(HostCode.CONFIG_INVALID, "top level", problem, "fix the syntax") from None
    raise refuse(
        HostCode.CONFIG_INVALID, "top level", f"unknown format {suffix!r}", "use .json or .toml"
    )


def _refuse_duplicate_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """A key given twice would hide one value from the reviewer, so refuse it."""
    result: dict[str, Any] = {}
    for key, value in pairs:
        if key in result:
            raise ValueError(f"key {key!r} appears twice in one object")
        result[key] = value
    return result


def _refuse_constant(name: str) -> object:
    raise ValueError(f"{name} is not a JSON number")


_SCHEMA_LOCATION = re.compile(r"^(?P<problem>.*?)(?: - at `\$(?P<key>[^`]*)`)?$", re.DOTALL)
_PATTERN_PROBLEM = re.compile(r"^Expected `str` matching regex '(?P<regex>.*)'$", re.DOTALL)
_ENUM_PROBLEM = re.compile(r"^Invalid enum value (?P<value>.*)$", re.DOTALL)


def _pattern_of(annotated: object) -> str:
    (meta,) = [m for m in typing.get_args(annotated)[1:] if isinstance(m, msgspec.Meta)]
    assert meta.pattern is not None
    return meta.pattern


_PATTERN_NAMES = {
    _pattern_of(Identity): "an identity (32 lowercase hexadecimal digits)",
    _pattern_of(Digest): "a digest (sha256: and 64 lowercase hexadecimal digits)",
    _pattern_of(Name): "a name (a lowercase letter, then up to 79 of a-z, 0-9, '_', '.', '-')",
    ABSOLUTE_PATH: "an absolute path (starting with /, no control characters)",
    UUID_PATTERN: (
        "a filesystem UUID (xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx, lowercase hexadecimal,"
        " as `blkid` or `ficc-executor provision-slot` prints it)"
    ),
}


def _schema_refusal(detail: str) -> HostError:
    """Turn msgspec's 'problem - at `$.slots[2].uid`' into 'slots[2].uid: problem; fix'.

    A pattern mismatch names the expected type rather than printing its regex, and an
    invalid enum value lists the allowed values.
    """
    match = _SCHEMA_LOCATION.match(detail)
    assert match is not None  # the pattern matches every string
    key = (match["key"] or "").lstrip(".") or "top level"
    problem = _readable_problem(match["problem"], key)
    if "unknown field" in problem:
        fix = _unknown_key_fix(problem, key)
    elif "missing required field" in problem:
        fix = "add it"
    else:
        fix = "fix this value"
    return refuse(
        HostCode.CONFIG_INVALID, key, problem, f"{fix}; docs/configuration.md lists every key"
    )


def _readable_problem(problem: str, key: str) -> str:
    pattern = _PATTERN_PROBLEM.match(problem)
    if pattern is not None:
        regex = pattern["regex"].encode().decode("unicode_escape")
        return f"expected {_PATTERN_NAMES.get(regex, 'a string of the documented form')}"
    enum = _ENUM_PROBLEM.match(problem)
    if enum is not None:
        allowed = _allowed_values(key)
        if allowed:
            return f"{enum['value']} is not one of {', '.join(allowed)}"
    return problem


_UNKNOWN_FIELD = re.compile(r"unknown field `(?P<name>[^`]*)`")


def _unknown_key_fix(problem: str, key: str) -> str:
    """What to do about an unknown key: the closest known key of the same object when
    one is close (a misspelling is the usual cause), else remove it."""
    found = _UNKNOWN_FIELD.search(problem)
    node = _type_at("" if key == "top level" else key)
    if found is not None and isinstance(node, msgspec.inspect.StructType):
        known = [f.encode_name for f in node.fields]
        close = difflib.get_close_matches(found["name"], known, n=1, cutoff=0.6)
        if close:
            return f"did you mean {close[0]!r}? Correct its spelling or remove it"
    return "remove it or correct its spelling (unknown keys are refused)"


def _type_at(key: str) -> Any:
    """The type (`msgspec.inspect`) at a key path such as `slots[0]`; None when the path
    leads nowhere in `Config`."""
    node: Any = msgspec.inspect.type_info(Config)
    for token in re.findall(r"[^.\[\]]+", key):
        while isinstance(node, msgspec.inspect.Metadata):
            node = node.type
        if isinstance(node, msgspec.inspect.StructType):
            fields = {f.encode_name: f.type for f in node.fields}
            if token not in fields:
                return None
            node = fields[token]
        elif isinstance(node, (msgspec.inspect.VarTupleType, msgspec.inspect.ListType)):
            node = node.item_type
        else:
            return None
    while isinstance(node, msgspec.inspect.Metadata):
        node = node.type
    return node


def _allowed_values(key: str) -> list[str]:
    """The literal values allowed at a key path such as `initial_offer.control`."""
    node = _type_at(key)
    if isinstance(node, msgspec.inspect.LiteralType):
        return [json.dumps(value) for value in node.values]
    return []
