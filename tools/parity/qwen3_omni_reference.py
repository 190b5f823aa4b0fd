"""Reference fixtures for the Qwen3-Omni thinker/talker parity tests, from transformers 5.24.

Writes our tiny random checkpoint (seed 0, ``write_random_checkpoint``), loads it with
transformers' ``Qwen3OmniMoeForConditionalGeneration`` and runs its ``generate`` (greedy
thinker, greedy talker with its default repetition penalty 1.05) on a text prompt and on
image, audio, video and audio-in-video prompts. Stores
``tests/models/qwen3_omni/fixtures/thinker_talker_reference.safetensors`` (small): per case the
prompt ids, transformers' MRoPE positions and delta, the encoder rows the thinker received
(audio / image / video embeddings and deepstack features), the greedy thinker tokens, their
logits at a fixed set of vocabulary ids, the talker's prefill rows, first code-0 logits and
greedy codes.

The checkpoint holds every part (thinker with its encoders, talker, code2wav; code2wav is
unused here: ``qwen3_omni_encoders_reference.py`` covers it).
The encoders' raw inputs and their output rows are stored too, so the thinker is compared
both on identical encoder rows and end to end from the raw inputs through our encoders.
Placeholder counts follow transformers' own formulas (merged grid, audio feature lengths).
For audio in video, video and audio placeholders are laid out by the same time merge as the
positions.

Regenerate (from the repository root, in the omnistage venv, which has transformers 5.24):

    python tools/parity/qwen3_omni_reference.py
"""

from __future__ import annotations

import functools
import hashlib
import json
import sys
import tempfile
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from omnistage.models.qwen3_omni.random_checkpoint import write_random_checkpoint  # noqa: E402

OUT = ROOT / "tests/models/qwen3_omni/fixtures/thinker_talker_reference.safetensors"
SEED = 0
THINKER_TOKENS = 10
TALKER_FRAMES = 10
LOGIT_IDS = 256  # logits are stored at this many fixed vocabulary ids (plus each step's argmax)
SPEAKER = "ethan"
IM_START, IM_END, NL = 151644, 151645, 198
SYSTEM, USER, ASSISTANT = 8948, 872, 77091
VISION_START, VISION_END, IMAGE, VIDEO = 151652, 151653, 151655, 151656
AUDIO_START, AUDIO_END, AUDIO = 151669, 151670, 151675
PATCH_VALUES = 3 * 2 * 16 * 16  # channels * temporal patch * patch * patch


def weights_digest(checkpoint_dir: Path) -> str:
    """sha256 of model.safetensors (the tests recompute it on their rebuilt checkpoint)."""
    return hashlib.sha256((checkpoint_dir / "model.safetensors").read_bytes()).hexdigest()


def chat(user: list[int]) -> list[int]:
    """system turn, one user turn holding ``user``, an open assistant turn."""
    return [
        IM_START,
        SYSTEM,
        NL,
        2610,
        525,
        264,
        10950,
        IM_END,
        NL,
        IM_START,
        USER,
        NL,
        *user,
        IM_END,
        NL,
        IM_START,
        ASSISTANT,
        NL,
    ]


def audio_tokens(frames: int) -> int:
    from transformers.models.qwen3_omni_moe.modeling_qwen3_omni_moe import (
        _get_feat_extract_output_lengths,
    )

    return int(_get_feat_extract_output_lengths(torch.tensor(frames), 50))


