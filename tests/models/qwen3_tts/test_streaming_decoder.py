"""Streaming decoding with carried state equals the offline decode (tiny random codec, fp32);
the channels-last decoder decodes as the ``[B, C, L]`` one, offline, streamed and in the
arena."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from omnistage.config.overrides import resolve_config
from omnistage.engine.causal_vocoder import CausalConv, CausalTransConv
from omnistage.engine.vocoder_arena import (
    ArenaFullError,
    StreamingDecoderArena,
    context_pieces,
    graph_batch_buckets,
)
from omnistage.models.qwen3_tts.config import Qwen3TTSPipelineConfig
from omnistage.models.qwen3_tts.modeling.speech_tokenizer.decoder import (
    SpeechTokenizerDecoder,
    load_decoder,
)
from omnistage.models.qwen3_tts.modeling.speech_tokenizer.random_init import (
    write_random_speech_tokenizer,
)
from omnistage.pipeline.stage import build_scheduler

SPF = 1920
TOLERANCE = 1e-5
# Channels-last against [B, C, L] in fp32: the same sums in another order (fp64 agrees to
# 1e-12 below), so only rounding differs: at most 1.0e-6 here over 6 seeds (output peak
# ~0.33), as large as the NCL decoder's own streamed-vs-offline differences; 5e-6 leaves
# room for another CPU's kernels.
CL_TOLERANCE = 5e-6
LAYOUTS = ["ncl", "cl"]


@pytest.fixture(scope="module")
def decoder(tmp_path_factory: pytest.TempPathFactory) -> SpeechTokenizerDecoder:
    directory: Path = tmp_path_factory.mktemp("speech_tokenizer")
    write_random_speech_tokenizer(directory, "tiny", seed=0)
    return load_decoder(directory)


@pytest.fixture(scope="module")
def decoders(decoder) -> dict[str, SpeechTokenizerDecoder]:
    """The decoder in both layouts: ``[B, C, L]`` and channels-last (the same weights)."""
    return {"ncl": decoder, "cl": copy.deepcopy(decoder).to_channels_last()}


def _codes(frames: int, seed: int) -> torch.Tensor:
    return torch.randint(0, 2048, (frames, 16), generator=torch.Generator().manual_seed(seed))


def _offline(decoder: SpeechTokenizerDecoder, codes: torch.Tensor) -> torch.Tensor:
    with torch.inference_mode():
        return decoder(codes[None])[0]


def _stream(arena: StreamingDecoderArena, slot: int, codes: torch.Tensor, sizes: list[int]) -> torch.Tensor:
    pieces, start = [], 0
    for size in sizes:
        chunk = codes[start : start + size]
        piece = arena.decode([slot], chunk[None])[0]
        assert piece.shape == (chunk.shape[0] * SPF,)
        pieces.append(piece)
        start += size
    return torch.cat(pieces)


@settings(max_examples=6, deadline=None)
@given(sizes=st.lists(st.integers(1, 9), min_size=1, max_size=6), seed=st.integers(0, 2**16))
def test_any_chunk_schedule_concatenates_to_the_offline_decode(decoder, sizes: list[int], seed: int) -> None:
    codes = _codes(sum(sizes), seed)
    arena = StreamingDecoderArena(decoder, num_slots=2)
    slot = arena.allocate()
    streamed = _stream(arena, slot, codes, sizes)
    assert streamed.shape == (sum(sizes) * SPF,)
    assert (streamed - _offline(decoder, codes)).abs().max() <= TOLERANCE


def test_streaming_past_the_attention_window_stays_exact(decoder) -> None:
    codes = _codes(90, seed=7)  # > the 72-frame sliding window
    arena = StreamingDecoderArena(decoder, num_slots=1)
    streamed = _stream(arena, arena.allocate(), codes, [1, 2, 4] + [8] * 10 + [3])
    assert arena.position(0) == 90
    assert (streamed - _offline(decoder, codes)).abs().max() <= TOLERANCE


def test_left_context_is_decoded_once_and_never_emitted(decoder) -> None:
    reference, codes = _codes(11, seed=1), _codes(13, seed=2)
    arena = StreamingDecoderArena(decoder, num_slots=1)
    slot = arena.allocate(left_context=reference)
    assert arena.position(slot) == 11
    streamed = _stream(arena, slot, codes, [1, 2, 4, 6])
    expected = _offline(decoder, torch.cat([reference, codes]))[11 * SPF :]
    assert streamed.shape == expected.shape
    assert (streamed - expected).abs().max() <= TOLERANCE


@pytest.mark.parametrize("layout", LAYOUTS)
def test_a_batch_of_eight_streams_equals_eight_single_streams(decoders, layout) -> None:
    decoder = decoders[layout]
    utterances = [_codes(9, seed=s) for s in range(8)]
    batched = StreamingDecoderArena(decoder, num_slots=8)
    slots = [batched.allocate(left_context=_codes(3 + s, seed=100 + s) if s % 2 else None) for s in range(8)]
    pieces = [torch.stack(batched.decode(slots, torch.stack([u[a:b] for u in utterances]))) for a, b in ((0, 1), (1, 3), (3, 9))]
    together = torch.cat(pieces, dim=1)
    for s, utterance in enumerate(utterances):
        single = StreamingDecoderArena(decoder, num_slots=1)
        slot = single.allocate(left_context=_codes(3 + s, seed=100 + s) if s % 2 else None)
        alone = _stream(single, slot, utterance, [1, 2, 6])
        assert (together[s] - alone).abs().max() <= TOLERANCE


def test_decode_full_equals_offline_and_drops_the_left_context(decoder) -> None:
    arena = StreamingDecoderArena(decoder, num_slots=1)
    short, long_, reference = _codes(5, seed=3), _codes(140, seed=4), _codes(4, seed=5)
    out = arena.decode_full([(short, None), (long_, reference)])
    assert out[0].shape == (5 * SPF,) and out[1].shape == (140 * SPF,)
    assert (out[0] - _offline(decoder, short)).abs().max() <= TOLERANCE
    assert (out[1] - _offline(decoder, torch.cat([reference, long_]))[4 * SPF :]).abs().max() <= TOLERANCE


@pytest.mark.parametrize("layout", LAYOUTS)
def test_a_full_arena_raises_and_free_is_idempotent(decoders, layout) -> None:
    decoder = decoders[layout]
    arena = StreamingDecoderArena(decoder, num_slots=2)
    first, second = arena.allocate(), arena.allocate()
    assert arena.num_free == 0
    with pytest.raises(ArenaFullError):
        arena.allocate()
    arena.free(first)
    arena.free(first)
    assert arena.num_free == 1
    with pytest.raises(ValueError, match="allocated"):
        arena.decode([first], _codes(1, seed=0)[None])
    arena.free(second)
    assert arena.num_free == 2


@pytest.mark.parametrize("layout", LAYOUTS)
def test_a_reused_slot_starts_from_a_fresh_state(decoders, layout) -> None:
    decoder = decoders[layout]
    arena = StreamingDecoderArena(decoder, num_slots=1)
    slot = arena.allocate()
    arena.decode([slot], _codes(6, seed=8)[None])
    arena.free(slot)
    slot = arena.allocate()
    codes = _codes(4, seed=9)
    assert arena.position(slot) == 0
    assert (arena.decode([slot], codes[None])[0] - _offline(decoder, codes)).abs().max() <= TOLERANCE


def _graphed_arena(
    decoder: SpeechTokenizerDecoder, monkeypatch, context_lengths: tuple[int, ...] = ()
) -> StreamingDecoderArena:
    """The decoder on CUDA (in its layout) in an 8-slot arena with graphs for batches 1, 4,
    8 and chunks of 1, 2, 3, 8 frames (and ``context_lengths`` for batch 1); cuDNN
    convolutions default to TF32 (10-bit mantissa), so this turns it off to compare in true
    fp32."""
    monkeypatch.setattr(torch.backends.cudnn, "allow_tf32", False)
    monkeypatch.setattr(torch.backends.cuda.matmul, "allow_tf32", False)
    device_decoder = SpeechTokenizerDecoder(decoder.config).to("cuda")
    device_decoder.load_state_dict(decoder.state_dict())
    if decoder.channels_last:
        device_decoder.to_channels_last()
    graphed = StreamingDecoderArena(device_decoder, num_slots=8)
    graphed.capture_graphs(batch_buckets=(1, 4, 8), chunk_lengths=(1, 2, 3, 8), context_lengths=context_lengths)
    return graphed


@pytest.mark.gpu
@pytest.mark.parametrize("layout", LAYOUTS)
def test_cuda_graph_replay_equals_eager_decoding(decoders, layout, monkeypatch) -> None:
    """Graph replays on CUDA against the CPU's eager offline decode of the same layout (and,
    channels-last, of the NCL decoder)."""
    decoder = decoders[layout]
    graphed = _graphed_arena(decoder, monkeypatch)
    utterances = [_codes(14, seed=s).cuda() for s in range(3)]
    slots = [graphed.allocate() for _ in utterances]
    pieces = [torch.stack(graphed.decode(slots, torch.stack([u[a:b] for u in utterances]))) for a, b in ((0, 1), (1, 3), (3, 11), (11, 14))]
    together = torch.cat(pieces, dim=1).cpu()
    for s, utterance in enumerate(utterances):
        assert (together[s] - _offline(decoder, utterance.cpu())).abs().max() <= 1e-4
        assert (together[s] - _offline(decoders["ncl"], utterance.cpu())).abs().max() <= 1e-4


def _continue(arena: StreamingDecoderArena, slots: list[int], codes: list[torch.Tensor]) -> list[torch.Tensor]:
    """Each slot's audio for its codes, decoded in chunks 1, 2 then the rest, all slots batched."""
    pieces = [torch.stack(arena.decode(slots, torch.stack([c[a:b] for c in codes]))) for a, b in ((0, 1), (1, 3), (3, codes[0].shape[0]))]
    return list(torch.cat(pieces, dim=1))


