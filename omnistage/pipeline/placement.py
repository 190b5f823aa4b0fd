"""Placement: where the processes of a pipeline's process groups run.

A :class:`Placement` starts one process per process group and replica (an *endpoint*:
the group's name, or ``<group>@<replica>``), gives the server process its transport to
them, tells the pipeline's supervisor which one died, and replaces a dead one. The
pipeline (:mod:`omnistage.pipeline.pipeline`) is the same whatever the backend: the same
topology validation, the same coordinator in the server process, the same failure
contract (a death fails the requests in flight within ``process_death_timeout_s``).

- :class:`LocalPlacement` (``placement: local``): spawned OS processes on this host,
  ZMQ over ``ipc://`` sockets; a dead process is replaced by the supervisor after its
  backoff.
- :class:`omnistage.pipeline.ray_placement.RayPlacement` (``placement: ray``): one Ray
  actor per endpoint in one placement group, ZMQ over ``tcp://``; Ray restarts a dead
  actor and it rejoins.
"""

from __future__ import annotations

import asyncio
import multiprocessing
import tempfile
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass

from omnistage.config.pipeline import PipelineConfig
from omnistage.core.errors import PipelineConfigError
from omnistage.pipeline.child import run_child
from omnistage.pipeline.control import ControlMessage, Ready, StateReply
from omnistage.pipeline.host import StageHost
from omnistage.pipeline.transport import MAIN_GROUP, ZmqTransport


@dataclass(frozen=True)
class PlacementContext:
    """What a placement is given by its pipeline.

    ``endpoints``: endpoint name -> its process group; ``expect(key)``: a future the
    pipeline resolves with the control message ``key`` names when it arrives
    (``ready:<endpoint>``: its :class:`Ready`, failed with :class:`PipelineConfigError`
    on its :class:`~omnistage.pipeline.control.StartupFailed`).
    """

    config: PipelineConfig
    routes: dict[str, str]
    replicas: dict[str, int]
    endpoints: dict[str, str]
    segment_prefix: str
    startup_timeout_s: float
    expect: Callable[[str], asyncio.Future[Ready | StateReply]]

    @property
    def config_class(self) -> str:
        """Dotted path of the config's class, which a stage process rebuilds it with."""
        return f"{type(self.config).__module__}:{type(self.config).__qualname__}"


class Placement(ABC):
    """The processes of the process groups, behind one interface (see the module doc)."""

    def __init__(self, context: PlacementContext) -> None:
        self.context = context

    @abstractmethod
    def open(self, host: StageHost) -> ZmqTransport:
        """The server process's transport (bound, not started) for ``host``."""

    @abstractmethod
    async def start(self, endpoints: list[str]) -> None:
        """Start the processes of ``endpoints`` and wait until each reports ready.

        Raises:
            PipelineConfigError: one failed, died or timed out while starting.
        """

    @abstractmethod
    def dead(self) -> tuple[str, str] | None:
        """``(endpoint, why)`` of a process found dead since it was last started, or None.
        Called by the supervisor every quarter of ``process_death_timeout_s``."""

    @abstractmethod
    async def replace(self, endpoint: str, backoff_s: float) -> None:
        """Bring a dead endpoint back and wait until it is ready.

        Raises:
            PipelineConfigError: it failed, died or timed out while starting.
        """

    @abstractmethod
    async def stop(self) -> None:
        """Stop every process (they were sent ``stop``) and release what was placed."""

    def on_control(self, message: ControlMessage) -> None:  # noqa: B027 -- optional hook
        """Every control message from a stage process, before the pipeline handles it
        (receiver thread); the local placement needs none."""


class LocalPlacement(Placement):
    """Spawned OS processes on this host, ZMQ over ``ipc://`` sockets in a temporary
    directory; shared memory and CUDA IPC for tensors."""

    def __init__(self, context: PlacementContext) -> None:
        super().__init__(context)
        self.processes: dict[str, multiprocessing.process.BaseProcess] = {}
        self._socket_dir: tempfile.TemporaryDirectory[str] | None = None
        self._addresses: dict[str, str] = {}

    def open(self, host: StageHost) -> ZmqTransport:
        self._socket_dir = tempfile.TemporaryDirectory(prefix="omnistage-")
        names = [MAIN_GROUP, *self.context.endpoints]
        self._addresses = {g: f"ipc://{self._socket_dir.name}/{g}.sock" for g in names}
        return ZmqTransport(MAIN_GROUP, self._addresses, self.context.segment_prefix, host.on_message, host.on_undeliverable)

    async def start(self, endpoints: list[str]) -> None:
        context, ctx = multiprocessing.get_context("spawn"), self.context
        ready = [ctx.expect(f"ready:{e}") for e in endpoints]
        for endpoint in endpoints:
            process = context.Process(
                target=run_child,
                args=(ctx.config_class, ctx.config.model_dump_json(), ctx.endpoints[endpoint], endpoint,
                      self._addresses, ctx.routes, ctx.replicas, ctx.segment_prefix),  # fmt: skip
                name=f"omnistage-{endpoint}",
                daemon=True,
            )
            process.start()
            self.processes[endpoint] = process
        waiting = asyncio.ensure_future(asyncio.gather(*ready))
        deadline = asyncio.get_running_loop().time() + ctx.startup_timeout_s
        while not waiting.done():
            await asyncio.wait({waiting}, timeout=0.2)
            dead = [f"{e} (exit code {self.processes[e].exitcode})" for e in endpoints if not self.processes[e].is_alive()]
            if dead and not waiting.done():
                waiting.cancel()
                raise PipelineConfigError(f"stage processes died while starting: {', '.join(dead)}")
            if asyncio.get_running_loop().time() > deadline and not waiting.done():
                waiting.cancel()
                raise PipelineConfigError(f"stage processes not ready within {ctx.startup_timeout_s:g} s")
        await waiting  # raises the first start-up failure a process reported

    def dead(self) -> tuple[str, str] | None:
        for endpoint, process in self.processes.items():
            if not process.is_alive():
                return endpoint, f"pid {process.pid}; it died with exit code {process.exitcode}"
        return None

    async def replace(self, endpoint: str, backoff_s: float) -> None:
        await asyncio.sleep(backoff_s)
        try:
            await self.start([endpoint])
        except PipelineConfigError:
            if self.processes[endpoint].is_alive():  # timed out starting
                self.processes[endpoint].kill()
            raise

    async def stop(self) -> None:
        for process in self.processes.values():
            await asyncio.get_running_loop().run_in_executor(None, process.join, 5.0)
            if process.is_alive():
                process.kill()
        self.processes.clear()
        if self._socket_dir is not None:
            self._socket_dir.cleanup()
            self._socket_dir = None