def cases() -> dict[str, dict]:
    """name -> {"ids": prompt, "kwargs": generate inputs, "layout": our MultimodalLayout fields}."""
    g = torch.Generator().manual_seed(SEED)
    image_grid, video_grid, seconds = (
        [1, 4, 4],
        [2, 4, 4],
        0.5,
    )  # 0.5 s per grid: fractional T positions
    n_image, n_video = 4, 8
    audio_frames = 150
    n_audio = audio_tokens(audio_frames)
    pixels = torch.randn(16, PATCH_VALUES, generator=g)
    video = torch.randn(32, PATCH_VALUES, generator=g)
    mel = torch.randn(1, 128, audio_frames, generator=g)
    mel_mask = torch.ones(1, audio_frames, dtype=torch.long)
    text = [9707, 11, 1246, 525, 498, 3351, 30]
    image_kw = {"pixel_values": pixels, "image_grid_thw": torch.tensor([image_grid])}
    audio_kw = {"input_features": mel, "feature_attention_mask": mel_mask}
    video_kw = {"pixel_values_videos": video, "video_grid_thw": torch.tensor([video_grid]),
                "video_second_per_grid": torch.tensor([seconds])}  # fmt: skip
    image_block = [VISION_START, *[IMAGE] * n_image, VISION_END]
    audio_block = [AUDIO_START, *[AUDIO] * n_audio, AUDIO_END]
    video_block = [VISION_START, *[VIDEO] * n_video, VISION_END]
    return {
        "text": {"ids": chat(text), "kwargs": {}, "layout": {}},
        "image": {"ids": chat([*image_block, *text[:3]]), "kwargs": image_kw, "layout": {"image_grids": [image_grid]}},
        "audio": {"ids": chat([*audio_block, *text[:3]]), "kwargs": audio_kw, "layout": {"audio_lengths": [n_audio]}},
        "video": {
            "ids": chat([*video_block, *text[:2]]), "kwargs": video_kw,
            "layout": {"video_grids": [video_grid], "video_seconds_per_grid": [seconds]},
        },
        "image_audio_video": {
            "ids": chat([*image_block, 1234, *audio_block, *video_block, *text[:2]]),
            "kwargs": {**image_kw, **audio_kw, **video_kw},
            "layout": {"image_grids": [image_grid], "audio_lengths": [n_audio], "video_grids": [video_grid],
                       "video_seconds_per_grid": [seconds]},
        },
        "audio_in_video": {
            "ids": chat([VISION_START, AUDIO_START, *interleaved_av(video_grid, seconds, n_audio), AUDIO_END, VISION_END, *text[:2]]),
            "kwargs": {**audio_kw, **video_kw, "use_audio_in_video": True},
            "layout": {"audio_lengths": [n_audio], "video_grids": [video_grid], "video_seconds_per_grid": [seconds],
                       "use_audio_in_video": True},
        },
    }  # fmt: skip


def interleaved_av(grid: list[int], seconds: float, n_audio: int) -> list[int]:
    """Video and audio placeholders ordered by time, video first on ties (13 positions/s)."""
    per_frame = grid[1] * grid[2] // 4
    video_t = [t * seconds * 13 for t in range(grid[0]) for _ in range(per_frame)]
    out, v, a = [], 0, 0
    while v < len(video_t) and a < n_audio:
        if video_t[v] <= a:
            out.append(VIDEO)
            v += 1
        else:
            out.append(AUDIO)
            a += 1
    return out + [VIDEO] * (len(video_t) - v) + [AUDIO] * (n_audio - a)


