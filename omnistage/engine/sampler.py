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
_FLOAT32_MAX = torch.finfo(torch.float32).max
# rows with 0 < top_k <= TOP_K_MAX (and top_p 1) draw among torch.topk's survivors instead
# of sorting the whole vocabulary (Qwen3-TTS samples with top-k 50)
TOP_K_MAX = 64
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
        ValueError: on out-of-range values (also a float above float32's maximum).
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
        # held as float32 on the device: a value that overflows there would raise in the
        # engine's step and fail every request batched with this one
        if max(self.temperature, self.top_p, self.repetition_penalty) > _FLOAT32_MAX:
            raise ValueError("temperature, top_p and repetition_penalty must fit in float32")


@dataclass(frozen=True)
class SamplerFeatures:
    """Which parts of :func:`sample` a batch needs; the others are skipped (each is several
    kernels per draw over ``[B, V]``). Decided on the host from the requests' params, so a
    CUDA graph is captured per value (see :meth:`of`).

    Attributes:
        repetition_penalty: some row has a penalty != 1.
        masks: some row suppresses ids or has stop ids masked by ``min_new_tokens``.
        draws: some row samples (temperature > 0); else the batch is greedy (argmax only).
        full_sort: some sampled row needs the whole sorted vocabulary (top-p < 1, or top-k
            0 or above :data:`TOP_K_MAX`); else a draw runs on ``torch.topk``'s survivors.
            Both give a row the same token (same survivors, values and noise).
    """

    repetition_penalty: bool = True
    masks: bool = True
    draws: bool = True
    full_sort: bool = True

    @classmethod
    def of(cls, params: Sequence[SamplingParams]) -> SamplerFeatures:
        return cls(
            repetition_penalty=any(p.repetition_penalty != 1 for p in params),
            masks=any(p.suppress_ranges or (p.stop_token_ids and p.min_new_tokens > 0) for p in params),
            draws=any(p.temperature > 0 for p in params),
            full_sort=any(p.temperature > 0 and (p.top_p < 1 or not 0 < p.top_k <= TOP_K_MAX) for p in params),
        )


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
        keeps one persistent batch with a row per slot and calls this on admission.

        Every write is a fill of a host value (a kernel taking it as an argument), so none
        waits for the device: ``t[row] = x`` of one element copies ``x`` in from the host
        and waits for the stream to drain, and a list index is uploaded the same way; with
        another engine's step queued on the stream (the Omni thinker beside the talker) each
        such write waited for that step."""
        self.temperature[row].fill_(params.temperature)
        self.top_p[row].fill_(params.top_p)
        self.repetition_penalty[row].fill_(params.repetition_penalty)
        self.top_k[row].fill_(params.top_k)
        self.min_new_tokens[row].fill_(params.min_new_tokens)
        self.seed[row].fill_(params.seed)
        self.banned[row].fill_(False)
        for start, end in params.suppress_ranges:
            self.banned[row, start:end].fill_(True)
        self.stop[row].fill_(False)
        for token in params.stop_token_ids:
            self.stop[row, token].fill_(True)
        self.generated[row].fill_(False)
        self.num_generated[row].fill_(0)

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
    """``[B, V]`` (``step [B]``) or ``[B, S, V]`` (``step [B, S]``) float32 in (0, 1), a pure
    function of (seed, step, id); ``seed [B] int64``."""
    ids = torch.arange(vocab_size, device=seed.device, dtype=torch.int64)
    seed = seed.view(-1, *([1] * (step.dim() - 1)))
    key = _hash32(_hash32(seed * 0x9E37 + step)[..., None] + ids)
    return (key.to(torch.float64) + 0.5).div(2.0**32).to(torch.float32).clamp_(1e-7, 1 - 1e-7)


def gumbel_noise(seed: torch.Tensor, step: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Gumbel(0, 1) noise ``-log(-log U)`` of :func:`uniform_noise` (same shapes). Computing
    it for several steps at once (the code predictor's 15 draws of a frame) costs the
    kernels of one."""
    return -torch.log(-torch.log(uniform_noise(seed, step, vocab_size)))


def sample(
    logits: torch.Tensor,
    batch: SamplingBatch,
    features: SamplerFeatures = SamplerFeatures(),
    gumbel: torch.Tensor | None = None,
) -> torch.Tensor:
    """Next token of every request. ``logits``: ``[B, V]`` (any float dtype, computed in
    fp32). ``features``: the parts the batch needs (default: all). ``gumbel``: this draw's
    :func:`gumbel_noise` ``[B, V]`` (None: computed from ``batch.num_generated``).
    Returns ``[B] int64`` on the logits' device; does not update ``batch`` (call
    :meth:`SamplingBatch.record`)."""
    x = logits.float()
    if features.repetition_penalty:
        penalty = batch.repetition_penalty[:, None]
        penalized = torch.where(x > 0, x / penalty, x * penalty)
        x = torch.where(batch.generated, penalized, x)
    if features.masks:
        early = (batch.num_generated < batch.min_new_tokens)[:, None]
        x = x.masked_fill(batch.banned | (batch.stop & early), float("-inf"))
    greedy = x.argmax(dim=-1)
    if not features.draws:
        return greedy
    if gumbel is None:
        gumbel = gumbel_noise(batch.seed, batch.num_generated, x.shape[-1])
    x = x / batch.temperature.clamp_min(1e-6)[:, None]
    if features.full_sort:
        drawn = (_top_k_top_p(x, batch.top_k, batch.top_p) + gumbel).argmax(dim=-1)
    else:
        drawn = _top_k_draw(x, batch.top_k, gumbel)
    return torch.where(batch.temperature > 0, drawn, greedy)


def _top_k_draw(x: torch.Tensor, top_k: torch.Tensor, gumbel: torch.Tensor) -> torch.Tensor:
    """Gumbel-max over each row's ``top_k`` best ids (``0 < top_k <= TOP_K_MAX``), found
    with ``torch.topk``: the same survivors, values and noise as masking the sorted row, so
    the same token; ``[B, V]`` fp32 -> ``[B] int64``."""
    values, ids = x.topk(min(TOP_K_MAX, x.shape[-1]), dim=-1)
    rank = torch.arange(values.shape[-1], device=x.device)[None, :]
    values = values.masked_fill(rank >= top_k[:, None], float("-inf"))
    best = (values + gumbel.gather(1, ids)).argmax(dim=-1, keepdim=True)
    return ids.gather(1, best)[:, 0]


def _top_k_top_p(x: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Mask (``-inf``) ids outside each row's top-k and top-p sets; ``[B, V]`` fp32. A
    ``top_p`` of 1 is off (a cumulative sum that rounds up to 1 must not drop the tail: the
    top-k-only path keeps it)."""
    sorted_x, order = x.sort(dim=-1, descending=True)
    rank = torch.arange(x.shape[-1], device=x.device)[None, :]
    k = torch.where(top_k > 0, top_k, x.shape[-1])[:, None]
    probs = sorted_x.softmax(dim=-1)
    mass_before = probs.cumsum(dim=-1) - probs
    drop = (rank >= k) | ((mass_before >= top_p[:, None]) & (rank > 0) & (top_p < 1)[:, None])
    sorted_x = sorted_x.masked_fill(drop, float("-inf"))
    return torch.empty_like(x).scatter_(-1, order, sorted_x)
