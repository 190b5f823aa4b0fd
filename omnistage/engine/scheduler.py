"""Continuous batching: which requests run in the next engine step.

A bounded FIFO waiting queue (full -> :class:`~omnistage.core.errors.QueueFullError`); admission
by free KV blocks, free step-embedding rows and a free slot. A request's KV blocks are
reserved for its whole generation (prompt + max_new_tokens) at admission, so a running
request never runs out of blocks and there is no preemption: preempting a feedback-decoding
request would mean replaying every fed-back frame embedding, and a stream that stalls mid
sentence is worse for TTS than a request that waits a little longer to start. The head of
the queue blocks the others (no overtaking), so big requests cannot starve.

Each step is either one prefill of admissible waiting requests (prefill first, as in
nano-vllm; at most ``max_prefill_tokens`` computed prompt tokens, the per-step prefill
budget) or one decode of every running request. A prefill is never followed by another
while running requests can decode: a burst of arrivals larger than one step's budget is
prefilled a budget at a time, with a decode step between, so the running streams keep
getting a frame at least every other step instead of stalling until the burst is in. With
``decode_with_prefill`` (the engine's overlap, :class:`~omnistage.engine.engine.EngineConfig`)
a prefill step also decodes the running requests (the engine runs both as one mixed step): every step then
gives every running request a frame, and a burst is prefilled a budget per step. Prefills are coalesced: while the oldest
waiting request has waited less than ``prefill_hold_s`` and the waiting requests could not
fill the free slots, the running requests decode and newcomers gather. An idle engine
(nothing running) prefills at once: there is nothing to keep decoding meanwhile. Finishing, aborting
and failing free blocks, rows and the slot at once.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Literal

from omnistage.core.errors import QueueFullError
from omnistage.core.request import FinishReason
from omnistage.engine.block_manager import BlockManager
from omnistage.engine.sequence import Sequence, SequenceStatus, block_keys


@dataclass(frozen=True)
class ScheduledBatch:
    """One step's work.

    Attributes:
        kind: a prefill of newly admitted requests, or a decode of running ones.
        seqs: the batch's requests.
        decode: with a prefill and ``decode_with_prefill``, the running requests decoded
            in the same step (those that were schedulable before the admission); else
            empty.
    """

    kind: Literal["prefill", "decode"]
    seqs: list[Sequence]
    decode: list[Sequence] = field(default_factory=list)


class BatchScheduler:
    """Args:
    kv_blocks: the KV pool's bookkeeping.
    row_blocks: the step-embedding row pool's bookkeeping.
    max_num_seqs: running requests at most (slots).
    max_waiting: waiting requests at most.
    max_prefill_tokens: prompt tokens per prefill at most (a longer single prompt still
        runs alone).
    prefill_hold_s: the coalescing window (seconds).
    prefix_caching: admit a request with ``inputs.cache_prompt`` on the registered blocks
        its prompt begins with (see :mod:`omnistage.engine.block_manager`); only the
        rest of its prompt is prefilled, and only that counts against
        ``max_prefill_tokens``.
    decode_with_prefill: a prefill step also decodes the running requests
        (:attr:`ScheduledBatch.decode`; the module docstring).
    """

    def __init__(
        self,
        kv_blocks: BlockManager,
        row_blocks: BlockManager,
        max_num_seqs: int,
        max_waiting: int,
        max_prefill_tokens: int,
        prefill_hold_s: float,
        prefix_caching: bool = False,
        decode_with_prefill: bool = False,
    ) -> None:
        self.kv_blocks, self.row_blocks = kv_blocks, row_blocks
        self.prefix_caching, self.decode_with_prefill = prefix_caching, decode_with_prefill
        self.max_waiting, self.max_prefill_tokens, self.prefill_hold_s = max_waiting, max_prefill_tokens, prefill_hold_s
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self._free_slots: deque[int] = deque(range(max_num_seqs))
        self._by_id: dict[str, Sequence] = {}
        self._after_prefill = False  # the last batch was a prefill without a decode

    def add(self, seq: Sequence) -> None:
        """Queue ``seq``.

        Raises:
            QueueFullError: ``max_waiting`` requests are waiting.
            ValueError: the request id is already in the engine.
        """
        if seq.request_id in self._by_id:
            raise ValueError(f"request {seq.request_id!r} is already in the engine")
        if len(self.waiting) >= self.max_waiting:
            raise QueueFullError(self.max_waiting)
        self.waiting.append(seq)
        self._by_id[seq.request_id] = seq

    def get(self, request_id: str) -> Sequence | None:
        return self._by_id.get(request_id)

    def live_requests(self) -> set[str]:
        return set(self._by_id)

    def schedule(self, now: float) -> ScheduledBatch | None:
        """The next step's batch, or None when there is nothing to run now."""
        decode = [s for s in self.running if s.schedulable]
        admitted = [] if self._after_prefill and decode else self._admit(now)
        if admitted and self.decode_with_prefill:
            return ScheduledBatch("prefill", admitted, decode)
        self._after_prefill = bool(admitted)
        if admitted:
            return ScheduledBatch("prefill", admitted)
        return ScheduledBatch("decode", decode) if decode else None

    def hold_remaining(self, now: float) -> float | None:
        """Seconds until waiting requests may be prefilled (0: now); None if none waits."""
        if not self.waiting:
            return None
        if self._prefill_due(now):
            return 0.0
        return self.prefill_hold_s - (now - self.waiting[0].arrival)

    def finish(self, seq: Sequence, reason: FinishReason) -> None:
        """End ``seq`` (any state) and free everything it holds; idempotent."""
        if seq.status is SequenceStatus.FINISHED:
            return
        if seq.status is SequenceStatus.WAITING:
            self.waiting.remove(seq)
        else:
            self.running.remove(seq)
            self.kv_blocks.release(seq.request_id)
            self.row_blocks.release(seq.request_id)
            self._free_slots.append(seq.slot)
            seq.slot = -1
        seq.status, seq.finish_reason = SequenceStatus.FINISHED, reason
        del self._by_id[seq.request_id]

    def _prefill_due(self, now: float) -> bool:
        # Holding lets running requests decode while newcomers gather; with none running
        # it would only delay the first frame (5 ms of a 25 ms TTFA budget at concurrency 1).
        if not self.running:
            return True
        held = now - self.waiting[0].arrival < self.prefill_hold_s
        return not held or len(self.waiting) >= len(self._free_slots)

    def _admit(self, now: float) -> list[Sequence]:
        if not self.waiting or not self._prefill_due(now):
            return []
        admitted: list[Sequence] = []
        tokens = 0
        while self.waiting and self._free_slots:
            seq = self.waiting[0]
            cached = self._cached_blocks(seq)
            computed = seq.prompt_len - len(cached) * self.kv_blocks.block_size
            if admitted and tokens + computed > self.max_prefill_tokens:
                break
            if not (
                self.kv_blocks.can_allocate(seq.reserved_tokens, cached)
                and self.row_blocks.can_allocate(seq.inputs.num_step_rows)
            ):
                break
            self.waiting.popleft()
            seq.block_table = self.kv_blocks.allocate(seq.request_id, seq.reserved_tokens, cached)
            seq.num_cached = seq.prompt_len - computed
            self.row_blocks.allocate(seq.request_id, seq.inputs.num_step_rows)
            seq.row_slots = self.row_blocks.slots(seq.request_id)
            seq.slot = self._free_slots.popleft()
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            admitted.append(seq)
            tokens += computed
        return admitted

    def _cached_blocks(self, seq: Sequence) -> list[int]:
        """The registered blocks ``seq``'s prompt begins with (its last token excluded:
        the prefill must compute it), with prefix caching on."""
        keys = seq.inputs.row_keys
        if not self.prefix_caching or keys is None:
            return []
        size = self.kv_blocks.block_size
        if not seq.prompt_keys:
            seq.prompt_keys = block_keys(keys, size)
        return self.kv_blocks.match(seq.prompt_keys[: (seq.prompt_len - 1) // size])
