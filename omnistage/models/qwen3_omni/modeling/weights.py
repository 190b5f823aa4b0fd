"""Qwen3-Omni weights: the expected tensors of a checkpoint, loading the Hugging Face layout,
and random weights built in place (``--load-format dummy``).

A checkpoint (``model.safetensors`` or shards listed by ``model.safetensors.index.json``) holds
the parts under these prefixes (shared/reference/qwen3-omni.md, section 1)::

    thinker.model. thinker.lm_head.   the thinker's text model     (Thinker)
    thinker.audio_tower.              the audio encoder
    thinker.visual.                   the vision encoder
    talker.                           talker, projections, code predictor (Talker)
    code2wav.                         the vocoder

A stage loads only the parts it runs (a thinker stage never reads the talker). Within a loaded
part the names must match exactly: any missing or unexpected tensor, or a wrong shape, is an
error listing them; a tensor under no known prefix is unexpected. Routed experts are stored
one tensor per expert (``...mlp.experts.{e}.{gate,up,down}_proj.weight``) and stacked here
into the :class:`~omnistage.engine.moe.SparseMoE` layout; every other tensor loads by name.
Modules are built on the meta device and tensors assigned directly (one copy of the weights).
"""

from __future__ import annotations

import math
import zlib
from collections.abc import Callable
from contextlib import ExitStack, closing
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from torch import nn

from omnistage.checkpoint.safetensors_files import CheckpointWeightsError, check_names, weight_files
from omnistage.engine.moe import SparseMoE

__all__ = [
    "KNOWN_PREFIXES",
    "CheckpointWeightsError",
    "TensorSource",
    "checkpoint_shapes",
    "fill_module",
    "load_parts",
    "random_source",
    "random_tensor",
    "weight_files",
    "SafetensorsSource",
    "Part",
]

KNOWN_PREFIXES = (
    "thinker.model.",
    "thinker.lm_head.",
    "thinker.audio_tower.",
    "thinker.visual.",
    "talker.",
    "code2wav.",
)

def random_tensor(
    name: str, shape: torch.Size, seed: int, device: torch.device | str
) -> torch.Tensor:
    """One random fp32 tensor, drawn from a generator seeded by ``(seed, crc32(name))``: norm
    weights around 1 (``1 + 0.1 N``), other vectors ``0.02 N``, embeddings ``N(0, 1)``,
    matrices ``N(0, 1 / fan_in)``, so activations stay finite and differences show."""
    generator = torch.Generator(device=device).manual_seed(
        (seed * 1_000_003 + zlib.crc32(name.encode())) % 2**63
    )
    x = torch.randn(shape, generator=generator, device=device, dtype=torch.float32)
    if name.endswith("norm.weight"):
        return 1.0 + 0.1 * x
    if len(shape) == 1:
        return 0.02 * x
    if "embed" in name:
        return x
    return x / math.sqrt(math.prod(shape[1:]))


TensorSource = Callable[[str, torch.Size], torch.Tensor]
"""``source(checkpoint_name, expected_shape) -> tensor`` (any float dtype, on the target device)."""


def _moe_layers(module: nn.Module) -> dict[str, SparseMoE]:
    return {name: m for name, m in module.named_modules() if isinstance(m, SparseMoE)}


