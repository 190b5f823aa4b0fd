"""Load a Qwen3-TTS checkpoint directory into our modules.

Reads config.json, generation_config.json (mandatory), the text tokenizer (vocab.json,
merges.txt, tokenizer_config.json) and the weights: ``model.safetensors`` or shards listed
by ``model.safetensors.index.json``. Tensor names must match the module tree exactly; any
missing or unexpected name is an error that lists them. Modules are built on the meta
device and the tensors assigned directly (no random init, one copy of the weights).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open
from transformers import PreTrainedTokenizerBase, Qwen2Tokenizer

from omnistage.checkpoint.safetensors_files import CheckpointWeightsError, check_names, weight_files
from omnistage.models.qwen3_tts.modeling.config import (
    GenerationConfig,
    Qwen3TTSConfig,
    load_config,
    load_generation_config,
)
from omnistage.models.qwen3_tts.modeling.model import Qwen3TTSModel

__all__ = ["CheckpointWeightsError", "LoadedCheckpoint", "default_dtype", "load_checkpoint", "load_text_tokenizer", "weight_files"]

@dataclass
class LoadedCheckpoint:
    """A loaded checkpoint: model in eval mode on the requested device and dtype."""

    config: Qwen3TTSConfig
    generation: GenerationConfig
    tokenizer: PreTrainedTokenizerBase
    model: Qwen3TTSModel


def default_dtype(device: torch.device | str) -> torch.dtype:
    """bf16 on CUDA (the shipped checkpoints' dtype), fp32 elsewhere."""
    return torch.bfloat16 if torch.device(device).type == "cuda" else torch.float32


def load_checkpoint(
    checkpoint_dir: str | Path, device: torch.device | str = "cpu", dtype: torch.dtype | None = None
) -> LoadedCheckpoint:
    """Load config, generation config, tokenizer and weights.

    Args:
        checkpoint_dir: the checkpoint root (the speech tokenizer folder is not read here).
        device: where the weights go.
        dtype: weight dtype; default :func:`default_dtype` of ``device``. Non-persistent
            buffers (RoPE frequencies, mel filterbank) stay fp32.

    Raises:
        CheckpointConfigError: config.json or generation_config.json missing or incomplete.
        CheckpointWeightsError: weight files missing, names missing/unexpected, shape mismatch.
        OSError: the tokenizer files cannot be loaded.
    """
    root = Path(checkpoint_dir)
    config = load_config(root)
    generation = load_generation_config(root)
    dtype = dtype or default_dtype(device)
    with torch.device("meta"):
        model = Qwen3TTSModel(config)
    expected = model.state_dict()
    files = weight_files(root)
    check_names(set(expected), set(files), root)
    by_file: dict[Path, list[str]] = {}
    for name, file in files.items():
        by_file.setdefault(file, []).append(name)
    state = {}
    for file, names in sorted(by_file.items()):
        with safe_open(str(file), framework="pt", device=str(torch.device(device))) as f:
            for name in names:
                tensor = f.get_tensor(name)
                if tensor.shape != expected[name].shape:
                    raise CheckpointWeightsError(
                        f"{name} in {file.name} has shape {tuple(tensor.shape)}, the model expects {tuple(expected[name].shape)}"
                    )
                state[name] = tensor.to(dtype)
    model.load_state_dict(state, strict=True, assign=True)
    model.reset_buffers(device)
    tokenizer = load_text_tokenizer(root)
    return LoadedCheckpoint(config=config, generation=generation, tokenizer=tokenizer, model=model.eval().requires_grad_(False))


def load_text_tokenizer(checkpoint_dir: str | Path) -> PreTrainedTokenizerBase:
    """The checkpoint's text tokenizer (vocab.json, merges.txt, tokenizer_config.json).

    Raises: OSError: the files cannot be loaded."""
    # the class the reference's processor declares; AutoTokenizer would also parse config.json
    return Qwen2Tokenizer.from_pretrained(str(checkpoint_dir))
