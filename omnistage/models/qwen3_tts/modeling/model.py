"""The Qwen3-TTS checkpoint's module tree: ``talker`` and, for Base, ``speaker_encoder``.

Its ``state_dict`` names are exactly the checkpoint's tensor names (the speech tokenizer
lives in its own folder and module). Non-persistent buffers (RoPE tables, the mel
filterbank and window) are fp32 and not in checkpoints: after building on the meta device
or casting the model, call :meth:`Qwen3TTSModel.reset_buffers`.
"""

from __future__ import annotations

import torch
from torch import nn

from omnistage.models.qwen3_tts.modeling.config import Qwen3TTSConfig
from omnistage.models.qwen3_tts.modeling.speaker_encoder import MelFrontEnd, SpeakerEncoder
from omnistage.models.qwen3_tts.modeling.talker import RotaryEmbedding, Talker

__all__ = ["Qwen3TTSModel"]


class Qwen3TTSModel(nn.Module):
    """``talker`` (:class:`Talker`) and ``speaker_encoder`` (:class:`SpeakerEncoder`, Base
    only, else ``None``)."""

    def __init__(self, config: Qwen3TTSConfig) -> None:
        super().__init__()
        self.config = config
        self.talker = Talker(config.talker, config.code_predictor)
        self.speaker_encoder = SpeakerEncoder(config.speaker_encoder) if config.speaker_encoder is not None else None

    def reset_buffers(self, device: torch.device | str) -> None:
        """Rebuild every fp32 non-persistent buffer on ``device``."""
        for module in self.modules():
            if isinstance(module, RotaryEmbedding | MelFrontEnd):
                module.reset_buffers(device)
