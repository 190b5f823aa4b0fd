"""Batched token sampling on the device, per request, in fp32, with no host sync.

One call samples the next token of every running request from its logits ``[B, V]``:
repetition penalty over the request's generated ids, suppressed id ranges, ``min_new_tokens``
(stop ids masked until then), temperature, top-k, top-p, then a draw.

The draw is Gumbel-max with noise from a counter-based hash of ``(seed, step, token id)``
instead of a stateful generator: a request's tokens depend only on its own seed and step,
never on which other requests share the batch, so a seeded request is reproducible under
continuous batching, and the whole step stays on the device (no ``.item()``, no
per-request generator objects). ``temperature == 0`` is greedy (argmax).

Sources: repetition penalty as in CTRL (Keskar et al., 2019) and Hugging Face
``RepetitionPenaltyLogitsProcessor`` (divide positive logits, multiply negative ones);
top-p as in Holtzman et al. (2019), keeping the smallest prefix whose mass reaches p
(the first token always kept); Gumbel-max: argmax(logits / T + G) with G = -log(-log U)
samples softmax(logits / T).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, fields

import torch

_MASK32 = 0xFFFFFFFF
# Multipliers below 2**31 keep every product of two 32-bit values inside int64.
_MIX1, _MIX2, _MIX3 = 0x7FEB352D, 0x46B5B1E3, 0x2C1B3C6D


@dataclass(frozen=True)
class SamplingParams:
    """One request's sampling settings.

    Attributes:
        temperature: >= 0; 0 = greedy.
        top_k: keep the k most likely ids; 0 = off.
        top_p: nucleus mass in (0, 1]; 1 = off.
        repetition_penalty: > 0; 1 = off; applied to ids the request already generated.
        min_new_tokens: stop ids are masked until this many tokens were generated.
        stop_token_ids: ids that end the request (e.g. EOS).
        suppress_ranges: half-open id ranges ``(start, end)`` never sampled.
        seed: makes the request reproducible (any int in [0, 2**31)).

    Raises:
        ValueError: on out-of-range values.
    """

    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    repetition_penalty: float = 1.0
    min_new_tokens: int = 0
    stop_token_ids: tuple[int, ...] = ()
    suppress_ranges: tuple[tuple[int, int], ...] = ()
    seed: int = 0

    def __post_init__(self) -> None:
        if self.temperature < 0 or self.top_k < 0 or not 0 < self.top_p <= 1:
            raise ValueError("need temperature >= 0, top_k >= 0 and 0 < top_p <= 1")
        if self.repetition_penalty <= 0 or self.min_new_tokens < 0 or not 0 <= self.seed < 2**31:
            raise ValueError("need repetition_penalty > 0, min_new_tokens >= 0, 0 <= seed < 2**31")


@dataclass
class SamplingBatch:
    """Per-request sampling state of a batch, as device tensors (``B`` requests, ``V`` ids).

    Attributes:
        temperature, top_p, repetition_penalty: ``[B] float32``.
        top_k, min_new_tokens, seed: ``[B] int64``.
        banned: ``[B, V] bool``, suppressed ids.
        stop: ``[B, V] bool``, stop ids (masked while ``num_generated < min_new_tokens``).
        generated: ``[B, V] bool``, ids each request generated so far (repetition penalty).
        num_generated: ``[B] int64``, tokens generated so far (also the hash's step).
    """

    temperature: torch.Tensor
    top_p: torch.Tensor
    repetition_penalty: torch.Tensor
    top_k: torch.Tensor
    min_new_tokens: torch.Tensor
    seed: torch.Tensor
    banned: torch.Tensor
    stop: torch.Tensor
    generated: torch.Tensor
    num_generated: torch.Tensor

    @classmethod
    def build(cls, params: Sequence[SamplingParams], vocab_size: int, device: torch.device | str) -> SamplingBatch:
        """Tensors for ``params`` (one per request) over ``vocab_size`` ids on ``device``."""
        batch = cls.empty(len(params), vocab_size, device)
        for row, p in enumerate(params):
            batch.set_row(row, p)
        return batch

    @classmethod
    def empty(cls, rows: int, vocab_size: int, device: torch.device | str) -> SamplingBatch:
        """``rows`` greedy rows (temperature 0, nothing banned); fill them with :meth:`set_row`."""
        def col(dtype: torch.dtype) -> torch.Tensor:
            return torch.zeros(rows, dtype=dtype, device=device)

        banned = torch.zeros(rows, vocab_size, dtype=torch.bool, device=device)
        return cls(
            temperature=col(torch.float32),
            top_p=col(torch.float32) + 1,
            repetition_penalty=col(torch.float32) + 1,
            top_k=col(torch.int64),
            min_new_tokens=col(torch.int64),
            seed=col(torch.int64),
            banned=banned,
            stop=torch.zeros_like(banned),
            generated=torch.zeros_like(banned),
            num_generated=col(torch.int64),
        )

    def set_row(self, row: int, params: SamplingParams) -> None:
        """Make ``row`` a fresh request with ``params`` (nothing generated yet). The engine
        keeps one persistent batch with a row per slot and calls this on admission."""
        self.temperature[row] = params.temperature
        self.top_p[row] = params.top_p
        self.repetition_penalty[row] = params.repetition_penalty
        self.top_k[row] = params.top_k
        self.min_new_tokens[row] = params.min_new_tokens
        self.seed[row] = params.seed
        self.banned[row] = False
        for start, end in params.suppress_ranges:
            self.banned[row, start:end] = True
        self.stop[row] = False
        self.stop[row, list(params.stop_token_ids)] = True
        self.generated[row] = False
        self.num_generated[row] = 0

    def select(self, rows: torch.Tensor) -> SamplingBatch:
        """The batch of ``rows`` (``[B] int64`` device tensor), gathered on the device (no
        host sync, so it can run inside a CUDA graph with a static index buffer)."""
        return SamplingBatch(*(getattr(self, f.name).index_select(0, rows) for f in fields(self)))

    def record(self, tokens: torch.Tensor, rows: torch.Tensor | None = None) -> None:
        """Account the sampled ``tokens`` (``[B] int64``) of this step, for every row or for
        ``rows`` (``[B] int64``, distinct) of a persistent batch."""
        if rows is None:
            self.generated.scatter_(1, tokens[:, None], True)
            self.num_generated += 1
        else:
            self.generated.index_put_((rows, tokens), torch.ones_like(tokens, dtype=torch.bool))
            self.num_generated.index_add_(0, rows, torch.ones_like(rows))


def _hash32(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit integer mix (xorshift-multiply rounds) of int64 ``x``; values in [0, 2**32)."""
    x = x & _MASK32
    x = ((x ^ (x >> 16)) * _MIX1) & _MASK32
    x = ((x ^ (x >> 15)) * _MIX2) & _MASK32
    x = ((x ^ (x >> 16)) * _MIX3) & _MASK32
    return x ^ (x >> 15)


def uniform_noise(seed: torch.Tensor, step: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """``[B, V] float32`` in (0, 1), a pure function of (seed, step, id)."""
    ids = torch.arange(vocab_size, device=seed.device, dtype=torch.int64)
    key = _hash32(_hash32(seed[:, None] * 0x9E37 + step[:, None]) + ids[None, :])
    return (key.to(torch.float64) + 0.5).div(2.0**32).to(torch.float32).clamp_(1e-7, 1 - 1e-7)


def sample(logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    """Next token of every request. ``logits``: ``[B, V]`` (any float dtype, computed in
    fp32). Returns ``[B] int64`` on the logits' device; does not update ``batch`` (call
    :meth:`SamplingBatch.record`)."""
    x = logits.float()
    penalty = batch.repetition_penalty[:, None]
    penalized = torch.where(x > 0, x / penalty, x * penalty)
    x = torch.where(batch.generated, penalized, x)
    early = (batch.num_generated < batch.min_new_tokens)[:, None]
    x = x.masked_fill(batch.banned | (batch.stop & early), float("-inf"))
    greedy = x.argmax(dim=-1)
    temperature = batch.temperature.clamp_min(1e-6)[:, None]
    x = _top_k_top_p(x / temperature, batch.top_k, batch.top_p)
    gumbel = -torch.log(-torch.log(uniform_noise(batch.seed, batch.num_generated, x.shape[-1])))
    drawn = (x + gumbel).argmax(dim=-1)
    return torch.where(batch.temperature > 0, drawn, greedy)


def _top_k_top_p(x: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Mask (``-inf``) ids outside each row's top-k and top-p sets; ``[B, V]`` fp32."""
    sorted_x, order = x.sort(dim=-1, descending=True)
    rank = torch.arange(x.shape[-1], device=x.device)[None, :]
    k = torch.where(top_k > 0, top_k, x.shape[-1])[:, None]
    probs = sorted_x.softmax(dim=-1)
    mass_before = probs.cumsum(dim=-1) - probs
    drop = (rank >= k) | ((mass_before >= top_p[:, None]) & (rank > 0))
    sorted_x = sorted_x.masked_fill(drop, float("-inf"))
    return torch.empty_like(x).scatter_(-1, order, sorted_x)
