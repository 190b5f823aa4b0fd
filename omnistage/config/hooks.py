"""Resolution of dotted paths (factories and dynamic hooks) to callables, and the knob
schema of a stage factory (its signature)."""

from __future__ import annotations

import importlib
import inspect
from collections.abc import Callable
from typing import Any

from pydantic import ConfigDict, TypeAdapter, ValidationError

from omnistage.config.pipeline import StageConfig
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


def factory_parameters(stage: StageConfig) -> dict[str, inspect.Parameter]:
    """The knobs of ``stage``'s factory ``factory(ctx, ...)``: its keyword parameters after
    ``ctx`` (not ``*args`` / ``**kwargs``), annotations evaluated.

    Raises:
        PipelineConfigError: the factory cannot be imported or its annotations evaluated,
            or ``stage.factory.args`` names a parameter it does not take (unless it has
            ``**kwargs``).
    """
    factory = import_callable(stage.factory.path, stage=stage.name, what="factory")
    try:
        signature = inspect.signature(factory, eval_str=True)
    except NameError as exc:
        raise PipelineConfigError(f"factory {stage.factory.path!r}: {exc}", stage.name) from exc
    keyword = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
    params = {n: p for n, p in list(signature.parameters.items())[1:] if p.kind in keyword}
    open_ended = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in signature.parameters.values())
    unknown = sorted(set(stage.factory.args) - set(params))
    if unknown and not open_ended:
        raise PipelineConfigError(
            f"factory args {unknown} are not parameters of {stage.factory.path}; it takes "
            f"{', '.join(params) or 'none'}",
            stage.name,
        )
    return params


def factory_args(stage: StageConfig) -> dict[str, Any]:
    """``stage.factory.args`` validated against the factory's annotations (a YAML list
    becomes the ``tuple[int, ...]`` a parameter declares).

    Raises:
        PipelineConfigError: see :func:`factory_parameters`, or a value does not fit its
            parameter's type.
    """
    params = factory_parameters(stage)
    args = {}
    for name, value in stage.factory.args.items():
        param = params.get(name)
        if param is None or param.annotation is param.empty:
            args[name] = value
            continue
        adapter = TypeAdapter(param.annotation, config=ConfigDict(arbitrary_types_allowed=True))
        try:
            args[name] = adapter.validate_python(value)
        except ValidationError as exc:
            raise PipelineConfigError(
                f"factory arg {name}={value!r}: {exc.errors()[0]['msg']}", stage.name
            ) from None
    return args
