"""Talker prompts for every Qwen3-TTS mode, built exactly as the reference builds them.

Each prompt position is the sum of a text track ``T(x) = text_projection(text_embedding(x))``
and a codec track ``C(x) = codec_embedding(x)`` (digest sections 2 and 4):

1. optional instructions ``T(<|im_start|>user\\n{instructions}<|im_end|>\\n)`` (text only);
2. role ``T(<|im_start|>assistant\\n)``;
3. codec prefix ``[nothink, think_bos, think_eos]`` (language auto) or ``[think, think_bos,
   lang, think_eos]``, then the speaker vector (CustomVoice ``C(spk_id)``, Base x-vector,
   VoiceDesign none), then ``[pad, bos]``; all but the last are added to text
   ``[tts_pad] * (n - 2) + [tts_bos]``;
4. the target text, in one of three layouts:
   - streaming text: ``T(text[0]) + C(bos)``; trailing text ``T(text[1:]) ++ T(tts_eos)``;
   - non-streaming text: ``(T(text) ++ T(tts_eos)) + C(pad)`` per position, then
     ``T(tts_pad) + C(bos)``; no trailing text;
   - ICL (Base with reference codes): text ``T(ref_text ++ text) ++ T(tts_eos)`` against codec
     ``C(bos) ++ frame sums of the reference codes``; streaming aligns them position by
     position (leftover text becomes trailing text, missing text is tts_pad), non-streaming
     puts all text (+ ``C(pad)``) first, then the codec rows (+ ``T(tts_pad)``).

During decoding, step ``g`` feeds the frame embedding plus ``step_rows[g]`` while it
lasts, then ``tts_pad``. Text is tokenized from the reference's templates and sliced as it
does ([:3] role, [3:-5] text; reference text [3:-2]).
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass
from functools import lru_cache
from typing import NamedTuple

import torch
from transformers import PreTrainedTokenizerBase

from omnistage.core.lru import BoundedLRU
from omnistage.engine.model_runner import upload
from omnistage.models.qwen3_tts.modeling.config import Qwen3TTSConfig
from omnistage.models.qwen3_tts.modeling.talker import Talker

__all__ = ["PromptBuilder", "PromptHead", "PromptSize", "PromptTokens", "TalkerPrompt"]

AUTO = "auto"
REF_TEXT_CACHE_SIZE = 256
"""Reference transcripts whose ids :class:`PromptTokens` keeps (each at most the input cap
of 2000 characters: about 1 MB of text and ids at worst)."""
ROLE_CACHE_SIZE = 16
"""Roles whose rows :class:`PromptBuilder` keeps (3 rows each). A role is
``<|im_start|>assistant`` and the token its newline becomes, which the text's first
characters can change (a text starting with a newline merges with it)."""
REF_CODES_CACHE_SIZE = 64
"""ICL references whose codec rows :class:`PromptBuilder` keeps, least recently used out
first (``[1 + R, H]`` each: 80 KB for a 3 s reference at the 0.6B's H = 1024 in bf16, 0.8 MB
for the longest, 30 s, R = 375)."""


@dataclass(frozen=True)
class TalkerPrompt:
    """One request's talker input.

    Attributes:
        prefill: ``[L, H]`` embeddings of the prefill (positions 0..L-1).
        step_rows: ``[M, H]`` text rows added to decode steps 0..M-1 (M may be 0).
        tts_pad: ``[H]`` text row added to every decode step from M on.
        ref_codes: ICL only: ``[R, 16] int64`` reference frames to prepend to the generated
            codes before the vocoder (and drop from its audio), the tensor given (the
            reference encoder's are on the host, where the vocoder hashes them); else ``None``.
    """

    prefill: torch.Tensor
    step_rows: torch.Tensor
    tts_pad: torch.Tensor
    ref_codes: torch.Tensor | None = None

    def text_row(self, step: int) -> torch.Tensor:
        """The text-track row of decode step ``step`` (0-based): ``[H]``."""
        return self.step_rows[step] if step < self.step_rows.shape[0] else self.tts_pad


class TargetIds(NamedTuple):
    """A target text's token ids (:meth:`PromptTokens.target`).

    Attributes:
        role: the assistant role's ids that open the text's template (3).
        text: the text's own ids, sliced as the reference slices them.
    """

    role: list[int]
    text: list[int]


@dataclass(frozen=True)
class PromptSize:
    """The rows of a talker prompt, known from token ids alone (no embedding).

    Attributes:
        prefill: ``L``, the prefill's positions.
        step_rows: ``M``, the text rows added to decode steps 0..M-1.
    """

    prefill: int
    step_rows: int


class PromptTokens:
    """The token ids of talker prompts and the choices made from the config alone (the
    language id), with no tensor: :class:`PromptBuilder` embeds what this yields, and the
    request builder sizes a prompt with :meth:`size` before any model work.

    A reference transcript's ids are memoized (:data:`REF_TEXT_CACHE_SIZE` transcripts,
    least recently used out first): every request of a cloned voice sends the same
    ``ref_text``, and the request builder and the preprocessing stage both need its ids.

    Args:
        config: the checkpoint's config (special ids, languages, speakers).
        tokenizer: the checkpoint's text tokenizer.
    """

    def __init__(self, config: Qwen3TTSConfig, tokenizer: PreTrainedTokenizerBase) -> None:
        self.config, self.tokenizer = config, tokenizer
        self._ref_ids = lru_cache(maxsize=REF_TEXT_CACHE_SIZE)(self._ref_text_ids)  # thread-safe

    def target(self, text: str) -> TargetIds:
        """The role's and the text's ids of the target text, sliced as the reference does."""
        target = self._tokenize(f"<|im_start|>assistant\n{text}<|im_end|>\n<|im_start|>assistant\n")
        return TargetIds(target[:3], target[3:-5])

    def instructions(self, instructions: str) -> list[int]:
        return self._tokenize(f"<|im_start|>user\n{instructions}<|im_end|>\n")

    def ref_text(self, ref_text: str) -> list[int]:
        """The ids of a reference transcript, sliced as the reference does (a new list)."""
        return list(self._ref_ids(ref_text))

    def _ref_text_ids(self, ref_text: str) -> tuple[int, ...]:
        return tuple(self._tokenize(f"<|im_start|>assistant\n{ref_text}<|im_end|>\n")[3:-2])

    def language_id(self, language: str, voice: str | None = None) -> int | None:
        """The codec language id of ``language`` (None for auto); a CustomVoice dialect
        ``voice`` switches chinese or auto to its dialect.

        Raises: ValueError: an unknown language, or a dialect named as a language."""
        name = language.lower()
        talker = self.config.talker
        dialect = None if voice is None else talker.spk_is_dialect.get(voice.lower())
        if dialect is not None and name in ("chinese", AUTO):
            return talker.codec_language_id[dialect]
        if name == AUTO:
            return None
        if name not in talker.codec_language_id or "dialect" in name:
            supported = [lang for lang in talker.codec_language_id if "dialect" not in lang]
            raise ValueError(f"unknown language {language!r}; use 'auto' or one of {sorted(supported)}")
        return talker.codec_language_id[name]

    def size(
        self,
        text_ids: list[int],
        language_id: int | None,
        speaker: bool,
        instructions: str | None,
        non_streaming_mode: bool,
        ref_text: str | None = None,
        ref_frames: int = 0,
    ) -> PromptSize:
        """The rows :class:`PromptBuilder` builds for these inputs (``speaker``: a speaker
        row, CustomVoice or Base; ``ref_frames``: ICL's reference frames ``R``, with
        ``ref_text``), counted from the target's ``text_ids`` (:attr:`TargetIds.text`) and
        the other inputs' token ids (the layout: module docstring)."""
        codec = (3 if language_id is None else 4) + int(speaker) + 2
        prefill = 3 + codec - 1 + (len(self.instructions(instructions)) if instructions is not None else 0)
        if ref_text is not None:
            n_text, n_codec = len(self.ref_text(ref_text)) + len(text_ids) + 1, 1 + ref_frames
            if non_streaming_mode:
                return PromptSize(prefill + n_text + n_codec, 0)
            return PromptSize(prefill + n_codec, max(0, n_text - n_codec))
        if non_streaming_mode:
            return PromptSize(prefill + len(text_ids) + 2, 0)
        return PromptSize(prefill + len(text_ids[:1]), len(text_ids[1:]) + 1)

    def _tokenize(self, template: str) -> list[int]:
        return list(self.tokenizer(template)["input_ids"])


