"""The scheduler protocol and the batch boundary.

A scheduler owns one compute thread. The stage runtime puts
:data:`omnistage.core.messages.StageInput` messages into its thread-safe inbox
(:meth:`Scheduler.put`); the scheduler reports through its :class:`StageOutbox`
(results, stream chunks, failures), which is thread-safe too.

Failure has one exit: :meth:`Scheduler.run_batch`, the batch boundary. Whatever a batch's
compute raises (``torch.OutOfMemoryError`` included) fails exactly the requests of that
batch, their per-request state is released through ``release_callback``, and the scheduler
goes on serving the next requests.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Literal, Protocol

from omnistage.core.messages import StageInput
from omnistage.core.request import FinishReason
from omnistage.scheduling.faults import FaultInjector

#: What sort of batch a stage ran, for the batch metrics: an AR engine's step is a
#: ``prefill``, a ``mixed`` step (a prefill that also decodes), a ``decode`` or a ``drain``
#: (only the in-flight step waited for); every other stage's batch is a ``batch``.
BatchKind = Literal["batch", "prefill", "mixed", "decode", "drain"]

logger = logging.getLogger(__name__)


class StageOutbox(Protocol):
    """Where a scheduler reports; every method is thread-safe and ignores unknown requests
    (a request aborted meanwhile is simply dropped)."""

    def result(self, request_id: str, data: object, finish_reason: FinishReason = "stop") -> None:
        """The request is done at this stage; ``data`` goes to the next stages / client."""

    def stream(self, request_id: str, data: object) -> None:
        """One stream item to this stage's stream targets (or to the client, if terminal);
        its type is one of the stage's ``stream_types``."""

    def stream_many(self, items: Sequence[tuple[str, object]]) -> None:
        """``(request_id, data)`` chunks of many requests (e.g. one engine step's frames):
        as :meth:`stream` for each, sent as one message per stream target."""

    def mark(self, request_id: str, name: str) -> None:
        """A point of the request's timeline (e.g. ``"prefill"``), now
        (:mod:`omnistage.pipeline.timeline`)."""

    def fail(self, request_id: str, error: BaseException) -> None:
        """The request failed here; the coordinator fails it and aborts it everywhere."""

    def dead(self, error: BaseException) -> None:
        """The compute loop died: the pipeline is unhealthy."""


@dataclass(frozen=True, slots=True)
class ItemFailure:
    """Returned in place of one item's output by a batch compute: only that item fails."""

    error: BaseException


@dataclass(frozen=True, slots=True)
class ItemResult:
    """Returned in place of a bare output to finish an item with another finish_reason
    (e.g. ``"length"`` when a generation cap was reached)."""

    data: object
    finish_reason: FinishReason = "stop"


class Scheduler(ABC):
    """Base of all schedulers: an inbox, a compute thread, and the batch boundary.

    Args:
        release_callback: ``callback(request_id)`` that releases the model's per-request
            state (KV blocks, vocoder slots, buffers). Called on abort and on failure, on
            every race path, possibly more than once per request: it must be idempotent.
    """

    def __init__(self, release_callback: Callable[[str], None] | None = None) -> None:
        self.release_callback = release_callback
        self.stage_name = "?"
        self.expects_stream = False
        self._outbox: StageOutbox | None = None
        self._inbox: queue.SimpleQueue[StageInput | None] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        # (batch size, wall seconds, kind) of each batch run_batch ran, e.g. metrics histograms
        self.batch_observer: Callable[[int, float, BatchKind], None] | None = None
        self.faults: FaultInjector | None = None  # OMNISTAGE_FAULTS (tests, soak runs)

    @property
    def outbox(self) -> StageOutbox:
        assert self._outbox is not None, "bind() the scheduler before starting it"
        return self._outbox

    def bind(self, stage_name: str, outbox: StageOutbox, *, expects_stream: bool) -> None:
        """Attach to a stage. ``expects_stream``: the stage has stream sources, so every
        request also gets one :class:`StreamDone` (after all its sources finished)."""
        self.stage_name, self._outbox, self.expects_stream = stage_name, outbox, expects_stream
        self.faults = FaultInjector.from_env(stage_name)

    def start(self) -> None:
        self._thread = threading.Thread(target=self._thread_main, name=f"stage-{self.stage_name}", daemon=True)
        self._thread.start()

    def _thread_main(self) -> None:
        """The thread boundary: a failure outside a batch (a scheduler bug) kills the
        compute loop; every request it holds fails and the stage reports itself dead, so
        nothing waits on a stage that no longer computes."""
        try:
            self._run()
        except Exception as exc:  # noqa: BLE001 -- the thread boundary (docstring)
            logger.exception("stage %s: compute loop died", self.stage_name)
            for request_id in self.live_requests():
                self.outbox.fail(request_id, exc)
            self.outbox.dead(exc)

    def put(self, message: StageInput) -> None:
        """Thread-safe: hand a message to the compute thread."""
        self._inbox.put(message)

    def take(self, block: bool, limit: int | None = None, timeout: float | None = None) -> list[StageInput | None]:
        """Messages from the inbox: waits for one first if ``block`` (at most ``timeout``
        seconds, None: no limit), then takes those already there (at most ``limit`` in
        all). ``None`` in the list means stop."""
        messages: list[StageInput | None] = []
        if block:
            try:
                messages.append(self._inbox.get(timeout=timeout))
            except queue.Empty:
                return messages
        while limit is None or len(messages) < limit:
            try:
                messages.append(self._inbox.get_nowait())
            except queue.Empty:
                break
        return messages

    def queue_depth(self) -> int:
        """Messages waiting in the inbox (approximate; for metrics)."""
        return self._inbox.qsize()

    def stop(self, timeout: float = 5.0) -> None:
        if self._thread is not None:
            self._inbox.put(None)
            self._thread.join(timeout)
            self._thread = None

    @abstractmethod
    def _run(self) -> None:
        """The compute loop; returns when it takes ``None`` from the inbox."""

    @abstractmethod
    def live_requests(self) -> set[str]:
        """Ids of requests this scheduler holds state for (for leak checks)."""

    def release(self, request_id: str) -> None:
        """Call ``release_callback`` for ``request_id`` (idempotent by contract)."""
        if self.release_callback is not None:
            self.release_callback(request_id)

    def run_batch(self, request_ids: Iterable[str], compute: Callable[[], None], kind: BatchKind = "batch") -> bool:
        """The batch boundary: run ``compute``; if it raises, fail every request of the
        batch (releasing their state) and return False. Returns True on success. Either way
        :attr:`batch_observer` gets the batch's size, wall seconds and ``kind``
        (:data:`BatchKind`; an AR engine's from :meth:`~omnistage.scheduling.ar.ARScheduler.step_kind`)."""
        ids = list(request_ids)
        start, ok = time.perf_counter(), True
        try:
            if self.faults is not None:
                self.faults.before_batch()
            compute()
        except Exception as exc:  # noqa: BLE001 -- the one batch boundary (module docstring)
            logger.warning("stage %s: batch of %d failed: %r", self.stage_name, len(ids), exc)
            for request_id in ids:
                self.release(request_id)
                self.outbox.fail(request_id, exc)
            ok = False
        if self.batch_observer is not None:
            self.batch_observer(len(ids), time.perf_counter() - start, kind)
        return ok
