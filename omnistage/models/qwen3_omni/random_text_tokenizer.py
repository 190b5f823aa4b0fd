"""A small byte-level BPE tokenizer with Qwen3-Omni's special tokens at their real ids, for
tests and the parity script.

The shared writer (:mod:`omnistage.checkpoint.text_tokenizer`) with the
special-token table of the Qwen2.5/Qwen3 vocabularies from ``<|endoftext|>`` (151643) to
``<|audio_pad|>`` (151675): the ids the Qwen3-Omni config records (shared/reference/
qwen3-omni.md, section 1), and the ``extra_special_tokens`` names transformers'
Qwen3-Omni processor reads (``tokenizer.image_token`` ...). No chat template: without one
the processor uses ours (:data:`omnistage.models.qwen3_omni.processing.CHAT_TEMPLATE`).
"""

from __future__ import annotations

import json
from pathlib import Path

from omnistage.checkpoint.text_tokenizer import write_text_tokenizer as _write

SPECIAL_START = 151643
SPECIAL_TOKENS = {
    0: "<|endoftext|>", 1: "<|im_start|>", 2: "<|im_end|>", 9: "<|vision_start|>",
    10: "<|vision_end|>", 11: "<|vision_pad|>", 12: "<|image_pad|>", 13: "<|video_pad|>",
    24: "<think>", 25: "</think>", 26: "<|audio_start|>", 27: "<|audio_end|>", 28: "<tts_pad>",
    29: "<tts_text_bos>", 30: "<tts_text_eod>", 31: "<tts_text_bos_single>", 32: "<|audio_pad|>",
}  # fmt: skip
EXTRA_SPECIAL_TOKENS = {
    "image_token": "<|image_pad|>", "video_token": "<|video_pad|>", "audio_token": "<|audio_pad|>",
    "vision_bos_token": "<|vision_start|>", "vision_eos_token": "<|vision_end|>",
    "audio_bos_token": "<|audio_start|>", "audio_eos_token": "<|audio_end|>",
}  # fmt: skip


def write_text_tokenizer(out_dir: str | Path) -> None:
    """Write ``vocab.json``, ``merges.txt`` and ``tokenizer_config.json`` (``Qwen2Tokenizer``,
    151676 ids) into ``out_dir`` (created if missing)."""
    _write(
        Path(out_dir),
        SPECIAL_START,
        SPECIAL_TOKENS,
        num_specials=max(SPECIAL_TOKENS) + 1,
        config_extra={"extra_special_tokens": EXTRA_SPECIAL_TOKENS},
    )


#: The role words whose ids the talker prompt reads (``talker_config``'s user/assistant ids).
ROLE_IDS = {"user": 872, "assistant": 77091}


def give_role_words_their_ids(directory: str | Path) -> None:
    """Give the role words ``user`` and ``assistant`` (single BPE tokens of the test
    tokenizer) their real ids, swapping ids with the unused tokens there: the talker prompt
    finds the user turns and the assistant opening by these ids (merges name strings, so
    they are unchanged). Idempotent: a word that has its id already is left as it is."""
    path = Path(directory) / "vocab.json"
    vocab = json.loads(path.read_text())
    for word, token_id in ROLE_IDS.items():
        if vocab[word] == token_id:
            continue
        unused = f"<|unused_{token_id}|>"
        vocab[word], vocab[unused] = token_id, vocab[word]
    path.write_text(json.dumps(vocab))
