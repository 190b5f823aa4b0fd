"""A request in the engine: what it generates from (:class:`GenerationInput`), its state
while it waits and runs (:class:`Sequence`), and what it produced (:class:`GenerationResult`).

Steps and frames: the prefill produces frame 0; decode step ``k`` (k >= 1) feeds frame
``k - 1``'s feedback embedding at position ``prompt_len + k - 1`` and produces frame ``k``.
The feedback embedding of frame ``k`` is ``model.next_input_embeds(codes_k, row_k)`` where
``row_k`` is the request's step row ``k`` while ``k < M`` and then ``pad_embed``
(Qwen3-TTS: the trailing text rows, then ``tts_pad``; see shared/reference/qwen3-tts.md,
sections 2 and 4). It is made at the start of decode step ``k + 1``, so row ``k`` is
needed only then.

Streamed rows: a request given with ``more_rows=True`` gets the rest of its rows after
admission (:meth:`AREngine.append_step_rows`), then an end mark
(:meth:`AREngine.complete_step_rows`); only then do frames past its last row take the
pad row. Until row ``k`` arrived (or the rows are complete), decode step ``k + 1`` of the
request waits: it is left out of the batch, the other requests go on.

Hidden additions (:class:`HiddenAdditions`): rows a request adds to the backbone's hidden
states at chosen prompt positions after each of its first layers, during its prefill
(Qwen3-Omni: the vision encoder's deepstack features at the image/video tokens).
"""

from __future__ import annotations

import enum
import hashlib
from dataclasses import dataclass, field

import torch

from omnistage.core.errors import RequestValidationError
from omnistage.core.request import FinishReason
from omnistage.engine.sampler import SamplingParams


@dataclass(frozen=True)
class HiddenAdditions:
    """Rows added to a forward's hidden states: after layer ``l`` (0-based) for ``l <
    len(embeds)``, ``embeds[l]`` is added to the rows ``rows`` (DeepStack, Meng et al. 2024).

    Attributes:
        rows: ``[M] int64`` row indices, distinct (in a request: prompt positions
            ``0..L-1``; the runner maps them to the batch's rows).
        embeds: one ``[M, H]`` float tensor per layer, in layer order.
    """

    rows: torch.Tensor
    embeds: tuple[torch.Tensor, ...]


