"""Ray placement (``placement: ray``): the process groups of a pipeline as Ray actors.

Needs the optional extra ``omnistage[ray]``. The server process joins the cluster at
``ray_address`` (None: starts a private single-node instance), and keeps the coordinator
and the stages without a process group. Each endpoint (a process group, or one replica of
it) is one actor of :class:`StageGroupActor` in one placement group: its bundle is the sum
of its stages' ``resources`` (``CPU``, ``GPU`` and custom resources such as ``thinker``),
the placement group's strategy ``placement_strategy`` (PACK, SPREAD, STRICT_PACK,
STRICT_SPREAD). The actor runs the same stage process as a local placement
(:func:`omnistage.pipeline.child.run_child`) on a thread of its own.

Transport: the same ZMQ envelopes as on one host, over ``tcp://<node ip>:<free port>``
(each process binds a free port; the addresses are exchanged at start-up: an actor sends
a :class:`~omnistage.pipeline.control.Hello` with its address and node, the server sends
every process the :class:`~omnistage.pipeline.control.Peers` map).
Tensors go by shared memory / CUDA IPC to a process on the same Ray node, inline in the
message to one on another node (:mod:`omnistage.pipeline.relay`; docs/ray.md has the
measurement that chose this over Ray's object store and over Ray actor calls).

Failure: each actor sends a :class:`~omnistage.pipeline.control.Beat` every quarter of
``process_death_timeout_s``; one silent for three quarters of it is dead (its worker
process died or hangs, or its node was lost; a silent actor is killed, so that a hung one
is restarted too), and so is one whose restarted incarnation says hello first. Ray restarts a dead
actor (``max_restarts=-1``; a lost node's bundle is placed again once a node with its
resources is back); the new incarnation rejoins (hello, then ready) and the
pipeline serves again, without a server restart. The pipeline's own limit
(``max_stage_restarts`` within ``stage_restart_window_s``) still ends it; Ray restarts at
once, so ``stage_restart_backoff_s`` does not apply.
"""

from __future__ import annotations

import asyncio
import logging
import os
import shutil
import tempfile
import threading
import time
import uuid
from dataclasses import dataclass, field

import ray
from ray.actor import ActorHandle
from ray.util.placement_group import PlacementGroup, placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from omnistage.core.errors import PipelineConfigError
from omnistage.pipeline.child import run_child
from omnistage.pipeline.control import Beat, ControlMessage, Hello, Peers, Ready, StartupFailed
from omnistage.pipeline.host import StageHost
from omnistage.pipeline.placement import Placement, PlacementContext
from omnistage.pipeline.transport import MAIN_GROUP, ZmqTransport

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class ActorSpec:
    """What an actor is built from (kept by Ray, so a restarted actor is built alike)."""

    config_class: str
    config_json: str
    group: str
    endpoint: str
    routes: dict[str, str]
    replicas: dict[str, int]
    segment_prefix: str
    main_address: str
    beat_interval_s: float


def node_ip() -> str:
    """The IP address Ray knows this process's node by (the one given to ``ray start
    --node-ip-address``)."""
    return ray.get_runtime_context().worker.node_ip_address


class StageGroupActor:
    """One endpoint's stage process inside a Ray actor (see the module doc). Its stages
    run on a thread of their own; the actor's methods only report on it."""

    def __init__(self, spec: ActorSpec) -> None:
        self.spec = spec
        self.incarnation = uuid.uuid4().hex
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._serve, name=f"omnistage-{spec.endpoint}", daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        spec = self.spec
        node = ray.get_runtime_context().get_node_id()

        def announce(transport: ZmqTransport) -> None:
            transport.send(MAIN_GROUP, "control", Hello(spec.endpoint, self.incarnation, transport.address, node, os.getpid()))
            threading.Thread(target=self._beat, args=(transport,), name="omnistage-beat", daemon=True).start()

        try:
            run_child(
                spec.config_class, spec.config_json, spec.group, spec.endpoint, {MAIN_GROUP: spec.main_address},
                spec.routes, spec.replicas, spec.segment_prefix,
                bind=f"tcp://{node_ip()}:*", announce=announce, alive=lambda: True,
            )  # fmt: skip
        finally:
            self._stopped.set()

    def _beat(self, transport: ZmqTransport) -> None:
        while not self._stopped.wait(self.spec.beat_interval_s):
            transport.send(MAIN_GROUP, "control", Beat(self.spec.endpoint, self.incarnation))

    def pid(self) -> int:
        """This incarnation's worker process id."""
        return os.getpid()


@dataclass
class _Incarnation:
    hello: Hello
    last_beat: float
    ready: asyncio.Event = field(default_factory=asyncio.Event)
    failed: str | None = None  # its start-up failure report
    dead: str | None = None  # why it counts as dead


