"""Pipeline: validate a config, place its stages, and run the coordinator.

Placement: stages without ``process`` (or with ``process: main``) run in the server
process; each other process group is one process per replica (``replicas``), placed by
the config's backend (:mod:`omnistage.pipeline.placement`: spawned on this host, or Ray
actors). Start-up builds the stages in list order (a model relies on that: e.g. the
vocoder is resident before the engine sizes its KV pool), waits until every process
reports ready, then admits requests. Each request runs on one replica of each replicated
group, the one with the fewest requests in flight when it is admitted, for its whole life.

A process that dies fails the requests in flight on it within ``process_death_timeout_s``
(all of them when it was the last live replica of its group: the pipeline is then
unhealthy, new requests get :class:`PipelineUnhealthyError` with a retry delay); the
supervisor has the placement replace it (local: respawned after a backoff,
``stage_restart_backoff_s``, doubling; Ray: restarted by Ray), and the pipeline serves
again once it is ready. More than ``max_stage_restarts`` restarts of one process within
``stage_restart_window_s`` and it gives up: :attr:`Pipeline.fatal_error` is set and
``on_fatal`` called (the server exits non-zero so that its own supervisor restarts it).
"""

from __future__ import annotations

import asyncio
import logging
import multiprocessing.process
import os
import time
import uuid
from collections import deque
from collections.abc import Callable

from omnistage.config.hooks import import_callable
from omnistage.config.pipeline import PipelineConfig
from omnistage.core.errors import PipelineConfigError, PipelineUnhealthyError
from omnistage.core.messages import (
    CLIENT_SOURCE,
    StageFailed,
    StagePayload,
    StreamChunk,
    StreamDone,
)
from omnistage.core.request import PipelineRequest
from omnistage.pipeline import relay
from omnistage.pipeline.control import (
    ControlMessage,
    Ready,
    StartupFailed,
    StateQuery,
    StateReply,
    Stop,
)
from omnistage.pipeline.coordinator import Coordinator, RequestHandle
from omnistage.pipeline.host import StageHost, endpoint_name
from omnistage.pipeline.placement import LocalPlacement, Placement, PlacementContext
from omnistage.pipeline.stage import StageRuntime, build_scheduler
from omnistage.pipeline.topology import Topology
from omnistage.pipeline.transport import MAIN_GROUP, segment_name_prefix

logger = logging.getLogger(__name__)

LiveState = list[str] | int | dict[str, list[str]]
"""One entry of :meth:`Pipeline.live_state`: request ids or segment names, a byte count
(``coordinator.queued_bytes``), or a stage's structures -> the request ids they hold."""


def sample_requests(config: PipelineConfig) -> list[tuple[str, PipelineRequest]]:
    """The model's declared sample requests (``sample_requests_fn``), or none."""
    if not config.sample_requests_fn:
        return []
    return list(import_callable(config.sample_requests_fn, what="sample_requests_fn")())


def build_topology(config: PipelineConfig) -> Topology:
    """Validate ``config`` statically and prove it on its sample requests.

    Raises:
        PipelineConfigError: naming the stage at fault.
    """
    topology = Topology(config)
    topology.check_consistency(sample_requests(config))
    return topology


def _placement_class(config: PipelineConfig) -> type[Placement]:
    if config.placement == "ray":
        try:
            from omnistage.pipeline.ray_placement import RayPlacement  # ray is an optional extra
        except ModuleNotFoundError as exc:
            if exc.name != "ray":
                raise
            raise PipelineConfigError("placement: ray needs Ray: pip install 'omnistage[ray]'") from exc
        return RayPlacement
    return LocalPlacement


