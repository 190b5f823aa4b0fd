"""SimpleScheduler: one compute thread that batches requests."""

from __future__ import annotations

import queue
import time
from collections.abc import Callable

from omnistage.core.messages import Abort, StageInput, StagePayload
from omnistage.scheduling.base import ItemFailure, ItemResult, Scheduler


class SimpleScheduler(Scheduler):
    """Collects up to ``max_batch_size`` payloads, waiting at most ``max_batch_wait_ms``
    after the first, and runs ``compute`` on the batch.

    Args:
        compute: ``compute(batch: list[StagePayload]) -> list[output]``, one output per
            item in order; an :class:`ItemFailure` in place of an output fails that item
            alone. If ``compute`` raises, the whole batch fails.
        max_batch_size: most payloads per call (>= 1).
        max_batch_wait_ms: how long to hold a partial batch for more arrivals.
        waits_for: whether a payload is worth holding its batch open for (e.g. not one a
            cache answers at once); a batch none of whose payloads is takes only what has
            already arrived. None: every payload is.
        release_callback: see :class:`Scheduler`.
    """

    def __init__(
        self,
        compute: Callable[[list[StagePayload]], list[object]],
        max_batch_size: int = 1,
        max_batch_wait_ms: float = 0.0,
        release_callback: Callable[[str], None] | None = None,
        waits_for: Callable[[StagePayload], bool] | None = None,
    ) -> None:
        super().__init__(release_callback)
        if max_batch_size < 1:
            raise ValueError(f"max_batch_size must be >= 1, got {max_batch_size}")
        self.compute = compute
        self.max_batch_size = max_batch_size
        self.max_batch_wait_s = max_batch_wait_ms / 1000.0
        self.waits_for = waits_for
        self._pending: list[StagePayload] = []

    def live_requests(self) -> set[str]:
        return {p.request_id for p in self._pending}

    def _run(self) -> None:
        while True:
            message = self._inbox.get()
            if message is None:
                return
            self._accept(message)
            deadline = time.monotonic() + self.max_batch_wait_s
            while len(self._pending) < self.max_batch_size:
                timeout = deadline - time.monotonic() if self._holds_open() else 0.0
                try:
                    message = self._inbox.get(timeout=timeout) if timeout > 0 else self._inbox.get_nowait()
                except queue.Empty:
                    break
                if message is None:
                    return
                self._accept(message)
            if self._pending:
                batch, self._pending = self._pending[: self.max_batch_size], self._pending[self.max_batch_size :]
                self._compute(batch)

    def _holds_open(self) -> bool:
        """Whether the pending batch waits for more arrivals (until its deadline)."""
        return self.waits_for is None or any(self.waits_for(p) for p in self._pending)

    def _accept(self, message: StageInput) -> None:
        if isinstance(message, StagePayload):
            self._pending.append(message)
        elif isinstance(message, Abort):
            self._pending = [p for p in self._pending if p.request_id != message.request_id]
            self.release(message.request_id)
        else:
            self.outbox.fail(message.request_id, TypeError(f"stage {self.stage_name!r} takes no streams"))

    def _compute(self, batch: list[StagePayload]) -> None:
        outputs: list[object] = []

        def compute() -> None:
            outputs.extend(self.compute(batch))
            if len(outputs) != len(batch):
                raise RuntimeError(f"compute returned {len(outputs)} outputs for {len(batch)} inputs")

        if not self.run_batch([p.request_id for p in batch], compute):
            return
        for payload, output in zip(batch, outputs, strict=True):
            if isinstance(output, ItemFailure):
                self.release(payload.request_id)
                self.outbox.fail(payload.request_id, output.error)
            elif isinstance(output, ItemResult):
                self.outbox.result(payload.request_id, output.data, output.finish_reason)
            else:
                self.outbox.result(payload.request_id, output)