def checkpoint_shapes(module: nn.Module, prefix: str) -> dict[str, torch.Size]:
    """Checkpoint name -> shape of every tensor ``module`` (under ``prefix``) loads: its
    state_dict names, with each :class:`SparseMoE`'s stacked experts expanded to the per-expert
    names and nn.Linear shapes. Works on the meta device (no memory)."""
    moe = _moe_layers(module)
    stacked = {f"{name}.{p}" for name in moe for p in ("expert_gate_up", "expert_down")}
    shapes = {f"{prefix}{k}": v.shape for k, v in module.state_dict().items() if k not in stacked}
    for name, layer in moe.items():
        e, h, two_i = layer.expert_gate_up.shape
        for n in range(e):
            base = f"{prefix}{name}.experts.{n}."
            shapes[f"{base}gate_proj.weight"] = torch.Size((two_i // 2, h))
            shapes[f"{base}up_proj.weight"] = torch.Size((two_i // 2, h))
            shapes[f"{base}down_proj.weight"] = torch.Size((h, two_i // 2))
    return shapes


def fill_module(
    module: nn.Module,
    prefix: str,
    source: TensorSource,
    device: torch.device | str,
    dtype: torch.dtype,
) -> None:
    """Give every parameter and persistent buffer of ``module`` (built on meta) its tensor from
    ``source``, cast to ``dtype`` on ``device``; experts are stacked one at a time.

    Raises: CheckpointWeightsError when a tensor's shape differs from the expected one."""
    moe = _moe_layers(module)
    stacked = {f"{name}.{p}" for name in moe for p in ("expert_gate_up", "expert_down")}

    def fetch(name: str, shape: torch.Size) -> torch.Tensor:
        tensor = source(name, shape)
        if tensor.shape != shape:
            raise CheckpointWeightsError(
                f"{name} has shape {tuple(tensor.shape)}, the model expects {tuple(shape)}"
            )
        return tensor.to(device=device, dtype=dtype)

    state = {
        k: fetch(f"{prefix}{k}", v.shape)
        for k, v in module.state_dict().items()
        if k not in stacked
    }
    for name, layer in moe.items():
        for p in ("expert_gate_up", "expert_down"):
            state[f"{name}.{p}"] = torch.empty(getattr(layer, p).shape, device=device, dtype=dtype)
    module.load_state_dict(state, strict=True, assign=True)
    for name, layer in moe.items():
        e, h, two_i = layer.expert_gate_up.shape
        i = two_i // 2
        for n in range(e):
            base = f"{prefix}{name}.experts.{n}."
            layer.load_expert(
                n,
                fetch(f"{base}gate_proj.weight", torch.Size((i, h))),
                fetch(f"{base}up_proj.weight", torch.Size((i, h))),
                fetch(f"{base}down_proj.weight", torch.Size((h, i))),
            )


class SafetensorsSource:
    """A :data:`TensorSource` over ``files`` (name -> file, from :func:`weight_files`); each
    file is opened once, on first use. :meth:`close` releases them (``contextlib.closing``)."""

    def __init__(self, files: dict[str, Path], device: torch.device | str) -> None:
        self.files, self.device = files, str(torch.device(device))
        self._stack = ExitStack()
        self._handles: dict[Path, Any] = {}

    def __call__(self, name: str, shape: torch.Size) -> torch.Tensor:
        file = self.files[name]
        if file not in self._handles:
            self._handles[file] = self._stack.enter_context(
                safe_open(str(file), framework="pt", device=self.device)
            )
        return self._handles[file].get_tensor(name)

    def close(self) -> None:
        self._stack.close()
        self._handles.clear()


def random_source(seed: int, device: torch.device | str) -> TensorSource:
    """Random tensors drawn per name exactly as the random checkpoint writer draws them
    (:mod:`omnistage.models.qwen3_omni.random_checkpoint`), fp32 on ``device``: a dummy-loaded
    model equals the checkpoint ``init-random`` writes with the same seed."""

    def source(name: str, shape: torch.Size) -> torch.Tensor:
        return random_tensor(name, shape, seed, device)

    return source


@dataclass(frozen=True)
class Part:
    """One loadable part: the module (on meta) and the checkpoint prefix of its names."""

    module: nn.Module
    prefix: str


def load_parts(
    checkpoint_dir: str | Path, parts: list[Part], device: torch.device | str, dtype: torch.dtype
) -> None:
    """Load ``parts`` from the checkpoint's safetensors files (strict per part; see the module
    docstring). Tensors of parts not asked for are not read.

    Raises: CheckpointWeightsError: no weight files, a shard missing, a tensor under no known
    prefix, names missing/unexpected within a loaded part, or a shape mismatch."""
    root = Path(checkpoint_dir)
    files = weight_files(root)
    stray = sorted(n for n in files if not n.startswith(KNOWN_PREFIXES))
    if stray:
        check_names(set(), set(stray), str(root))
    for part in parts:
        expected = checkpoint_shapes(part.module, part.prefix)
        owned = {n for n in files if n.startswith(_owned_prefixes(part.prefix))}
        check_names(set(expected), owned, f"{root} (part {part.prefix.rstrip('.')})")
    with closing(SafetensorsSource(files, device)) as source:
        for part in parts:
            fill_module(part.module, part.prefix, source, device, dtype)


def _owned_prefixes(prefix: str) -> tuple[str, ...]:
    """The thinker's text part owns two prefixes (its module holds ``model`` and ``lm_head``)."""
    if prefix == "thinker.":
        return ("thinker.model.", "thinker.lm_head.")
    return (prefix,)
