"""Reference fixture of a whole served Qwen3-Omni chat request (text + audio, greedy), from
transformers 5.24.

Writes our tiny random checkpoint (seed 0, ``write_random_checkpoint``: every part, code2wav
included) with the test tokenizer (``omnistage.models.qwen3_omni.random_text_tokenizer``, role words at
their real ids), renders the request's messages to prompt ids with our processor (the
checkpoint has no chat template, so ours: the Qwen3-Omni ChatML layout), and runs
``Qwen3OmniMoeForConditionalGeneration.generate`` on them: greedy thinker
(``THINKER_TOKENS`` at most), greedy talker (its default repetition penalty 1.05,
``TALKER_FRAMES`` frames at most), speaker ``SPEAKER``. Stores
``tests/models/qwen3_omni/fixtures/chat_reference.safetensors`` (small): the prompt ids, the
reply tokens and the waveform (24 kHz float32), with the request's messages and the
checkpoint digest in the metadata.

``tests/models/qwen3_omni/test_chat_parity.py`` sends the same messages to the served tiny
model (``--load-format dummy`` draws the same weights) with ``max_tokens`` and
``max_audio_seconds`` set to these caps, and compares.

Regenerate (from the repository root, in the omnistage venv):

    python tools/parity/qwen3_omni_chat_reference.py
"""

from __future__ import annotations

import hashlib
import json
import sys
import tempfile
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from omnistage.models.qwen3_omni.processing import ChatMessage, ChatPart, Qwen3OmniProcessor  # noqa: E402
from omnistage.models.qwen3_omni.random_checkpoint import write_random_checkpoint  # noqa: E402
from omnistage.models.qwen3_omni.random_text_tokenizer import (  # noqa: E402
    give_role_words_their_ids,
    write_text_tokenizer,
)

OUT = ROOT / "tests/models/qwen3_omni/fixtures/chat_reference.safetensors"
SEED = 0
THINKER_TOKENS = 6
TALKER_FRAMES = 8  # = max_audio_seconds 0.64 at 12.5 frames per second
SPEAKER = "ethan"
MESSAGES = [
    {"role": "system", "content": "You are brief."},
    {"role": "user", "content": "Say something nice."},
]


def main() -> None:
    from safetensors.torch import save_file
    from transformers import Qwen3OmniMoeForConditionalGeneration

    torch.set_grad_enabled(False)
    with tempfile.TemporaryDirectory() as tmp:
        root = write_random_checkpoint(Path(tmp) / "tiny", "tiny", seed=SEED)
        write_text_tokenizer(root)
        give_role_words_their_ids(root)
        digest = hashlib.sha256((root / "model.safetensors").read_bytes()).hexdigest()
        processor = Qwen3OmniProcessor.from_checkpoint(root)
        messages = [ChatMessage(m["role"], (ChatPart("text", text=m["content"]),)) for m in MESSAGES]
        ids = processor(messages).input_ids[None]
        ref = Qwen3OmniMoeForConditionalGeneration.from_pretrained(
            str(root), dtype=torch.float32, attn_implementation="eager"
        ).eval()
    sequences, wav = ref.generate(
        input_ids=ids, attention_mask=torch.ones_like(ids), speaker=SPEAKER,
        thinker_max_new_tokens=THINKER_TOKENS, thinker_do_sample=False,
        talker_do_sample=False, talker_max_new_tokens=TALKER_FRAMES + 1,
    )  # fmt: skip
    tokens = sequences[0, ids.shape[1] :]
    tensors = {"ids": ids[0].contiguous(), "tokens": tokens.contiguous(), "waveform": wav.reshape(-1).contiguous()}
    meta = {"seed": SEED, "digest": digest, "messages": MESSAGES, "speaker": SPEAKER,
            "thinker_tokens": THINKER_TOKENS, "talker_frames": TALKER_FRAMES}  # fmt: skip
    OUT.parent.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(OUT), metadata={"meta": json.dumps(meta)})
    print(f"prompt {ids.shape[1]} ids, reply {tokens.tolist()}, {wav.numel()} samples; wrote {OUT} ({OUT.stat().st_size} bytes)")


if __name__ == "__main__":
    main()
