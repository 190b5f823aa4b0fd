"""The topology graph: build-time validation, the consistency proof, and per-request
evaluation of the dynamic hooks against their static sets.

Static rules (each violation raises :class:`PipelineConfigError` naming the stage):
unique names; the entry stage exists and has no predecessor; exactly one of ``next`` /
``terminal``; every referenced stage exists; hooks only where meaningful (``route_fn``
needs ``next``; ``wait_for_fn`` and ``merge_fn`` need ``wait_for``; ``stream_done_to_fn``
needs ``stream_to``; ``can_accept_stream_before_payload`` needs a stream source or client
input); a stage
with several predecessors declares them all in ``wait_for`` (with a ``merge_fn``);
terminal stages neither route nor stream to stages; at most one stage takes client input
(``accepts_client_input``) and no stage is named ``"client"`` (the client's stream
source); the ``next`` graph is acyclic; every
stage is reachable from the entry, so every path ends at a terminal stage; every edge's
declared types agree (:mod:`omnistage.pipeline.edges`).

The consistency proof (:meth:`Topology.check_consistency`) goes beyond the static rules:
for each sample request it follows the routes the hooks choose and proves that every
fan-in source a stage waits for is produced (and nothing else arrives), that every stream
target a producer sends to is reached and every reached consumer gets stream-done from
each of its stream sources, and that the declared terminal set equals the terminal
stages actually reached. A pipeline that fails it would hang or leak requests at run
time, so it fails at start-up instead.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any, ParamSpec, TypeVar

from omnistage.config.hooks import import_callable
from omnistage.config.pipeline import PipelineConfig, StageConfig
from omnistage.core.errors import PipelineConfigError, StageFailureError
from omnistage.core.messages import CLIENT_SOURCE, StagePayload
from omnistage.core.request import PipelineRequest
from omnistage.pipeline.edges import StageTypes, check_edges


@dataclass(frozen=True)
class StageHooks:
    """A stage's resolved dynamic hooks (None where not declared)."""

    route: Callable[[StagePayload], str | list[str]] | None
    wait_for: Callable[[StagePayload], list[str]] | None
    merge: Callable[[dict[str, StagePayload]], object] | None
    stream_done_to: Callable[[StagePayload], list[str]] | None


P = ParamSpec("P")
R = TypeVar("R")


def _hook(path: str | None, stage: str, what: str) -> Callable[..., Any] | None:
    """The callable a config's dotted ``path`` names (imported: its signature is the
    hook's, see :class:`StageHooks`)."""
    return import_callable(path, stage=stage, what=what) if path else None


def _call(stage: str | None, what: str, hook: Callable[P, R], *args: P.args, **kwargs: P.kwargs) -> R:
    """Run a user hook; whatever it raises fails the request as a typed stage failure."""
    try:
        return hook(*args, **kwargs)
    except Exception as exc:
        raise StageFailureError(stage or "coordinator", f"{what} raised {type(exc).__name__}: {exc}") from exc


