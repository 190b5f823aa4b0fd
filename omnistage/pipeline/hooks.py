"""Resolution of dotted paths (factories and dynamic hooks) to callables."""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any

from omnistage.core.errors import PipelineConfigError


def import_callable(path: str, *, stage: str | None = None, what: str = "hook") -> Callable[..., Any]:
    """Import ``"pkg.module:attr"`` or ``"pkg.module.attr"``.

    Raises:
        PipelineConfigError: the module or attribute does not exist, or is not callable;
            the message names ``stage`` and ``what`` (e.g. ``"route_fn"``).
    """
    module_name, sep, attr = path.partition(":")
    if not sep:
        module_name, _, attr = path.rpartition(".")
    if not module_name or not attr:
        raise PipelineConfigError(f"{what} {path!r} is not a dotted path", stage)
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise PipelineConfigError(f"{what} {path!r}: cannot import {module_name!r}: {exc}", stage) from exc
    target = getattr(module, attr, None)
    if not callable(target):
        raise PipelineConfigError(f"{what} {path!r}: {module_name!r} has no callable {attr!r}", stage)
    return target


def import_type(path: str, *, stage: str | None = None, what: str = "type") -> type:
    """Import a class by dotted path (as :func:`import_callable`).

    Raises:
        PipelineConfigError: the path does not resolve to a class.
    """
    target = import_callable(path, stage=stage, what=what)
    if not isinstance(target, type):
        raise PipelineConfigError(f"{what} {path!r} is not a class", stage)
    return target
