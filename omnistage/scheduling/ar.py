"""ARScheduler: an AR engine (:class:`~omnistage.engine.engine.AREngine`) as a pipeline stage.

Payload contract: the stage's input is a
:class:`~omnistage.engine.sequence.GenerationInput` (prompt embeddings ``[L, H]`` or token
ids ``[L]``, per-step rows ``[M, H]`` and a pad row ``[H]``, sampling params with stop ids
and ``min_new_tokens``, ``max_new_tokens``, code-predictor sampling), by default the
payload's ``data``; a model passes ``build_input`` to derive it otherwise. A request the
engine cannot take fails at once with a typed error (``QueueFullError`` when the waiting
queue is full, ``RequestValidationError`` when it can never fit).

Output: every frame goes to the stage's stream targets as soon as the host has it, as a
``[1, G] int64`` chunk on the engine's device (modality ``"audio_codes"``): on CUDA one
step after it was computed (the host reads step t's frames while the device runs step
t+1). The result is the :class:`~omnistage.engine.sequence.GenerationResult` (all frames
``[T, G]``) with finish_reason ``"stop"`` (a stop id; the stop frame is not emitted) or
``"length"`` (``max_new_tokens``).

Aborts free the request's KV blocks at once; a step that raises fails exactly the
requests of that step (the batch boundary, :meth:`Scheduler.run_batch`), whose blocks the
engine has already freed.
"""

from __future__ import annotations

from collections.abc import Callable

from omnistage.core.errors import OmnistageError
from omnistage.core.messages import Abort, StageInput, StagePayload
from omnistage.engine.engine import AREngine
from omnistage.engine.sequence import GenerationInput
from omnistage.scheduling.base import Scheduler


def payload_data(payload: StagePayload) -> GenerationInput:
    """The default ``build_input``: the payload's data, which must be a GenerationInput.

    Raises:
        TypeError: it is not.
    """
    if not isinstance(payload.data, GenerationInput):
        raise TypeError(f"an AR stage takes a GenerationInput, got {type(payload.data).__name__}")
    return payload.data


class ARScheduler(Scheduler):
    """Args:
    engine: the engine (built on the stage's device).
    build_input: ``build_input(payload) -> GenerationInput``; raises a typed
        :class:`~omnistage.core.errors.OmnistageError`, ``ValueError`` or ``TypeError`` for bad input.
    modality: of the streamed frames.
    abort_callback: see :class:`Scheduler` (the engine's own state is freed regardless).
    """

    max_messages_per_tick = 256

    def __init__(
        self,
        engine: AREngine,
        build_input: Callable[[StagePayload], GenerationInput] = payload_data,
        modality: str = "audio_codes",
        abort_callback: Callable[[str], None] | None = None,
    ) -> None:
        super().__init__(abort_callback)
        self.engine, self.build_input, self.modality = engine, build_input, modality

    def live_requests(self) -> set[str]:
        return self.engine.live_requests()

    def release(self, request_id: str) -> None:
        self.engine.abort(request_id)
        super().release(request_id)

    def _run(self) -> None:
        while True:
            hint = self.engine.wait_hint()
            messages = self.take(block=hint != 0, limit=self.max_messages_per_tick, timeout=hint)
            for message in messages:
                if message is None:
                    return
                self._ingest(message)
            self._step()

    def _ingest(self, message: StageInput) -> None:
        request_id = message.request_id
        if isinstance(message, Abort):
            self.release(request_id)
        elif isinstance(message, StagePayload):
            try:
                self.engine.add_request(request_id, self.build_input(message))
            except (OmnistageError, ValueError, TypeError) as exc:
                self.outbox.fail(request_id, exc)
        else:
            self.outbox.fail(request_id, TypeError(f"stage {self.stage_name!r} takes no streams"))

    def _step(self) -> None:
        plan = self.engine.schedule()
        if not plan.request_ids:
            return
        outputs = []
        if not self.run_batch(plan.request_ids, lambda: outputs.extend(self.engine.execute(plan))):
            return
        for out in outputs:
            if out.frame is not None:
                self.outbox.stream(out.request_id, out.frame, self.modality)
            if out.result is not None:
                self.outbox.result(out.request_id, out.result, out.result.finish_reason)
