"""Reference fixtures for the Qwen3-TTS talker parity tests, from the official ``qwen-tts``.

Runs the official reference package (qwen-tts 0.1.1, transformers 4.57.3) on OUR tiny
random checkpoints and writes ``tests/models/qwen3_tts/fixtures/talker_reference.safetensors``
(~0.3 MB): for every case, the reference's prefill embeddings, trailing text rows, first
code-0 logits and greedy codes; plus the speaker-encoder x-vector of a stored clip.

Regenerate (from the repository root; the omnistage venv writes the checkpoints, the
reference environment reads them):

    . .venv/bin/activate
    for t in base custom_voice voice_design; do
        omnistage init-random --size tiny --type $t --seed 0 /tmp/qwen3_tts_tiny/$t
    done
    /work/refenv/bin/python tools/parity/qwen3_tts_talker_reference.py /tmp/qwen3_tts_tiny

(``/work/refenv``: ``python -m venv`` + ``pip install torch==2.13.0 qwen-tts==0.1.1
transformers==4.57.3``.) The tests rebuild the same checkpoints with seed 0 and check the
weights' digest stored here first, so a changed initializer asks for regeneration instead
of failing obscurely.

Reference settings: greedy talker (``do_sample=False``, repetition penalty 1.05 still
applied), greedy predictor, ``max_new_tokens = FRAMES + 1`` (the reference returns FRAMES
frames: its last code 0 is never completed). ICL reference codes are fixed random ids fed
through the reference's ``voice_clone_prompt`` (no speech tokenizer involved).

The reference's 25 Hz tokenizer imports torchaudio, whose CPU wheel does not match torch
2.13 in the reference environment; it is unused here, so empty stand-in modules satisfy that
import.
"""

from __future__ import annotations

import hashlib
import importlib.machinery
import json
import sys
import types
from pathlib import Path

import torch

FRAMES = 24
CLIP_SAMPLES = 12000  # 0.5 s at 24 kHz
REF_FRAMES = 17
OUT = Path(__file__).resolve().parents[2] / "tests/models/qwen3_tts/fixtures/talker_reference.safetensors"

# name -> (checkpoint type, generate kwargs of our PromptBuilder's vocabulary)
CASES = {
    "base_xvector_streaming": ("base", {"text": "Hello there.", "language": "english", "non_streaming": False}),
    "base_xvector_nonstreaming": ("base", {"text": "Hello there.", "language": "auto", "non_streaming": True}),
    "base_icl_streaming": ("base", {"text": "Good day to you all.", "language": "english", "ref_text": "ok", "non_streaming": False}),
    "base_icl_streaming_long_text": (
        "base", {"text": "A much longer sentence than the reference audio is.", "language": "english", "ref_text": "hi", "non_streaming": False},
    ),
    "base_icl_nonstreaming": ("base", {"text": "Good day.", "language": "auto", "ref_text": "ok", "non_streaming": True}),
    "custom_voice_nonstreaming": ("custom_voice", {"text": "Hi, Vivian here.", "language": "english", "speaker": "vivian", "non_streaming": True}),
    "custom_voice_dialect_streaming": ("custom_voice", {"text": "你好", "language": "auto", "speaker": "Eric", "non_streaming": False}),
    "custom_voice_instruct": (
        "custom_voice", {"text": "Slowly now.", "language": "chinese", "speaker": "ryan", "instruct": "Speak slowly.", "non_streaming": True},
    ),
    "voice_design_nonstreaming": ("voice_design", {"text": "Design me.", "language": "english", "instruct": "A calm low voice.", "non_streaming": True}),
    "voice_design_streaming": ("voice_design", {"text": "Design me.", "language": "auto", "instruct": "Bright and fast.", "non_streaming": False}),
}


def _stub_torchaudio() -> None:
    for name in ("torchaudio", "torchaudio.compliance", "torchaudio.compliance.kaldi"):
        module = types.ModuleType(name)
        module.__spec__ = importlib.machinery.ModuleSpec(name, None)
        sys.modules[name] = module
    sys.modules["torchaudio"].compliance = sys.modules["torchaudio.compliance"]
    sys.modules["torchaudio.compliance"].kaldi = sys.modules["torchaudio.compliance.kaldi"]


def weights_digest(checkpoint_dir: Path) -> str:
    """sha256 of model.safetensors (the tests recompute it on their rebuilt checkpoint)."""
    return hashlib.sha256((checkpoint_dir / "model.safetensors").read_bytes()).hexdigest()