@dataclass(frozen=True)
class GenerationInput:
    """What one request generates from; also the payload an AR stage takes
    (:mod:`omnistage.scheduling.ar`).

    Attributes:
        prompt: ``[L, H]`` float prompt embeddings (model dtype), or ``[L] int64`` token ids
            (embedded by ``model.embed_tokens``). May live on any device; moved once.
        sampling: code-0 (token) sampling: temperature, top-k/p, repetition penalty over
            generated ids, suppressed ranges, ``min_new_tokens``, ``stop_token_ids`` (a
            sampled stop id ends the request with finish_reason ``"stop"``; its frame is
            not emitted) and the seed.
        max_new_tokens: frames (tokens) at most; reaching it ends with ``"length"``.
        step_rows: ``[M, H]`` rows added to the feedback embedding of frames ``0..M-1``
            (None: no rows).
        pad_embed: ``[H]`` row added from frame ``M`` on (None: zeros); with streamed
            rows, from the frame after the last row once the rows are complete.
        more_rows: more step rows follow after admission (see the module docstring). The
            request then reserves a row for every frame that can be fed back
            (``max_new_tokens - 1``, or ``M`` if more); rows past them are dropped.
        predictor_sampling: sampling of codes ``1..G-1`` by the code predictor (None:
            greedy); its repetition penalty, stop ids and ``min_new_tokens`` must be off.
            It may share ``sampling.seed``: the engine draws its noise from a stream of
            its own.
        positions: ``[3, L]`` int64 or float32 multimodal RoPE positions (T, H, W) of the
            prompt, for a model with ``spec.position_rows == 3`` (None: ``0..L-1`` on each
            row); a host tensor. Float: fractional positions (Qwen3-Omni's video T is
            ``t * seconds_per_grid * 13``); they reach the model as float32.
        rope_delta: added to a decode step's position, which is then the cache length +
            ``rope_delta`` on all three rows (Qwen3-Omni: ``max(positions) + 1 - L``,
            shared/reference/qwen3-omni.md section 4; may be fractional). Only with
            ``position_rows == 3``.
        hidden_additions: rows added to the prompt's hidden states during the prefill
            (:class:`HiddenAdditions`, rows are prompt positions), for a model that takes
            them (``spec.hidden_addition_layers``); None: none.
        return_hidden: the engine returns the states of the model's ``hidden_layers`` for
            every prompt and fed-back token (``StepOutput.hidden``).
        cache_prompt: the prompt's KV may be shared with other requests whose prompts
            begin with the same embeddings (prefix caching, where the engine has it on):
            its rows are hashed (:class:`PromptDigest`; the prompt is not to be written to
            afterwards), so the cache key is the content itself and one request's KV is
            never served for another's different prompt (architecture rule 8). Not with
            ``positions``, ``hidden_additions`` or ``return_hidden``.
        stop_strings: texts that end the reply before them (OpenAI's ``stop``), each
            non-empty. Matched not by the engine but by the stage's scheduler through its
            tokenizer (:class:`~omnistage.scheduling.ar.ARScheduler` ``token_text``), on
            the token ids of code 0.
    """

    prompt: torch.Tensor
    sampling: SamplingParams
    max_new_tokens: int
    step_rows: torch.Tensor | None = None
    pad_embed: torch.Tensor | None = None
    predictor_sampling: SamplingParams | None = None
    more_rows: bool = False
    positions: torch.Tensor | None = None
    rope_delta: float = 0
    return_hidden: bool = False
    hidden_additions: HiddenAdditions | None = None
    cache_prompt: bool = False
    stop_strings: tuple[str, ...] = ()
    digest: PromptDigest | None = field(default=None, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if self.prompt.dim() not in (1, 2) or self.prompt.shape[0] < 1:
            raise RequestValidationError("prompt must be [L] token ids or [L, H] embeddings, L >= 1", "prompt")
        if self.prompt.dim() == 1 and self.prompt.dtype != torch.int64:
            raise RequestValidationError(f"token-id prompts are int64, got {self.prompt.dtype}", "prompt")
        if self.max_new_tokens < 1:
            raise RequestValidationError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}", "max_new_tokens")
        if not all(self.stop_strings):
            raise RequestValidationError("stop strings must be non-empty", "stop")
        pos = self.positions
        if pos is not None and (pos.dtype not in (torch.int64, torch.float32) or pos.shape != (3, self.prompt.shape[0])):
            raise RequestValidationError(
                f"positions must be [3, {self.prompt.shape[0]}] int64 or float32, got {tuple(pos.shape)} {pos.dtype}",
                "positions",
            )
        add = self.hidden_additions
        if add is not None:
            length, rows = self.prompt.shape[0], add.rows
            if rows.dim() != 1 or rows.dtype != torch.int64 or not add.embeds:
                raise RequestValidationError("hidden_additions: rows must be [M] int64, with >= 1 layer", "hidden_additions")
            if any(e.shape != (rows.shape[0], e.shape[-1]) or e.dim() != 2 for e in add.embeds):
                raise RequestValidationError(f"hidden_additions: every layer's rows must be [{rows.shape[0]}, H]", "hidden_additions")
            if rows.numel() and (int(rows.min()) < 0 or int(rows.max()) >= length or rows.unique().numel() != rows.numel()):
                raise RequestValidationError(f"hidden_additions: rows must be distinct prompt positions in 0..{length - 1}",
                                             "hidden_additions")
        p = self.predictor_sampling
        if p is not None and (p.repetition_penalty != 1 or p.stop_token_ids or p.min_new_tokens):
            raise RequestValidationError(
                "the code predictor's sampling takes no repetition penalty, stop ids or min_new_tokens",
                "predictor_sampling",
            )
        if self.cache_prompt:
            if self.positions is not None or self.hidden_additions is not None or self.return_hidden:
                raise RequestValidationError(
                    "cache_prompt takes no positions, hidden_additions or return_hidden", "cache_prompt"
                )
            object.__setattr__(self, "digest", PromptDigest(self.prompt))

    @property
    def row_keys(self) -> tuple[bytes, ...] | None:
        """With ``cache_prompt``: one digest per prompt row (:func:`prompt_row_keys`)."""
        return None if self.digest is None else self.digest.keys()

    @property
    def num_given_rows(self) -> int:
        """``M``: step rows given with the request."""
        return 0 if self.step_rows is None else self.step_rows.shape[0]

    @property
    def row_capacity(self) -> int:
        """Step rows the request can hold: ``M``, or with streamed rows also one for every
        frame that can be fed back."""
        if not self.more_rows:
            return self.num_given_rows
        return max(self.num_given_rows, self.max_new_tokens - 1)

    @property
    def num_step_rows(self) -> int:
        """Rows the request keeps in the step-row pool: :attr:`row_capacity` and the pad row."""
        return self.row_capacity + 1


class PromptDigest:
    """A prompt's :func:`prompt_row_keys`, made without waiting for the device: a CUDA
    prompt is copied to pinned host memory behind the work that makes it and hashed on
    first use (the engine's admission, by when the copy is long done); serialized for
    another process, it is hashed first."""

    def __init__(self, prompt: torch.Tensor) -> None:
        self._keys: tuple[bytes, ...] | None = None
        self._ready: torch.cuda.Event | None = None
        if prompt.is_cuda:
            self._host = torch.empty(prompt.shape, dtype=prompt.dtype, pin_memory=True)
            self._host.copy_(prompt.detach(), non_blocking=True)
            self._ready = torch.cuda.Event()
            self._ready.record()
        else:
            self._host = prompt.detach()

    def keys(self) -> tuple[bytes, ...]:
        if self._keys is None:
            if self._ready is not None:
                self._ready.synchronize()
            self._keys = prompt_row_keys(self._host)
            self._host, self._ready = torch.empty(0), None
        return self._keys

    def __getstate__(self) -> dict[str, object]:
        return {"_keys": self.keys(), "_ready": None, "_host": torch.empty(0)}


