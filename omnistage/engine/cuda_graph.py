"""Decode steps (talker + code predictor + sampling) and prefill tails captured as CUDA graphs.

Graphs per bucketed batch size, all sharing one memory pool (captured largest first,
as in nano-vllm). A decode graph reads one static ``[bucket, 3] int64`` index buffer (slot,
step row, context length; see :meth:`ModelRunner.decode_meta`); a batch of ``B`` requests
is padded up to its bucket with rows that touch only scratch state (the scratch slot, the
scratch step row and the KV pool's scratch block), so replaying a graph never writes to
another request's state. Everything else a step reads (next input embeddings, sampling
state, block tables, the KV pool) lives at fixed addresses already.

Why: a 0.6B frame is thousands of small kernels (28 talker layers, 15 predictor passes of
5 layers, 16 samplings), so eagerly it is bound by kernel launches from Python: measured
on an H200, 100-190 ms per step eager vs 16 ms replayed at batch 1, and a 100-token
prefill 110 ms eager vs 35 ms with its tail replayed (benchmarks/results/engine_gpu.json).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from omnistage.engine.model_runner import ModelRunner, StepSampling

Outputs = tuple[torch.Tensor, torch.Tensor | None]  # frames [B, G]; hidden-layer states [B, K, H] or None


def default_batch_sizes(max_num_seqs: int) -> list[int]:
    """1, 2, 4, 8, then every 8 up to ``max_num_seqs`` (at most 7 padded rows past 8)."""
    sizes = [b for b in (1, 2, 4) if b < max_num_seqs] + list(range(8, max_num_seqs + 1, 8))
    return sorted(set(sizes) | {max_num_seqs})


class CUDAGraphRunner:
    """Captures, per bucket, :meth:`ModelRunner.decode` (a whole decode step) and
    :meth:`ModelRunner.frame_tail` (what follows a prefill's forward: code 0, the code
    predictor, sampling; ~3/4 of a 0.6B prefill's kernel launches), and replays them.

    A graph is also specific to a :class:`~omnistage.engine.model_runner.StepSampling`
    (which sampler work its batches need). The general one, which serves any batch, is
    captured for every bucket here; a step that needs less replays its own variant,
    captured on first use (a one-off pause of about one eager step).

    Args:
        runner: the eager runner (its state buffers are what the graphs read and write).
        batch_sizes: buckets to capture.
        sampling_variants: more :class:`StepSampling` values to capture for every bucket
            at start-up (besides the general one).

    Raises:
        ValueError: the runner's device is not CUDA.
    """

    def __init__(self, runner: ModelRunner, batch_sizes: list[int], sampling_variants: Sequence[StepSampling] = ()) -> None:
        if runner.spec.device.type != "cuda":
            raise ValueError("CUDA graphs need a CUDA device")
        self.runner = runner
        self.batch_sizes = sorted(batch_sizes)
        largest, spec = self.batch_sizes[-1], runner.spec
        self.padding = runner.padding_meta(largest).to(spec.device)
        self.meta = self.padding.clone()  # decode input: slot, step row, context length
        self.hidden = torch.zeros(largest, spec.hidden_size, dtype=spec.dtype, device=spec.device)  # tail input
        self.tail_slots = self.padding[:, 0].clone()  # tail input: slot
        self.graphs: dict[tuple[str, int, StepSampling], tuple[torch.cuda.CUDAGraph, Outputs]] = {}
        # the graphs write into these predictor caches: they must live as long as the graphs
        # (shared by the graphs of a bucket: they never run at the same time)
        self.frame_caches = {size: runner.model.new_frame_cache(size) for size in self.batch_sizes}
        self._pool = None
        for size in reversed(self.batch_sizes):  # largest first, as in nano-vllm
            for kind in ("decode", "tail"):
                for sampling in dict.fromkeys((StepSampling(), *sampling_variants)):
                    self._capture(kind, size, sampling)
        torch.cuda.synchronize()

    @property
    def max_batch_size(self) -> int:
        return self.batch_sizes[-1]

    def decode(self, meta: torch.Tensor, sampling: StepSampling) -> Outputs:
        """Replay the decode step for ``meta`` (``[B, 3] int64`` host tensor, ``B <=``
        :attr:`max_batch_size`) and ``sampling`` (its requests'); returns views of the
        graph's outputs (:meth:`ModelRunner.decode`'s), valid until the next replay."""
        batch = meta.shape[0]
        size = self._bucket(batch)
        graph, (codes, layers) = self._graph("decode", size, sampling)
        padded = torch.cat([meta, self.runner.padding_meta(size - batch)])
        self.meta[:size].copy_(padded.pin_memory(), non_blocking=True)
        graph.replay()
        return codes[:batch], None if layers is None else layers[:batch]

    def frame_tail(self, hidden: torch.Tensor, slot_ids: torch.Tensor, sampling: StepSampling) -> torch.Tensor:
        """Replay :meth:`ModelRunner.frame_tail` for ``B <=`` :attr:`max_batch_size`
        requests (device inputs); returns a view ``[B, G]``, valid until the next replay."""
        batch = hidden.shape[0]
        size = self._bucket(batch)
        graph, (codes, _) = self._graph("tail", size, sampling)
        self.hidden[:batch].copy_(hidden)
        self.tail_slots[:batch].copy_(slot_ids)
        self.tail_slots[batch:size].copy_(self.padding[batch:size, 0])
        graph.replay()
        return codes[:batch]

    def _graph(self, kind: str, size: int, sampling: StepSampling) -> tuple[torch.cuda.CUDAGraph, Outputs]:
        key = (kind, size, sampling)
        return self.graphs[key] if key in self.graphs else self._capture(kind, size, sampling)

    def _capture(self, kind: str, size: int, sampling: StepSampling) -> tuple[torch.cuda.CUDAGraph, Outputs]:
        """Warm up and capture one graph on padding inputs: it touches only scratch state,
        and it is ordered after any replay still queued on the stream."""
        runner, cache = self.runner, self.frame_caches[size]
        self.meta[:size].copy_(self.padding[:size])
        self.tail_slots[:size].copy_(self.padding[:size, 0])
        if kind == "decode":
            def step() -> Outputs:
                return runner.decode(self.meta[:size], cache, sampling=sampling)
        else:
            def step() -> Outputs:
                return runner.frame_tail(self.hidden[:size], self.tail_slots[:size], cache, sampling), None
        step()  # warm-up: Triton compiles, cuBLAS picks kernels
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        # thread_local: a stage capturing a variant on first use while another stage's thread
        # of the same process drives its own engine (the Omni thinker and talker) would
        # otherwise make that thread's syncs fail the capture
        with torch.cuda.graph(graph, pool=self._pool, capture_error_mode="thread_local"):
            outputs = step()
        self._pool = graph.pool()
        self.graphs[(kind, size, sampling)] = (graph, outputs)
        return graph, outputs

    def _bucket(self, batch: int) -> int:
        return next(s for s in self.batch_sizes if s >= batch)
