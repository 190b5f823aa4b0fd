"""The scheduler's batch boundary (:meth:`Scheduler.run_batch`): a batch's size and wall
time reach the batch observer whether its compute succeeds or fails."""

from __future__ import annotations

import time

from omnistage.scheduling.simple import SimpleScheduler


class _Outbox:
    """Records the requests the boundary fails."""

    def __init__(self) -> None:
        self.failed: list[tuple[str, str]] = []

    def fail(self, request_id: str, error: BaseException) -> None:
        self.failed.append((request_id, str(error)))


def _busy_for(seconds: float) -> None:
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


def test_the_observer_gets_each_batchs_size_and_wall_seconds_success_or_failure():
    released: list[str] = []
    scheduler = SimpleScheduler(lambda batch: [], release_callback=released.append)
    outbox = _Outbox()
    scheduler.bind("s", outbox, expects_stream=False)
    seen: list[tuple[int, float, str]] = []
    scheduler.batch_observer = lambda size, seconds, kind: seen.append((size, seconds, kind))

    assert scheduler.run_batch(["a", "b"], lambda: _busy_for(0.02)) is True

    def fails() -> None:
        _busy_for(0.01)
        raise RuntimeError("boom")

    assert scheduler.run_batch(["c"], fails, kind="decode") is False
    assert [(size, kind) for size, _, kind in seen] == [(2, "batch"), (1, "decode")]
    assert seen[0][1] >= 0.02 and seen[1][1] >= 0.01
    assert outbox.failed == [("c", "boom")] and released == ["c"]
