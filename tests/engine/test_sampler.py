"""The batched sampler: greedy, reproducibility under batching, distribution, filters."""

import pytest
import torch

from omnistage.engine.sampler import (
    SamplerFeatures,
    SamplingBatch,
    SamplingParams,
    sample,
    uniform_noise,
)
from omnistage.testing.host_syncs import DispatchedOps

V = 8
LOGITS = torch.tensor([2.0, 1.0, 0.5, 0.0, -0.5, -1.0, -2.0, 0.2])


def run(params: list[SamplingParams], logits: torch.Tensor, steps: int = 1) -> torch.Tensor:
    """``[steps, B]`` tokens for fixed logits."""
    batch = SamplingBatch.build(params, V, "cpu")
    out = []
    for _ in range(steps):
        tokens = sample(logits, batch)
        batch.record(tokens)
        out.append(tokens)
    return torch.stack(out)


def test_temperature_zero_is_argmax():
    tokens = run([SamplingParams(temperature=0.0)], LOGITS[None], steps=3)
    assert tokens.tolist() == [[0], [0], [0]]


def test_a_seeded_request_does_not_depend_on_its_batch():
    me = SamplingParams(temperature=1.0, seed=1234)
    alone = run([me], LOGITS[None], steps=20)[:, 0]
    others = [SamplingParams(temperature=0.7, seed=1), SamplingParams(temperature=1.3, top_k=3, seed=2)]
    batched = run([others[0], me, others[1]], LOGITS.repeat(3, 1), steps=20)[:, 1]
    assert torch.equal(alone, batched)


def test_samples_follow_the_softmax():
    steps = 6000
    tokens = run([SamplingParams(temperature=1.0, seed=7)], LOGITS[None], steps=steps)[:, 0]
    freq = torch.bincount(tokens, minlength=V).float() / steps
    expected = LOGITS.softmax(-1)
    assert torch.allclose(freq, expected, atol=0.02), (freq, expected)


def test_different_seeds_give_different_sequences():
    a = run([SamplingParams(seed=1)], LOGITS[None], steps=30)
    b = run([SamplingParams(seed=2)], LOGITS[None], steps=30)
    assert not torch.equal(a, b)


def test_top_k_and_top_p_restrict_the_support():
    top2 = run([SamplingParams(top_k=2, seed=3)], LOGITS[None], steps=500)
    assert set(top2.flatten().tolist()) == {0, 1}
    # softmax of LOGITS: id 0 holds ~0.50, id 1 ~0.18: p=0.6 keeps exactly {0, 1}
    nucleus = run([SamplingParams(top_p=0.6, seed=4)], LOGITS[None], steps=500)
    assert set(nucleus.flatten().tolist()) == {0, 1}
    assert set(run([SamplingParams(top_k=1, seed=5)], LOGITS[None], steps=50).flatten().tolist()) == {0}


def test_repetition_penalty_discourages_generated_ids():
    logits = torch.tensor([[1.0, 0.9, -3, -3, -3, -3, -3, -3]])
    plain = run([SamplingParams(temperature=0.0)], logits, steps=2)[:, 0].tolist()
    penalized = run([SamplingParams(temperature=0.0, repetition_penalty=1.5)], logits, steps=2)[:, 0].tolist()
    assert plain == [0, 0] and penalized == [0, 1]


def test_suppressed_ranges_and_min_new_tokens():
    params = SamplingParams(temperature=0.0, suppress_ranges=((1, 3),), stop_token_ids=(0,), min_new_tokens=2)
    tokens = run([params], LOGITS[None], steps=3)[:, 0].tolist()
    assert tokens[:2] == [7, 7] and tokens[2] == 0  # 0 is a stop id, allowed from step 2; 1, 2 never


def test_noise_is_uniform_and_a_pure_function_of_seed_step_and_id():
    seeds, steps = torch.tensor([5, 5, 6]), torch.tensor([0, 0, 0])
    noise = uniform_noise(seeds, steps, 4096)
    assert torch.equal(noise[0], noise[1]) and not torch.equal(noise[0], noise[2])
    assert 0.48 < noise.mean().item() < 0.52 and noise.min() > 0 and noise.max() < 1


