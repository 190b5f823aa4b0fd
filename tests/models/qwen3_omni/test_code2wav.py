"""Qwen3-Omni code2wav: parity with transformers 5.24 (fixture from
tools/parity/qwen3_omni_encoders_reference.py) and exact streaming: any chunk schedule,
any mix of stream positions in a batch, concatenates to the offline decode; channels-last
as well, equal to the ``[B, C, L]`` decode."""

from __future__ import annotations

import copy

import pytest
import torch
from encoder_fixtures import check_inputs, load_fixture, rel_error, seeded_module
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers.models.qwen3_omni_moe import configuration_qwen3_omni_moe as hf_config
from transformers.models.qwen3_omni_moe import modeling_qwen3_omni_moe as hf

from omnistage.config.overrides import resolve_config
from omnistage.engine.causal_vocoder import CausalConv, CausalTransConv
from omnistage.engine.vocoder_arena import StreamingDecoderArena
from omnistage.models.qwen3_omni.config import Qwen3OmniPipelineConfig
from omnistage.models.qwen3_omni.modeling.code2wav import (
    Code2Wav,
    Code2WavConfig,
    expected_weights,
    leading_trim,
)
from omnistage.models.qwen3_omni.modeling.random_init import CODE2WAV_GAINS
from omnistage.models.qwen3_omni.parity_inputs import code_frames
from omnistage.pipeline.stage import build_scheduler

SPF = 1920
TRIM = 555
TOLERANCE = 1e-5  # streamed vs offline, absolute (output peak ~0.3)
# channels-last vs [B, C, L] in fp32: the same sums in another order, so rounding only: at
# most 8.9e-7 over 4 seeds here, as large as NCL's own streamed-vs-offline differences
CL_TOLERANCE = 5e-6
LAYOUTS = ["ncl", "cl"]


@pytest.fixture(scope="module")
def reference() -> dict:
    return load_fixture("code2wav.npz")


@pytest.fixture(scope="module")
def code2wav(reference: dict) -> Code2Wav:
    return seeded_module(
        reference, lambda raw: Code2Wav(Code2WavConfig.from_hf(raw)), CODE2WAV_GAINS
    )


@pytest.fixture(scope="module")
def code2wavs(code2wav: Code2Wav) -> dict[str, Code2Wav]:
    """code2wav in both layouts: ``[B, C, L]`` and channels-last (the same weights)."""
    return {"ncl": code2wav, "cl": copy.deepcopy(code2wav).to_channels_last()}


def _codes(frames: int, seed: int) -> torch.Tensor:
    return torch.randint(0, 2048, (frames, 16), generator=torch.Generator().manual_seed(seed))


def _offline(code2wav: Code2Wav, codes: torch.Tensor) -> torch.Tensor:
    with torch.inference_mode():
        return code2wav(codes[None])[0]


def _stream(arena: StreamingDecoderArena, codes: torch.Tensor, sizes: list[int]) -> torch.Tensor:
    slot, pieces, start = arena.allocate(), [], 0
    for size in sizes:
        (piece,) = arena.decode([slot], codes[start : start + size][None])
        assert piece.shape == (size * SPF - (TRIM if start == 0 else 0),)
        pieces.append(piece)
        start += size
    return torch.cat(pieces)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_waveform_matches_transformers(code2wavs: dict[str, Code2Wav], layout: str, reference: dict) -> None:
    code2wav = code2wavs[layout]
    codes = code_frames(16, 2048)
    check_inputs(reference, codes.float())
    wave = _offline(code2wav, codes)
    assert wave.shape == (codes.shape[0] * SPF - TRIM,)
    kept = reference["wave_head"].shape[0]
    assert rel_error(wave[:kept], reference["wave_head"]) <= 1e-4
    assert rel_error(wave[-kept:], reference["wave_tail"]) <= 1e-4


def test_the_trim_follows_the_vocoder_rates() -> None:
    assert leading_trim(Code2WavConfig()) == TRIM
    assert leading_trim(Code2WavConfig(upsample_rates=(2, 3))) == (1 * 2 + 1) * 3


