"""Resolution of dotted paths to types (stage edge payloads); callables resolve through
:func:`omnistage.config.hooks.import_callable`."""

from __future__ import annotations

from omnistage.config.hooks import import_callable
from omnistage.core.errors import PipelineConfigError


def import_type(path: str, *, stage: str | None = None, what: str = "type") -> type:
    """Import a class by dotted path (as :func:`import_callable`).

    Raises:
        PipelineConfigError: the path does not resolve to a class.
    """
    target = import_callable(path, stage=stage, what=what)
    if not isinstance(target, type):
        raise PipelineConfigError(f"{what} {path!r} is not a class", stage)
    return target
