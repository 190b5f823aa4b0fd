"""A small byte-level BPE text tokenizer in the Qwen2 file layout, for random checkpoints
of the Qwen model families (each passes its own special-token table).

Writes ``vocab.json``, ``merges.txt`` and ``tokenizer_config.json`` (``Qwen2Tokenizer``)
that both transformers 4.57 (the reference's pin) and 5.x load. The vocabulary is the 256
byte symbols (GPT-2's printable byte mapping, Radford et al. 2019) plus merges that make
``assistant`` and ``user`` single tokens (``\\n`` already is one), so the reference's prompt
slices ([:3] role, [3:-5] text, [3:-2] ref text) hold. The special tokens follow Qwen's
layout: ``<|endoftext|>`` at ``special_start``, ``<|im_start|>`` +1, ``<|im_end|>`` +2,
``<tts_pad>`` +28, ``<tts_text_bos>`` +29, ``<tts_text_eod>`` +30 (real ids 151643..151673
with ``special_start = 151643``); the ids in between are reserved special tokens. Ids from
the BPE vocabulary up to ``special_start`` are unreachable fillers.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

__all__ = ["SpecialTokenIds", "base_vocab_size", "write_text_tokenizer"]

_MERGED_WORDS = ("assistant", "user")
_SPECIALS = {0: "<|endoftext|>", 1: "<|im_start|>", 2: "<|im_end|>", 28: "<tts_pad>", 29: "<tts_text_bos>", 30: "<tts_text_eod>"}
NUM_SPECIALS = 31


@dataclass(frozen=True)
class SpecialTokenIds:
    """Text ids the config.json records."""

    im_start: int
    im_end: int
    tts_pad: int
    tts_bos: int
    tts_eos: int


def _byte_symbols() -> list[str]:
    """The printable stand-in of each byte 0..255: printable Latin-1 bytes map to themselves,
    the rest to code points 256.. in byte order."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    symbols, extra = [], 0
    for byte in range(256):
        if byte in printable:
            symbols.append(chr(byte))
        else:
            symbols.append(chr(256 + extra))
            extra += 1
    return symbols


def _merges() -> list[tuple[str, str]]:
    merges: list[tuple[str, str]] = []
    for word in _MERGED_WORDS:
        token = word[0]
        for char in word[1:]:
            if (token, char) not in merges:
                merges.append((token, char))
            token += char
    return merges


def base_vocab_size() -> int:
    """Size of the BPE vocabulary (bytes + merged tokens) before fillers and specials."""
    return 256 + len(_merges())


def write_text_tokenizer(
    out_dir: Path,
    special_start: int,
    specials: dict[int, str] | None = None,
    num_specials: int = NUM_SPECIALS,
    config_extra: dict | None = None,
) -> SpecialTokenIds:
    """Write the three tokenizer files into ``out_dir``.

    Args:
        special_start: id of ``<|endoftext|>`` (>= :func:`base_vocab_size`); the tokenizer
            then has ``special_start + num_specials`` ids.
        specials: offset -> special token, replacing the default names above (e.g. a
            model's ``<|audio_pad|>`` at +32); offsets without a name are reserved tokens.
        num_specials: special tokens written [31].
        config_extra: entries added to ``tokenizer_config.json`` (e.g. a chat template).

    Raises:
        ValueError: ``special_start`` is below the BPE vocabulary size.
    """
    merges = _merges()
    vocab = {symbol: i for i, symbol in enumerate(_byte_symbols())}
    for left, right in merges:
        vocab[left + right] = len(vocab)
    if special_start < len(vocab):
        raise ValueError(f"special_start {special_start} < BPE vocabulary size {len(vocab)}")
    for i in range(len(vocab), special_start):
        vocab[f"<|unused_{i}|>"] = i
    added = {}
    names = _SPECIALS if specials is None else specials
    for offset in range(num_specials):
        content = names.get(offset, f"<|reserved_{offset}|>")
        added[str(special_start + offset)] = {
            "content": content, "lstrip": False, "normalized": False, "rstrip": False, "single_word": False, "special": True,
        }
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "vocab.json").write_text(json.dumps(vocab, ensure_ascii=False), encoding="utf-8")
    (out_dir / "merges.txt").write_text("#version: 0.2\n" + "".join(f"{a} {b}\n" for a, b in merges), encoding="utf-8")
    config = {
        "tokenizer_class": "Qwen2Tokenizer",
        "added_tokens_decoder": added,
        "additional_special_tokens": ["<|im_start|>", "<|im_end|>"],
        "bos_token": None,
        "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>",
        "unk_token": None,
        "errors": "replace",
        "clean_up_tokenization_spaces": False,
        "split_special_tokens": False,
        "model_max_length": 131072,
        **(config_extra or {}),
    }
    (out_dir / "tokenizer_config.json").write_text(json.dumps(config, indent=2), encoding="utf-8")
    return SpecialTokenIds(
        im_start=special_start + 1, im_end=special_start + 2,
        tts_pad=special_start + 28, tts_bos=special_start + 29, tts_eos=special_start + 30,
    )