@pytest.mark.parametrize("layout", LAYOUTS)
def test_a_batch_of_opens_equals_the_same_opens_one_by_one(decoders, layout) -> None:
    """Opens of fresh, repeated and different-length left contexts in one call continue
    exactly as the same streams opened one at a time in arenas without a cache."""
    decoder = decoders[layout]
    a, b, c = _codes(5, seed=11), _codes(5, seed=12), _codes(7, seed=13)
    contexts = [a, None, b, a, c]
    utterances = [_codes(6, seed=20 + s) for s in range(len(contexts))]
    arena = StreamingDecoderArena(decoder, num_slots=len(contexts))
    slots = arena.allocate_many(contexts)
    assert [arena.position(s) for s in slots] == [5, 0, 5, 5, 7]
    together = _continue(arena, slots, utterances)
    for context, utterance, audio in zip(contexts, utterances, together, strict=True):
        single = StreamingDecoderArena(decoder, num_slots=1, context_cache_size=0)
        alone = _continue(single, [single.allocate(context)], [utterance])[0]
        assert (audio - alone).abs().max() <= TOLERANCE
        full = utterance if context is None else torch.cat([context, utterance])
        skip = 0 if context is None else context.shape[0] * SPF
        assert (audio - _offline(decoder, full)[skip:]).abs().max() <= TOLERANCE