def prompt_row_keys(prompt: torch.Tensor) -> tuple[bytes, ...]:
    """One 16-byte BLAKE2b digest per prompt row (``[L, H]`` embeddings or ``[L]`` ids, any
    device: copied to the host once) of the row's bytes, its dtype and its width."""
    host = prompt.detach().to("cpu").contiguous()
    if host.dtype in (torch.bfloat16, torch.float16):  # numpy has no bfloat16: the same bytes as int16
        host = host.view(torch.int16)
    rows = host.reshape(host.shape[0], -1).numpy()
    salt = f"{prompt.dtype}:{rows.shape[1]}".encode()
    return tuple(hashlib.blake2b(row.tobytes(), digest_size=16, key=salt).digest() for row in rows)


def block_keys(row_keys: tuple[bytes, ...], block_size: int) -> list[bytes]:
    """Keys of the prompt's full blocks: block ``i``'s names its rows and, chained, every
    row before them (the KV of a token depends on the tokens before it and on its
    position, which the chain fixes too)."""
    keys, previous = [], b""
    for start in range(0, len(row_keys) - block_size + 1, block_size):
        previous = hashlib.blake2b(previous + b"".join(row_keys[start : start + block_size]), digest_size=16).digest()
        keys.append(previous)
    return keys


@dataclass(frozen=True)
class GenerationResult:
    """A finished request.

    Attributes:
        codes: ``[T, G] int64`` every emitted frame (the stop frame excluded), on the host.
        finish_reason: ``"stop"`` (a stop id), ``"length"`` (``max_new_tokens``).
        num_prompt_tokens: ``L``.
    """

    codes: torch.Tensor
    finish_reason: FinishReason
    num_prompt_tokens: int


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(eq=False)
class Sequence:
    """A request's state in the engine (host side; device state lives in its slot).

    Attributes:
        request_id, inputs: the request.
        arrival: monotonic seconds when it was added (for the prefill hold window).
        status: waiting -> running -> finished.
        slot: its row in the runner's per-slot device state while running, else -1.
        block_table: KV blocks, reserved for the whole generation at admission.
        row_slots: pool rows of its step embeddings (``inputs.row_capacity``), then its
            pad row.
        num_rows: step rows it has (given and appended; at most its capacity).
        rows_complete: no more rows will come (always, unless ``inputs.more_rows``).
        pending_rows: rows appended while it waits for admission (host side until then).
        num_scheduled: steps launched so far (= frames that are or will be produced).
        num_cached: leading prompt tokens whose KV came from the prefix cache (a multiple
            of the block size; never the whole prompt: its last token is computed).
        prompt_keys: :func:`block_keys` of its prompt (with ``inputs.cache_prompt`` and the
            engine's prefix caching on), registered once its prefill is launched.
        frames: ``[1, G] int64`` frames emitted so far (host tensors).
        stop_ids: ``inputs.sampling.stop_token_ids`` as a set (host-side stop check).
        finish_reason: set once it finished.
        frame_cap: a cap lowered while it runs (:meth:`AREngine.cap_new_tokens`), or None.
    """

    request_id: str
    inputs: GenerationInput
    arrival: float
    status: SequenceStatus = SequenceStatus.WAITING
    slot: int = -1
    block_table: list[int] = field(default_factory=list)
    row_slots: list[int] = field(default_factory=list)
    num_rows: int = 0
    rows_complete: bool = True
    pending_rows: list[torch.Tensor] = field(default_factory=list)
    num_scheduled: int = 0
    num_cached: int = 0
    prompt_keys: list[bytes] = field(default_factory=list)
    frames: list[torch.Tensor] = field(default_factory=list)
    finish_reason: FinishReason | None = None
    frame_cap: int | None = None

    def __post_init__(self) -> None:
        self.stop_ids = frozenset(self.inputs.sampling.stop_token_ids)
        self.num_rows = self.inputs.num_given_rows
        self.rows_complete = not self.inputs.more_rows

    @property
    def prompt_len(self) -> int:
        return self.inputs.prompt.shape[0]

    @property
    def max_new_tokens(self) -> int:
        """``inputs.max_new_tokens``, or the lower ``frame_cap`` set while it runs."""
        return self.inputs.max_new_tokens if self.frame_cap is None else self.frame_cap

    @property
    def reserved_tokens(self) -> int:
        """KV tokens it can ever hold: the prompt and every fed-back frame but the last
        (from ``inputs``: a later ``frame_cap`` does not change what was reserved)."""
        return self.prompt_len + self.inputs.max_new_tokens - 1


    @property
    def schedulable(self) -> bool:
        """Running, frames left, and (past the prefill) the row its next step feeds has
        arrived or the rows are complete."""
        if self.status is not SequenceStatus.RUNNING or self.num_scheduled >= self.max_new_tokens:
            return False
        return self.rows_complete or self.num_scheduled - 1 < self.num_rows

    def step_row(self, frame: int) -> int:
        """The pool row added to frame ``frame``'s feedback embedding (its row while it has
        one, else the pad row)."""
        return self.row_slots[frame] if frame < self.num_rows else self.row_slots[-1]
