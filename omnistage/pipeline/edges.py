"""Typed stage edges: what each edge carries, checked when the topology is built and
enforced on every message a stage sends.

A stage declares (dotted paths in :class:`~omnistage.config.pipeline.StageConfig`) the
class of its payload data (``payload_type``), of its result (``result_type``), of the
items it streams (``stream_types``) and of those it takes on its stream edges
(``accepts_stream_types``), and of the input its clients send into running requests
(``accepts_client_input``). A ``next`` edge carries its source's ``result_type``, a
``stream_to`` edge its source's ``stream_types``. An edge is typed when both of its ends
declare, and untyped when neither does; half a declaration is an error, because nothing
could be proved about the edge.

Build-time rules (each violation raises :class:`PipelineConfigError` naming the stage):
the result of a ``next`` source is a subclass of its target's payload type; a fan-in
target's ``merge_fn`` annotates its return with a subclass of the target's payload type;
every class a stream source declares is a subclass of one its target accepts. At run
time a stage whose result, stream item or merged payload is not of its declared class
fails that request with a :class:`StageFailureError` naming the stage and both classes.
"""

from __future__ import annotations

import typing
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

from omnistage.config.pipeline import StageConfig
from omnistage.core.errors import PipelineConfigError, StageFailureError
from omnistage.core.messages import StagePayload
from omnistage.pipeline.hooks import import_type


@dataclass(frozen=True)
class StageTypes:
    """A stage's resolved declarations (None / empty: undeclared)."""

    payload: type | None
    result: type | None
    streams: tuple[type, ...]
    accepts_streams: tuple[type, ...]
    client_input: tuple[type, ...] = ()

    @classmethod
    def of(cls, stage: StageConfig) -> StageTypes:
        """Raises: PipelineConfigError: a path does not resolve to a class."""

        def one(path: str | None, what: str) -> type | None:
            return import_type(path, stage=stage.name, what=what) if path else None

        return cls(
            payload=one(stage.payload_type, "payload_type"),
            result=one(stage.result_type, "result_type"),
            streams=tuple(import_type(p, stage=stage.name, what="stream_types") for p in stage.stream_types),
            accepts_streams=tuple(
                import_type(p, stage=stage.name, what="accepts_stream_types") for p in stage.accepts_stream_types
            ),
            client_input=tuple(
                import_type(p, stage=stage.name, what="accepts_client_input") for p in stage.accepts_client_input
            ),
        )


@dataclass(frozen=True)
class Edge:
    """One edge of the graph and what it carries (empty ``carries``: untyped)."""

    kind: Literal["next", "stream"]
    source: str
    target: str
    carries: tuple[type, ...]

    def describe(self) -> str:
        arrow = "->" if self.kind == "next" else "~>"
        carried = ", ".join(_name(t) for t in self.carries) or "untyped"
        return f"{self.source} {arrow} {self.target}: {carried}"


def _name(cls: type) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"


def check_edges(
    stages: dict[str, StageConfig], types: dict[str, StageTypes], merges: dict[str, Callable[[dict[str, StagePayload]], object] | None]
) -> list[Edge]:
    """Check every edge's declarations; returns the edges with what they carry.

    Raises:
        PipelineConfigError: on a rule of the module docstring.
    """
    edges: list[Edge] = []
    for name, stage in stages.items():
        source = types[name]
        for target in stage.next:
            if stages[target].wait_for:
                continue  # a fan-in target's payload is merge_fn's result, checked below
            edges.append(_next_edge(name, target, source.result, types[target].payload))
        for target in stage.stream_to:
            edges.append(_stream_edge(name, target, source.streams, types[target].accepts_streams))
    for name, stage in stages.items():
        if stage.wait_for and types[name].payload is not None:
            _check_merge(name, merges[name], types[name].payload)
        if stage.wait_for:
            edges += [Edge("next", s, name, ()) for s in stage.wait_for]
    return edges


def _next_edge(source: str, target: str, result: type | None, payload: type | None) -> Edge:
    if (result is None) != (payload is None):
        side = f"{source!r} declares result_type" if result else f"{target!r} declares payload_type"
        raise PipelineConfigError(f"edge {source} -> {target} is half typed: only {side}", target)
    if result is not None and payload is not None and not issubclass(result, payload):
        raise PipelineConfigError(
            f"edge {source} -> {target} carries {_name(result)}, but {target!r} takes {_name(payload)}", target
        )
    return Edge("next", source, target, (result,) if result else ())


def _stream_edge(source: str, target: str, streams: tuple[type, ...], accepts: tuple[type, ...]) -> Edge:
    if bool(streams) != bool(accepts):
        side = f"{source!r} declares stream_types" if streams else f"{target!r} declares accepts_stream_types"
        raise PipelineConfigError(f"stream edge {source} ~> {target} is half typed: only {side}", target)
    for item in streams:
        if not any(issubclass(item, accepted) for accepted in accepts):
            raise PipelineConfigError(
                f"stream edge {source} ~> {target} carries {_name(item)}, but {target!r} accepts only "
                f"{[_name(a) for a in accepts]}",
                target,
            )
    return Edge("stream", source, target, streams)


def _check_merge(stage: str, merge: Callable[[dict[str, StagePayload]], object] | None, payload: type) -> None:
    assert merge is not None, "validated: fan-in stages have a merge_fn"
    returned = typing.get_type_hints(merge).get("return")
    if not isinstance(returned, type) or not issubclass(returned, payload):
        raise PipelineConfigError(
            f"merge_fn must annotate its return with {_name(payload)} (the stage's payload_type), "
            f"got {returned!r}",
            stage,
        )


def check_message(stage: str, what: str, data: object, declared: type | tuple[type, ...] | None) -> None:
    """Run-time check of one outgoing ``data`` against its declaration.

    Raises:
        StageFailureError: ``data`` is not of the declared class(es).
    """
    if declared is None or declared == () or isinstance(data, declared):
        return
    names = [_name(d) for d in (declared if isinstance(declared, tuple) else (declared,))]
    raise StageFailureError(stage, f"its {what} is {type(data).__name__}, but it declares {' | '.join(names)}")
