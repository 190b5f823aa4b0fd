"""Pipeline: validate a config, place its stages, and run the coordinator.

Placement: stages without ``process`` (or with ``process: main``) run in the server
process; each other process group is one spawned OS process. Start-up builds the stages
in list order (a model relies on that: e.g. the vocoder is resident before the engine
sizes its KV pool), waits until every process reports ready, then admits requests. A
process that dies fails every in-flight request within ``process_death_timeout_s`` and
marks the pipeline unhealthy (new requests get :class:`PipelineUnhealthyError` with a
retry delay); the supervisor restarts the process after a backoff
(``stage_restart_backoff_s``, doubling), and the pipeline serves again once it is ready.
More than ``max_stage_restarts`` restarts of one group within ``stage_restart_window_s``
and it gives up: :attr:`Pipeline.fatal_error` is set and ``on_fatal`` called (the server
exits non-zero so that its own supervisor restarts it).
"""

from __future__ import annotations

import asyncio
import logging
import multiprocessing
import os
import tempfile
import time
import uuid
from collections import deque
from collections.abc import Callable
from typing import Any

from omnistage.config.hooks import import_callable
from omnistage.config.pipeline import PipelineConfig
from omnistage.core.errors import PipelineConfigError, PipelineUnhealthyError
from omnistage.core.messages import StagePayload
from omnistage.pipeline import relay
from omnistage.pipeline.child import run_child
from omnistage.pipeline.coordinator import Coordinator, RequestHandle
from omnistage.pipeline.host import StageHost
from omnistage.pipeline.stage import StageRuntime, build_scheduler
from omnistage.pipeline.topology import Topology
from omnistage.pipeline.transport import MAIN_GROUP, Envelope, ZmqTransport, segment_name_prefix

logger = logging.getLogger(__name__)