class Topology:
    """A validated pipeline graph with its hooks resolved.

    Raises:
        PipelineConfigError: on any static rule violation (see module docstring).
    """

    def __init__(self, config: PipelineConfig) -> None:
        self.config = config
        self.stages: dict[str, StageConfig] = {}
        for stage in config.stages:
            if stage.name in self.stages:
                raise PipelineConfigError("duplicate stage name", stage.name)
            if stage.name == CLIENT_SOURCE:
                raise PipelineConfigError(f"{CLIENT_SOURCE!r} names the client's stream source, not a stage", stage.name)
            self.stages[stage.name] = stage
        takers = [s.name for s in config.stages if s.accepts_client_input]
        if len(takers) > 1:
            raise PipelineConfigError(f"only one stage may take client input; {takers} declare accepts_client_input", takers[1])
        #: the stage a client's input into its running request goes to (None: no such input)
        self.client_input_stage: str | None = takers[0] if takers else None
        if not self.stages:
            raise PipelineConfigError("a pipeline needs at least one stage")
        self.entry = config.entry
        if self.entry not in self.stages:
            raise PipelineConfigError(f"entry_stage {self.entry!r} is not a stage")
        self.predecessors: dict[str, list[str]] = defaultdict(list)
        self.stream_sources: dict[str, list[str]] = defaultdict(list)
        for stage in config.stages:
            self._check_stage(stage)
        for stage in config.stages:
            self._check_fan_in(stage)
        self.order = self._topological_order()
        self._check_reachable()
        self.terminals = frozenset(s.name for s in config.stages if s.terminal)
        self.hooks = {
            s.name: StageHooks(
                route=_hook(s.route_fn, s.name, "route_fn"),
                wait_for=_hook(s.wait_for_fn, s.name, "wait_for_fn"),
                merge=_hook(s.merge_fn, s.name, "merge_fn"),
                stream_done_to=_hook(s.stream_done_to_fn, s.name, "stream_done_to_fn"),
            )
            for s in config.stages
        }
        self._terminal_fn: Callable[[PipelineRequest], Iterable[str]] | None = _hook(config.terminal_stages_fn, None, "terminal_stages_fn")
        self.types = {name: StageTypes.of(stage) for name, stage in self.stages.items()}
        self.edges = check_edges(self.stages, self.types, {name: h.merge for name, h in self.hooks.items()})

    # ----------------------------------------------------------------- static rules
    def _check_stage(self, stage: StageConfig) -> None:
        name = stage.name
        if stage.terminal == bool(stage.next):
            raise PipelineConfigError(
                "declare exactly one of `next` (a non-empty list) or `terminal: true`", name
            )
        for field in ("next", "wait_for", "stream_to"):
            refs: list[str] = getattr(stage, field)
            if len(set(refs)) != len(refs):
                raise PipelineConfigError(f"`{field}` lists a stage twice: {refs}", name)
            for ref in refs:
                if ref not in self.stages:
                    raise PipelineConfigError(
                        f"`{field}` references unknown stage {ref!r}; stages: {sorted(self.stages)}",
                        name,
                    )
                if ref == name:
                    raise PipelineConfigError(f"`{field}` references the stage itself", name)
        for target in stage.next:
            self.predecessors[target].append(name)
        for target in stage.stream_to:
            self.stream_sources[target].append(name)
        if stage.route_fn and not stage.next:
            raise PipelineConfigError("`route_fn` needs `next` (a terminal stage routes nowhere)", name)
        if (stage.wait_for_fn or stage.merge_fn) and not stage.wait_for:
            raise PipelineConfigError("`wait_for_fn` and `merge_fn` need `wait_for`", name)
        if stage.stream_done_to_fn and not stage.stream_to:
            raise PipelineConfigError("`stream_done_to_fn` needs `stream_to`", name)
        if stage.terminal and stage.stream_to:
            raise PipelineConfigError(
                "a terminal stage streams to the client, not to stages: remove `stream_to`", name
            )

    def _check_fan_in(self, stage: StageConfig) -> None:
        name = stage.name
        preds = self.predecessors.get(name, [])
        if name == self.entry and preds:
            raise PipelineConfigError(f"the entry stage cannot have predecessors ({preds})", name)
        if stage.can_accept_stream_before_payload and not (self.stream_sources.get(name) or stage.accepts_client_input):
            raise PipelineConfigError(
                "`can_accept_stream_before_payload` is set but no stage streams to it and it takes no client input", name
            )
        if len(preds) > 1 and not stage.wait_for:
            raise PipelineConfigError(
                f"has several predecessors {sorted(preds)}: declare them in `wait_for` with a `merge_fn`",
                name,
            )
        if stage.wait_for:
            if set(stage.wait_for) != set(preds):
                raise PipelineConfigError(
                    f"`wait_for` {sorted(stage.wait_for)} must equal the stages whose `next` "
                    f"lists it: {sorted(preds)}",
                    name,
                )
            if not stage.merge_fn:
                raise PipelineConfigError("a fan-in stage (`wait_for`) needs a `merge_fn`", name)

    def _topological_order(self) -> list[str]:
        indegree = {name: len(self.predecessors.get(name, [])) for name in self.stages}
        ready = [name for name in self.stages if indegree[name] == 0]
        order: list[str] = []
        while ready:
            name = ready.pop(0)
            order.append(name)
            for target in self.stages[name].next:
                indegree[target] -= 1
                if indegree[target] == 0:
                    ready.append(target)
        if len(order) != len(self.stages):
            cycle = sorted(set(self.stages) - set(order))
            raise PipelineConfigError(f"the `next` graph has a cycle through {cycle}", cycle[0])
        return order

    def _check_reachable(self) -> None:
        seen, frontier = {self.entry}, [self.entry]
        while frontier:
            for target in self.stages[frontier.pop()].next:
                if target not in seen:
                    seen.add(target)
                    frontier.append(target)
        for name in self.stages:
            if name not in seen:
                raise PipelineConfigError(f"unreachable from the entry stage {self.entry!r}", name)

    # ------------------------------------------------------- per-request decisions
    def routes(self, stage: str, payload: StagePayload) -> list[str]:
        """The stages ``stage`` sends ``payload``'s result to (a non-empty subset of ``next``).

        Raises:
            StageFailureError: ``route_fn`` returned something outside ``next`` or nothing.
        """
        config, hook = self.stages[stage], self.hooks[stage].route
        if hook is None:
            return list(config.next)
        chosen = _call(stage, "route_fn", hook, payload)
        chosen = [chosen] if isinstance(chosen, str) else list(chosen)
        return self._subset(stage, "route_fn", chosen, config.next, allow_empty=False)

    def waits(self, stage: str, payload: StagePayload) -> frozenset[str]:
        """The sources fan-in stage ``stage`` waits for on this request (subset of ``wait_for``)."""
        config, hook = self.stages[stage], self.hooks[stage].wait_for
        if hook is None:
            return frozenset(config.wait_for)
        chosen = self._subset(
            stage, "wait_for_fn", list(_call(stage, "wait_for_fn", hook, payload)), config.wait_for, allow_empty=False
        )
        return frozenset(chosen)

    def stream_targets(self, stage: str, payload: StagePayload) -> list[str]:
        """The stream targets of ``stage`` for this request (subset of ``stream_to``)."""
        config, hook = self.stages[stage], self.hooks[stage].stream_done_to
        if hook is None:
            return list(config.stream_to)
        chosen = list(_call(stage, "stream_done_to_fn", hook, payload))
        return self._subset(stage, "stream_done_to_fn", chosen, config.stream_to, allow_empty=True)

    def terminal_set(self, request: PipelineRequest) -> frozenset[str]:
        """The terminal stages ``request`` ends at (all terminals without a hook)."""
        if self._terminal_fn is None:
            return self.terminals
        chosen = self._subset(
            None, "terminal_stages_fn", list(_call(None, "terminal_stages_fn", self._terminal_fn, request)), sorted(self.terminals), allow_empty=False
        )
        return frozenset(chosen)

    def merge(self, stage: str, payloads: dict[str, StagePayload]) -> object:
        """``merge_fn`` of fan-in stage ``stage`` applied to its sources' payloads."""
        merge = self.hooks[stage].merge
        assert merge is not None, "validated: fan-in stages have a merge_fn"
        return _call(stage, "merge_fn", merge, payloads)

    @staticmethod
    def _subset(stage: str | None, hook: str, chosen: list[str], allowed: Iterable[str], *, allow_empty: bool) -> list[str]:
        allowed = list(allowed)
        bad = [c for c in chosen if c not in allowed]
        if bad or (not chosen and not allow_empty):
            problem = f"returned {chosen}" if chosen else "returned no stage"
            raise StageFailureError(
                stage or "coordinator", f"{hook} {problem}; it must choose from {allowed}"
            )
        return chosen

    # ---------------------------------------------------------- consistency proof
    def check_consistency(self, samples: Iterable[tuple[str, PipelineRequest]]) -> None:
        """Prove, for each ``(label, request)``, that no request can hang or leak.

        Raises:
            PipelineConfigError: naming the stage and the sample request that fails.
        """
        for label, request in samples:
            payload = StagePayload(request_id=f"sample:{label}", request=request, data=None)
            try:
                self._check_sample(label, payload)
            except StageFailureError as exc:
                raise PipelineConfigError(f"sample request {label!r}: {exc.cause}", exc.stage) from exc

    def _check_sample(self, label: str, payload: StagePayload) -> None:
        reached, incoming = {self.entry}, defaultdict(set)
        for name in self.order:
            if name not in reached or self.stages[name].terminal:
                continue
            for target in self.routes(name, payload):
                reached.add(target)
                incoming[target].add(name)
        for name in reached:
            self._check_sample_stage(label, name, payload, reached, incoming[name])
        expected = self.terminal_set(payload.request)
        actual = frozenset(n for n in reached if n in self.terminals)
        if expected != actual:
            raise PipelineConfigError(
                f"sample request {label!r}: terminal_stages_fn gives {sorted(expected)} but the "
                f"routes reach the terminals {sorted(actual)}",
                sorted(expected ^ actual)[0],
            )

    def _check_sample_stage(
        self, label: str, name: str, payload: StagePayload, reached: set[str], incoming: set[str]
    ) -> None:
        if self.stages[name].wait_for:
            waits = self.waits(name, payload)
            if waits != incoming:
                raise PipelineConfigError(
                    f"sample request {label!r}: waits for {sorted(waits)} but receives from "
                    f"{sorted(incoming)}",
                    name,
                )
        if self.stages[name].stream_to:
            active = set(self.stream_targets(name, payload))
            should = {t for t in self.stages[name].stream_to if t in reached}
            if active != should:
                raise PipelineConfigError(
                    f"sample request {label!r}: stream_done_to_fn gives {sorted(active)} but the "
                    f"stream targets this request reaches are {sorted(should)}",
                    name,
                )
        for source in self.stream_sources.get(name, []):
            if source not in reached:
                raise PipelineConfigError(
                    f"sample request {label!r}: stream source {source!r} is not reached, so "
                    "stream-done would never arrive",
                    name,
                )