class Pipeline:
    """A running pipeline. Use ``async with Pipeline(config) as pipeline`` or
    :meth:`start` / :meth:`stop` on a running event loop.

    Raises:
        PipelineConfigError: at construction, if the topology is invalid.
    """

    #: longest wait between two restarts of a stage process, seconds
    MAX_RESTART_BACKOFF_S = 30.0

    def __init__(
        self,
        config: PipelineConfig,
        *,
        startup_timeout_s: float = 120.0,
        on_fatal: Callable[[str], None] | None = None,
    ) -> None:
        self.config = config
        self.on_fatal = on_fatal
        self.fatal_error: str | None = None
        self.down: dict[str, list[str]] = {}  # endpoint -> its stages, while down
        self._restarts: dict[str, deque[float]] = {}
        self.topology = build_topology(config)
        self.startup_timeout_s = startup_timeout_s
        self.routes = {s.name: s.process or MAIN_GROUP for s in config.stages}
        self.groups = sorted({g for g in self.routes.values() if g != MAIN_GROUP})
        counts = {s.process: s.replicas for s in config.stages if s.process and s.process != MAIN_GROUP}
        self.replicas = {g: n for g, n in counts.items() if n > 1}
        # endpoint (one process of a group: the group, or <group>@<replica>) -> its group
        self.endpoints = {endpoint_name(g, k, counts[g]): g for g in self.groups for k in range(counts[g])}
        self.coordinator: Coordinator | None = None
        self.host: StageHost | None = None
        self._segment_prefix = f"omnistage_{os.getpid()}_{uuid.uuid4().hex[:6]}_"
        self._control: dict[str, asyncio.Future[Ready | StateReply]] = {}
        self._watchdog: asyncio.Task[None] | None = None
        context = PlacementContext(
            config, self.routes, self.replicas, self.endpoints, self._segment_prefix, startup_timeout_s, self._expect
        )
        self.placement: Placement = _placement_class(config)(context)

    @property
    def processes(self) -> dict[str, multiprocessing.process.BaseProcess]:
        """The spawned processes by endpoint (local placement; empty under Ray)."""
        return self.placement.processes if isinstance(self.placement, LocalPlacement) else {}

    async def __aenter__(self) -> Pipeline:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()

    # ---------------------------------------------------------------- lifecycle
    async def start(self) -> None:
        """Build local stages, spawn the process groups, and wait until all are ready.

        Raises:
            PipelineConfigError: a stage failed to build (the message names it).
        """
        config = self.config
        self.coordinator = Coordinator(
            self.topology,
            self._dispatch,
            self._broadcast_abort,
            self._deliver_input,
            max_concurrent_requests=config.max_concurrent_requests,
            stream_queue_max_bytes=config.stream_queue_max_bytes,
            stream_request_max_bytes=config.stream_request_max_bytes,
            request_timeout_s=config.request_timeout_s,
        )
        self.host = StageHost(MAIN_GROUP, self.routes, self.coordinator.post, replicas=self.replicas)
        self.host.on_control = self._on_control
        try:
            if self.endpoints:
                self.host.transport = self.placement.open(self.host)
                self.host.transport.start()
            for stage in config.stages:
                if self.routes[stage.name] == MAIN_GROUP:
                    runtime = StageRuntime(self.topology, stage.name, build_scheduler(config, stage), self.host)
                    self.host.stages[stage.name] = runtime
            if self.endpoints:
                await self.placement.start(list(self.endpoints))
                self._watchdog = asyncio.get_running_loop().create_task(self._watch_processes())
        except BaseException:
            await self.stop()
            raise
        for runtime in self.host.stages.values():
            runtime.start()

    async def stop(self) -> None:
        """Stop all stages and processes; fails requests still in flight."""
        if self.coordinator is not None and self.coordinator.unhealthy_reason is None:
            self.coordinator.fail_all("the pipeline is stopping")
        if self._watchdog is not None:
            self._watchdog.cancel()
            self._watchdog = None
        if self.host is not None:
            for runtime in self.host.stages.values():
                await asyncio.to_thread(runtime.stop)
            if self.host.transport is not None:
                for endpoint in self.endpoints:
                    self.host.transport.send(endpoint, "control", Stop())
        await self.placement.stop()
        if self.host is not None and self.host.transport is not None:
            self.host.transport.stop()
            self.host.transport = None
        relay.sweep_segments(self._segment_prefix)

    async def _watch_processes(self) -> None:
        """Supervise the stage processes: restart a dead one, or give up past the limit."""
        interval = self.config.process_death_timeout_s / 4
        while True:
            await asyncio.sleep(interval)
            dead = self.placement.dead()
            if dead is not None and not await self._restart(*dead):
                return

    async def _restart(self, endpoint: str, why: str) -> bool:
        """Fail the requests in flight on ``endpoint``, have the placement replace it until
        it is ready; False once past the restart limit (the pipeline stays down: fatal)."""
        assert self.coordinator is not None
        stages = self._stages_of(self.endpoints[endpoint])
        self.down[endpoint] = stages
        reason = f"stage process {endpoint!r} (stages {', '.join(stages)}; {why})"
        while True:
            now = time.monotonic()
            restarts = self._restarts.setdefault(endpoint, deque())
            while restarts and now - restarts[0] > self.config.stage_restart_window_s:
                restarts.popleft()
            if len(restarts) >= self.config.max_stage_restarts:
                self._give_up(f"{reason}; it was restarted {len(restarts)} times within "
                              f"{self.config.stage_restart_window_s:g} s: giving up")  # fmt: skip
                return False
            backoff = min(self.config.stage_restart_backoff_s * 2 ** len(restarts), self.MAX_RESTART_BACKOFF_S)
            restarts.append(now)
            logger.error("%s; restarting it in %.1f s (restart %d of at most %d)", reason, backoff,
                         len(restarts), self.config.max_stage_restarts)  # fmt: skip
            self._fail_on(endpoint, f"{reason}; restarting it", retry_after_s=backoff + 1.0)
            try:
                await self.placement.replace(endpoint, backoff)
            except PipelineConfigError as exc:
                reason = f"stage process {endpoint!r} failed to restart: {exc}"
                continue
            self._sweep_segments_of(endpoint)
            del self.down[endpoint]
            if self._every_group_live():
                self.coordinator.recovered()
            logger.info("stage process %r restarted; serving again", endpoint)
            return True

    def _every_group_live(self) -> bool:
        return all(any(e not in self.down for e, g in self.endpoints.items() if g == group) for group in self.groups)

    def _fail_on(self, endpoint: str, reason: str, retry_after_s: float) -> None:
        """Fail the requests in flight on ``endpoint``: all of them, marking the pipeline
        unhealthy, when its group has no live replica left; else those assigned to it."""
        assert self.coordinator is not None and self.host is not None
        group = self.endpoints[endpoint]
        if not self._every_group_live() or group not in self.replicas:
            self.coordinator.fail_all(reason, retry_after_s=retry_after_s)
            return
        replica = int(endpoint.rpartition("@")[2])
        error = PipelineUnhealthyError(reason, retry_after_s)
        for request_id, replicas in list(self.host.assignments.items()):
            if replicas.get(group) == replica:
                self.coordinator.on_event(StageFailed(request_id, self._stages_of(group)[0], error))

    def _stages_of(self, group: str) -> list[str]:
        """The stages of process group ``group``, in build order."""
        return [s.name for s in self.config.stages if self.routes[s.name] == group]

    def _sweep_segments_of(self, endpoint: str) -> None:
        """Unlink the shared-memory segments the dead process ``endpoint`` made or was sent
        but never received: all belong to requests that failed with it (no request is
        admitted on it before it is marked live again, which follows)."""
        swept = relay.sweep_segments(segment_name_prefix(self._segment_prefix, endpoint))
        for sender in [MAIN_GROUP, *self.endpoints]:
            swept += relay.sweep_segments(segment_name_prefix(self._segment_prefix, sender, endpoint))
        if swept:
            logger.info("stage process %r: swept %d shared-memory segments it never received", endpoint, swept)

    def _give_up(self, reason: str) -> None:
        logger.critical(reason)
        assert self.coordinator is not None
        self.fatal_error = reason
        self.coordinator.fail_all(reason)
        if self.on_fatal is not None:
            self.on_fatal(reason)

    # ------------------------------------------------------------------ requests
    def submit(
        self,
        request: PipelineRequest,
        request_id: str | None = None,
        timeout_s: float | None = None,
        *,
        collect: bool = False,
        received_at: float | None = None,
    ) -> RequestHandle:
        """Admit a request (see :meth:`Coordinator.submit` for ``collect``, ``received_at``
        and the errors)."""
        if self.coordinator is None:
            raise PipelineUnhealthyError("the pipeline is not started")
        return self.coordinator.submit(
            request, request_id, timeout_s, collect=collect, received_at=received_at
        )

    def send_input(self, request_id: str, data: object) -> bool:
        """More client input into a running request (:meth:`Coordinator.send_input`)."""
        if self.coordinator is None:
            raise PipelineUnhealthyError("the pipeline is not started")
        return self.coordinator.send_input(request_id, data)

    def end_input(self, request_id: str) -> bool:
        """No more client input for ``request_id`` (:meth:`Coordinator.end_input`)."""
        if self.coordinator is None:
            raise PipelineUnhealthyError("the pipeline is not started")
        return self.coordinator.end_input(request_id)

    def abort(self, request_id: str) -> None:
        """Abort a request everywhere; idempotent."""
        if self.coordinator is not None:
            self.coordinator.abort(request_id)

    @property
    def healthy(self) -> bool:
        return self.coordinator is not None and self.coordinator.unhealthy_reason is None

    def _dispatch(self, payload: StagePayload) -> None:
        assert self.host is not None
        if self.replicas:
            self.host.assign(payload.request_id, self._least_outstanding())
        self.host.send(self.topology.entry, payload, MAIN_GROUP)

    def _least_outstanding(self) -> dict[str, int]:
        """For each replicated group, its live replica with the fewest requests in flight
        (the lowest index on a tie)."""
        assert self.host is not None
        choice = {}
        for group, count in self.replicas.items():
            load = [0] * count
            for replicas in self.host.assignments.values():
                load[replicas[group]] += 1
            live = [k for k in range(count) if endpoint_name(group, k, count) not in self.down]
            choice[group] = min(live or range(count), key=lambda k: (load[k], k))
        return choice

    def _deliver_input(self, message: StreamChunk | StreamDone) -> None:
        assert self.host is not None and self.topology.client_input_stage is not None
        self.host.send(self.topology.client_input_stage, message, CLIENT_SOURCE)

    def _broadcast_abort(self, request_id: str) -> None:
        assert self.host is not None
        self.host.abort_local(request_id)
        if self.host.transport is not None:
            for endpoint in self.endpoints:
                self.host.transport.send(endpoint, "abort", request_id)

    # -------------------------------------------------------------- introspection
    async def live_state(self, timeout_s: float = 5.0) -> dict[str, LiveState]:
        """Per-request state held anywhere (empty when nothing leaked): coordinator
        requests and queued stream bytes, each stage's structures (in every process),
        and shared-memory segments not yet received."""
        assert self.coordinator is not None and self.host is not None
        state: dict[str, LiveState] = {}
        if self.coordinator.requests:
            state["coordinator.requests"] = sorted(self.coordinator.requests)
        if self.coordinator.queued_bytes:
            state["coordinator.queued_bytes"] = self.coordinator.queued_bytes
        state.update({f"main.{k}": v for k, v in self.host.live_state().items()})
        if self.host.transport is not None:
            for endpoint in self.endpoints:
                token = uuid.uuid4().hex
                reply = self._expect(f"state:{token}")
                self.host.transport.send(endpoint, "control", StateQuery(token))
                answer = await asyncio.wait_for(reply, timeout_s)
                assert isinstance(answer, StateReply)
                state.update({f"{endpoint}.{k}": v for k, v in answer.state.items()})
        segments = [n for n in os.listdir("/dev/shm") if n.startswith(self._segment_prefix)] if os.path.isdir("/dev/shm") else []
        if segments:
            state["shared_memory"] = segments
        return state

    def _expect(self, key: str) -> asyncio.Future[Ready | StateReply]:
        future = asyncio.get_running_loop().create_future()
        self._control[key] = future
        return future

    def _on_control(self, message: ControlMessage) -> None:
        """Transport callback for control replies (receiver thread); the placement sees
        each of them first (:meth:`Placement.on_control`)."""
        assert self.coordinator is not None
        self.placement.on_control(message)
        match message:
            case Ready(endpoint):
                key, value = f"ready:{endpoint}", message
            case StateReply(token):
                key, value = f"state:{token}", message
            case StartupFailed(endpoint, trace):
                error = PipelineConfigError(f"process group {endpoint!r} failed to start:\n{trace}")
                self.coordinator.loop.call_soon_threadsafe(self._resolve_error, f"ready:{endpoint}", error)
                return
            case _:
                return
        self.coordinator.loop.call_soon_threadsafe(self._resolve, key, value)

    def _resolve(self, key: str, value: Ready | StateReply) -> None:
        future = self._control.pop(key, None)
        if future is not None and not future.done():
            future.set_result(value)

    def _resolve_error(self, key: str, error: Exception) -> None:
        future = self._control.pop(key, None)
        if future is not None and not future.done():
            future.set_exception(error)