def test_bad_params_are_rejected():
    for bad in ({"temperature": -1}, {"top_p": 0}, {"repetition_penalty": 0}, {"seed": 2**31}):
        with pytest.raises(ValueError):
            SamplingParams(**bad)


def test_params_beyond_float32_are_rejected_before_they_reach_a_batch():
    for bad in ({"temperature": 1e300}, {"repetition_penalty": 1e39}):
        with pytest.raises(ValueError, match="float32"):
            SamplingParams(**bad)


def test_a_row_is_set_by_fills_of_host_values_alone():
    """Admission writes a slot's sampling row without waiting for the device: a one-element
    ``t[row] = x`` copies a host scalar in (``aten.copy_``) and a list-indexed write uploads
    its index (``aten.index_put_``), and on CUDA each waits for the stream to drain, behind
    any other engine's step queued on it (the Omni talker's admission behind the thinker's
    steps). Ops dispatch the same on every device, so the CPU shows which ones run."""
    batch = SamplingBatch.empty(3, V, "cpu")
    batch.generated[1, 3], batch.num_generated[1] = True, 4  # the slot's previous request
    params = SamplingParams(temperature=0.7, top_k=5, top_p=0.9, repetition_penalty=1.1, min_new_tokens=2,
                            stop_token_ids=(1, 6), suppress_ranges=((2, 4),), seed=11)  # fmt: skip
    with DispatchedOps() as ops:
        batch.set_row(1, params)
    assert set(ops.names) <= {"aten.select.int", "aten.slice.Tensor", "aten.fill_.Scalar"}, ops.names
    floats = torch.stack([batch.temperature, batch.top_p, batch.repetition_penalty])[:, 1]
    assert torch.equal(floats, torch.tensor([0.7, 0.9, 1.1], dtype=torch.float32))
    ints = (batch.top_k[1], batch.min_new_tokens[1], batch.seed[1], batch.num_generated[1])
    assert ints == (5, 2, 11, 0)
    assert batch.banned[1].nonzero().flatten().tolist() == [2, 3]
    assert batch.stop[1].nonzero().flatten().tolist() == [1, 6]
    assert not batch.generated[1].any()
    fresh = SamplingBatch.empty(3, V, "cpu")  # the other rows are untouched
    for name in ("temperature", "top_k", "banned", "stop", "generated", "num_generated"):
        assert torch.equal(getattr(batch, name)[0::2], getattr(fresh, name)[0::2]), name


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_samples_the_same_tokens_as_the_cpu():
    params = [SamplingParams(temperature=0.9, top_k=5, top_p=0.9, repetition_penalty=1.2, seed=s) for s in range(16)]
    logits = torch.randn(16, 4096, generator=torch.Generator().manual_seed(0))
    results = []
    for device in ("cpu", "cuda"):
        batch = SamplingBatch.build(params, 4096, device)
        steps = []
        for _ in range(32):
            tokens = sample(logits.to(device), batch)
            batch.record(tokens)
            steps.append(tokens.cpu())
        results.append(torch.stack(steps))
    assert torch.equal(results[0], results[1])


def test_a_batch_sampled_with_only_the_features_it_needs_gets_the_general_tokens():
    params = [SamplingParams(temperature=0.9, top_k=50, seed=s) for s in range(3)] + [SamplingParams(temperature=0.0)]
    features = SamplerFeatures.of(params)
    assert features == SamplerFeatures(repetition_penalty=False, masks=False, draws=True, full_sort=False)
    logits = torch.randn(4, 2048, generator=torch.Generator().manual_seed(0))
    general, reduced = SamplingBatch.build(params, 2048, "cpu"), SamplingBatch.build(params, 2048, "cpu")
    for _ in range(20):
        tokens = sample(logits, general)
        assert torch.equal(sample(logits, reduced, features), tokens)
        general.record(tokens)
        reduced.record(tokens)


def test_noise_of_several_steps_at_once_equals_step_by_step():
    seeds, steps = torch.tensor([3, 9]), torch.tensor([[16, 17, 18], [0, 1, 2]])
    at_once = uniform_noise(seeds, steps, 64)
    for s in range(3):
        assert torch.equal(at_once[:, s], uniform_noise(seeds, steps[:, s], 64))