@dataclass(frozen=True)
class PromptHead:
    """A talker prompt up to its target text, and what that text's rows are laid against
    (:meth:`PromptBuilder.with_text` completes it).

    Attributes:
        instructions: ``([I, H],)`` the instructions' rows, or ``()``; the role's rows
            follow them (they come from the text's tokenization, :meth:`PromptTokens.target`).
        codec_rows: ``[C, H]`` the codec prefix and speaker rows after the role.
        codec_bos: ``[H]`` ``C(codec_bos)``.
        codec_pad: ``[H]`` ``C(codec_pad)``.
        tts_pad, tts_eos: ``[H]`` the text track's pad and end rows.
        non_streaming_mode: the whole text goes into the prefill.
        ref_ids: ICL: the reference transcript's token ids; else None.
        icl_codec: ICL: ``[1 + R, H]`` ``C(codec_bos)`` then the reference frames' sums; else None.
        ref_codes: ICL: ``[R, 16] int64`` the reference frames, the tensor given; else None.
    """

    instructions: tuple[torch.Tensor, ...]
    codec_rows: torch.Tensor
    codec_bos: torch.Tensor
    codec_pad: torch.Tensor
    tts_pad: torch.Tensor
    tts_eos: torch.Tensor
    non_streaming_mode: bool
    ref_ids: list[int] | None = None
    icl_codec: torch.Tensor | None = None
    ref_codes: torch.Tensor | None = None

    @property
    def positions_before_text(self) -> int:
        """Prefill positions before the target text: instructions, the role's 3 tokens,
        the codec prefix and speaker."""
        return sum(rows.shape[0] for rows in self.instructions) + 3 + self.codec_rows.shape[0]

    def ids_to_start(self) -> int | None:
        """Target-text tokens the prefill holds when the text is longer (so a prompt can
        start with them while the rest is still arriving): 1 in streaming text mode, in
        ICL the reference frames not covered by the transcript's tokens; None in
        non-streaming mode (the whole text is in the prefill)."""
        if self.non_streaming_mode:
            return None
        if self.icl_codec is None or self.ref_ids is None:
            return 1
        return max(0, self.icl_codec.shape[0] - len(self.ref_ids))