@pytest.mark.parametrize("layout", LAYOUTS)
def test_a_cached_left_context_continues_exactly_like_a_decoded_one(decoders, layout) -> None:
    decoder = decoders[layout]
    reference, codes = _codes(9, seed=31), _codes(6, seed=32)
    arena = StreamingDecoderArena(decoder, num_slots=1, context_cache_size=4)
    arena.free(arena.allocate(reference))  # decodes it and caches the state after it
    slot = arena.allocate(reference.clone())  # same content: the cached state
    assert arena.position(slot) == 9
    expected = _offline(decoder, torch.cat([reference, codes]))[9 * SPF :]
    assert (_continue(arena, [slot], [codes])[0] - expected).abs().max() <= TOLERANCE


def test_two_different_references_never_share_a_cached_state(decoder) -> None:
    """Same length, one code different: the second reference is decoded on its own, and
    its stream continues its own audio, not the first one's."""
    first = _codes(6, seed=41)
    second = first.clone()
    second[3, 5] = (second[3, 5] + 1) % 2048
    codes = _codes(5, seed=42)
    arena = StreamingDecoderArena(decoder, num_slots=2, context_cache_size=4)
    arena.free(arena.allocate(first))
    slots = arena.allocate_many([second, first])
    got = _continue(arena, slots, [codes, codes])
    for context, audio in zip((second, first), got, strict=True):
        expected = _offline(decoder, torch.cat([context, codes]))[6 * SPF :]
        assert (audio - expected).abs().max() <= TOLERANCE
    assert (got[0] - got[1]).abs().max() > 100 * TOLERANCE


