"""The talker's prompt from the thinker's output, as transformers 5.24 builds it
(``Qwen3OmniMoeForConditionalGeneration.generate``; shared/reference/qwen3-omni.md, section 2).

Rows are in the talker's width ``H``. With ``T(x) = text_projection(x)`` over thinker token
embeddings and ``M(x) = hidden_projection(x)`` over the thinker's layer-``accept_hidden_layer``
hidden states:

- **user rows**: every token of every user turn (a token's turn is the role token after the
  latest ``<|im_start|>`` at or before it; system and earlier assistant turns are dropped):
  ``M(hidden)`` at audio/image/video placeholder positions, ``T(embedding)`` elsewhere;
- **assistant tail** (9 rows) from the last ``<|im_start|>assistant`` of the prompt: text side
  ``T(im_start), T(assistant), T(newline), T(tts_pad) x4, T(tts_bos), T(first reply token)``
  plus codec side ``0, 0, 0, C(nothink), C(think_bos), C(think_eos), C(voice), C(pad), C(bos)``;
- **step rows** (the trailing text): ``T`` of the reply tokens after the first, then ``T(tts_eos)``; the talker
  adds row ``s`` to its input at decode step ``s``, then ``T(tts_pad)`` forever.

Only reply tokens the thinker fed back appear (its last generated token, EOS or the one that
hit the length cap, never is). The talker's position ids are the MRoPE positions of its own ids:
the user tokens' ids followed by ``tts_pad`` for the tail (with audio in video, computed as
transformers' talker does, without the audio-in-video merge).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from omnistage.engine.model_runner import upload
from omnistage.models.qwen3_omni.modeling.config import Qwen3OmniConfig
from omnistage.models.qwen3_omni.modeling.mrope import (
    MultimodalLayout,
    PromptPositions,
    prompt_positions,
)
from omnistage.models.qwen3_omni.modeling.talker import Talker

__all__ = ["TalkerPrompt", "ThinkerRows", "build_talker_prompt", "talker_prompt_length"]

TAIL_ROWS = 9


@dataclass(frozen=True)
class ThinkerRows:
    """What the thinker hands the talker for one request.

    Attributes:
        prompt_ids: the thinker prompt ``[L] int64``.
        reply_ids: the generated tokens ``[G] int64`` (G >= 2: the first reply token must have
            been fed back).
        embeds: layer-0 rows (token embeddings, encoder rows at placeholders) ``[L + G - 1, Ht]``.
        hidden: layer-``accept_hidden_layer`` rows ``[L + G - 1, Ht]`` (only the multimodal
            positions are read).
    """

    prompt_ids: torch.Tensor
    reply_ids: torch.Tensor
    embeds: torch.Tensor
    hidden: torch.Tensor


@dataclass(frozen=True)
class TalkerPrompt:
    """``prefill [P, H]``, ``positions`` of the prefill (``[3, P]`` + decode delta),
    ``step_rows [T, H]``: the text rows added at decode steps ``0..T-1``, then ``tts_pad [H]``."""

    prefill: torch.Tensor
    positions: PromptPositions
    step_rows: torch.Tensor
    tts_pad: torch.Tensor

    def text_row(self, step: int) -> torch.Tensor:
        """The text row added at decode step ``step`` ``[1, H]``."""
        return (self.step_rows[step] if step < self.step_rows.shape[0] else self.tts_pad)[None]


def _user_mask(ids: torch.Tensor, config: Qwen3OmniConfig) -> torch.Tensor:
    n = ids.shape[0]
    index = torch.arange(n)
    starts = torch.where(ids == config.im_start_id, index, torch.full_like(index, -1))
    latest = torch.cummax(starts, dim=0).values.clamp_min(0)
    return ids[(latest + 1).clamp_max(n - 1)] == config.user_id


def talker_prompt_length(prompt_ids: torch.Tensor, config: Qwen3OmniConfig) -> int:
    """Rows of the talker's prefill for the thinker prompt ``prompt_ids`` ``[L] int64``
    (:func:`build_talker_prompt`'s ``prefill``): its user turns' tokens and the
    :data:`TAIL_ROWS` of the assistant tail."""
    return int(_user_mask(prompt_ids, config).sum()) + TAIL_ROWS


def build_talker_prompt(
    talker: Talker,
    thinker_embed: torch.nn.Embedding,
    config: Qwen3OmniConfig,
    rows: ThinkerRows,
    voice: str,
    layout: MultimodalLayout = MultimodalLayout(),
) -> TalkerPrompt:
    """Args:
        talker: the loaded talker (its projections and codec embedding are used).
        thinker_embed: the thinker's ``embed_tokens`` (tts_pad / tts_bos / tts_eos rows).
        config: the checkpoint config (special ids).
        rows: the thinker's output for this request.
        voice: a name of ``talker_config.speaker_id`` (any case).
        layout: the prompt's multimodal layout (for the talker's MRoPE positions).

    Raises:
        ValueError: unknown voice (the message lists the known ones), no
            ``<|im_start|>assistant`` in the prompt, fewer than two reply tokens, or row counts
            that do not match the ids.
    """
    assert config.talker is not None
    tc = config.talker
    key = voice.lower()
    if key not in tc.speaker_id:
        raise ValueError(f"unknown voice {voice!r}; known: {sorted(tc.speaker_id)}")
    ids, reply = rows.prompt_ids.cpu(), rows.reply_ids.cpu()
    fed = ids.shape[0] + reply.shape[0] - 1
    if reply.shape[0] < 2:
        raise ValueError(
            "the talker needs at least two reply tokens (the first must have been fed back)"
        )
    if rows.embeds.shape[0] != fed or rows.hidden.shape[0] != fed:
        raise ValueError(
            f"thinker rows: {rows.embeds.shape[0]} embeds, {rows.hidden.shape[0]} hidden; expected {fed}"
        )
    opens = (
        ((ids[:-1] == config.im_start_id) & (ids[1:] == config.assistant_id)).nonzero().flatten()
    )
    if opens.numel() == 0:
        raise ValueError("the prompt has no <|im_start|>assistant turn")
    start = int(opens[-1])
    th = config.thinker
    multimodal = (
        (ids == th.audio_token_id) | (ids == th.image_token_id) | (ids == th.video_token_id)
    )
    user = _user_mask(ids, config)
    device = rows.embeds.device
    # the ids are host tensors and every index is found on the host; the indices reach the
    # device by pinned uploads (upload), which do not wait for the device: the talker's
    # prompt is built while the thinker's steps are queued on the same stream
    user_idx, mm = user.nonzero().flatten(), multimodal[user]
    user_rows = talker.text_projection(rows.embeds[upload(user_idx, device)])
    if bool(mm.any()):
        mm_rows = talker.hidden_projection(rows.hidden[upload(user_idx[mm], device)])
        user_rows = user_rows.index_copy(0, upload(mm.nonzero().flatten(), device), mm_rows)
    special = upload([config.tts_pad_id, config.tts_bos_id, config.tts_eos_id], device)
    tts_pad, tts_bos, tts_eos = talker.text_projection(thinker_embed(special)).to(user_rows.dtype)
    assistant = talker.text_projection(rows.embeds[start:fed])
    text = torch.cat((assistant[:3], tts_pad.expand(4, -1), tts_bos[None], assistant[3:4]))
    codec_ids = upload(
        [
            tc.codec_nothink_id,
            tc.codec_think_bos_id,
            tc.codec_think_eos_id,
            tc.speaker_id[key],
            tc.codec_pad_id,
            tc.codec_bos_id,
        ],
        device,
    )
    codec = torch.cat(
        (
            torch.zeros(3, text.shape[1], dtype=text.dtype, device=device),
            talker.codec_embed(codec_ids),
        )
    )
    prefill = torch.cat((user_rows, text + codec))
    talker_ids = torch.cat(
        (ids[user], torch.full((TAIL_ROWS,), config.tts_pad_id, dtype=ids.dtype))
    )
    if layout.use_audio_in_video:
        # transformers' generate does not hand use_audio_in_video to the talker: its positions
        # take each clip's audio as plain audio and the clip's video placeholders as text
        layout = MultimodalLayout(
            image_grids=layout.image_grids, audio_lengths=layout.audio_lengths
        )
    return TalkerPrompt(
        prefill=prefill,
        positions=prompt_positions(talker_ids.tolist(), th, layout),
        step_rows=torch.cat((assistant[4:], tts_eos[None])),
        tts_pad=tts_pad,
    )
