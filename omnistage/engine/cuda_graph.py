"""Decode steps (talker + code predictor + sampling), prefill tails and small prefills
captured as CUDA graphs.

Graphs per bucketed batch size (decode feeds, frame tails) and per bucketed token count
(prefill forwards), all sharing one memory pool (captured largest first, as in
nano-vllm). A decode step is two replays: a *feed* graph (the input embeddings from the
last frames and step rows, the backbone; :meth:`ModelRunner.feed`) that writes each row's
last hidden and slot into the static input of the *tail* graphs (code 0, the code
predictor, sampling; :meth:`ModelRunner.frame_tail`), then the tail of the same bucket. A
prefill's last rows go into that input too: alone (a prefill step) or after a feed's
``B`` rows (a mixed step: one tail at the bucket of ``B + k`` makes the decode frames and
the prefill's first frames at once). A feed graph reads one static ``[bucket, 3] int64``
index buffer (slot, step row, context length; see :meth:`ModelRunner.decode_meta`); a
batch of ``B`` requests is padded up to its bucket with rows that touch only scratch state
(the scratch slot, the scratch step row and the KV pool's scratch block), so replaying a
graph never writes to another request's state. Everything else a step reads (next input
embeddings, sampling state, block tables, the KV pool) lives at fixed addresses already.

A prefill graph is the backbone over ``bucket`` rows (:meth:`ModelRunner.forward_rows`):
a prefill's computed tokens (those after its prefix-cache hits, of any number of requests)
are rows of the same index layout, each attending through its request's block table, then
padding rows as a decode batch's; their input embeddings are copied into a static buffer.
A prefill of more tokens than the largest bucket, or with hidden additions, runs eagerly.

Why: a 0.6B frame is thousands of small kernels (28 talker layers, 15 predictor passes of
5 layers, 16 samplings), so eagerly it is bound by kernel launches from Python: measured
on an H200, 83 ms per step eager vs 7.8 ms replayed at batch 1, and a 100-token prefill
54.1 ms eager vs 18.9 ms with its tail replayed (benchmarks/results/engine_gpu.json). A
prefill of a few tokens (a known voice's text after its cached prefix) is launch-bound
the same way: 28 layers of small kernels whatever the token count.

Capture (:func:`capturing`, also the vocoder arena's): one at a time in the process (a lock),
in thread-local capture mode (other threads keep launching and waiting while one captures),
each runner on a capture stream of its own. Why a stream of its own: torch keys the cuBLAS
and cuBLASLt workspaces by (handle, stream) and a captured GEMM keeps the workspace's
address, so every graph one thread captured on torch's shared default capture stream uses
one workspace (pytorch/pytorch#193402); on one stream their replays run one after another,
but two engines replaying on streams of their own (``EngineConfig.own_stream``) would run
GEMMs on the same workspace at once (split-K partial sums, stream-K tile flags). A graph is
replayed on the stream current at the call (the engine's), after the inputs written on it.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterable, Iterator

import torch

from omnistage.engine.model_runner import ModelRunner, StepSampling
from omnistage.engine.sequence import Sequence

Outputs = tuple[torch.Tensor, torch.Tensor | None]  # frames [B, G] (a prefill, a feed: hidden [R, H]); states [., K, H] or None
DEFAULT_PREFILL_TOKENS = (16, 32, 64, 128)
"""Prefill buckets captured by default (tokens computed in one prefill): a known voice's
text after its cached prefix is ~15 tokens, a whole short prompt up to ~100."""


_CAPTURE_LOCK = threading.RLock()


def device_synchronize(device: torch.device | None = None) -> None:
    """``torch.cuda.synchronize(device)`` under the process-wide capture lock: a device-wide
    synchronize from one thread fails (or invalidates the capture) while another thread
    captures a graph, even in thread-local capture mode, so every one this package makes
    waits until no capture is under way."""
    with _CAPTURE_LOCK:
        torch.cuda.synchronize(device)


@contextlib.contextmanager
def capturing(
    graph: torch.cuda.CUDAGraph, pool: tuple[int, int] | None, stream: torch.cuda.Stream
) -> Iterator[None]:
    """Capture the block's work on ``stream`` into ``graph`` (memory from ``pool``; None: a
    new pool), holding the process-wide capture lock: two captures at once would collide
    (torch's entry to a capture synchronizes the device and empties the allocator's cache,
    which fails while another capture is under way). Thread-local capture mode: only this
    thread's calls are checked, so the other stages' threads go on launching and waiting
    on their own streams and events meanwhile (their streams are not the capture stream);
    a device-wide synchronize is the exception (:func:`device_synchronize` waits for the lock). ``stream``: one nothing
    else launches on while it captures (a runner's own; the vocoder arena's, at start-up)."""
    with _CAPTURE_LOCK, torch.cuda.graph(graph, pool=pool, stream=stream, capture_error_mode="thread_local"):
        yield


def default_batch_sizes(max_num_seqs: int) -> list[int]:
    """1, 2, 4, 8, then every 8 up to ``max_num_seqs`` (at most 7 padded rows past 8)."""
    sizes = [b for b in (1, 2, 4) if b < max_num_seqs] + list(range(8, max_num_seqs + 1, 8))
    return sorted(set(sizes) | {max_num_seqs})


class CUDAGraphRunner:
    """Captures, per bucket, :meth:`ModelRunner.feed` (a decode step's backbone),
    :meth:`ModelRunner.frame_tail` (what follows a feed or a prefill's forward: code 0, the
    code predictor, sampling; ~3/4 of a 0.6B prefill's kernel launches) and
    :meth:`ModelRunner.forward_rows` (a prefill's forward), and replays them.

    A tail graph is also specific to a
    :class:`~omnistage.engine.model_runner.StepSampling` (which sampler work its batches
    need). The general one, which serves any batch, is captured for every bucket here; a
    step that needs less replays its own variant, captured on first use (a one-off pause of
    about one eager step). A feed graph serves any sampling.

    Args:
        runner: the eager runner (its state buffers are what the graphs read and write).
        batch_sizes: feed and tail buckets to capture (may be empty).
        sampling_variants: more :class:`StepSampling` values to capture for every bucket
            at start-up (besides the general one).
        prefill_tokens: prefill buckets to capture, in computed tokens (None: none).

    Raises:
        ValueError: the runner's device is not CUDA, or there is no bucket at all.
    """

    def __init__(
        self, runner: ModelRunner, batch_sizes: list[int], sampling_variants: Iterable[StepSampling] = (),
        prefill_tokens: list[int] | None = None,
    ) -> None:
        if runner.spec.device.type != "cuda":
            raise ValueError("CUDA graphs need a CUDA device")
        self.runner = runner
        self.batch_sizes, self.prefill_tokens = sorted(batch_sizes), sorted(prefill_tokens or [])
        if not self.batch_sizes and not self.prefill_tokens:
            raise ValueError("no CUDA-graph bucket to capture")
        spec = runner.spec
        rows = max(self.batch_sizes + self.prefill_tokens)
        self.padding = runner.padding_meta(rows).to(spec.device)
        self.meta = self.padding.clone()  # feed and prefill input: slot, step row, context length
        # tail input (a feed graph writes its rows' last hidden and slots here)
        self.hidden = torch.zeros(rows, spec.hidden_size, dtype=spec.dtype, device=spec.device)
        self.tail_slots = self.padding[:, 0].clone()
        # prefill input: the rows' embeddings (padding rows keep earlier prompts' rows: they
        # reach only scratch state) and, for 3-row RoPE, their positions
        self.embeds = torch.zeros(rows, spec.hidden_size, dtype=spec.dtype, device=spec.device)
        self.positions = torch.zeros(3, rows, device=spec.device) if spec.position_rows == 3 else None
        self.graphs: dict[tuple[str, int, StepSampling], tuple[torch.cuda.CUDAGraph, Outputs]] = {}
        # the graphs write into these predictor caches: they must live as long as the graphs
        # (shared by the graphs of a bucket: they never run at the same time)
        self.frame_caches = {size: runner.model.new_frame_cache(size) for size in self.batch_sizes}
        self.capture_stream = torch.cuda.Stream(spec.device)  # this runner's alone (module docstring)
        self._pool = None
        # largest first, as in nano-vllm; prefill and feed graphs before every tail: their
        # hidden-layer states are read after the tail's replay (a mixed step's tail may be
        # of a larger bucket than its feed), so no tail graph may have been given their
        # memory (a graph captured later never takes a live output's)
        for size in reversed(self.prefill_tokens):
            self._capture("prefill", size, StepSampling())
        for size in reversed(self.batch_sizes):
            self._capture("feed", size, StepSampling())
        for size in reversed(self.batch_sizes):
            for sampling in dict.fromkeys((StepSampling(), *sampling_variants)):
                self._capture("tail", size, sampling)
        device_synchronize()

    @property
    def max_batch_size(self) -> int:
        """The largest feed and tail bucket (0: none)."""
        return self.batch_sizes[-1] if self.batch_sizes else 0

    def fits_prefill(self, seqs: list[Sequence]) -> bool:
        """Whether the prefill of ``seqs`` replays a graph: it computes at most the largest
        prefill bucket's tokens and has no hidden additions (their rows vary)."""
        tokens = sum(s.prompt_len - s.num_cached for s in seqs)
        return bool(self.prefill_tokens) and tokens <= self.prefill_tokens[-1] and all(
            s.inputs.hidden_additions is None for s in seqs
        )

    def prefill(self, seqs: list[Sequence]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """Replay the forward of the prefill of ``seqs`` (one that :meth:`fits_prefill`);
        returns what :meth:`ModelRunner.prefill` does: the last hidden ``[B, H]``, the slot
        ids ``[B] int64`` and the hidden-layer states ``[n, K, H]`` (or None), the last
        a view valid until the next replay."""
        n = sum(s.prompt_len - s.num_cached for s in seqs)
        size = self._bucket(self.prefill_tokens, n)
        graph, (hidden, layers) = self._graph("prefill", size, StepSampling())
        rows = self.runner.prefill_rows(seqs, size)
        self.meta[:size].copy_(rows.meta.pin_memory(), non_blocking=True)
        if self.positions is not None and rows.positions is not None:
            self.positions[:, :size].copy_(rows.positions.pin_memory(), non_blocking=True)
        self.embeds[:n].copy_(rows.embeds)
        slot_ids, last = self.runner.upload_meta(rows.ends)
        graph.replay()
        return hidden.index_select(0, last), slot_ids, None if layers is None else layers[:n]

    def decode(
        self, meta: torch.Tensor, sampling: StepSampling, extra: tuple[torch.Tensor, torch.Tensor] | None = None
    ) -> Outputs:
        """Replay the decode step for ``meta`` (``[B, 3] int64`` host tensor) and
        ``sampling`` (all its requests'): the feed at the bucket of ``B``, then one tail over
        its rows and, with ``extra`` (a prefill's last hidden ``[k, H]`` and slot ids
        ``[k] int64``, device), ``k`` more rows after them, at the bucket of ``B + k`` (``<=``
        :attr:`max_batch_size`). Returns what :meth:`ModelRunner.decode` does (frames
        ``[B + k, G]``, states ``[B, K, H]`` or None), views valid until the next replay."""
        batch = meta.shape[0]
        size = self._bucket(self.batch_sizes, batch)
        rows = batch if extra is None else batch + extra[0].shape[0]
        # both graphs first: a variant captured on first use resets the tail input
        feed, (_, layers) = self._graph("feed", size, StepSampling())
        tail = self._graph("tail", self._bucket(self.batch_sizes, rows), sampling)
        padded = torch.cat([meta, self.runner.padding_meta(size - batch)])
        self.meta[:size].copy_(padded.pin_memory(), non_blocking=True)
        feed.replay()  # writes the tail input's rows 0..size-1
        codes = self._replay_tail(tail, batch, extra)
        return codes, None if layers is None else layers[:batch]

    def frame_tail(self, hidden: torch.Tensor, slot_ids: torch.Tensor, sampling: StepSampling) -> torch.Tensor:
        """Replay :meth:`ModelRunner.frame_tail` for ``B <=`` :attr:`max_batch_size`
        requests (device inputs); returns a view ``[B, G]``, valid until the next replay."""
        tail = self._graph("tail", self._bucket(self.batch_sizes, hidden.shape[0]), sampling)
        return self._replay_tail(tail, 0, (hidden, slot_ids))

    def _replay_tail(
        self, tail: tuple[torch.cuda.CUDAGraph, Outputs], first: int, extra: tuple[torch.Tensor, torch.Tensor] | None
    ) -> torch.Tensor:
        """Replay ``tail`` over the tail input's rows ``0..first-1`` (a feed's) and the
        ``extra`` rows (hidden, slot ids) placed after them; padding slots past those.
        Returns the frames of those rows, a view."""
        graph, (codes, _) = tail
        rows = first
        if extra is not None:
            hidden, slot_ids = extra
            rows += hidden.shape[0]
            self.hidden[first:rows].copy_(hidden)
            self.tail_slots[first:rows].copy_(slot_ids)
            self.tail_slots[rows : codes.shape[0]].copy_(self.padding[rows : codes.shape[0], 0])
        graph.replay()
        return codes[:rows]

    def _graph(self, kind: str, size: int, sampling: StepSampling) -> tuple[torch.cuda.CUDAGraph, Outputs]:
        key = (kind, size, sampling)
        return self.graphs[key] if key in self.graphs else self._capture(kind, size, sampling)

    def _capture(self, kind: str, size: int, sampling: StepSampling) -> tuple[torch.cuda.CUDAGraph, Outputs]:
        """Warm up and capture one graph on padding inputs: it touches only scratch state,
        and it is ordered after any replay still queued on the stream."""
        runner, cache = self.runner, self.frame_caches.get(size)
        self.meta[:size].copy_(self.padding[:size])
        self.tail_slots[:size].copy_(self.padding[:size, 0])
        if kind == "prefill":
            positions = None if self.positions is None else self.positions[:, :size]

            def step() -> Outputs:
                return runner.forward_rows(self.meta[:size], self.embeds[:size], positions)
        elif kind == "feed":
            def step() -> Outputs:
                hidden, layers = runner.feed(self.meta[:size])
                self.hidden[:size].copy_(hidden)
                self.tail_slots[:size].copy_(self.meta[:size, 0])
                return self.hidden[:size], layers
        else:
            def step() -> Outputs:
                return runner.frame_tail(self.hidden[:size], self.tail_slots[:size], cache, sampling), None
        # a variant on first use is captured while other stages' threads drive their engines
        # (the Omni thinker and talker): the warm-up's device synchronize and the capture
        # hold the process's capture lock together (capturing() takes it again)
        with _CAPTURE_LOCK:
            step()  # warm-up: Triton compiles, cuBLAS picks kernels
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with capturing(graph, self._pool, self.capture_stream):
                outputs = step()
        self._pool = graph.pool()
        self.graphs[(kind, size, sampling)] = (graph, outputs)
        return graph, outputs

    @staticmethod
    def _bucket(sizes: list[int], count: int) -> int:
        return next(s for s in sizes if s >= count)
