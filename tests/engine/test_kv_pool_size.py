"""The KV pool's sizing rule (kv_cache.kv_pool_blocks): the need (max_num_seqs requests of
max_model_len), capped on CUDA at mem_fraction_static of the free memory; an explicit
kv_cache_bytes wins; a pool that cannot hold one request refuses to build, naming the knob."""

import pytest
import torch

from omnistage.engine.engine import AREngine, EngineConfig
from omnistage.engine.kv_cache import kv_pool_blocks, kv_token_bytes
from omnistage.testing.toy_ar import ToyARConfig, ToyTalker

GIB = 1 << 30
# Qwen3-Omni-30B-A3B in bf16 (random_checkpoint._real_config): the thinker 48 layers of 4 KV
# heads of 128, the talker 20 layers of 2
THINKER = kv_token_bytes(48, 4, 128, torch.bfloat16)
TALKER = kv_token_bytes(20, 2, 128, torch.bfloat16)
BLOCK = 16
SEQS, LEN = 16, 8192  # the Qwen3-Omni stages' defaults
NEED = SEQS * LEN // BLOCK + 1  # blocks: every request at max_model_len, and the scratch block


def pool(token_bytes, free, kv_cache_bytes=None, fraction=0.5, seqs=SEQS, length=LEN):
    return kv_pool_blocks(token_bytes, BLOCK, seqs, length, kv_cache_bytes, fraction, free)


def test_a_token_of_the_real_thinker_takes_96_kib_and_of_the_talker_20_kib():
    assert (THINKER, TALKER) == (96 << 10, 20 << 10)


def test_on_cpu_the_pool_holds_max_num_seqs_requests_of_max_model_len():
    assert pool(THINKER, free=None) == NEED


def test_on_cuda_a_need_within_the_fraction_of_free_memory_is_taken_whole():
    # 12 GiB of need, 0.5 x 70 GiB allowed
    assert pool(THINKER, free=70 * GIB) == NEED


def test_on_cuda_a_need_beyond_the_fraction_of_free_memory_is_capped_there():
    blocks = pool(THINKER, free=10 * GIB)
    assert blocks == (5 * GIB) // (THINKER * BLOCK) and blocks < NEED


def test_engines_built_in_turn_each_get_their_whole_need_in_either_order_while_it_fits():
    def build(order, free):
        sizes = {}
        for name, token_bytes in order:
            sizes[name] = pool(token_bytes, free)
            free -= sizes[name] * token_bytes * BLOCK
        return sizes

    forward = build([("thinker", THINKER), ("talker", TALKER)], 70 * GIB)
    backward = build([("talker", TALKER), ("thinker", THINKER)], 70 * GIB)
    assert forward == backward == {"thinker": NEED, "talker": NEED}


def test_when_memory_is_short_the_next_engine_takes_the_fraction_of_what_is_left():
    free = 8 * GIB
    thinker = pool(THINKER, free)
    left = free - thinker * THINKER * BLOCK
    assert thinker == (4 * GIB) // (THINKER * BLOCK)
    assert pool(TALKER, left) == (left // 2) // (TALKER * BLOCK) < NEED


def test_explicit_kv_cache_bytes_win_over_the_need_and_the_fraction():
    assert pool(THINKER, free=70 * GIB, kv_cache_bytes=2 * GIB) == (2 * GIB) // (THINKER * BLOCK)
    # more than the need too (spare blocks keep cached prefixes), on either device
    assert (
        pool(THINKER, free=None, kv_cache_bytes=16 * GIB) == (16 * GIB) // (THINKER * BLOCK) > NEED
    )
    assert pool(THINKER, free=GIB, kv_cache_bytes=16 * GIB) > NEED


def test_a_pool_too_small_for_one_request_names_kv_cache_bytes_and_the_bytes_needed():
    # the stages' former default: 256 MiB held 2704 thinker tokens
    needed = (LEN // BLOCK + 1) * BLOCK * THINKER
    with pytest.raises(ValueError, match=rf"kv_cache_bytes {256 << 20}\) holds 2704 tokens, fewer than one request "
                                         rf"of max_model_len {LEN}, which needs {needed} bytes") as err:  # fmt: skip
        pool(THINKER, free=70 * GIB, kv_cache_bytes=256 << 20)
    assert str(err.value).endswith(": raise kv_cache_bytes, or lower max_model_len")


def test_a_fraction_too_small_for_one_request_names_mem_fraction_static_and_the_free_memory():
    with pytest.raises(
        ValueError, match=rf"mem_fraction_static 0.5 of {GIB} bytes free\) holds 5440 tokens"
    ) as err:
        pool(THINKER, free=GIB)
    assert str(err.value).endswith(
        ": raise mem_fraction_static or give kv_cache_bytes, or lower max_model_len"
    )


def test_a_fraction_outside_0_to_1_is_refused_on_every_device():
    for free in (None, 70 * GIB):
        for fraction in (0.0, 1.5):
            with pytest.raises(
                ValueError, match=rf"mem_fraction_static must be in \(0, 1\], got {fraction}"
            ):
                pool(THINKER, free, fraction=fraction)


def test_an_engine_on_cpu_sizes_its_pool_by_the_need_unless_kv_cache_bytes_is_given():
    model = ToyTalker(ToyARConfig(), torch.float64)
    limits = dict(max_num_seqs=3, max_model_len=64, prefill_hold_ms=0.0, num_step_rows=256)
    assert AREngine(model, EngineConfig(**limits)).kv_blocks.num_blocks == 3 * 64 // BLOCK
    block_bytes = kv_token_bytes(2, 2, 8, torch.float64) * BLOCK
    explicit = AREngine(model, EngineConfig(kv_cache_bytes=21 * block_bytes, **limits))
    assert explicit.kv_blocks.num_blocks == 20  # one of the 21 is the scratch block