def sample_requests(config: PipelineConfig) -> list[tuple[str, Any]]:
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
        self.down: dict[str, list[str]] = {}  # process group -> its stages, while down
        self._restarts: dict[str, deque[float]] = {}
        self.topology = build_topology(config)
        self.startup_timeout_s = startup_timeout_s
        self.routes = {s.name: s.process or MAIN_GROUP for s in config.stages}
        self.groups = sorted({g for g in self.routes.values() if g != MAIN_GROUP})
        self.coordinator: Coordinator | None = None
        self.host: StageHost | None = None
        self.processes: dict[str, multiprocessing.process.BaseProcess] = {}
        self._segment_prefix = f"omnistage_{os.getpid()}_{uuid.uuid4().hex[:6]}_"
        self._socket_dir: tempfile.TemporaryDirectory[str] | None = None
        self._control: dict[str, asyncio.Future[Any]] = {}
        self._watchdog: asyncio.Task[None] | None = None

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
            max_concurrent_requests=config.max_concurrent_requests,
            stream_queue_max_bytes=config.stream_queue_max_bytes,
            stream_request_max_bytes=config.stream_request_max_bytes,
            request_timeout_s=config.request_timeout_s,
        )
        self.host = StageHost(MAIN_GROUP, self.routes, self.coordinator.post)
        self.host.on_control = self._on_control
        try:
            if self.groups:
                self._start_transport()
            for stage in config.stages:
                if self.routes[stage.name] == MAIN_GROUP:
                    runtime = StageRuntime(self.topology, stage.name, build_scheduler(config, stage), self.host)
                    self.host.stages[stage.name] = runtime
            if self.groups:
                await self._spawn_groups()
        except BaseException:
            await self.stop()
            raise
        for runtime in self.host.stages.values():
            runtime.start()

    def _start_transport(self) -> None:
        assert self.host is not None
        self._socket_dir = tempfile.TemporaryDirectory(prefix="omnistage-")
        addresses = {g: f"ipc://{self._socket_dir.name}/{g}.sock" for g in [MAIN_GROUP, *self.groups]}
        self.host.transport = ZmqTransport(
            MAIN_GROUP, addresses, self._segment_prefix, self.host.on_message, self.host.on_undeliverable
        )
        self.host.transport.start()
        self._addresses = addresses

    async def _spawn_groups(self) -> None:
        await self._start_groups(self.groups)
        self._watchdog = asyncio.get_running_loop().create_task(self._watch_processes())

    async def _start_groups(self, groups: list[str]) -> None:
        """Spawn ``groups`` and wait until each reports ready.

        Raises:
            PipelineConfigError: a process died, failed or timed out while starting.
        """
        context = multiprocessing.get_context("spawn")
        config_class = f"{type(self.config).__module__}:{type(self.config).__qualname__}"
        ready = [self._expect(f"ready:{g}") for g in groups]
        for group in groups:
            process = context.Process(
                target=run_child,
                args=(config_class, self.config.model_dump_json(), group, self._addresses, self.routes, self._segment_prefix),
                name=f"omnistage-{group}",
                daemon=True,
            )
            process.start()
            self.processes[group] = process
        waiting = asyncio.ensure_future(asyncio.gather(*ready))
        deadline = asyncio.get_running_loop().time() + self.startup_timeout_s
        while not waiting.done():
            await asyncio.wait({waiting}, timeout=0.2)
            dead = [f"{g} (exit code {self.processes[g].exitcode})" for g in groups if not self.processes[g].is_alive()]
            if dead and not waiting.done():
                waiting.cancel()
                raise PipelineConfigError(f"stage processes died while starting: {', '.join(dead)}")
            if asyncio.get_running_loop().time() > deadline and not waiting.done():
                waiting.cancel()
                raise PipelineConfigError(f"stage processes not ready within {self.startup_timeout_s:g} s")
        await waiting  # raises the first start-up failure a process reported

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
                for group in self.groups:
                    self.host.transport.send(group, "stop")
        for process in self.processes.values():
            await asyncio.get_running_loop().run_in_executor(None, process.join, 5.0)
            if process.is_alive():
                process.kill()
        self.processes.clear()
        if self.host is not None and self.host.transport is not None:
            self.host.transport.stop()
            self.host.transport = None
        relay.sweep_segments(self._segment_prefix)
        if self._socket_dir is not None:
            self._socket_dir.cleanup()
            self._socket_dir = None

    async def _watch_processes(self) -> None:
        """Supervise the stage processes: restart a dead one, or give up past the limit."""
        interval = self.config.process_death_timeout_s / 4
        while True:
            await asyncio.sleep(interval)
            dead = next((g for g, p in self.processes.items() if not p.is_alive()), None)
            if dead is not None and not await self._restart(dead):
                return

    async def _restart(self, group: str) -> bool:
        """Fail the requests in flight, wait the backoff, respawn ``group`` until it is
        ready; False once past the restart limit (the pipeline stays down: fatal)."""
        assert self.coordinator is not None
        process = self.processes[group]
        stages = [s.name for s in self.config.stages if self.routes[s.name] == group]
        self.down[group] = stages
        reason = f"stage process {group!r} (stages {', '.join(stages)}; pid {process.pid}) died with exit code {process.exitcode}"
        while True:
            now = time.monotonic()
            restarts = self._restarts.setdefault(group, deque())
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
            self.coordinator.fail_all(f"{reason}; restarting it", retry_after_s=backoff + 1.0)
            await asyncio.sleep(backoff)
            try:
                await self._start_groups([group])
            except PipelineConfigError as exc:
                if self.processes[group].is_alive():  # timed out starting
                    self.processes[group].kill()
                reason = f"stage process {group!r} failed to restart: {exc}"
                continue
            self._sweep_segments_of(group)
            del self.down[group]
            if not self.down:
                self.coordinator.recovered()
            logger.info("stage process %r restarted (pid %s); serving again", group, self.processes[group].pid)
            return True

    def _sweep_segments_of(self, group: str) -> None:
        """Unlink the shared-memory segments the dead process of ``group`` made or was sent
        but never received: all belong to requests that failed with it (no request is
        admitted before :meth:`Coordinator.recovered`, which follows)."""
        swept = relay.sweep_segments(segment_name_prefix(self._segment_prefix, group))
        for sender in [MAIN_GROUP, *self.groups]:
            swept += relay.sweep_segments(segment_name_prefix(self._segment_prefix, sender, group))
        if swept:
            logger.info("stage process %r: swept %d shared-memory segments it never received", group, swept)

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
        request: Any,
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

    def abort(self, request_id: str) -> None:
        """Abort a request everywhere; idempotent."""
        if self.coordinator is not None:
            self.coordinator.abort(request_id)

    @property
    def healthy(self) -> bool:
        return self.coordinator is not None and self.coordinator.unhealthy_reason is None

    def _dispatch(self, payload: StagePayload) -> None:
        assert self.host is not None
        self.host.send(self.topology.entry, payload, MAIN_GROUP)

    def _broadcast_abort(self, request_id: str) -> None:
        assert self.host is not None
        self.host.abort_local(request_id)
        if self.host.transport is not None:
            for group in self.groups:
                self.host.transport.send(group, "abort", request_id)

    # -------------------------------------------------------------- introspection
    async def live_state(self, timeout_s: float = 5.0) -> dict[str, Any]:
        """Per-request state held anywhere (empty when nothing leaked): coordinator
        requests and queued stream bytes, each stage's structures (in every process),
        and shared-memory segments not yet received."""
        assert self.coordinator is not None and self.host is not None
        state: dict[str, Any] = {}
        if self.coordinator.requests:
            state["coordinator.requests"] = sorted(self.coordinator.requests)
        if self.coordinator.queued_bytes:
            state["coordinator.queued_bytes"] = self.coordinator.queued_bytes
        state.update({f"main.{k}": v for k, v in self.host.live_state().items()})
        if self.host.transport is not None:
            for group in self.groups:
                token = uuid.uuid4().hex
                reply = self._expect(f"state:{token}")
                self.host.transport.send(group, "state_query", token)
                _, _, child_state = await asyncio.wait_for(reply, timeout_s)
                state.update({f"{group}.{k}": v for k, v in child_state.items()})
        segments = [n for n in os.listdir("/dev/shm") if n.startswith(self._segment_prefix)] if os.path.isdir("/dev/shm") else []
        if segments:
            state["shared_memory"] = segments
        return state

    def _expect(self, key: str) -> asyncio.Future[Any]:
        future = asyncio.get_running_loop().create_future()
        self._control[key] = future
        return future

    def _on_control(self, envelope: Envelope, body: Any) -> None:
        """Transport callback for control replies (receiver thread)."""
        assert self.coordinator is not None
        if envelope.kind == "ready":
            key, value = f"ready:{body}", body
        elif envelope.kind == "state_reply":
            key, value = f"state:{body[0]}", body
        elif envelope.kind == "startup_failed":
            group, trace = body
            error = PipelineConfigError(f"process group {group!r} failed to start:\n{trace}")
            self.coordinator.loop.call_soon_threadsafe(self._resolve_error, f"ready:{group}", error)
            return
        else:
            return
        self.coordinator.loop.call_soon_threadsafe(self._resolve, key, value)

    def _resolve(self, key: str, value: Any) -> None:
        future = self._control.pop(key, None)
        if future is not None and not future.done():
            future.set_result(value)

    def _resolve_error(self, key: str, error: Exception) -> None:
        future = self._control.pop(key, None)
        if future is not None and not future.done():
            future.set_exception(error)
