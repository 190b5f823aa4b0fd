"""ThreadedScheduler: N worker threads computing one request each."""

from __future__ import annotations

import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor

from omnistage.core.messages import Abort, StagePayload
from omnistage.scheduling.base import Scheduler


class ThreadedScheduler(Scheduler):
    """Runs ``compute(payload) -> output`` for up to ``num_workers`` requests at once.

    Several requests in flight at once is what lets a batcher further down (e.g. a
    reference-audio encoder shared by the workers) see batches larger than one.

    An abort releases the request at once (``release_callback``): work not started yet is
    cancelled; a compute already running is marked, and when it finishes its result is
    dropped and the request released again (the third race path), which is why
    ``release_callback`` must be idempotent.

    Args:
        compute: per-request compute, called on a worker thread.
        num_workers: worker threads (>= 1).
        release_callback: see :class:`Scheduler`.
    """

    def __init__(
        self,
        compute: Callable[[StagePayload], object],
        num_workers: int = 8,
        release_callback: Callable[[str], None] | None = None,
    ) -> None:
        super().__init__(release_callback)
        if num_workers < 1:
            raise ValueError(f"num_workers must be >= 1, got {num_workers}")
        self.compute = compute
        self.num_workers = num_workers
        self._lock = threading.Lock()
        self._running: dict[str, Future[None]] = {}
        self._aborted: set[str] = set()

    def live_requests(self) -> set[str]:
        with self._lock:
            return set(self._running) | self._aborted

    def _run(self) -> None:
        pool = ThreadPoolExecutor(self.num_workers, thread_name_prefix=f"{self.stage_name}-w")
        try:
            while (message := self._inbox.get()) is not None:
                if isinstance(message, StagePayload):
                    with self._lock:
                        self._running[message.request_id] = pool.submit(self._work, message)
                elif isinstance(message, Abort):
                    self._abort(message.request_id)
                else:
                    self.outbox.fail(message.request_id, TypeError(f"stage {self.stage_name!r} takes no streams"))
        finally:
            pool.shutdown(wait=True, cancel_futures=True)

    def _abort(self, request_id: str) -> None:
        with self._lock:
            future = self._running.get(request_id)
            if future is not None and future.cancel():  # not started: it never will
                del self._running[request_id]
            elif future is not None:
                self._aborted.add(request_id)
        self.release(request_id)

    def _work(self, payload: StagePayload) -> None:
        outputs: list[object] = []
        ok = self.run_batch([payload.request_id], lambda: outputs.append(self.compute(payload)))
        with self._lock:
            self._running.pop(payload.request_id, None)
            aborted = payload.request_id in self._aborted
            self._aborted.discard(payload.request_id)
        if aborted:
            self.release(payload.request_id)
        elif ok:
            self.outbox.result(payload.request_id, outputs[0])
