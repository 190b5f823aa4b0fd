"""Text that enters a running Qwen3-TTS generation as the client writes it.

In streaming text mode the talker reads its target text one token per frame: the prefill
holds the first token (in ICL, as many as the reference frames leave room for), and
decode step ``k + 1`` adds token ``k + 1``'s row (then ``tts_eos``, then ``tts_pad``) to
frame ``k``'s feedback. So a request can start once its first tokens are known and take
the rest as step rows while it runs (:meth:`~omnistage.engine.engine.AREngine.append_step_rows`);
a step whose row has not arrived waits, out of the batch, while the other requests go on.

Tokens are final only where the text can no longer change them: a token is appended once
the text has grown past the pre-tokenizer piece it belongs to (BPE merges never cross a
piece), so the last piece waits for the next delta or the end of the input. The
tokenizer's added tokens (``<|im_end|>``, ``<tts_pad>``, ...) are matched in the raw text
before the pre-tokenizer splits it, as the whole text's tokenization matches them: the
text before one is final, the token itself too, and text that may still grow into one
waits (with the piece before it). At the end the
whole text is tokenized once more and must begin with every token already fed; the result
is the very prompt the whole text gives at once
(:meth:`~.modeling.prompt.PromptBuilder.with_text`), and its step rows up to the rounding
of a matmul: the text projection runs over each chunk's rows, not over all of them at once
(a review measured up to 7.2e-7 apart in fp32 on the tiny checkpoints, 2026-12-07). So with
the same seed the same audio unless that rounding flips a sampled code.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from functools import lru_cache

import torch
from transformers import PreTrainedTokenizerBase

from omnistage.core.messages import StagePayload, StreamChunk
from omnistage.core.payloads import InputText
from omnistage.engine.sequence import GenerationInput
from omnistage.models.qwen3_tts.modeling.prompt import PromptBuilder, PromptTokens, TargetIds
from omnistage.models.qwen3_tts.payload_types import LivePrompt, TalkerStart
from omnistage.models.qwen3_tts.request_builders import max_frames_for_text, text_frame_cap
from omnistage.scheduling.ar import RowFeed, StreamInput

__all__ = ["FinalTokens", "LiveTextFeed"]


@dataclass(frozen=True)
class _AddedTokens:
    """A tokenizer's added tokens, which it finds in the raw text before its pre-tokenizer
    splits the rest.

    Attributes:
        pattern: any of them, the longest first (as the tokenizer prefers it); None if none.
        prefixes: their proper prefixes (the tail of a text that may still become one).
        longest: the longest one's length.
    """

    pattern: re.Pattern[str] | None
    prefixes: frozenset[str]
    longest: int

    def first(self, text: str) -> tuple[int, int] | None:
        """``(start, length)`` of the first added token in ``text``, or of a tail that may
        still become one (length 0), whichever starts first; None if neither."""
        found = self.pattern.search(text) if self.pattern is not None else None
        for start in range(max(0, len(text) - self.longest + 1), len(text)):
            if found is not None and found.start() <= start:
                break
            if text[start:] in self.prefixes:
                return start, 0
        return (found.start(), len(found.group())) if found is not None else None


@lru_cache(maxsize=8)
def _added_tokens(tokenizer: PreTrainedTokenizerBase) -> _AddedTokens:
    words = sorted(tokenizer.get_added_vocab(), key=len, reverse=True)
    pattern = re.compile("|".join(map(re.escape, words))) if words else None
    prefixes = frozenset(word[:k] for word in words for k in range(1, len(word)))
    return _AddedTokens(pattern, prefixes, max(map(len, words), default=0))


class FinalTokens:
    """The target tokens of text arriving in deltas, as far as more text cannot change them
    (module docstring). Each delta costs the tokenization of the text since the last final
    piece, not of the whole text.

    Attributes:
        text: all the text so far.
        role: the role's ids (:meth:`~.modeling.prompt.PromptTokens.target`), once known.
        ids: the final target ids so far.
    """

    def __init__(self, tokens: PromptTokens) -> None:
        self.tokens = tokens
        self.text = ""
        self.role: list[int] | None = None
        self.ids: list[int] = []
        self._end = 0  # characters of `text` whose tokens are in `ids`
        self._added = _added_tokens(tokens.tokenizer)

    def push(self, delta: str) -> None:
        """Add ``delta``; tokenize what became final."""
        self.text += delta
        while (final := self._final(self.text[self._end :])) > 0:
            end = self._end + final
            if self.role is None:  # the first tokens, with the role's: the text's own template
                self.role, self.ids = self.tokens.target(self.text[:end])
            else:  # from a piece boundary on, the text tokenizes by itself
                self.ids = self.ids + self.tokens.tokenizer(self.text[self._end : end])["input_ids"]
            self._end = end

    def _final(self, pending: str) -> int:
        """Characters at the start of ``pending`` (the text after the final ids) whose
        tokens more text cannot change: an added token at its start; else up to the first
        added token, or to the last pre-tokenizer piece before the first added token or the
        tail that may still become one."""
        added = self._added.first(pending)
        if added is not None and added[1]:  # a whole added token: the tokenizer splits there
            return added[0] or added[1]
        head = pending if added is None else pending[: added[0]]
        pieces = self.tokens.tokenizer.backend_tokenizer.pre_tokenizer.pre_tokenize_str(head)
        return pieces[-1][1][0] if pieces else 0

    def finish(self) -> TargetIds:
        """The role's and the text's ids of the whole text, which must begin with every final id.

        Raises:
            ValueError: they do not (a tokenizer whose pieces were not final after all).
        """
        target = self.tokens.target(self.text)
        if (self.role is not None and target.role != self.role) or target.text[: len(self.ids)] != self.ids:
            raise ValueError("the text's tokens changed after they were fed (the tokenizer's pieces were not final)")
        return target


class LiveTextFeed(StreamInput):
    """One request at the ``tts_engine`` stage: a whole :class:`TalkerStart` starts it at
    once; a live one starts when its prefill's tokens are final and then takes the
    client's :class:`InputText` as step rows, ``tts_eos`` and the whole text's frame cap
    at the end of the input (module docstring). Client text may arrive before the payload.

    Args:
        builder: the checkpoint's prompt builder (tokenizer and text embedding).
    """

    def __init__(self, builder: PromptBuilder) -> None:
        self.builder = builder
        self.live: LivePrompt | None = None
        self.whole = False
        self.early = ""  # the client's text before the payload
        self.tokens = FinalTokens(builder.tokens)
        self.ended = False  # the client's input ended
        self.fed = 0  # target tokens in the prompt or appended
        self.started = False

    def on_payload(self, payload: StagePayload) -> RowFeed:
        start = payload.data
        if not isinstance(start, TalkerStart):
            raise TypeError(f"tts_engine takes a TalkerStart, got {type(start).__name__}")
        if start.whole is not None:
            if self.early or self.ended:
                raise ValueError("client text came for a request whose text was complete")
            self.whole = True
            return RowFeed(start=start.whole)
        self.live = start.live
        assert self.live is not None
        self.tokens.push(self.live.text + self.early)
        return self._advance()

    def on_chunk(self, chunk: StreamChunk) -> RowFeed:
        if not isinstance(chunk.data, InputText):
            raise TypeError(f"tts_engine takes InputText from its client, got {type(chunk.data).__name__}")
        if self.whole or self.ended:
            raise ValueError("client text came after the input ended")
        if self.live is None:
            self.early += chunk.data.text
            return RowFeed()
        self.tokens.push(chunk.data.text)
        return self._advance()

    def on_done(self) -> RowFeed:
        return RowFeed()  # no stage streams to tts_engine

    def on_input_done(self) -> RowFeed:
        if self.whole:
            raise ValueError("the client ended the input of a request whose text was complete")
        self.ended = True
        return self._advance() if self.live is not None else RowFeed()

    @torch.inference_mode()
    def _advance(self) -> RowFeed:
        live, builder = self.live, self.builder
        assert live is not None
        role, ids = self.tokens.finish() if self.ended else (self.tokens.role, self.tokens.ids)
        if not self.started:
            needed = live.head.ids_to_start()
            if not self.ended and (needed is None or role is None or len(ids) < needed):
                return RowFeed()  # its prefill's tokens are not all known yet: it waits
            assert role is not None
            self.started, self.fed = True, len(ids)
            return RowFeed(start=self._start(role, ids))
        new, self.fed = ids[self.fed :], len(ids)
        rows = builder.text_rows(new) if new else None
        if not self.ended:
            return RowFeed(rows=rows)
        eos = live.head.tts_eos[None]
        return RowFeed(rows=eos if rows is None else torch.cat((rows, eos)), complete=True, max_new_tokens=self._cap())

    def _start(self, role: list[int], ids: list[int]) -> GenerationInput:
        live = self.live
        assert live is not None
        prompt = self.builder.with_text(live.head, role, ids, complete=self.ended)
        sampling = live.sampling
        cap = self._cap() if self.ended else None
        return GenerationInput(
            prompt=prompt.prefill,
            sampling=sampling.talker,
            max_new_tokens=sampling.max_new_tokens if cap is None else cap,
            step_rows=prompt.step_rows if prompt.step_rows.shape[0] else None,
            pad_embed=prompt.tts_pad,
            predictor_sampling=sampling.code_predictor,
            more_rows=not self.ended,
        )

    def _cap(self) -> int | None:
        """The whole text's frame cap (None: the client's cap stays)."""
        live = self.live
        assert live is not None
        if live.text_cap_limit is None:
            return None
        return text_frame_cap(max_frames_for_text(self.tokens.text), live.text_cap_limit, live.min_new_tokens)