def test_opening_more_streams_than_free_slots_takes_none(decoder) -> None:
    arena = StreamingDecoderArena(decoder, num_slots=2)
    with pytest.raises(ArenaFullError):
        arena.allocate_many([None, None, None])
    assert arena.num_free == 2


@pytest.mark.gpu
@pytest.mark.parametrize("layout", LAYOUTS)
def test_cuda_graphs_with_host_codes_and_cached_contexts_equal_the_offline_decode(decoders, layout, monkeypatch) -> None:
    """The serving path on CUDA: codes from the host, streams opened in one batch with one
    reference decoded once (the others copy its cached state), graph replays on the arena's
    stream, audio back on the host."""
    decoder = decoders[layout]
    graphed = _graphed_arena(decoder, monkeypatch)
    reference = _codes(5, seed=50)
    contexts = [reference, None, reference, _codes(5, seed=51)]
    utterances = [_codes(11, seed=60 + s) for s in range(len(contexts))]
    slots = graphed.allocate_many(contexts)
    pieces = [torch.stack(graphed.decode(slots, torch.stack([u[a:b] for u in utterances]))) for a, b in ((0, 1), (1, 3), (3, 11))]
    assert all(p.device.type == "cpu" and p.dtype == torch.float32 for p in pieces)
    together = torch.cat(pieces, dim=1)
    for context, utterance, audio in zip(contexts, utterances, together, strict=True):
        full = utterance if context is None else torch.cat([context, utterance])
        skip = 0 if context is None else 5 * SPF
        assert (audio - _offline(decoder, full)[skip:]).abs().max() <= 1e-4


@pytest.mark.gpu
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize(("context_lengths", "alone"), [((), [8, 8, 3, 1]), ((16,), [16, 3, 1])])
def test_a_left_context_longer_than_any_graph_is_decoded_by_replays_exactly(
    decoders, layout, monkeypatch, context_lengths, alone
) -> None:
    """A 20-frame reference (graph replays, never an eager decode of 20 frames; a 16-frame
    context graph only for one stream, two take the bucket of 4) opened alone and two in
    one batch continue as the offline decode does."""
    decoder = decoders[layout]
    graphed = _graphed_arena(decoder, monkeypatch, context_lengths)
    assert graphed._context_pieces(1, 20) == alone and graphed._context_pieces(2, 20) == [8, 8, 3, 1]
    contexts = [_codes(20, seed=70), _codes(20, seed=71), _codes(20, seed=72)]
    utterances = [_codes(11, seed=80 + s) for s in range(len(contexts))]
    slots = [graphed.allocate(contexts[0]), *graphed.allocate_many(contexts[1:])]
    assert [graphed.position(s) for s in slots] == [20, 20, 20]
    together = _continue(graphed, slots, utterances)
    for context, utterance, audio in zip(contexts, utterances, together, strict=True):
        assert (audio - _offline(decoder, torch.cat([context, utterance]))[20 * SPF :]).abs().max() <= 1e-4


@pytest.mark.parametrize(
    ("frames", "lengths", "expected"),
    [
        (38, range(1, 9), [8, 8, 8, 8, 6]),
        (5, (1, 2, 3, 8), [3, 2]),
        (20, (8, 3, 1, 2), [8, 8, 3, 1]),
        (8, range(1, 9), [8]),
        (7, (), [7]),
        (7, (2, 4), [4, 2, 1]),  # a rest no captured length fits is one last chunk
    ],
)
def test_a_left_context_splits_into_the_longest_captured_chunks(frames, lengths, expected) -> None:
    assert context_pieces(frames, lengths) == expected
    with pytest.raises(ValueError, match="frames"):
        context_pieces(0, lengths)


@pytest.mark.parametrize(
    ("requested", "num_slots", "expected"),
    [
        ((1, 2, 4, 8, 16, 32, 64), 128, [1, 2, 4, 8, 16, 32, 64, 128]),
        ((1, 2, 4, 8, 16, 32, 64), 100, [1, 2, 4, 8, 16, 32, 64, 100]),
        ((1, 2, 4, 8, 16, 32, 64), 300, [1, 2, 4, 8, 16, 32, 64, 128, 256, 300]),
        ((1, 4, 16), 8, [1, 4, 8]),
        ((64,), 1, [1]),
    ],
)
def test_graph_buckets_hold_every_batch_up_to_the_slot_count(
    requested, num_slots, expected
) -> None:
    buckets = graph_batch_buckets(requested, num_slots)
    assert buckets == expected
    assert all(any(b >= batch for b in buckets) for batch in range(1, num_slots + 1))