def clip() -> torch.Tensor:
    """A deterministic 0.5 s test clip: two tones and seeded noise, peak < 1."""
    t = torch.arange(CLIP_SAMPLES, dtype=torch.float64) / 24000
    noise = torch.randn(CLIP_SAMPLES, generator=torch.Generator().manual_seed(7), dtype=torch.float64)
    return (0.3 * torch.sin(2 * torch.pi * 220 * t) + 0.2 * torch.sin(2 * torch.pi * 1310 * t) + 0.05 * noise).float()


def ref_codes() -> torch.Tensor:
    return torch.randint(0, 2048, (REF_FRAMES, 16), generator=torch.Generator().manual_seed(11))


def main(root: Path) -> None:
    _stub_torchaudio()
    from qwen_tts import Qwen3TTSModel
    from qwen_tts.core.models import (
        Qwen3TTSConfig,
        Qwen3TTSForConditionalGeneration,
        Qwen3TTSProcessor,
    )
    from safetensors.torch import save_file
    from transformers import AutoConfig, AutoModel, AutoProcessor

    AutoConfig.register("qwen3_tts", Qwen3TTSConfig)
    AutoModel.register(Qwen3TTSConfig, Qwen3TTSForConditionalGeneration)
    AutoProcessor.register(Qwen3TTSConfig, Qwen3TTSProcessor)
    torch.set_grad_enabled(False)

    tensors: dict[str, torch.Tensor] = {}
    meta: dict[str, object] = {"frames": FRAMES, "digests": {}, "cases": {}}
    wrappers = {}
    for model_type in ("base", "custom_voice", "voice_design"):
        # the full official loader: config, weights (strict), speech tokenizer, processor
        wrapper = Qwen3TTSModel.from_pretrained(str(root / model_type), dtype=torch.float32, attn_implementation="eager")
        wrappers[model_type] = wrapper
        meta["digests"][model_type] = weights_digest(root / model_type)

    base = wrappers["base"].model
    wav = clip()
    tensors["clip"] = wav
    x_vector = base.extract_speaker_embedding(wav.numpy(), 24000).float()
    tensors["speaker.x_vector"] = x_vector
    tensors["icl.ref_codes"] = ref_codes()

    for name, (model_type, case) in CASES.items():
        wrapper = wrappers[model_type]
        model = wrapper.model
        captured = {}
        original = model.talker.generate

        def capture(*args, _original=original, _captured=captured, **kwargs):
            _captured.update(kwargs)
            return _original(*args, **kwargs)

        model.talker.generate = capture
        input_ids = wrapper._tokenize_texts([wrapper._build_assistant_text(case["text"])])
        kwargs = {}
        if "instruct" in case:
            kwargs["instruct_ids"] = wrapper._tokenize_texts([wrapper._build_instruct_text(case["instruct"])])
        if "speaker" in case:
            kwargs["speakers"] = [case["speaker"]]
        if model_type == "base":
            icl = "ref_text" in case
            kwargs["voice_clone_prompt"] = {
                "ref_code": [tensors["icl.ref_codes"]] if icl else [None],
                "ref_spk_embedding": [x_vector],
                "x_vector_only_mode": [not icl],
                "icl_mode": [icl],
            }
            if icl:
                kwargs["ref_ids"] = wrapper._tokenize_texts([wrapper._build_ref_text(case["ref_text"])])
        codes, _ = model.generate(
            input_ids=input_ids, languages=[case["language"]], non_streaming_mode=case["non_streaming"],
            max_new_tokens=FRAMES + 1, do_sample=False, subtalker_dosample=False, repetition_penalty=1.05, **kwargs,
        )
        model.talker.generate = original
        prefill = captured["inputs_embeds"][0]
        trailing = captured["trailing_text_hidden"][0]
        if trailing.shape[0] == 1 and torch.equal(trailing[0], captured["tts_pad_embed"].reshape(-1)):
            trailing = trailing[:0]  # "trailing = tts_pad": no text rows, tts_pad from step 0
        logits = model.talker(inputs_embeds=prefill[None], attention_mask=torch.ones(1, prefill.shape[0], dtype=torch.long)).logits[0, -1]
        tensors[f"{name}.prefill"] = prefill.contiguous()
        tensors[f"{name}.trailing"] = trailing.contiguous()
        tensors[f"{name}.tts_pad"] = captured["tts_pad_embed"].reshape(-1).contiguous()
        tensors[f"{name}.logits"] = logits.contiguous()
        tensors[f"{name}.codes"] = codes[0].contiguous()
        meta["cases"][name] = {"type": model_type, **case}
        print(f"{name}: prefill {tuple(prefill.shape)}, trailing {tuple(trailing.shape)}, codes {tuple(codes[0].shape)}")

    OUT.parent.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(OUT), metadata={"meta": json.dumps(meta)})
    print(f"wrote {OUT} ({OUT.stat().st_size} bytes)")


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit(__doc__)
    main(Path(sys.argv[1]))
