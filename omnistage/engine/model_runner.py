"""The model contract the engine drives (:class:`ARModel`) and the runner that executes a
prefill or a decode step on it, entirely on the device.

One engine step, for a batch of ``B`` requests::

    input  = model.next_input_embeds(last_codes[slot], step_row)          # the frame fed back
    hidden = model.forward(input, positions, paged_attention)             # backbone
    code0  = sample(model.head_logits(hidden_last), per-request params)   # fp32, seeded
    codes  = model.complete_frame(hidden_last, code0, sample_fn, cache)   # [B, G]
    last_codes[slot] = codes                                              # fed next step

(a prefill's input is the prompt instead). The fed-back embedding is made when it is fed,
not when its frame is made, so a step row is needed one step later: a request whose rows
stream in waits only for the row its next step really feeds.

No host sync inside: per-request state lives on the device in *slots* (one row per running
request, plus a scratch row ``max_num_seqs`` that the padding rows of a CUDA-graph batch
use): the last frame, the sampling state, the block table. A decode step reads its slots
through one small ``[B, 3] int64`` index tensor (slot, step row, context length), so the
same code runs eagerly or replayed from a CUDA graph
(:class:`~omnistage.engine.cuda_graph.CUDAGraphRunner`).

A small prefill can be replayed too (:meth:`ModelRunner.forward_rows`): its computed tokens
are the rows of a decode-like forward, each attending through its request's block table to
its context so far (the cached prefix and the prompt tokens before it), so the shapes depend
only on the number of rows, padded up to a bucket with rows that touch only scratch state.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import numpy as np
import torch

from omnistage.engine.attention import AttentionBackend, DenseKVCache
from omnistage.engine.kv_cache import PagedKVCache
from omnistage.engine.paged_attention import DecodeAttention, PagedAttention
from omnistage.engine.sampler import (
    SamplerFeatures,
    SamplingBatch,
    SamplingParams,
    gumbel_noise,
    sample,
)
from omnistage.engine.sequence import HiddenAdditions, Sequence

SampleFn = Callable[[int, torch.Tensor], torch.Tensor]
"""``sample_fn(group_index, logits [B, V_code]) -> [B] int64``: picks code group
``group_index`` (1..G-1) of every frame in the batch."""
GREEDY = SamplingParams(temperature=0.0)  # the predictor's sampling when a request gives none


@dataclass(frozen=True)
class StepSampling:
    """What a step's two samplers (code 0, code predictor) need, decided on the host from
    its requests' params (:meth:`of`); the default (everything) serves any batch. The
    CUDA-graph runner captures a graph per value: a captured graph holds only the sampler
    work its batches need."""

    code0: SamplerFeatures = SamplerFeatures()
    predictor: SamplerFeatures = SamplerFeatures()

    @classmethod
    def of(cls, seqs: list[Sequence]) -> StepSampling:
        return cls(
            SamplerFeatures.of([s.inputs.sampling for s in seqs]),
            SamplerFeatures.of([s.inputs.predictor_sampling or GREEDY for s in seqs]),
        )


@dataclass(frozen=True)
class PrefillRows:
    """A prefill laid out as the ``size`` rows of :meth:`ModelRunner.forward_rows` (the input
    of a captured prefill graph; :meth:`ModelRunner.prefill_rows` makes it).

    Attributes:
        meta: ``[size, 3] int64`` host: for each computed prompt token, in batch order, a
            decode step's index row (slot, step row: the scratch row, not read; context
            length through the token, i.e. its position + 1), then
            :meth:`ModelRunner.padding_meta` rows.
        positions: ``[3, size] float32`` host, the tokens' multimodal positions then zeros,
            for a model with ``spec.position_rows == 3``; else None (a 1-D position is the
            context length - 1).
        embeds: ``[n, H]`` (model dtype, on the device) the computed tokens' input
            embeddings, not padded (``n <= size``).
        ends: ``[2, B] int64`` host: each request's slot, and the row of its last token.
    """

    meta: torch.Tensor
    positions: torch.Tensor | None
    embeds: torch.Tensor
    ends: torch.Tensor

    @property
    def num_tokens(self) -> int:
        """``n``: rows that are prompt tokens (the rest pad)."""
        return self.embeds.shape[0]


@dataclass(frozen=True)
class ARModelSpec:
    """What the engine needs to know about a model.

    Attributes:
        num_layers, num_heads, num_kv_heads, head_dim: backbone attention geometry (query
            heads; the KV pool's layout).
        hidden_size: ``H``, width of input embeddings and hidden states.
        vocab_size: code-0 (token) vocabulary, the width of :meth:`ARModel.head_logits`.
        num_code_groups: ``G`` codes per frame (1 for a token LM).
        code_vocab_size: vocabulary of codes ``1..G-1`` (unused when G == 1).
        dtype, device: of the weights and activations.
        position_rows: 1: :meth:`ARModel.forward` takes positions ``[N]``; 3: multimodal
            RoPE positions ``[3, N]`` (T, H, W): a prompt's from its request, a decode
            step's the cache length + the request's ``rope_delta`` on every row.
        hidden_layers: hidden states the model returns beside its output
            (:meth:`ARModel.forward_with_hidden`), for requests with ``return_hidden``:
            index ``i`` is the state after the first ``i`` layers (0: the input
            embeddings), as in Hugging Face's ``hidden_states[i]``. Empty: none.
        hidden_addition_layers: how many first layers a request's
            :class:`~omnistage.engine.sequence.HiddenAdditions` may cover (0: the model
            takes none; else its ``forward`` / ``forward_with_hidden`` take ``additions``).

    Raises:
        ValueError: ``num_heads`` is not a positive multiple of ``num_kv_heads``.
    """

    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    hidden_size: int
    vocab_size: int
    num_code_groups: int
    code_vocab_size: int
    dtype: torch.dtype
    device: torch.device
    position_rows: int = 1
    hidden_layers: tuple[int, ...] = ()
    hidden_addition_layers: int = 0

    def __post_init__(self) -> None:
        if not (self.num_kv_heads >= 1 and self.num_heads >= 1 and self.num_heads % self.num_kv_heads == 0):
            raise ValueError(
                f"num_heads ({self.num_heads}) must be a positive multiple of num_kv_heads ({self.num_kv_heads})"
            )


class ARModel(Protocol):
    """An autoregressive backbone with a (possibly multi-codebook) head.

    Every method is device-only (no host sync) and works for any batch size, so the engine
    can capture decode steps in CUDA graphs.
    """

    spec: ARModelSpec

    def forward(self, input_embeds: torch.Tensor, positions: torch.Tensor, attn: AttentionBackend) -> torch.Tensor:
        """``input_embeds [N, H]``, ``positions [N] int64`` (``[3, N]`` if
        ``spec.position_rows == 3``; float32 then) -> hidden ``[N, H]`` (final norm
        applied). Layer ``i`` calls ``attn(i, q, k, v)``. A model with
        ``spec.hidden_addition_layers`` also takes the keyword ``additions``
        (:class:`~omnistage.engine.sequence.HiddenAdditions` over the ``N`` rows, or None),
        given only to a prefill whose requests have any."""

    def forward_with_hidden(
        self, input_embeds: torch.Tensor, positions: torch.Tensor, attn: AttentionBackend
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """:meth:`forward` that also returns the states of ``spec.hidden_layers``,
        ``[N, K, H]`` (K of them, in that order; a captured state is taken before that
        layer's additions); needed only when there are any. Takes ``additions`` as
        :meth:`forward` does."""

    def head_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """``[B, H]`` -> code-0 logits ``[B, vocab_size]``."""

    def embed_tokens(self, token_ids: torch.Tensor) -> torch.Tensor:
        """``[L] int64`` -> ``[L, H]`` (token-id prompts)."""

    def new_frame_cache(self, batch: int) -> DenseKVCache | None:
        """The code predictor's per-frame KV cache for ``batch`` requests (None if G == 1)."""

    def complete_frame(
        self, hidden: torch.Tensor, code0: torch.Tensor, sample_fn: SampleFn, cache: DenseKVCache | None
    ) -> torch.Tensor:
        """Codes of the frame ``[B, G] int64`` from the last hidden ``[B, H]`` and its
        code 0 ``[B]``; codes 1..G-1 drawn with ``sample_fn`` (G == 1: ``code0[:, None]``)."""

    def next_input_embeds(self, codes: torch.Tensor, step_rows: torch.Tensor) -> torch.Tensor:
        """The next step's input ``[B, H]`` from the frame ``[B, G]`` and the requests'
        step rows ``[B, H]`` (Qwen3-TTS: sum of the 16 codebook embeddings + the row)."""


class ModelRunner:
    """Executes prefills and decode steps of an :class:`ARModel` over a paged KV pool.

    Args:
        model: the model.
        cache: the KV pool.
        decode_attention: see :func:`~omnistage.engine.paged_attention.decode_attention_for`.
        max_num_seqs: slots (running requests at most).
        num_step_rows: rows of the step-embedding pool (a scratch row is added).
        max_blocks_per_seq: block-table width.
    """

    def __init__(
        self,
        model: ARModel,
        cache: PagedKVCache,
        decode_attention: DecodeAttention,
        max_num_seqs: int,
        num_step_rows: int,
        max_blocks_per_seq: int,
    ) -> None:
        spec = model.spec
        self.model, self.spec, self.cache = model, spec, cache
        self.attn = PagedAttention(cache, decode_attention)
        self.attn.decide_fused(spec.num_heads)  # at start-up, not at a live prefill
        device, slots = spec.device, max_num_seqs + 1
        self.scratch_slot, self.scratch_row = max_num_seqs, num_step_rows
        self.last_codes = torch.zeros(slots, spec.num_code_groups, dtype=torch.int64, device=device)
        # per-slot rope_delta (may be fractional), for models with 3-row positions only (the
        # 1-D path stays as it was)
        self.rope_deltas = torch.zeros(slots, dtype=torch.float32, device=device) if spec.position_rows == 3 else None
        self.step_rows = torch.zeros(num_step_rows + 1, spec.hidden_size, dtype=spec.dtype, device=device)
        self.block_tables = torch.full((slots, max_blocks_per_seq), cache.scratch_block, dtype=torch.int64, device=device)
        self.sampling = SamplingBatch.empty(slots, spec.vocab_size, device)
        self.predictor_sampling = (
            SamplingBatch.empty(slots, spec.code_vocab_size, device) if spec.num_code_groups > 1 else None
        )

    # ----------------------------------------------------------------- host side
    def admit(self, seq: Sequence) -> None:
        """Write an admitted request's slot state: sampling rows, block table, step rows."""
        inputs, device = seq.inputs, self.spec.device
        # nothing here waits for the device (fills and pinned uploads, see
        # SamplingBatch.set_row): a request admitted while another engine's step is queued on
        # the same stream (the Omni talker's beside the thinker's) is not held behind it
        self.sampling.set_row(seq.slot, inputs.sampling)
        if self.rope_deltas is not None:
            self.rope_deltas[seq.slot].fill_(inputs.rope_delta)
        if self.predictor_sampling is not None:
            self.predictor_sampling.set_row(seq.slot, inputs.predictor_sampling or GREEDY)
        self.block_tables[seq.slot].fill_(self.cache.scratch_block)
        self.block_tables[seq.slot, : len(seq.block_table)] = upload(seq.block_table, device)
        hidden = self.spec.hidden_size
        pad = inputs.pad_embed if inputs.pad_embed is not None else torch.zeros(hidden, dtype=self.spec.dtype, device=device)
        self._write_rows([seq.row_slots[-1]], pad.reshape(1, hidden))
        if inputs.step_rows is not None:
            self._write_rows(seq.row_slots[: inputs.num_given_rows], inputs.step_rows)

    def write_rows(self, seq: Sequence, first: int, rows: torch.Tensor) -> None:
        """Store ``rows [K, H]`` (any device and float dtype) as the running request's step
        rows ``first..first+K-1`` (within its capacity)."""
        self._write_rows(seq.row_slots[first : first + rows.shape[0]], rows)

    def _write_rows(self, slots: list[int], rows: torch.Tensor) -> None:
        # ordered after any step already queued on the device, so a step in flight reads
        # the rows it was launched with
        rows = rows.to(self.spec.device, self.spec.dtype, non_blocking=True)
        self.step_rows.index_copy_(0, upload(slots, self.spec.device), rows)

    def decode_meta(self, seqs: list[Sequence]) -> torch.Tensor:
        """``[B, 3] int64`` host tensor (slot, step row of the frame fed back, context
        length) of a decode step; call before incrementing ``num_scheduled``."""
        return torch.tensor(
            [[s.slot, s.step_row(s.num_scheduled - 1), s.prompt_len + s.num_scheduled] for s in seqs],
            dtype=torch.int64,
        )

    def padding_meta(self, rows: int) -> torch.Tensor:
        """``[rows, 3]`` meta rows that touch only scratch state (CUDA-graph padding)."""
        return torch.tensor([[self.scratch_slot, self.scratch_row, 1]] * rows, dtype=torch.int64).reshape(rows, 3)

    def prefill_rows(self, seqs: list[Sequence], size: int) -> PrefillRows:
        """The prefill of ``seqs`` (admitted, nothing scheduled yet; each from its first token
        not in the prefix cache, as in :meth:`prefill`) as ``size`` rows of
        :meth:`forward_rows` (see :class:`PrefillRows`).

        Raises:
            ValueError: the requests compute more than ``size`` tokens.
        """
        n = sum(s.prompt_len - s.num_cached for s in seqs)
        if n > size:
            raise ValueError(f"a prefill of {n} tokens does not fit {size} rows")
        slots = np.repeat([s.slot for s in seqs], [s.prompt_len - s.num_cached for s in seqs])
        context_lens = np.concatenate([np.arange(s.num_cached + 1, s.prompt_len + 1) for s in seqs])
        rows = np.stack([slots, np.full_like(slots, self.scratch_row), context_lens], axis=1).astype(np.int64)
        meta = torch.cat([torch.from_numpy(rows), self.padding_meta(size - n)])
        positions = None
        if self.rope_deltas is not None:
            given = [_prompt_positions(s)[:, s.num_cached :] for s in seqs]
            positions = torch.cat([*given, torch.zeros(3, size - n)], dim=1)
        ends = [0, *itertools.accumulate(s.prompt_len - s.num_cached for s in seqs)]
        last = torch.tensor([[s.slot for s in seqs], [end - 1 for end in ends[1:]]], dtype=torch.int64)
        embeds = torch.cat([self._prompt_embeds(s)[s.num_cached :] for s in seqs])
        return PrefillRows(meta, positions, embeds, last)

    # --------------------------------------------------------------- device side
    def prefill(self, seqs: list[Sequence]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """One variable-length forward over the prompts of ``seqs`` (admitted, nothing
        scheduled yet), each from its first token not in the prefix cache
        (``seq.num_cached``; those before it are attended to from their shared blocks).
        Returns the last hidden ``[B, H]`` and the slot ids ``[B] int64`` (the inputs of
        :meth:`frame_tail`, which makes frame 0), and the states of ``spec.hidden_layers``
        ``[N, K, H]`` of every computed prompt token (None without any). The requests'
        hidden additions are added at their rows of the batch."""
        device, size = self.spec.device, self.cache.block_size
        lengths = [s.prompt_len - s.num_cached for s in seqs]
        # every prompt token's KV slot, with numpy per request (per-token Python held the
        # GIL for tens of ms in a burst of long prompts); with a cached prefix all of them
        # are the context that attention reads
        cached = any(s.num_cached for s in seqs)
        slots = [prompt_kv_slots(s, size) for s in seqs]
        kv_slots = np.concatenate([slot[s.num_cached :] for slot, s in zip(slots, seqs, strict=True)])
        context = np.concatenate(slots) if cached else kv_slots[:0]
        ends = [end - 1 for end in itertools.accumulate(lengths)]
        per_seq = np.array([s.slot for s in seqs] + ends, dtype=np.int64)
        n, b = kv_slots.shape[0], len(seqs)
        if self.rope_deltas is None:
            positions = np.concatenate([np.arange(s.num_cached, s.prompt_len) for s in seqs])
            flat = upload(torch.from_numpy(np.concatenate([positions, kv_slots, context, per_seq])), device)
            positions_d, kv_slots_d = flat[: 2 * n].view(2, n)
            context_d = flat[2 * n : 2 * n + context.shape[0]]
        else:
            # float32: multimodal positions may be fractional
            positions_d = upload(torch.cat([_prompt_positions(s)[:, s.num_cached :] for s in seqs], dim=1), device)
            flat = upload(torch.from_numpy(np.concatenate([kv_slots, context, per_seq])), device)
            kv_slots_d, context_d = flat[:n], flat[n : n + context.shape[0]]
        slot_ids, last = flat[flat.shape[0] - 2 * b :].view(2, b)
        embeds = torch.cat([self._prompt_embeds(s)[s.num_cached :] for s in seqs])
        if cached:
            self.attn.prepare_prefill(kv_slots_d, lengths, context_d, [s.prompt_len for s in seqs])
        else:
            self.attn.prepare_prefill(kv_slots_d, lengths)
        hidden, layers = self._forward(embeds, positions_d, _batch_additions(seqs, lengths, self.spec))
        return hidden[last], slot_ids, layers

    def decode(
        self, meta: torch.Tensor, cache: DenseKVCache | None, width: int | None = None,
        sampling: StepSampling = StepSampling(), extra: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """One decode step of the requests in ``meta`` (``[B, 3] int64`` on the device, see
        :meth:`decode_meta`): :meth:`feed`, then one :meth:`frame_tail` over its ``B`` rows
        and, with ``extra`` (the last hidden ``[k, H]`` and slot ids ``[k] int64`` of a
        prefill, :meth:`prefill`'s first two outputs), ``k`` more rows after them: a mixed
        step makes the prefill's first frames in the same tail. ``width``: block-table
        columns to use (None: all); ``cache``: a frame cache for ``B + k`` rows;
        ``sampling``: :meth:`StepSampling.of` all ``B + k`` requests (or more).
        Returns the frames ``[B + k, G] int64`` (decode rows first) and the states of
        ``spec.hidden_layers`` of the fed tokens ``[B, K, H]`` (None without any)."""
        hidden, layers = self.feed(meta, width)
        slot_ids = meta[:, 0]
        if extra is not None:
            hidden, slot_ids = torch.cat([hidden, extra[0]]), torch.cat([slot_ids, extra[1]])
        return self.frame_tail(hidden, slot_ids, cache, sampling), layers

    def feed(self, meta: torch.Tensor, width: int | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """A decode step up to its frame tail: each request's input made from its last frame
        and step row (``meta`` as in :meth:`decode`), then the backbone. Returns the last
        hidden ``[B, H]`` (the input of :meth:`frame_tail`, with slot ids ``meta[:, 0]``) and
        the states of ``spec.hidden_layers`` ``[B, K, H]`` (None without any)."""
        slot_ids, row_ids = meta[:, 0], meta[:, 1]
        positions = self._prepare_rows(meta, width)
        fed = self.model.next_input_embeds(self.last_codes.index_select(0, slot_ids),
                                           self.step_rows.index_select(0, row_ids))
        if self.rope_deltas is not None:
            positions = (positions + self.rope_deltas.index_select(0, slot_ids)).expand(3, -1)
        return self._forward(fed.to(self.spec.dtype), positions)

    def forward_rows(
        self, meta: torch.Tensor, embeds: torch.Tensor, positions: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The backbone over ``R`` rows of given input, each attending as a decode step's
        token does: it writes its ``k, v`` at its slot, then attends to its request's first
        ``context length`` tokens through the block table (all rows' writes of a layer come
        before its attention, so the rows of one prompt attend causally to each other and to
        a cached prefix; a padding row attends to the scratch block only). Static shapes,
        no host sync: what a prefill graph replays (:class:`PrefillRows`).

        Args:
            meta: ``[R, 3] int64`` on the device (:attr:`PrefillRows.meta`; the step-row
                column is not read).
            embeds: ``[R, H]`` input embeddings, model dtype.
            positions: ``[3, R] float32`` on the device for ``spec.position_rows == 3``
                (else None: ``context length - 1``).

        Returns:
            The hidden ``[R, H]`` and the states of ``spec.hidden_layers`` ``[R, K, H]``
            (None without any) of every row.
        """
        rope_positions = self._prepare_rows(meta, None)
        return self._forward(embeds, rope_positions if positions is None else positions)

    def _prepare_rows(self, meta: torch.Tensor, width: int | None) -> torch.Tensor:
        """Announce a forward of one token per ``meta`` row (slot, -, context length) to
        the attention backend, with ``width`` block-table columns (None: all); returns the
        rows' positions ``[R] int64``."""
        slot_ids, context_lens = meta[:, 0], meta[:, 2]
        positions = context_lens - 1
        tables = self.block_tables.index_select(0, slot_ids)[:, :width]
        size = self.cache.block_size
        kv_slots = tables.gather(1, (positions // size)[:, None])[:, 0] * size + positions % size
        self.attn.prepare_decode(kv_slots, tables, context_lens)
        return positions

    def _forward(
        self, embeds: torch.Tensor, positions: torch.Tensor, additions: HiddenAdditions | None = None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        extra = {} if additions is None else {"additions": additions}
        if self.spec.hidden_layers:
            return self.model.forward_with_hidden(embeds, positions, self.attn, **extra)
        return self.model.forward(embeds, positions, self.attn, **extra), None

    def upload_meta(self, meta: torch.Tensor) -> torch.Tensor:
        return upload(meta, self.spec.device)

    def _prompt_embeds(self, seq: Sequence) -> torch.Tensor:
        prompt = upload(seq.inputs.prompt, self.spec.device)
        if prompt.dim() == 1:
            return self.model.embed_tokens(prompt)
        return prompt.to(self.spec.dtype)

    def frame_tail(
        self, hidden: torch.Tensor, slot_ids: torch.Tensor, cache: DenseKVCache | None,
        sampling: StepSampling = StepSampling(),
    ) -> torch.Tensor:
        """From the last hidden ``[B, H]`` to the frame ``[B, G] int64``: sample code 0,
        complete the frame, record the draws and keep the frame in each request's slot
        (``slot_ids``: ``[B] int64``; ``sampling``: see :meth:`decode`)."""
        batch = self.sampling.select(slot_ids)
        code0 = sample(self.model.head_logits(hidden), batch, sampling.code0)
        self.sampling.record(code0, slot_ids)
        sample_fn = self._predictor_sampler(slot_ids, batch.num_generated, sampling.predictor)
        codes = self.model.complete_frame(hidden, code0, sample_fn, cache)
        self.last_codes.index_copy_(0, slot_ids, codes)
        return codes

    def _predictor_sampler(
        self, slot_ids: torch.Tensor, frame_index: torch.Tensor, features: SamplerFeatures
    ) -> SampleFn:
        if self.predictor_sampling is None:
            return _no_sub_codes
        batch = self.predictor_sampling.select(slot_ids)
        groups = self.spec.num_code_groups
        # the seeded draw of (frame k, group g) uses hash step k * G + g: unique per draw.
        # The noise of the frame's G-1 draws is made at once: the kernels of one draw.
        gumbel = None
        if features.draws:
            steps = frame_index[:, None] * groups + torch.arange(1, groups, device=frame_index.device)
            gumbel = gumbel_noise(batch.seed ^ PREDICTOR_NOISE_SALT, steps, self.spec.code_vocab_size)

        def sample_fn(group: int, logits: torch.Tensor) -> torch.Tensor:
            return sample(logits, batch, features, None if gumbel is None else gumbel[:, group - 1])

        return sample_fn


# The code predictor's draws get their own noise stream: keyed by (seed, step) alone, a
# request whose predictor shares its talker seed would draw code 0 of frame k and code g
# of frame j with the same noise whenever k == j * G + g. (< 2**31, so seeds stay valid.)
PREDICTOR_NOISE_SALT = 0x5BD1E995


def prompt_kv_slots(seq: Sequence, block_size: int) -> np.ndarray:
    """The KV-pool slots ``[prompt_len] int64`` of ``seq``'s prompt tokens: token ``t``
    lives in block ``block_table[t // block_size]`` at offset ``t % block_size``."""
    tokens = np.arange(seq.prompt_len, dtype=np.int64)
    return np.asarray(seq.block_table, dtype=np.int64)[tokens // block_size] * block_size + tokens % block_size


def _prompt_positions(seq: Sequence) -> torch.Tensor:
    """``[3, L] float32`` host positions of a prompt: its request's, else ``0..L-1`` per row."""
    if seq.inputs.positions is not None:
        return seq.inputs.positions.to("cpu", torch.float32)
    return torch.arange(seq.prompt_len, dtype=torch.float32).expand(3, -1)


def _batch_additions(seqs: list[Sequence], lengths: list[int], spec: ARModelSpec) -> HiddenAdditions | None:
    """The prefill batch's :class:`HiddenAdditions`: each request's rows shifted by its
    offset in the batch, every layer's rows stacked (zeros for a request with fewer layers),
    on the model's device and dtype; None when no request has any."""
    given = [(offset, s.inputs.hidden_additions) for offset, s in zip(itertools.accumulate([0, *lengths[:-1]]), seqs, strict=True)
             if s.inputs.hidden_additions is not None]  # fmt: skip
    if not given:
        return None
    layers = max(len(a.embeds) for _, a in given)
    rows = torch.cat([a.rows + offset for offset, a in given])
    embeds = tuple(
        torch.cat([a.embeds[layer].to(spec.device, spec.dtype) if layer < len(a.embeds)
                   else torch.zeros(a.rows.shape[0], spec.hidden_size, dtype=spec.dtype, device=spec.device)
                   for _, a in given])  # fmt: skip
        for layer in range(layers)
    )
    return HiddenAdditions(upload(rows, spec.device), embeds)


def _no_sub_codes(group: int, logits: torch.Tensor) -> torch.Tensor:
    raise RuntimeError("a single-codebook model sampled a code-predictor group")


def upload(values: list[int] | torch.Tensor, device: torch.device) -> torch.Tensor:
    """A host int list (as int64) or tensor on ``device``; from the host to CUDA through
    pinned memory, without waiting (the copy is ordered before later kernels on the stream;
    a plain ``.to(device)`` or ``torch.tensor(..., device=...)`` waits for the stream to
    drain first). A tensor on a device already is moved with ``.to(device)``."""
    host = values if isinstance(values, torch.Tensor) else torch.tensor(values, dtype=torch.int64)
    if device.type != "cuda" or host.device.type != "cpu":
        return host.to(device)
    return host.pin_memory().to(device, non_blocking=True)