@pytest.mark.parametrize(("requested", "num_slots"), [((), 8), ((0, 4), 8), ((1, 4), 0)])
def test_graph_buckets_refuse_sizes_below_one(requested, num_slots) -> None:
    with pytest.raises(ValueError, match="batch buckets"):
        graph_batch_buckets(requested, num_slots)


def _chunks(arena: StreamingDecoderArena, codes: torch.Tensor, sizes: list[int]) -> torch.Tensor:
    """One fresh stream of ``arena`` decoding ``codes`` in chunks of ``sizes``, freed after."""
    slot = arena.allocate()
    audio = _stream(arena, slot, codes, sizes)
    arena.free(slot)
    return audio


def test_channels_last_decodes_as_ncl_offline_and_streamed(decoders) -> None:
    """Offline, and streamed in uneven chunks with carried state, the channels-last decoder
    gives the NCL decoder's audio; and its stream its own offline decode (the carried-state
    invariant)."""
    for seed in (90, 91):
        codes = _codes(18, seed)
        expected = _offline(decoders["ncl"], codes)
        offline = _offline(decoders["cl"], codes)
        assert offline.shape == expected.shape == (18 * SPF,)
        assert (offline - expected).abs().max() <= CL_TOLERANCE
        streamed = _chunks(StreamingDecoderArena(decoders["cl"], num_slots=2), codes, [1, 2, 4, 8, 3])
        assert (streamed - expected).abs().max() <= CL_TOLERANCE
        assert (streamed - offline).abs().max() <= CL_TOLERANCE


def test_channels_last_in_fp64_is_the_same_sums(decoder) -> None:
    """In fp64 the layouts agree to 1e-12 (relative to the peak): the same sums, only their
    order differs (cuDNN / oneDNN's NHWC kernels, the phase views)."""
    ncl = copy.deepcopy(decoder).double()
    cl = copy.deepcopy(ncl).to_channels_last()
    codes = _codes(13, seed=92)[None]
    expected = _offline(ncl, codes[0])
    bound = 1e-12 * expected.abs().max()
    assert (_offline(cl, codes[0]) - expected).abs().max() <= bound
    state, positions, pieces = cl.zero_state(1), torch.zeros(1, dtype=torch.int64), []
    with torch.inference_mode():
        for start, end in ((0, 1), (1, 4), (4, 12), (12, 13)):
            piece, state = cl.step(codes[:, start:end], positions, state)
            pieces.append(piece[0])
            positions = positions + end - start
    assert (torch.cat(pieces) - expected).abs().max() <= bound


def test_channels_last_keeps_its_layout_in_every_layer_weight_and_state(decoders) -> None:
    """Every 4-D output of every layer is channels-last (memory [B, L, C]; a one-sample chunk
    [B, C, 1, 1] is both layouts), from the quantizer to the output conv, for 1-frame and
    longer chunks; every conv weight is laid out channels-last (no conversion per call);
    the carried conv states are [H, C] per stream, contiguous in the arena, the window
    attention's as NCL's."""
    ncl, cl = decoders["ncl"], decoders["cl"]
    assert cl.channels_last and not ncl.channels_last
    for module in cl.modules():
        if isinstance(module, torch.nn.Conv1d | torch.nn.ConvTranspose1d):
            assert module.weight.unsqueeze(2).is_contiguous(memory_format=torch.channels_last)
    for ours, theirs in zip(cl.state_shapes(), ncl.state_shapes(), strict=True):
        assert ours == (theirs if len(theirs) == 4 else theirs[::-1])
    convs = {m.state_index for m in cl.modules() if isinstance(m, CausalConv | CausalTransConv) and m.carries_state()}
    assert len(convs) == len(cl.state_shapes()) - ncl.config.num_hidden_layers
    arena = StreamingDecoderArena(cl, num_slots=3)
    for tensor, shape in zip(arena._state, cl.state_shapes(), strict=True):
        assert tensor.shape == (4, *shape) and tensor.is_contiguous()
    seen: list[tuple[str, tuple[int, ...], tuple[int, ...]]] = []

    def record(module, inputs, output) -> None:  # noqa: ANN001 -- a forward hook
        if isinstance(output, torch.Tensor) and output.dim() == 4:
            seen.append((type(module).__name__, tuple(output.shape), output.stride()))

    hooks = [m.register_forward_hook(record) for m in cl.modules()]
    try:
        slots = arena.allocate_many([None, None])
        for n in (1, 2, 5):
            arena.decode(slots, torch.stack([_codes(n, seed=93), _codes(n, seed=94)]))
    finally:
        for hook in hooks:
            hook.remove()
    assert {name for name, _, _ in seen} >= {"CausalConv", "CausalTransConv", "SnakeBeta", "ResidualUnit", "ConvNeXtBlock"}
    for name, (_, channels, _, length), stride in seen:
        assert channels == 1 or stride[1] == 1, (name, stride)
        assert length == 1 or stride[3] == channels, (name, stride)


