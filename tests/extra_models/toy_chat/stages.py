"""The toy chat model's one stage, ``reply`` (terminal): the last user text's words in
reverse order, one :class:`TextDelta` per word, then a :class:`TextResult`."""

from __future__ import annotations

from dataclasses import dataclass

from omnistage.core.messages import StagePayload
from omnistage.core.payloads import TextDelta, TextResult
from omnistage.core.request import PipelineRequest
from omnistage.pipeline.stage import StageBuildContext
from omnistage.scheduling import SimpleScheduler


@dataclass(frozen=True)
class ToyChatRequest(PipelineRequest):
    """The pipeline's request: the conversation's text (``prompt``: every turn, joined),
    the last user text, ``shout`` (upper case) and the reply's word cap."""

    prompt: str
    last_user_text: str
    shout: bool
    max_words: int


def create_reply_stage(ctx: StageBuildContext) -> SimpleScheduler:
    scheduler = SimpleScheduler(lambda batch: [])

    def compute(batch: list[StagePayload]) -> list[object]:
        out: list[object] = []
        for payload in batch:
            request: ToyChatRequest = payload.request
            words = request.last_user_text.split()[::-1][: request.max_words]
            pieces = [(w.upper() if request.shout else w) + (" " if i < len(words) - 1 else "") for i, w in enumerate(words)]
            for piece in pieces:
                scheduler.outbox.stream(payload.request_id, TextDelta(piece))
            prompt_tokens = len(request.prompt.split())
            out.append(TextResult(text="".join(pieces), prompt_tokens=prompt_tokens, completion_tokens=len(words)))
        return out

    scheduler.compute = compute
    return scheduler
