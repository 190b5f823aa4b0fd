"""StageHost: the stages of one OS process and their links to everything else.

A host delivers a message to a local stage directly (same-process stages pass Python
objects; tensors stay where they are) or through the :class:`ZmqTransport` to the process
of the target stage. Coordinator events go to the coordinator (directly in the server
process, over ZMQ from a child process).

A process group with replicas is several processes (``<group>@<replica>``); a request runs
on one replica of each, chosen when it is admitted (:meth:`assign`). The choice travels in
the envelope of every stage message of the request, and each host keeps it until the
request's abort (sent to every process when the request ends), so that a stage anywhere
sends the request's messages to the replicas it runs on.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence

from omnistage.core.errors import StageFailureError
from omnistage.core.messages import Abort, CoordinatorEvent, StageFailed, StageInput
from omnistage.core.tombstones import Tombstones
from omnistage.pipeline.control import ControlMessage
from omnistage.pipeline.stage import StageRuntime
from omnistage.pipeline.transport import MAIN_GROUP, Body, Envelope, ZmqTransport


def endpoint_name(group: str, replica: int, replicas: int) -> str:
    """The transport name of one process of ``group``: the group itself when it has one
    replica, else ``<group>@<replica>``."""
    return group if replicas == 1 else f"{group}@{replica}"


class StageHost:
    """Args:
    group: this process's group name (``"main"`` for the server process).
    routes: stage name -> group name of the process that runs it.
    coordinator_sink: receives coordinator events, a sequence of them per call (one
        stage step's), in order (thread-safe callable).
    hold_until_built: hold stage and abort messages until :meth:`stages_built` (a stage
        process, whose transport starts before its stages exist).
    replicas: replica count of each process group that has more than one.
    """

    def __init__(
        self,
        group: str,
        routes: dict[str, str],
        coordinator_sink: Callable[[Sequence[CoordinatorEvent]], None],
        *,
        hold_until_built: bool = False,
        replicas: dict[str, int] | None = None,
    ) -> None:
        self.group, self.routes, self.coordinator_sink = group, routes, coordinator_sink
        self.replicas = replicas or {}
        self.stages: dict[str, StageRuntime] = {}
        self.transport: ZmqTransport | None = None
        self.on_control: Callable[[ControlMessage], None] | None = None
        self._held: list[tuple[Envelope, Body]] | None = [] if hold_until_built else None
        self._held_lock = threading.Lock()
        self.assignments: dict[str, dict[str, int]] = {}  # request id -> group -> replica
        self._assignments_lock = threading.Lock()
        self._ended = Tombstones()

    # StageLinks --------------------------------------------------------------
    def send(self, target: str, message: StageInput, source: str) -> None:
        local = self.stages.get(target)
        if local is not None:
            local.deliver(message, source)
            return
        assert self.transport is not None, f"stage {target!r} is remote but there is no transport"
        group, request_id = self.routes[target], message.request_id
        replicas = self.assignments.get(request_id, {}) if self.replicas else {}
        if group in self.replicas:
            if group not in replicas:  # the request ended here (its abort came first): drop
                return
            group = endpoint_name(group, replicas[group], self.replicas[group])
        self.transport.send(group, "stage", message, target=target, source=source, request_id=request_id, replicas=replicas)

    def assign(self, request_id: str, replicas: dict[str, int]) -> None:
        """Record the replicas ``request_id`` runs on (until its abort)."""
        with self._assignments_lock:
            if request_id not in self._ended:
                self.assignments.setdefault(request_id, replicas)

    def to_coordinator(self, events: Sequence[CoordinatorEvent]) -> None:
        self.coordinator_sink(events)

    # -------------------------------------------------------------------------
    def abort_local(self, request_id: str) -> None:
        if self.replicas:
            with self._assignments_lock:
                self.assignments.pop(request_id, None)
                self._ended.add(request_id)
        for stage in self.stages.values():
            stage.deliver(Abort(request_id), MAIN_GROUP)

    def stages_built(self) -> None:
        """Deliver, in order, the messages held while the stages were being built. A
        process that replaces a dead one receives what was queued for it: the aborts of
        the requests that failed with it must reach the new stages before a late payload
        of one of them (which they then drop instead of starting it)."""
        with self._held_lock:
            for envelope, body in self._held or ():
                self._dispatch(envelope, body)
            self._held = None

    def on_message(self, envelope: Envelope, body: Body) -> None:
        """Transport callback (receiver thread)."""
        if envelope.kind in ("stage", "abort"):
            with self._held_lock:
                if self._held is not None:
                    self._held.append((envelope, body))
                    return
        self._dispatch(envelope, body)

    def _dispatch(self, envelope: Envelope, body: Body) -> None:
        if envelope.kind == "stage":
            if envelope.replicas:
                self.assign(envelope.request_id, envelope.replicas)
            self.stages[envelope.target].deliver(body, envelope.source)
        elif envelope.kind == "abort":
            self.abort_local(body)
        elif envelope.kind == "event":
            self.coordinator_sink(body)  # a tuple of events
        elif envelope.kind == "control" and self.on_control is not None:
            self.on_control(body)

    def on_undeliverable(self, envelope: Envelope, error: Exception) -> None:
        """Transport callback: a received message could not be decoded or delivered; its
        request fails (control messages are only logged by the transport)."""
        if envelope.request_id:
            where = envelope.target or "transport"
            cause = f"a {envelope.kind} message from {envelope.source or 'another process'} could not be delivered: {error!r}"
            self.coordinator_sink([StageFailed(envelope.request_id, where, StageFailureError(where, cause))])

    def live_state(self) -> dict[str, dict[str, list[str]]]:
        """Per-request state of the local stages (only stages that hold some), and the
        replica assignments of requests not yet ended here (``replicas``)."""
        state = {name: state for name, stage in self.stages.items() if (state := stage.live_state())}
        if self.assignments:
            state["replicas"] = {"requests": sorted(self.assignments)}
        return state