def test_the_vocoder_stage_takes_channels_last_from_the_command_line(tiny_servable_checkpoints) -> None:
    """``--vocoder.factory.args.channels_last true`` builds the stage's decoder channels-last;
    ``false`` and the default on the CPU (channels-last only on CUDA with graphs) keep
    ``[B, C, L]``."""
    defaults = Qwen3TTSPipelineConfig.for_model_path(str(tiny_servable_checkpoints["base"]))
    knob = "vocoder.factory.args.channels_last"
    for args, expected in (([], False), ([(knob, "false")], False), ([(knob, "true")], True)):
        config = resolve_config(defaults, None, [("vocoder.device", "cpu"), *args]).config
        scheduler = build_scheduler(config, config.stage("vocoder"))
        assert_arena_layout(scheduler.decoder, expected)


@pytest.mark.gpu
def test_the_vocoder_stage_on_cuda_is_channels_last_with_graphs_by_default(tiny_servable_checkpoints) -> None:
    """On CUDA the default layout follows ``cuda_graphs``: channels-last with graphs (where it
    was timed faster), ``[B, C, L]`` without (eager channels-last was slower)."""
    defaults = Qwen3TTSPipelineConfig.for_model_path(str(tiny_servable_checkpoints["base"]))
    for args, expected in (([], True), ([("vocoder.factory.args.cuda_graphs", "false")], False)):
        config = resolve_config(defaults, None, [("vocoder.device", "cuda"), *args]).config
        scheduler = build_scheduler(config, config.stage("vocoder"))
        assert_arena_layout(scheduler.decoder, expected)


def assert_arena_layout(arena: StreamingDecoderArena, channels_last: bool) -> None:
    """``arena``'s decoder is in the layout ``channels_last`` says, its conv weights laid out
    and the arena's conv states ``[H, C]`` per slot (``[C, H]`` in NCL), not just the flag."""
    decoder = arena.decoder
    assert decoder.channels_last is channels_last
    convs = [m for m in decoder.modules() if isinstance(m, CausalConv | CausalTransConv)]
    assert convs and all(m.channels_last is channels_last for m in convs)
    for m in convs:
        if m.conv.kernel_size[0] > 1 and m.conv.weight.shape[1] > 1:  # else both layouts at once
            laid_out = m.conv.weight.unsqueeze(2).is_contiguous(memory_format=torch.channels_last)
            assert laid_out is channels_last, (m, m.conv.weight.stride())
        if m.carries_state():
            shape = (m.history, m.conv.in_channels) if channels_last else (m.conv.in_channels, m.history)
            assert tuple(arena._state[m.state_index].shape[1:]) == shape


def test_a_state_from_before_the_layout_switch_is_refused(decoder) -> None:
    """A state made in NCL (conv histories ``[C, H]``) does not reach a channels-last
    decoder's layers, where ``[C, H]`` read as ``[H, C]`` could pass unnoticed with C == H."""
    cl = copy.deepcopy(decoder)
    state = cl.zero_state(1)
    cl.to_channels_last()
    with pytest.raises(ValueError, match="state must be"):
        cl.step(_codes(2, seed=95)[None], torch.zeros(1, dtype=torch.int64), state)
