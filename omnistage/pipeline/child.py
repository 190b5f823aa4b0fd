"""Entry point of a stage process: one per process group and replica, spawned by
:class:`~omnistage.pipeline.placement.LocalPlacement` or run in a Ray actor by
:class:`~omnistage.pipeline.ray_placement.RayPlacement`."""

from __future__ import annotations

import logging
import multiprocessing
import threading
import traceback
from collections.abc import Callable, Sequence

from omnistage.config.hooks import import_callable
from omnistage.config.pipeline import PipelineConfig
from omnistage.core.messages import CoordinatorEvent, StageFailed, StreamChunk
from omnistage.pipeline.control import (
    ControlMessage,
    Peers,
    Ready,
    StartupFailed,
    StateQuery,
    StateReply,
    Stop,
)
from omnistage.pipeline.host import StageHost
from omnistage.pipeline.relay import RelayError
from omnistage.pipeline.stage import StageRuntime, build_scheduler
from omnistage.pipeline.topology import Topology
from omnistage.pipeline.transport import MAIN_GROUP, ZmqTransport

PARENT_CHECK_S = 0.5


def _parent_alive() -> bool:
    parent = multiprocessing.parent_process()
    return parent is None or parent.is_alive()


def run_child(
    config_class: str,
    config_json: str,
    group: str,
    endpoint: str,
    addresses: dict[str, str],
    routes: dict[str, str],
    replicas: dict[str, int],
    prefix: str,
    *,
    bind: str | None = None,
    announce: Callable[[ZmqTransport], None] | None = None,
    alive: Callable[[], bool] = _parent_alive,
) -> None:
    """Build the stages of ``group`` as its process ``endpoint`` (``replicas``: the replica
    count of each replicated group), report :class:`Ready` (or :class:`StartupFailed`), and serve until told to stop or ``alive()`` turns False (default:
    the parent process is gone). ``bind``: the address to bind instead of
    ``addresses[endpoint]``; ``announce(transport)``: called once the transport runs,
    before the stages are built (Ray placement: the :class:`~omnistage.pipeline.control.Hello` with the bound address)."""
    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s [{endpoint}] %(levelname)s %(name)s: %(message)s")
    stopped = threading.Event()

    def send_event(events: Sequence[CoordinatorEvent]) -> None:
        """One message for the whole sequence (a terminal stage's chunks of a step); if
        it cannot be serialized, each event alone, so only the request whose event cannot
        be (e.g. a result that cannot be pickled) fails."""
        ids = {event.request_id for event in events}
        try:
            transport.send(MAIN_GROUP, "event", tuple(events), request_id=ids.pop() if len(ids) == 1 else "")
        except RelayError:
            for event in events:
                send_alone(event)

    def send_alone(event: CoordinatorEvent) -> None:
        try:
            transport.send(MAIN_GROUP, "event", (event,), request_id=event.request_id)
        except RelayError as exc:
            stage = event.source if isinstance(event, StreamChunk) else event.stage
            failed = StageFailed(event.request_id, stage, exc)
            transport.send(MAIN_GROUP, "event", (failed,), request_id=event.request_id)

    host = StageHost(endpoint, routes, coordinator_sink=send_event, hold_until_built=True, replicas=replicas)
    transport = ZmqTransport(endpoint, addresses, prefix, host.on_message, host.on_undeliverable, bind=bind)
    host.transport = transport

    def on_control(message: ControlMessage) -> None:
        match message:
            case StateQuery(token):
                transport.send(MAIN_GROUP, "control", StateReply(token, endpoint, host.live_state()))
            case Peers(addresses, remote):
                transport.set_peers(addresses, remote)
            case Stop():
                stopped.set()

    host.on_control = on_control
    transport.start()
    if announce is not None:
        announce(transport)
    try:
        config = _load_config(config_class, config_json)
        topology = Topology(config)
        for stage in config.stages:
            if routes[stage.name] == group:
                host.stages[stage.name] = StageRuntime(topology, stage.name, build_scheduler(config, stage), host)
    except BaseException as exc:  # noqa: BLE001 -- the process boundary: any start-up failure is reported
        transport.send(MAIN_GROUP, "control", StartupFailed(endpoint, "".join(traceback.format_exception(exc))))
        stopped.wait(5.0)
        transport.stop()
        return
    host.stages_built()
    for stage in host.stages.values():
        stage.start()
    transport.send(MAIN_GROUP, "control", Ready(endpoint))
    while not stopped.wait(PARENT_CHECK_S):
        if not alive():
            break
    for stage in host.stages.values():
        stage.stop()
    transport.stop()


def _load_config(config_class: str, config_json: str) -> PipelineConfig:
    cls = import_callable(config_class, what="config class")
    return cls.model_validate_json(config_json)