class RayPlacement(Placement):
    """Ray actors in one placement group (see the module doc)."""

    def __init__(self, context: PlacementContext) -> None:
        super().__init__(context)
        self.actors: dict[str, ActorHandle] = {}  # endpoint -> its actor
        self.group: PlacementGroup | None = None
        self._live: dict[str, _Incarnation] = {}  # endpoint -> its current incarnation
        self._reported: set[str] = set()  # incarnations dead() has reported
        self._replaced: list[tuple[str, str]] = []  # deaths learnt from a restart's hello
        self._owns_ray = False
        self._ray_environ: dict[str, str] = {}
        self._temp_dir: str | None = None  # a private instance's session files
        self._transport: ZmqTransport | None = None
        self._node_id = ""
        self._loop: asyncio.AbstractEventLoop | None = None
        death = context.config.process_death_timeout_s
        self.beat_interval_s, self.silence_s = death / 4, death * 0.75

    # ------------------------------------------------------------------ lifecycle
    def open(self, host: StageHost) -> ZmqTransport:
        config = self.context.config
        if not ray.is_initialized():
            options: dict[str, object] = {"include_dashboard": False, "log_to_driver": False, "configure_logging": False}
            if config.ray_address is None:  # private instance on loopback (127.0.0.1 Ray would replace), sized to the bundles
                wants = self.bundles()
                custom = {k: sum(b.get(k, 0.0) for b in wants) for b in wants for k in b if k not in ("CPU", "GPU")}
                cpus = max(float(os.cpu_count() or 1), sum(b.get("CPU", 0.0) for b in wants))
                self._temp_dir = tempfile.mkdtemp(prefix="omnistage-ray-")  # its sessions' files, removed by stop()
                options |= {"address": "local", "num_cpus": cpus, "resources": custom, "_node_ip_address": "127.0.0.2",
                            "_temp_dir": self._temp_dir}  # fmt: skip
                logger.info("starting a private Ray instance (%g logical CPUs, %s)", cpus, custom or "no custom resources")
            else:
                options["address"] = config.ray_address
                logger.info("joining the Ray cluster at %s", config.ray_address)
            self._ray_environ = {k: v for k, v in os.environ.items() if k.startswith("RAY_")}
            ray.init(**options)  # sets RAY_* variables (e.g. RAY_AUTH_MODE), restored by stop()
            self._owns_ray = True
        self._node_id = ray.get_runtime_context().get_node_id()
        self._transport = ZmqTransport(
            MAIN_GROUP, {}, self.context.segment_prefix, host.on_message, host.on_undeliverable,
            bind=f"tcp://{node_ip()}:*",
        )  # fmt: skip
        return self._transport

    def bundles(self) -> list[dict[str, float]]:
        """One bundle per endpoint, in endpoint order: the sum of its stages' resources.

        Raises:
            PipelineConfigError: an endpoint's stages ask for no resource at all (Ray
                refuses an empty bundle).
        """
        config, bundles = self.context.config, []
        for endpoint, group in self.context.endpoints.items():
            bundle: dict[str, float] = {}
            for stage in config.stages:
                if stage.process == group:
                    wants = {"CPU": stage.resources.cpus, "GPU": stage.resources.gpus, **stage.resources.custom}
                    for name, amount in wants.items():
                        bundle[name] = bundle.get(name, 0.0) + amount
            bundle = {k: v for k, v in bundle.items() if v > 0}
            if not bundle:
                raise PipelineConfigError(f"process {endpoint!r}: its stages declare no resources (cpus, gpus, custom)")
            bundles.append(bundle)
        return bundles

    async def start(self, endpoints: list[str]) -> None:
        ctx, self._loop = self.context, asyncio.get_running_loop()
        bundles = self.bundles()
        self.group = placement_group(bundles, strategy=ctx.config.placement_strategy, name=f"{ctx.segment_prefix}pg")
        try:
            await asyncio.wait_for(asyncio.wrap_future(self.group.ready().future()), ctx.startup_timeout_s)
        except TimeoutError:
            raise PipelineConfigError(
                f"the Ray cluster cannot place the process groups within {ctx.startup_timeout_s:g} s: bundles "
                f"{dict(zip(ctx.endpoints, bundles, strict=True))}, strategy {ctx.config.placement_strategy}, "
                f"cluster resources {ray.cluster_resources()}"
            ) from None
        assert self._transport is not None
        ready = [ctx.expect(f"ready:{e}") for e in endpoints]
        for index, endpoint in enumerate(ctx.endpoints):
            if endpoint not in endpoints:
                continue
            spec = ActorSpec(
                ctx.config_class, ctx.config.model_dump_json(), ctx.endpoints[endpoint], endpoint, ctx.routes,
                ctx.replicas, ctx.segment_prefix, self._transport.address, self.beat_interval_s,
            )  # fmt: skip
            bundle = bundles[index]
            self.actors[endpoint] = ray.remote(StageGroupActor).options(
                num_cpus=bundle.get("CPU", 0.0),
                num_gpus=bundle.get("GPU", 0.0),
                resources={k: v for k, v in bundle.items() if k not in ("CPU", "GPU")},
                scheduling_strategy=PlacementGroupSchedulingStrategy(self.group, placement_group_bundle_index=index),
                max_restarts=-1,
                max_task_retries=0,
                name=f"{ctx.segment_prefix}{endpoint}",
            ).remote(spec)
        try:
            await asyncio.wait_for(asyncio.gather(*ready), ctx.startup_timeout_s)
        except TimeoutError:
            missing = [e for e in endpoints if e not in self._live or not self._live[e].ready.is_set()]
            raise PipelineConfigError(
                f"stage processes not ready within {ctx.startup_timeout_s:g} s: {', '.join(missing)}"
            ) from None

    def dead(self) -> tuple[str, str] | None:
        if self._replaced:  # an incarnation that was restarted before it fell silent
            return self._replaced.pop(0)
        now = time.monotonic()
        for endpoint, life in self._live.items():
            if life.hello.incarnation in self._reported:
                continue
            if life.dead is None and now - life.last_beat > self.silence_s:
                life.dead = f"Ray actor pid {life.hello.pid} on node {life.hello.node_id[:12]}: silent for {now - life.last_beat:.1f} s"
                # a hung actor lives on for Ray and would never say hello again: kill it so
                # that Ray restarts it (one already dead, or on a lost node, restarts anyway)
                ray.kill(self.actors[endpoint], no_restart=False)
            if life.dead is not None:
                self._reported.add(life.hello.incarnation)
                self._publish_peers()
                return endpoint, life.dead
        return None

    async def replace(self, endpoint: str, backoff_s: float) -> None:
        """Wait for Ray's restart of the actor to rejoin (``backoff_s`` does not apply: Ray
        restarts at once); a restarted actor that fails to start is killed so that Ray
        restarts it again."""
        deadline = time.monotonic() + self.context.startup_timeout_s
        while time.monotonic() < deadline:
            life = self._live.get(endpoint)
            if life is not None and life.hello.incarnation not in self._reported:
                if life.failed is not None:
                    self._reported.add(life.hello.incarnation)
                    ray.kill(self.actors[endpoint], no_restart=False)
                    raise PipelineConfigError(f"process {endpoint!r} failed to start:\n{life.failed}")
                if life.ready.is_set():
                    return
            await asyncio.sleep(0.05)
        raise PipelineConfigError(f"the Ray actor of {endpoint!r} did not rejoin within {self.context.startup_timeout_s:g} s")

    async def stop(self) -> None:
        for handle in self.actors.values():
            ray.kill(handle, no_restart=True)
        self.actors.clear()
        if self.group is not None:
            remove_placement_group(self.group)
            self.group = None
        self._live.clear()
        if self._owns_ray:
            ray.shutdown()
            self._owns_ray = False
            for name in [k for k in os.environ if k.startswith("RAY_")]:
                del os.environ[name]
            os.environ.update(self._ray_environ)
        if self._temp_dir is not None:
            shutil.rmtree(self._temp_dir, ignore_errors=True)
            self._temp_dir = None

    # --------------------------------------------------------------- control plane
    def on_control(self, message: ControlMessage) -> None:
        """Receiver thread: the actors' :class:`Hello` and :class:`Beat`, and the
        :class:`Ready` or :class:`StartupFailed` of a rejoining one."""
        match message:
            case Beat(endpoint, incarnation):
                life = self._live.get(endpoint)
                if life is not None and life.hello.incarnation == incarnation:
                    life.last_beat = time.monotonic()
            case Hello() | Ready() | StartupFailed() if self._loop is not None:
                self._loop.call_soon_threadsafe(self._on_loop, message)

    def _on_loop(self, message: Hello | Ready | StartupFailed) -> None:
        if isinstance(message, Hello):
            old = self._live.get(message.endpoint)
            if old is not None and old.hello.incarnation not in self._reported:
                self._reported.add(old.hello.incarnation)
                why = f"Ray actor pid {old.hello.pid} died; Ray restarted it (pid {message.pid})"
                self._replaced.append((message.endpoint, why))
            self._live[message.endpoint] = _Incarnation(message, time.monotonic())
            self._publish_peers()
            return
        life = self._live.get(message.endpoint)
        if life is None:
            return
        if isinstance(message, Ready):
            life.ready.set()
        else:
            life.failed = message.trace

    def _publish_peers(self) -> None:
        """Send every live process (and the server's transport) the addresses of the
        others and which of them are on another node."""
        assert self._transport is not None
        nodes = {MAIN_GROUP: self._node_id}
        addresses = {MAIN_GROUP: self._transport.address}
        for endpoint, life in self._live.items():
            if life.dead is None:
                nodes[endpoint], addresses[endpoint] = life.hello.node_id, life.hello.address
        for name, node in nodes.items():
            remote = frozenset(n for n, other in nodes.items() if other != node)
            if name == MAIN_GROUP:
                self._transport.set_peers(addresses, remote)
            else:
                self._transport.send(name, "control", Peers(addresses, remote))