@settings(max_examples=6, deadline=None)
@given(sizes=st.lists(st.integers(1, 9), min_size=1, max_size=6), seed=st.integers(0, 2**16))
def test_any_chunk_schedule_concatenates_to_the_offline_decode(code2wav, sizes, seed) -> None:
    codes = _codes(sum(sizes), seed)
    streamed = _stream(StreamingDecoderArena(code2wav, num_slots=1), codes, sizes)
    assert (streamed - _offline(code2wav, codes)).abs().max() <= TOLERANCE


@pytest.mark.parametrize("sizes", [[1, 2, 4, 8, 8, 8, 8, 1], [1] * 12, [40], [3, 37]])
def test_the_ramp_and_other_schedules_equal_the_offline_decode(code2wav, sizes) -> None:
    codes = _codes(sum(sizes), seed=len(sizes))
    streamed = _stream(StreamingDecoderArena(code2wav, num_slots=1), codes, sizes)
    expected = _offline(code2wav, codes)
    assert streamed.shape == expected.shape == (sum(sizes) * SPF - TRIM,)
    assert (streamed - expected).abs().max() <= TOLERANCE


@pytest.mark.parametrize("layout", LAYOUTS)
def test_a_batch_mixing_new_and_running_streams_equals_single_streams(code2wavs, layout) -> None:
    """Two streams at different positions in one batch (the zeroed leading samples of one
    beside the other's signal) continue as each alone."""
    code2wav = code2wavs[layout]
    first, second = _codes(7, seed=1), _codes(5, seed=2)
    arena = StreamingDecoderArena(code2wav, num_slots=2)
    a = arena.allocate()
    head = arena.decode([a], first[None, :3])
    b = arena.allocate()  # b starts while a is at frame 3: one batch, two positions
    rows = arena.decode([a, b], torch.stack([first[3:7], second[:4]]))
    assert rows[0].shape == (4 * SPF,) and rows[1].shape == (4 * SPF - TRIM,)
    tail = arena.decode([b], second[None, 4:])
    torch.testing.assert_close(
        torch.cat([head[0], rows[0]]), _offline(code2wav, first), rtol=0, atol=TOLERANCE
    )
    torch.testing.assert_close(
        torch.cat([rows[1], tail[0]]), _offline(code2wav, second), rtol=0, atol=TOLERANCE
    )


@pytest.mark.gpu
@pytest.mark.parametrize("layout", LAYOUTS)
def test_cuda_graph_replays_equal_the_offline_decode(code2wavs, layout, monkeypatch) -> None:
    """The code2wav stage's CUDA path (in either layout): graphs per batch bucket and chunk
    length, streams at different positions in one batch, the ramp then the steady chunk
    (true fp32: cuDNN's and matmul's TF32 off), against the CPU's NCL offline decode."""
    code2wav = code2wavs["ncl"]
    monkeypatch.setattr(torch.backends.cudnn, "allow_tf32", False)
    monkeypatch.setattr(torch.backends.cuda.matmul, "allow_tf32", False)
    device_model = Code2Wav(code2wav.config).to("cuda")
    device_model.load_state_dict(code2wav.state_dict())
    if layout == "cl":
        device_model.to_channels_last()
    arena = StreamingDecoderArena(device_model, num_slots=4)
    arena.capture_graphs(batch_buckets=(1, 4), chunk_lengths=(1, 2, 4, 8))
    utterances = [_codes(15, seed=10 + s) for s in range(3)]
    slots = [arena.allocate() for _ in utterances]
    pieces = [arena.decode(slots, torch.stack([u[a:b] for u in utterances])) for a, b in ((0, 1), (1, 3), (3, 7), (7, 15))]
    for s, utterance in enumerate(utterances):
        streamed = torch.cat([piece[s] for piece in pieces])
        assert (streamed - _offline(code2wav, utterance)).abs().max() <= TOLERANCE


def test_decode_full_equals_offline(code2wav) -> None:
    arena = StreamingDecoderArena(code2wav, num_slots=1)
    short, long_ = _codes(2, seed=3), _codes(130, seed=4)  # 130 > the 128-frame inner chunks
    out = arena.decode_full([(short, None), (long_, None)])
    assert out[0].shape == (2 * SPF - TRIM,) and out[1].shape == (130 * SPF - TRIM,)
    assert (out[0] - _offline(code2wav, short)).abs().max() <= TOLERANCE
    assert (out[1] - _offline(code2wav, long_)).abs().max() <= TOLERANCE


