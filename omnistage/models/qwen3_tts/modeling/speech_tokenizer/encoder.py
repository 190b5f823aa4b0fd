"""The Qwen3-TTS 12 Hz speech tokenizer's encoder: 24 kHz mono audio -> codes ``[T, 16]``.

The encoder is Mimi (SEANet, a causal sliding-window transformer, a stride-2 downsample
and a split residual quantizer; shared/reference/qwen3-tts.md, section 6), built here from
transformers' own Mimi modules (``MimiEncoderModel`` + ``MimiSplitResidualVectorQuantizer``)
and the checkpoint's ``encoder_config``. The checkpoint stores it in the older
transformers layout (one ``MimiModel``); :data:`CHECKPOINT_PREFIXES` maps those names.
Of the 32 quantizers the first ``encoder_valid_num_quantizers`` (16) are kept.

A clip of ``S`` samples gives ``ceil(S / 1920)`` frames, as in the reference, which
encodes zero-padded batches and trims each clip's codes to that count.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path

import torch
from safetensors.torch import load_file
from torch import nn
from transformers import MimiConfig
from transformers.models.mimi.modeling_mimi import (
    MimiConv1d,
    MimiEncoderModel,
    MimiSplitResidualVectorQuantizer,
)

from omnistage.models.qwen3_tts.modeling.speech_tokenizer.config import SpeechTokenizerConfig

# checkpoint name prefix -> module name prefix (old single-MimiModel layout -> ours)
CHECKPOINT_PREFIXES = (
    ("encoder.encoder.", "encoder.encoder_seanet."),
    ("encoder.encoder_transformer.", "encoder.encoder_transformer."),
    ("encoder.downsample.", "encoder.downsample."),
    ("encoder.quantizer.", "quantizer."),
)


def _rename(name: str, pairs: Sequence[tuple[str, str]]) -> str | None:
    for old, new in pairs:
        if name.startswith(old):
            return new + name[len(old) :]
    return None


def encoder_state_dict(checkpoint: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The encoder's tensors from a speech tokenizer checkpoint, under this module's names."""
    renamed = {_rename(k, CHECKPOINT_PREFIXES): v for k, v in checkpoint.items()}
    return {k: v for k, v in renamed.items() if k is not None}


def checkpoint_name(module_name: str) -> str:
    """The checkpoint's name for one of this module's tensors (inverse of the mapping).

    Raises:
        KeyError: ``module_name`` is not an encoder tensor name.
    """
    name = _rename(module_name, [(new, old) for old, new in CHECKPOINT_PREFIXES])
    if name is None:
        raise KeyError(module_name)
    return name


class SpeechTokenizerEncoder(nn.Module):
    """Mimi encoder + the first ``encoder_valid_num_quantizers`` quantizers.

    Args:
        config: the speech tokenizer's config (``encoder`` is a Mimi config dict).
    """

    def __init__(self, config: SpeechTokenizerConfig) -> None:
        super().__init__()
        mimi = MimiConfig(**config.encoder)
        self.encoder = MimiEncoderModel(mimi.encoder_config)
        self.quantizer = MimiSplitResidualVectorQuantizer(mimi)
        self.num_quantizers = config.encoder_valid_num_quantizers
        self.samples_per_frame = config.encode_downsample_rate
        self.sample_rate = config.input_sample_rate
        _keep_conv_lengths_on_host(self.encoder)

    @torch.inference_mode()
    def encode_batch(self, clips: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """Encode several clips in one zero-padded batch.

        Args:
            clips: 1-D float tensors ``[S_i]``, 24 kHz mono (the request builder's
                :func:`~omnistage.models.qwen3_tts.request_builders.load_reference` output),
                each with ``S_i >= 1``.

        Returns:
            Per clip, codes ``[ceil(S_i / 1920), 16]`` int64 on the encoder's device.

        Raises:
            ValueError: no clips, or a clip that is empty or not 1-D.
        """
        if not clips or any(c.dim() != 1 or c.numel() == 0 for c in clips):
            raise ValueError("encode_batch needs one or more non-empty 1-D clips")
        weight = next(self.parameters())
        longest = max(c.numel() for c in clips)
        batch = torch.zeros(len(clips), 1, longest, dtype=weight.dtype, device=weight.device)
        for i, clip in enumerate(clips):
            batch[i, 0, : clip.numel()] = clip.to(batch)
        latents = self.encoder(batch).latents
        codes = self.quantizer.encode(latents, self.num_quantizers)  # [K, B, T]
        return [codes[:, i, : math.ceil(c.numel() / self.samples_per_frame)].T.contiguous() for i, c in enumerate(clips)]

    def encode(self, clip: torch.Tensor) -> torch.Tensor:
        """One clip ``[S]`` (24 kHz mono float) -> codes ``[ceil(S / 1920), 16]`` int64.
        Raises ValueError as :meth:`encode_batch`."""
        return self.encode_batch([clip])[0]


#: The length buffers of transformers' ``MimiConv1d`` (0-dim int64, not in checkpoints):
#: its forward computes each conv's padding from them and hands it to ``F.pad``, which
#: reads it back as Python ints: on a device, two host syncs per conv (30 per encode of the
#: 0.6B/1.7B speech tokenizer, whose 15 convs each wait for the GPU to drain).
_CONV_LENGTHS = ("stride", "kernel_size", "padding_total")


def _keep_conv_lengths_on_host(module: nn.Module) -> None:
    """Turn every ``MimiConv1d``'s :data:`_CONV_LENGTHS` buffers into plain attributes (CPU
    copies of the same values), which ``.to(device)`` leaves on the host, as the module's own
    ``padding_left`` / ``padding_right`` already are: the padding arithmetic then stays on
    the CPU, same integers, no sync."""
    for conv in module.modules():
        if isinstance(conv, MimiConv1d):
            for name in _CONV_LENGTHS:
                # a copy: the registered tensor is marked a Buffer and would register again
                setattr(conv, name, conv._buffers.pop(name).clone())


def load_encoder(directory: str | Path, device: torch.device | str = "cpu") -> SpeechTokenizerEncoder:
    """Build the fp32 encoder from a ``speech_tokenizer`` folder.

    Raises:
        FileNotFoundError: a file is missing.
        RuntimeError: the checkpoint's encoder tensors do not match the config.
    """
    config = SpeechTokenizerConfig.load(directory)
    encoder = SpeechTokenizerEncoder(config)
    weights = encoder_state_dict(load_file(Path(directory) / "model.safetensors"))
    encoder.load_state_dict(weights, strict=True)
    return encoder.to(device).eval().requires_grad_(False)