@dataclass(frozen=True)
class _Specials:
    """The rows of the special ids, the same in every prompt (``[H]`` each; ``text_end``
    ``[2, H]``: non-streaming text's last two rows, ``T(tts_eos) + C(codec_pad)`` and
    ``T(tts_pad) + C(codec_bos)``)."""

    tts_pad: torch.Tensor
    tts_bos: torch.Tensor
    tts_eos: torch.Tensor
    codec_pad: torch.Tensor
    codec_bos: torch.Tensor
    text_end: torch.Tensor


class PromptBuilder:
    """Builds :class:`TalkerPrompt` s for one loaded checkpoint.

    Args:
        talker: the loaded talker (its device and dtype are used).
        config: the checkpoint's config (model type, special ids, languages, speakers).
        tokenizer: the checkpoint's text tokenizer.

    Every method raises ``ValueError`` for input the checkpoint cannot serve: empty text, a
    mode the model type lacks, an unknown language or speaker, a missing instructions
    (VoiceDesign) or an incomplete ICL reference.

    No method waits for the device (the preprocessing stage launches on the CUDA stream
    the engine's steps are queued on, where a blocking copy waits for all of them): token
    ids and host tensors go up through pinned memory
    (:func:`~omnistage.engine.model_runner.upload`): a prompt's text ids (after an ICL
    transcript's) in one copy, instructions in one more. Rows that depend on the
    checkpoint alone are made on first use and kept: the special ids' rows, each
    language's codec prefix (with a CustomVoice speaker's row), each role's rows
    (:data:`ROLE_CACHE_SIZE`); so are an ICL reference's codec rows, by the content of its
    codes (:data:`REF_CODES_CACHE_SIZE`). A kept row is what the same ops on the same ids
    made, so a prompt is what it would be without them. Thread-safe: a race makes the same
    rows twice and keeps one.
    """

    def __init__(self, talker: Talker, config: Qwen3TTSConfig, tokenizer: PreTrainedTokenizerBase) -> None:
        self.talker, self.config, self.tokens = talker, config, PromptTokens(config, tokenizer)
        self._specials_kept: _Specials | None = None
        self._codec_kept: dict[tuple[int | None, int | None], torch.Tensor] = {}  # (language id, speaker id)
        self._role_rows = lru_cache(maxsize=ROLE_CACHE_SIZE)(self._embed_role)  # thread-safe
        self._references: BoundedLRU[str, torch.Tensor] = BoundedLRU(max_entries=REF_CODES_CACHE_SIZE)

    # -- public modes --------------------------------------------------------------------

    def custom_voice(
        self, text: str, voice: str, language: str = AUTO, instructions: str | None = None, non_streaming_mode: bool = True
    ) -> TalkerPrompt:
        """CustomVoice: a built-in ``voice`` (case-insensitive). Dialect speakers switch the
        language id to their dialect when ``language`` is chinese or auto. The reference's
        wrapper drops the instructions for 0.6B CustomVoice models; here that is an error."""
        return self.whole(self.custom_voice_head(voice, language, instructions, non_streaming_mode), text)

    def voice_design(self, text: str, instructions: str, language: str = AUTO, non_streaming_mode: bool = True) -> TalkerPrompt:
        """VoiceDesign: the voice is described by ``instructions`` (required); no speaker vector."""
        return self.whole(self.voice_design_head(instructions, language, non_streaming_mode), text)

    def voice_clone(
        self,
        text: str,
        x_vector: torch.Tensor,
        language: str = AUTO,
        ref_text: str | None = None,
        ref_codes: torch.Tensor | None = None,
        non_streaming_mode: bool = False,
    ) -> TalkerPrompt:
        """Base: x-vector-only (``ref_text`` and ``ref_codes`` both ``None``) or ICL (both
        given: ``ref_codes [R, 16] int64`` from the speech tokenizer's encoder, on the host
        (kept by content; a device tensor is embedded every time), ``ref_text`` its
        transcript). ``x_vector``: ``[H]`` from the speaker encoder."""
        return self.whole(self.voice_clone_head(x_vector, language, ref_text, ref_codes, non_streaming_mode), text)

    # -- heads: a prompt up to its target text -----------------------------------------

    def custom_voice_head(
        self, voice: str, language: str = AUTO, instructions: str | None = None, non_streaming_mode: bool = True
    ) -> PromptHead:
        """:meth:`custom_voice`'s prompt before its text."""
        self._require_type("custom_voice")
        talker = self.config.talker
        name = voice.lower()
        if name not in talker.spk_id:
            raise ValueError(f"unknown voice {voice!r}; this model has {sorted(talker.spk_id)}")
        if instructions and self.config.tts_model_size == "0b6":
            raise ValueError("instructions are not supported by 0.6B CustomVoice models")
        language_id = self.tokens.language_id(language, name)
        return self._head(language_id, talker.spk_id[name], instructions or None, non_streaming_mode)

    def voice_design_head(self, instructions: str, language: str = AUTO, non_streaming_mode: bool = True) -> PromptHead:
        """:meth:`voice_design`'s prompt before its text."""
        self._require_type("voice_design")
        if not instructions:
            raise ValueError("VoiceDesign needs non-empty instructions describing the voice")
        return self._head(self.tokens.language_id(language), None, instructions, non_streaming_mode)

    def voice_clone_head(
        self,
        x_vector: torch.Tensor,
        language: str = AUTO,
        ref_text: str | None = None,
        ref_codes: torch.Tensor | None = None,
        non_streaming_mode: bool = False,
    ) -> PromptHead:
        """:meth:`voice_clone`'s prompt before its text."""
        self._require_type("base")
        if (ref_codes is None) != (not ref_text):
            raise ValueError("ICL needs both ref_text and ref_codes; x-vector-only mode needs neither")
        groups = self.config.talker.num_code_groups
        if ref_codes is not None and (ref_codes.dim() != 2 or ref_codes.shape[1] != groups or ref_codes.shape[0] == 0):
            raise ValueError(f"ref_codes must be [R >= 1, {groups}], got {tuple(ref_codes.shape)}")
        hidden = self.config.talker.decoder.hidden_size
        if x_vector.shape != (hidden,):
            raise ValueError(f"x_vector must be [{hidden}], got {tuple(x_vector.shape)}")
        speaker_row = upload(x_vector, self._device).to(self._dtype)
        icl = None if ref_codes is None else (ref_text, ref_codes)
        return self._head(self.tokens.language_id(language), speaker_row, None, non_streaming_mode, icl)

    # -- the target text ----------------------------------------------------------------

    def text_rows(self, ids: list[int]) -> torch.Tensor:
        """``[len(ids), H]`` text-track rows ``T(ids)`` (the ids go up without a wait)."""
        return self.talker.text_embed(upload(ids, self._device))

    def whole(self, head: PromptHead, text: str) -> TalkerPrompt:
        """``head`` with the whole ``text`` (raises ``ValueError`` if it is empty)."""
        return self.whole_many([(head, *self.tokens.target(text))])[0]

    @torch.no_grad()
    def whole_many(self, items: Sequence[tuple[PromptHead, list[int], list[int]]]) -> list[TalkerPrompt]:
        """:meth:`whole` of each ``(head, role_ids, ids)`` (a text's
        :meth:`PromptTokens.target`), in order, the same prompts: the ids of all of them go
        up in one copy and through the text embedding (a row lookup) at once;
        the text projection (a matmul, whose rows can round differently by how many it has)
        runs per :meth:`text_segments` as :meth:`whole` runs it. One upload and one lookup
        a batch instead of a prompt's (four of its ~27 torch calls; on a GPU host each call
        costs tens of microseconds of the GIL).

        Raises:
            ValueError: a text has no ids (nothing is built).
        """
        if not all(ids for _, _, ids in items):
            raise ValueError("text is empty")
        segments = [self.text_segments(head, ids) for head, _, ids in items]
        lengths = [len(segment) for prompt in segments for segment in prompt]
        flat = [i for prompt in segments for segment in prompt for i in segment]
        # Talker.text_embed in its two parts: the lookup for all, the projection per segment
        rows = self.talker.model.text_embedding(upload(flat, self._device))
        looked_up = iter(rows.split(lengths) if len(lengths) > 1 else (rows,))
        return [
            self.with_text(head, role_ids, ids, True, [self.talker.text_projection(next(looked_up)) for _ in prompt])
            for (head, role_ids, ids), prompt in zip(items, segments, strict=True)
        ]

    @staticmethod
    def text_segments(head: PromptHead, ids: list[int]) -> list[list[int]]:
        """The id lists whose text rows :meth:`with_text` makes for ``head`` and the target
        ``ids``, each by one ``text_embed``: in ICL the reference transcript's and the
        target's together; in non-streaming mode the target's; in streaming mode its first
        id alone (as a live text's prompt must make it: its other ids may not exist yet),
        then the rest."""
        if head.icl_codec is not None:
            assert head.ref_ids is not None, "an ICL head has its transcript's ids"
            return [head.ref_ids + ids]
        return [ids] if head.non_streaming_mode else [ids[:1], ids[1:]]

    @torch.no_grad()
    def with_text(
        self,
        head: PromptHead,
        role_ids: list[int],
        ids: list[int],
        complete: bool,
        text: Sequence[torch.Tensor] | None = None,
    ) -> TalkerPrompt:
        """``head`` with the role ``role_ids`` and the target text ``ids``
        (:meth:`PromptTokens.target`): all of it (``complete``), or while the text
        is still arriving its first ``ids``, at least :meth:`PromptHead.ids_to_start` of
        them; the rest then follows as step rows (:meth:`text_rows`, and ``tts_eos`` last),
        which give the very prompt the whole text gives. ``text``: the ``[n, H]`` text rows
        of each of :meth:`text_segments` when made already (:meth:`whole_many`); None
        makes them here.

        Raises:
            ValueError: ``complete`` with no ids; fewer ids than the head needs to start
                (or a non-streaming head) while incomplete; ``text`` not the rows of
                :meth:`text_segments`.
        """
        segments = self.text_segments(head, ids)
        expected = [len(segment) for segment in segments]
        if text is not None and [rows.shape[0] for rows in text] != expected:
            raise ValueError(f"text must be the rows of segments of {expected} ids, got {[r.shape[0] for r in text]}")
        if complete and not ids:
            raise ValueError("text is empty")
        needed = head.ids_to_start()
        if not complete and (needed is None or len(ids) < needed):
            raise ValueError(f"the prompt needs {needed or 'all'} text tokens before it starts, got {len(ids)}")
        if text is None:
            text = [self.text_rows(segment) for segment in segments]
        eos = head.tts_eos[None] if complete else head.tts_eos[None][:0]
        pad_row = head.tts_pad
        parts = [*head.instructions, self._role_rows(tuple(role_ids)), head.codec_rows]
        trailing = pad_row[None][:0]
        if head.icl_codec is not None:
            text_rows = text[0]  # the transcript's and the text's rows
            codec_rows_icl = head.icl_codec
            n_text, n_codec = text_rows.shape[0] + eos.shape[0], codec_rows_icl.shape[0]
            if head.non_streaming_mode:  # complete: eos is there
                end = self._specials().text_end[:1]  # T(tts_eos) + C(pad)
                parts += [text_rows + head.codec_pad, end, codec_rows_icl + pad_row]
            elif n_text > n_codec or not complete:
                with_eos = torch.cat((text_rows, eos))
                parts.append(with_eos[:n_codec] + codec_rows_icl)
                trailing = with_eos[n_codec:]
            else:
                padded = torch.cat((text_rows, eos, pad_row.expand(n_codec - n_text, -1)))
                parts.append(padded + codec_rows_icl)
        elif head.non_streaming_mode:
            parts += [text[0] + head.codec_pad, self._specials().text_end]
        else:
            first, rest = text  # the first row alone: a live text's other ids may not exist yet
            parts.append(first + head.codec_bos)
            trailing = torch.cat((rest, eos))
        return TalkerPrompt(prefill=torch.cat(parts), step_rows=trailing, tts_pad=pad_row, ref_codes=head.ref_codes)

    # -- construction --------------------------------------------------------------------

    @property
    def _device(self) -> torch.device:
        return self.talker.codec_head.weight.device

    @property
    def _dtype(self) -> torch.dtype:
        return self.talker.codec_head.weight.dtype

    def _require_type(self, model_type: str) -> None:
        if self.config.tts_model_type != model_type:
            raise ValueError(f"this is a {self.config.tts_model_type} model; {model_type} prompts need a {model_type} checkpoint")

    @torch.no_grad()
    def _head(
        self,
        language_id: int | None,
        speaker: int | torch.Tensor | None,
        instructions: str | None,
        non_streaming_mode: bool,
        icl: tuple[str, torch.Tensor] | None = None,
    ) -> PromptHead:
        """``speaker``: a CustomVoice speaker id, a Base x-vector row ``[H]`` or None."""
        specials = self._specials()
        instruction_rows = () if instructions is None else (self.text_rows(self.tokens.instructions(instructions)),)
        ref_ids = icl_codec = ref_codes = None
        if icl is not None:
            ref_text, ref_codes = icl
            ref_ids = self.tokens.ref_text(ref_text)
            icl_codec = self._reference_rows(ref_codes)
        return PromptHead(
            instructions=instruction_rows, codec_rows=self._codec_rows(language_id, speaker),
            codec_bos=specials.codec_bos, codec_pad=specials.codec_pad, tts_pad=specials.tts_pad,
            tts_eos=specials.tts_eos, non_streaming_mode=non_streaming_mode,
            ref_ids=ref_ids, icl_codec=icl_codec, ref_codes=ref_codes,
        )  # fmt: skip

    def _specials(self) -> _Specials:
        if self._specials_kept is None:
            cfg, t = self.config, self.config.talker
            text = self.talker.text_embed(upload([cfg.tts_pad_id, cfg.tts_bos_id, cfg.tts_eos_id], self._device))
            codec = self.talker.codec_embed(upload([t.codec_pad_id, t.codec_bos_id], self._device))
            text_end = torch.stack((text[2] + codec[0], text[0] + codec[1]))
            self._specials_kept = _Specials(*text, *codec, text_end)
        return self._specials_kept

    def _codec_rows(self, language_id: int | None, speaker: int | torch.Tensor | None) -> torch.Tensor:
        """``[C, H]`` the rows after the role: the codec prefix (``language_id``: its
        layout), the speaker and ``codec_pad``, each with ``tts_pad`` but the last, with
        ``tts_bos`` (``C(codec_bos)`` is the text's first row's). Kept unless ``speaker`` is
        an x-vector, which goes between the kept rows of no speaker."""
        key = (language_id, speaker if isinstance(speaker, int) else None)
        rows = self._codec_kept.get(key)
        if rows is None:
            rows = self._codec_kept[key] = self._embed_codec_rows(*key)
        if isinstance(speaker, torch.Tensor):
            rows = torch.cat((rows[:-1], (self._specials().tts_pad + speaker)[None], rows[-1:]))
        return rows

    def _embed_codec_rows(self, language_id: int | None, speaker_id: int | None) -> torch.Tensor:
        t, specials = self.config.talker, self._specials()
        if language_id is None:
            prefix = [t.codec_nothink_id, t.codec_think_bos_id, t.codec_think_eos_id]
        else:
            prefix = [t.codec_think_id, t.codec_think_bos_id, language_id, t.codec_think_eos_id]
        ids = [*prefix, *([] if speaker_id is None else [speaker_id]), t.codec_pad_id]
        codec = self.talker.codec_embed(upload(ids, self._device))
        return torch.cat((specials.tts_pad.expand(len(ids) - 1, -1), specials.tts_bos[None])) + codec

    def _embed_role(self, role_ids: tuple[int, ...]) -> torch.Tensor:
        return self.text_rows(list(role_ids))

    def _reference_rows(self, ref_codes: torch.Tensor) -> torch.Tensor:
        """``[1 + R, H]``: ``C(codec_bos)`` then the frame sums of ``ref_codes [R, 16]``;
        kept by the codes' content when they are on the host."""
        if ref_codes.device.type != "cpu":  # its content is not known without a wait
            return self._embed_reference(ref_codes)
        host = ref_codes.to(torch.int64).contiguous()
        key = hashlib.sha256(host.numpy().tobytes() + str(tuple(host.shape)).encode()).hexdigest()
        return self._references.get_or_compute(key, lambda: self._embed_reference(host))

    def _embed_reference(self, ref_codes: torch.Tensor) -> torch.Tensor:
        codes = upload(ref_codes.to(torch.int64), self._device)
        return torch.cat((self._specials().codec_bos[None], self.talker.frame_embedding(codes)))