def test_expected_weights_are_the_checkpoint_names() -> None:
    shapes = expected_weights(Code2WavConfig())
    assert shapes["code_embedding.weight"] == (32768, 1024)
    assert shapes["pre_transformer.layers.7.self_attn.q_proj.weight"] == (1024, 1024)
    assert shapes["pre_transformer.layers.0.self_attn_layer_scale.scale"] == (1024,)
    assert shapes["upsample.1.0.conv.weight"] == (1024, 1024, 2)
    assert shapes["decoder.0.conv.weight"] == (1536, 1024, 7)
    assert shapes["decoder.4.block.1.conv.weight"] == (192, 96, 6)
    assert shapes["decoder.6.conv.weight"] == (1, 96, 7)
    assert not any("input_proj" in name or "quantizer" in name for name in shapes)


def test_config_reads_both_rope_spellings_and_refuses_the_unsupported() -> None:
    assert Code2WavConfig.from_hf({"rope_theta": 500.0}).rope_theta == 500.0
    assert Code2WavConfig.from_hf({"rope_parameters": {"rope_theta": 600.0}}).rope_theta == 600.0
    assert Code2WavConfig.from_hf({"hidden_size": 64, "num_attention_heads": 4}).head_dim == 16
    with pytest.raises(ValueError, match="code2wav_config.attention_bias"):
        Code2WavConfig.from_hf({"attention_bias": True})
    with pytest.raises(ValueError, match="code2wav_config.hidden_act"):
        Code2WavConfig.from_hf({"hidden_act": "gelu"})


def test_real_size_weights_have_the_reference_names_and_shapes() -> None:
    with torch.device("meta"):
        reference = hf.Qwen3OmniMoeCode2Wav(hf_config.Qwen3OmniMoeCode2WavConfig())
    assert expected_weights(Code2WavConfig()) == {
        k: tuple(v.shape) for k, v in reference.state_dict().items()
    }


def test_channels_last_decodes_as_ncl_offline_and_streamed(code2wavs) -> None:
    """With its leading trim (the zeroed samples of ``zero_before``): channels-last offline
    and streamed in uneven chunks equal the NCL offline decode, and the stream its own
    offline decode."""
    for seed in (5, 6):
        codes = _codes(18, seed)
        expected = _offline(code2wavs["ncl"], codes)
        offline = _offline(code2wavs["cl"], codes)
        assert offline.shape == expected.shape == (18 * SPF - TRIM,)
        assert (offline - expected).abs().max() <= CL_TOLERANCE
        streamed = _stream(StreamingDecoderArena(code2wavs["cl"], num_slots=1), codes, [1, 2, 4, 8, 3])
        assert (streamed - expected).abs().max() <= CL_TOLERANCE
        assert (streamed - offline).abs().max() <= CL_TOLERANCE


def test_the_code2wav_stage_takes_channels_last_from_the_command_line(omni_tiny_checkpoint) -> None:
    """``--code2wav.factory.args.channels_last true`` builds the stage's vocoder
    channels-last; the default keeps ``[B, C, L]``."""
    defaults = Qwen3OmniPipelineConfig.for_model_path(str(omni_tiny_checkpoint), load_format="dummy")
    for args, expected in (([], False), ([("code2wav.factory.args.channels_last", "true")], True)):
        config = resolve_config(defaults, None, [("code2wav.device", "cpu"), *args]).config
        scheduler = build_scheduler(config, config.stage("code2wav"))
        arena = scheduler.decoder
        assert arena.decoder.channels_last is expected
        convs = [m for m in arena.decoder.modules() if isinstance(m, CausalConv | CausalTransConv)]
        assert convs and all(m.channels_last is expected for m in convs)
        for m in convs:  # the arena's conv states in the decoder's layout: [H, C] channels-last
            if m.carries_state():
                shape = (m.history, m.conv.in_channels) if expected else (m.conv.in_channels, m.history)
                assert tuple(arena._state[m.state_index].shape[1:]) == shape
