"""Helpers shared by the commands: user-error exits and option groups.

An *option group* is a frozen dataclass whose fields are typer-annotated options. Decorating
a command with :func:`option_group` adds those options to the command's signature and hands
the command one instance of the dataclass, so commands sharing a group cannot drift apart.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
from collections.abc import Callable
from typing import Any, NoReturn, TypeVar, get_type_hints

import typer

__all__ = ["API_KEY_ENV", "USAGE_ERROR", "fail", "option_group"]

API_KEY_ENV = "OMNISTAGE_API_KEY"
USAGE_ERROR = 2  # click's exit status for usage errors; ours too
F = TypeVar("F", bound=Callable[..., Any])


def fail(message: str, code: int = USAGE_ERROR) -> NoReturn:
    """Print ``Error: <message>`` on stderr and exit with ``code`` (no traceback)."""
    typer.echo(f"Error: {message}", err=True)
    raise typer.Exit(code)


def _group_parameters(group: type) -> list[inspect.Parameter]:
    hints = get_type_hints(group, include_extras=True)
    params = []
    for f in dataclasses.fields(group):
        if f.default is dataclasses.MISSING:
            raise TypeError(f"option group field {group.__name__}.{f.name} needs a default")
        params.append(
            inspect.Parameter(
                f.name, inspect.Parameter.KEYWORD_ONLY, default=f.default, annotation=hints[f.name]
            )
        )
    return params


def option_group(group: type, keyword: str) -> Callable[[F], F]:
    """Decorator: add the fields of dataclass ``group`` as options of a typer command, which
    receives them bundled as ``group(...)`` in its ``keyword`` parameter."""
    extra = _group_parameters(group)

    def decorate(command: F) -> F:
        signature = inspect.signature(command, eval_str=True)
        kw = inspect.Parameter.KEYWORD_ONLY  # typer passes keywords; the group's options first
        own = [p.replace(kind=kw) for p in signature.parameters.values() if p.name != keyword]

        @functools.wraps(command)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            bundle = group(**{p.name: kwargs.pop(p.name) for p in extra})
            return command(*args, **kwargs, **{keyword: bundle})

        params = [*extra, *own]
        wrapper.__signature__ = signature.replace(parameters=params)  # type: ignore[attr-defined]
        wrapper.__annotations__ = {p.name: p.annotation for p in params}
        return wrapper  # type: ignore[return-value]

    return decorate