def main() -> None:
    from safetensors.torch import save_file
    from transformers import Qwen3OmniMoeForConditionalGeneration

    torch.set_grad_enabled(False)
    tensors: dict[str, torch.Tensor] = {}
    meta: dict[str, object] = {"seed": SEED, "speaker": SPEAKER, "thinker_tokens": THINKER_TOKENS,
                               "talker_frames": TALKER_FRAMES, "cases": {}}  # fmt: skip
    with tempfile.TemporaryDirectory() as tmp:
        root = write_random_checkpoint(Path(tmp) / "tiny", "tiny", seed=SEED)
        meta["digest"] = weights_digest(root)
        torch.manual_seed(SEED)
        ref = Qwen3OmniMoeForConditionalGeneration.from_pretrained(
            str(root), dtype=torch.float32, attn_implementation="eager"
        )
        ref.eval()
    # the reference's talker positions read the audio config of its own config (digest §7)
    ref.talker.config.audio_config = ref.config.thinker_config.audio_config
    vocab = ref.config.thinker_config.text_config.vocab_size
    logit_ids = (
        torch.randperm(vocab, generator=torch.Generator().manual_seed(SEED + 1))[:LOGIT_IDS]
        .sort()
        .values
    )
    tensors["logit_ids"] = logit_ids

    for name, case in cases().items():
        captured = _capture(ref)
        ids = torch.tensor([case["ids"]])
        kwargs = dict(case["kwargs"])
        _, _ = ref.generate(
            input_ids=ids, attention_mask=torch.ones_like(ids), speaker=SPEAKER,
            thinker_max_new_tokens=THINKER_TOKENS, thinker_do_sample=False, thinker_output_logits=True,
            talker_do_sample=False, talker_max_new_tokens=TALKER_FRAMES + 1, **kwargs,
        )  # fmt: skip
        thinker, talker_in, talker_out = (
            captured["thinker"],
            captured["talker_kwargs"],
            captured["talker"],
        )
        tokens = thinker.sequences[0, ids.shape[1] :]
        logits = torch.stack([step[0] for step in thinker.logits]).float()
        codes = torch.stack(
            [h[-1][0] for h in talker_out.hidden_states if h[-1] is not None]
        )  # [F, 16]
        positions, delta = ref.thinker.get_rope_index(
            ids, kwargs.get("image_grid_thw"), kwargs.get("video_grid_thw"), torch.ones_like(ids),
            bool(kwargs.get("use_audio_in_video", False)),
            kwargs["feature_attention_mask"].sum(-1) if "feature_attention_mask" in kwargs else None,
            kwargs.get("video_second_per_grid"),
        )  # fmt: skip
        prefill = talker_in["inputs_embeds"][0]
        first = ref.talker(
            inputs_embeds=prefill[None], attention_mask=torch.ones(1, prefill.shape[0], dtype=torch.long),
            talker_input_ids=talker_in["talker_input_ids"], image_grid_thw=talker_in.get("image_grid_thw"),
            video_grid_thw=talker_in.get("video_grid_thw"), video_second_per_grid=talker_in.get("video_second_per_grid"),
            audio_feature_lengths=talker_in.get("audio_feature_lengths"), use_audio_in_video=talker_in.get("use_audio_in_video"),  # as generate() calls it: unset
        ).logits[0, -1]  # fmt: skip
        ref.talker.rope_deltas = None
        steps = torch.arange(logits.shape[0])
        tensors.update({
            f"{name}.ids": ids[0], f"{name}.positions": positions[:, 0].float().contiguous(),
            f"{name}.delta": delta.float().reshape(1), f"{name}.tokens": tokens.contiguous(),
            f"{name}.logits": logits[:, logit_ids].contiguous(),
            f"{name}.argmax_logits": logits[steps, logits.argmax(-1)].contiguous(),
            f"{name}.talker_prefill": prefill.contiguous(), f"{name}.talker_trailing": talker_in["trailing_text_hidden"][0].contiguous(),
            f"{name}.talker_first_logits": first.float().contiguous(), f"{name}.codes": codes.contiguous(),
        })  # fmt: skip
        for key, rows in captured["encoders"].items():
            tensors[f"{name}.{key}"] = rows.contiguous()
        for key in ("pixel_values", "image_grid_thw", "pixel_values_videos", "video_grid_thw", "input_features"):
            if key in kwargs:  # every case draws the same inputs: stored once
                tensors.setdefault(f"input.{key}", kwargs[key].contiguous())
        meta["cases"][name] = {"layout": case["layout"], "encoders": sorted(captured["encoders"])}
        print(
            f"{name}: prompt {ids.shape[1]}, tokens {tokens.tolist()}, codes {tuple(codes.shape)}, rows {sorted(captured['encoders'])}"
        )

    OUT.parent.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(OUT), metadata={"meta": json.dumps(meta)})
    print(f"wrote {OUT} ({OUT.stat().st_size} bytes)")


def _capture(ref) -> dict:
    """Wraps the reference's thinker/talker generate and encoder feature calls on this instance
    (fresh per case) and returns the dict they fill."""
    captured: dict = {"encoders": {}}
    thinker_model = ref.thinker.model

    def wrap(obj, attr, record):
        original = getattr(type(obj), attr).__get__(obj)

        @functools.wraps(original)  # generate() reads the encoders' signatures
        def call(*args, **kwargs):
            result = original(*args, **kwargs)
            record(kwargs, result)
            return result

        setattr(obj, attr, call)

    def thinker(kwargs, result):
        captured["thinker"] = result

    def talker(kwargs, result):
        captured["talker_kwargs"], captured["talker"] = kwargs, result

    def vision(kind):
        def record(kwargs, out):
            captured["encoders"][kind] = torch.cat(list(out.pooler_output), dim=0)
            for level, feature in enumerate(out.deepstack_features):
                captured["encoders"][f"{kind}_deepstack.{level}"] = torch.cat(list(feature), dim=0)

        return record

    def audio(kwargs, out):
        captured["encoders"]["audio"] = out.last_hidden_state

    wrap(ref.thinker, "generate", thinker)
    wrap(ref.talker, "generate", talker)
    wrap(thinker_model, "get_image_features", vision("image"))
    wrap(thinker_model, "get_video_features", vision("video"))
    wrap(thinker_model, "get_audio_features", audio)
    return captured


if __name__ == "__main__":
    main()
