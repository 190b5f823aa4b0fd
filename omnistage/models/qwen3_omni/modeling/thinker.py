"""The thinker's text model and LM head (checkpoint prefixes ``thinker.model``, ``thinker.lm_head``).

A :class:`~omnistage.models.qwen3_omni.modeling.decoder.MoEDecoder` with routed experts in
every MoE layer (no shared expert) and ``embed_tokens [vocab, H]``; the LM head is untied
(``tie_word_embeddings`` false in the shipped config). Multimodal rows are merged by the
caller: placeholder embeddings at audio/image/video token positions are replaced by the
encoders' outputs before :meth:`ThinkerTextModel.decode`, and the vision encoder's deepstack
features are passed as the engine's :class:`~omnistage.engine.sequence.HiddenAdditions`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from omnistage.engine.attention import AttentionBackend
from omnistage.engine.model_runner import upload
from omnistage.engine.sequence import HiddenAdditions
from omnistage.models.qwen3_omni.modeling.config import ThinkerConfig
from omnistage.models.qwen3_omni.modeling.decoder import MoEDecoder, routed_or_dense

__all__ = ["EncoderRows", "Thinker", "ThinkerTextModel"]


@dataclass(frozen=True)
class EncoderRows:
    """The encoders' outputs for one prompt, each in prompt order, thinker width ``H``.

    Attributes:
        audio: ``[Na, H]`` rows for the audio placeholder tokens (all audios concatenated).
        image, video: ``[Ni, H]`` / ``[Nv, H]`` rows for the image / video placeholder tokens.
        image_deepstack, video_deepstack: per deepstack level, ``[Ni, H]`` / ``[Nv, H]``.
    """

    audio: torch.Tensor | None = None
    image: torch.Tensor | None = None
    image_deepstack: tuple[torch.Tensor, ...] = ()
    video: torch.Tensor | None = None
    video_deepstack: tuple[torch.Tensor, ...] = ()


class ThinkerTextModel(MoEDecoder):
    """Decoder stack plus ``embed_tokens`` (prefix ``thinker.model``)."""

    def __init__(self, config: ThinkerConfig) -> None:
        super().__init__(config.text, routed_or_dense)
        self.embed_tokens = nn.Embedding(config.text.vocab_size, config.text.hidden_size)


class Thinker(nn.Module):
    """The thinker's language part: ``model`` and ``lm_head`` (the encoders ``audio_tower`` and
    ``visual`` are attached beside them by :class:`~omnistage.models.qwen3_omni.modeling.model.Qwen3OmniModel`)."""

    def __init__(self, config: ThinkerConfig) -> None:
        super().__init__()
        self.config = config
        self.model = ThinkerTextModel(config)
        self.lm_head = nn.Linear(config.text.hidden_size, config.text.vocab_size, bias=False)

    def reset_buffers(self, device: torch.device | str) -> None:
        """Rebuild the RoPE buffers on ``device`` (after a meta-device build)."""
        self.model.reset_buffers(device)

    def embed(self, token_ids: torch.Tensor) -> torch.Tensor:
        """``[L] int64`` -> ``[L, H]``."""
        return self.model.embed_tokens(token_ids)

    def forward(
        self, input_embeds: torch.Tensor, positions: torch.Tensor, attn: AttentionBackend
    ) -> torch.Tensor:
        """The engine contract: ``[N, H]`` rows, positions ``[3, N]`` or ``[N]`` -> hidden ``[N, H]``."""
        return self.model(input_embeds, positions, attn)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """``[B, H]`` -> ``[B, vocab]`` in the activation dtype."""
        return self.lm_head(hidden)

    def merge(
        self, input_ids: torch.Tensor, rows: EncoderRows
    ) -> tuple[torch.Tensor, HiddenAdditions | None]:
        """Prompt embeddings ``[L, H]`` on the model's device with the encoder rows at their
        placeholder tokens, and the deepstack features at the visual (image or video) positions,
        image and video rows interleaved in prompt order (transformers'
        ``Qwen3OmniMoeThinkerModel.forward``); the additions' ``rows`` are host positions.

        ``input_ids``: ``[L] int64`` on the host. The placeholders are found there and the ids
        and indices are uploaded without waiting (:func:`~omnistage.engine.model_runner.upload`),
        so the merge never waits for the device: on the thinker's stage thread a wait would
        queue behind the engine's decode steps on the stream.

        Raises: ValueError when ``input_ids`` is not on the host, a modality's placeholder
        count differs from its rows, or image and video carry different numbers of deepstack
        levels."""
        if input_ids.device.type != "cpu":
            raise ValueError(f"input_ids must be on the host, got {input_ids.device}")
        c = self.config
        device = self.model.embed_tokens.weight.device
        embeds = self.embed(upload(input_ids, device))
        visual = torch.zeros_like(input_ids, dtype=torch.bool)
        blocks: list[tuple[torch.Tensor, tuple[torch.Tensor, ...]]] = []  # visual: host index, deepstack
        for token, block, deepstack, name in (
            (c.audio_token_id, rows.audio, (), "audio"),
            (c.image_token_id, rows.image, rows.image_deepstack, "image"),
            (c.video_token_id, rows.video, rows.video_deepstack, "video"),
        ):
            mask = input_ids == token
            index = mask.nonzero().flatten()
            count = index.shape[0]
            if count != (0 if block is None else block.shape[0]):
                raise ValueError(
                    f"{count} {name} placeholder tokens but {0 if block is None else block.shape[0]} {name} rows"
                )
            if block is None or count == 0:
                continue
            embeds = embeds.index_copy(0, upload(index, device), block.to(embeds.dtype))
            if name != "audio":
                visual |= mask
                if blocks and len(blocks[0][1]) != len(deepstack):
                    raise ValueError(
                        f"image and video have {len(blocks[0][1])} and {len(deepstack)} deepstack levels"
                    )
                blocks.append((index, deepstack))
        if not blocks or not blocks[0][1]:
            return embeds, None
        rows_index = visual.nonzero().flatten()
        # each block's rows among the visual positions, found on the host, uploaded once
        slot = torch.full_like(input_ids, -1)
        slot[rows_index] = torch.arange(rows_index.shape[0])
        placed = [(upload(slot[index], device), deepstack) for index, deepstack in blocks]
        joint = []
        for level in range(len(blocks[0][1])):
            out = embeds.new_zeros(rows_index.shape[0], embeds.shape[1])
            for where, deepstack in placed:
                out.index_copy_(0, where, deepstack[level].to(embeds.dtype))
            joint.append(out)
        return embeds, HiddenAdditions(rows=rows_index, embeds=tuple(joint))
