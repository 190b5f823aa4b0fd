"""Reading a checkpoint's JSON config files: one error type, and typed access to a field
that names its dotted path when it is missing or malformed."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

__all__ = ["CheckpointConfigError", "load_json", "read_json_object", "require"]

_T = TypeVar("_T")


class CheckpointConfigError(ValueError):
    """A checkpoint's config file is missing or unreadable, or a field is missing, malformed
    or out of range; the message names the file and the dotted field."""


def require(section: Any, key: str, where: str, kind: Callable[[Any], Any] | None = None) -> Any:
    """``section[key]``, converted by ``kind`` when given (a bool is not an int or a float,
    a float not an int); ``where`` is the section's dotted path ("" at the top level).

    Raises: CheckpointConfigError naming ``where.key``."""
    field = f"{where}.{key}" if where else key
    if not isinstance(section, dict):
        raise CheckpointConfigError(f"{where or 'config'} is not a JSON object")
    if key not in section:
        raise CheckpointConfigError(f"{field} is missing")
    value = section[key]
    if kind is None:
        return value
    if (kind in (int, float) and isinstance(value, bool)) or (kind is int and isinstance(value, float)):
        raise CheckpointConfigError(f"{field} = {value!r} is not a {kind.__name__}")
    try:
        return kind(value)
    except (TypeError, ValueError):
        raise CheckpointConfigError(f"{field} = {value!r} is not a {getattr(kind, '__name__', kind)}") from None


def read_json_object(path: Path, missing_note: str = "") -> dict[str, Any]:
    """The JSON object in ``path``; ``missing_note`` is appended to the missing-file message.

    Raises: CheckpointConfigError when the file is missing, unreadable or not an object."""
    if not path.is_file():
        raise CheckpointConfigError(f"{path.name} is missing from {path.parent}{missing_note}")
    try:
        raw = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise CheckpointConfigError(f"{path} cannot be read as JSON: {exc}") from exc
    if not isinstance(raw, dict):
        raise CheckpointConfigError(f"{path} holds a JSON {type(raw).__name__}, not an object")
    return raw


def load_json(path: Path, parse: Callable[[dict[str, Any]], _T], missing_note: str = "") -> _T:
    """``parse`` of the object in ``path`` (:func:`read_json_object`).

    Raises: CheckpointConfigError from either, its message prefixed with ``path``."""
    raw = read_json_object(path, missing_note)
    try:
        return parse(raw)
    except CheckpointConfigError as exc:
        raise CheckpointConfigError(f"{path}: {exc}") from None
