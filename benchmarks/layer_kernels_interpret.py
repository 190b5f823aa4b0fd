#!/usr/bin/env python3
"""The decoder layers' Triton kernels (omnistage/engine/triton_layers.py) run by Triton's
interpreter on the CPU, against the PyTorch forms they replace: a check for a machine with no
GPU (it runs the kernels' Python, not their compiled code, and none of it is timed). The
dense decode attention's units in the last place are of each output row's largest magnitude
(a row is a weighted sum of value rows).

Needs Triton installed beside the CPU torch (``pip install --no-deps triton``; the
interpreter needs no GPU). ``TRITON_INTERPRET=1`` is set before Triton is imported. Three
stand-ins make the kernels runnable there: ``libdevice.exp`` (the interpreter has no
libdevice) is ``tl.exp``, the wrappers' refusals are lifted (they refuse CPU tensors; the
dispatch path still checks the ``layers.*_fits`` shapes), and their ``torch.cuda.device``
guard is a no-op. The interpreter computes with
numpy (correctly rounded division, ``rsqrt`` and ``exp``), not the GPU's instructions, so
its differences are not the GPU's. It emulates bf16 by truncation, so bf16 is not checked;
fp16 goes through the same rounding steps (numpy rounds fp16 to nearest even).

Per kernel and dtype, ``max_ulps`` is the largest difference from PyTorch's result in units
in the last place (of each element; of the row's largest magnitude for RoPE, whose two
products may cancel) and ``bit_equal`` the share of elements with the same bits. Then a fp16
decoder stack (fused projections, prefill of 2 x 7 tokens and a decode step) and the MoE
experts' loop path run with the kernels dispatched (``layers.triton_runs`` true) against
PyTorch's form. Prints a table and writes JSON (default
benchmarks/results/layer_kernels_interpret.json).

Usage: python benchmarks/layer_kernels_interpret.py [--output PATH]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import types
from pathlib import Path
from unittest import mock

os.environ["TRITON_INTERPRET"] = "1"

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from omnistage.engine import layers  # noqa: E402
from omnistage.engine import triton_layers as kernels  # noqa: E402
from omnistage.engine.attention import DenseKVCache  # noqa: E402
from omnistage.engine.layers import Decoder, DecoderConfig, RotaryEmbedding, apply_rope  # noqa: E402
from omnistage.engine.moe import SparseMoE  # noqa: E402

kernels.libdevice = types.SimpleNamespace(exp=lambda x: tl.exp(x))
kernels._refuse_unless = lambda *args, **kwargs: None
torch.cuda.device = lambda device: contextlib.nullcontext()  # the wrappers' device guard


def compare(out: torch.Tensor, expected: torch.Tensor, scale: torch.Tensor | None = None) -> dict:
    mantissa = {torch.float16: 10, torch.float32: 23}[expected.dtype]
    magnitude = (expected if scale is None else scale).float().abs().clamp_min(torch.finfo(expected.dtype).tiny)
    ulp = torch.exp2(torch.floor(torch.log2(magnitude)) - mantissa)
    return {"max_ulps": ((out.float() - expected.float()).abs() / ulp).max().item(),
            "bit_equal": (out == expected).float().mean().item()}


def kernel_rows(dtype: torch.dtype, g: torch.Generator) -> list[dict]:
    rows = []
    for cols in (80, 1024):
        x = (torch.randn(7, cols + 16, generator=g) * 3).to(dtype)[:, 8 : 8 + cols]  # strided rows
        delta = torch.randn(7, cols, generator=g).to(dtype)
        weight = (torch.rand(cols, generator=g) + 0.5).to(dtype)
        normed, _ = kernels.rms_norm_triton(x, weight, 1e-6)
        rows.append({"kernel": f"rms_norm H={cols}", **compare(normed, weight * F.rms_norm(x, (cols,), eps=1e-6))})
        normed, summed = kernels.rms_norm_triton(x, weight, 1e-6, delta)
        rows.append({"kernel": f"add + rms_norm H={cols}", "sum_exact": torch.equal(summed, x + delta),
                     **compare(normed, weight * F.rms_norm(x + delta, (cols,), eps=1e-6))})
    n, hq, hkv, d = 9, 4, 2, 128
    qkv = (torch.randn(n, hq + 2 * hkv, d, generator=g) * 2).to(dtype)
    weight = (torch.rand(hq + 2 * hkv, d, generator=g) + 0.5).to(dtype)
    rotary = RotaryEmbedding(d, 1e6, 4096)
    rotary.reset_buffers("cpu")
    cos, sin = rotary(torch.randint(0, 4096, (n,), generator=g), dtype)
    qk = apply_rope(weight * F.rms_norm(qkv, (d,), eps=1e-6), cos, sin)[:, : hq + hkv]
    out = qkv.clone()
    kernels.qk_norm_rope_triton_(out, weight, cos, sin, 1e-6, hq + hkv)
    rows.append({"kernel": "q/k norm + RoPE D=128", "v_untouched": torch.equal(out[:, hq + hkv :], qkv[:, hq + hkv :]),
                 **compare(out[:, : hq + hkv], qk, qk.abs().amax(-1, keepdim=True))})
    for cols in (100, 3072):
        gate_up = (torch.randn(5, 2 * cols, generator=g) * 4).to(dtype)
        gate, up = gate_up.chunk(2, dim=-1)
        rows.append({"kernel": f"swiglu I={cols}", **compare(kernels.swiglu_triton(gate_up), F.silu(gate) * up)})
    for position in (2, 15):  # the code predictor's cache: 17 positions, 16 q / 8 KV heads of 128
        cache = DenseKVCache(1, 4, 17, 8, 128, dtype=dtype)
        cache.k.normal_(generator=g)
        cache.v.normal_(generator=g)
        k_cache, v_cache = cache.k[0].clone(), cache.v[0].clone()
        qkv = torch.randn(4, 32, 128, generator=g).to(dtype)
        q, k, v = qkv[:, :16], qkv[:, 16:24], qkv[:, 24:]
        cache.length = position
        cache.prepare(1)
        expected = cache(0, q, k, v)  # the CPU: two copies and SDPA
        out = kernels.dense_decode_attention_triton(q, k, v, k_cache, v_cache, position)
        rows.append({"kernel": f"dense decode pos={position}", "cache_exact": torch.equal(k_cache, cache.k[0])
                     and torch.equal(v_cache, cache.v[0]), **compare(out, expected, expected.abs().amax(-1, keepdim=True))})
    return [{"dtype": str(dtype).removeprefix("torch."), **r} for r in rows]


def dispatched(num_layers: int) -> dict:
    """A fp16 decoder of ``num_layers``, kernels dispatched vs PyTorch's form."""
    config = DecoderConfig(hidden_size=256, intermediate_size=768, num_layers=num_layers, num_heads=4, num_kv_heads=2,
                           head_dim=64, rms_norm_eps=1e-6, rope_theta=1e6, vocab_size=16, attention_bias=False)
    torch.manual_seed(0)
    decoder = Decoder(config, 64).eval().requires_grad_(False)
    for p in decoder.parameters():
        p.uniform_(0.5, 1.5) if p.dim() == 1 else p.normal_(0, 0.05)
    decoder = decoder.half()
    decoder.rotary.reset_buffers("cpu")
    decoder.fuse_projections()
    embeds = torch.randn(2, 7, 256).half()

    def run() -> torch.Tensor:
        cache = decoder.new_dense_cache(2, 8, torch.float16, "cpu", fused_decode=True)
        cache.prepare(7)
        prefill = decoder(embeds.reshape(14, 256), torch.arange(7).repeat(2), cache)
        cache.prepare(1)
        return torch.cat((prefill, decoder(embeds[:, -1], torch.full((2,), 7), cache)))

    with torch.inference_mode():
        eager = run()
        with mock.patch.object(layers, "triton_runs", return_value=True):
            fused = run()
    return {"layers": num_layers, "bit_equal": (fused == eager).float().mean().item(),
            "max_rel_diff": ((fused.float() - eager.float()).abs().max() / eager.float().abs().max()).item()}


def moe_dispatched() -> dict:
    torch.manual_seed(0)
    moe = SparseMoE(256, 128, 8, 2, True, impl="loop").requires_grad_(False)
    for p in moe.parameters():
        p.normal_(0, 0.05)
    moe, x = moe.half(), torch.randn(20, 256).half()
    with torch.inference_mode():
        eager = moe(x)
        with mock.patch.object(layers, "triton_runs", return_value=True):
            fused = moe(x)
    return {"bit_equal": (fused == eager).float().mean().item()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--output", default="benchmarks/results/layer_kernels_interpret.json")
    args = parser.parse_args()
    g = torch.Generator().manual_seed(0)
    rows = [r for dtype in (torch.float16, torch.float32) for r in kernel_rows(dtype, g)]
    stacks = [dispatched(1), dispatched(3)]
    moe = moe_dispatched()
    print(f"{'kernel':<24}{'dtype':>9}{'max ulps':>10}{'bit-equal':>11}")
    for r in rows:
        print(f"{r['kernel']:<24}{r['dtype']:>9}{r['max_ulps']:>10.2f}{r['bit_equal']:>11.4f}")
    for s in stacks:
        print(f"fp16 decoder, {s['layers']} layer(s): bit-equal {s['bit_equal']:.4f}, max rel diff {s['max_rel_diff']:.2e}")
    print(f"fp16 MoE experts (loop): bit-equal {moe['bit_equal']:.4f}")
    report = {"torch": torch.__version__, "triton": triton.__version__, "kernels": rows, "decoders": stacks, "moe": moe}
    Path(args.output).parent.mkdir(parents=True, exist_ok=True)
    Path(args.output).write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {args.output}")


if __name__ == "__main__":
    main()
