"""A checkpoint's weights in the Hugging Face safetensors layout: one ``model.safetensors``,
or shards ``model-0000i-of-0000n.safetensors`` listed by ``model.safetensors.index.json``
(``{"metadata": {"total_size": bytes}, "weight_map": {name: file}}``).

Reading: :func:`weight_files` (name -> file) and :func:`check_names` (the strict name match a
loader applies). Writing: :func:`write_safetensors` cuts the tensors into shards of at most
:data:`SHARD_BYTES` and makes each tensor only while its shard is written, so at most one
shard is in host memory.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

__all__ = [
    "INDEX_FILE",
    "SHARD_BYTES",
    "SINGLE_FILE",
    "CheckpointWeightsError",
    "check_names",
    "shard_names",
    "weight_files",
    "write_safetensors",
]

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
SHARD_BYTES = 2 * 1024**3
"""Largest shard a writer makes (a bigger tensor goes alone in its shard)."""
_LISTED = 20  # names shown per category in an error message


class CheckpointWeightsError(ValueError):
    """Weight files are missing or their tensor names/shapes do not match the model."""


def weight_files(checkpoint_dir: Path) -> dict[str, Path]:
    """Tensor name -> file holding it (``model.safetensors`` or the shards of
    ``model.safetensors.index.json``).

    Raises: CheckpointWeightsError when neither layout is present, the index is unreadable,
    or a shard it names is missing."""
    index_path = checkpoint_dir / INDEX_FILE
    if index_path.is_file():
        try:
            weight_map = json.loads(index_path.read_text(encoding="utf-8"))["weight_map"]
        except (OSError, json.JSONDecodeError, KeyError, TypeError) as exc:
            raise CheckpointWeightsError(f"{index_path} is not a safetensors index: {exc}") from exc
        files = {name: checkpoint_dir / file for name, file in weight_map.items()}
        missing = sorted({p.name for p in files.values() if not p.is_file()})
        if missing:
            raise CheckpointWeightsError(f"{checkpoint_dir} lacks shards named in {INDEX_FILE}: {missing}")
        return files
    single = checkpoint_dir / SINGLE_FILE
    if not single.is_file():
        raise CheckpointWeightsError(f"{checkpoint_dir} has neither {SINGLE_FILE} nor {INDEX_FILE}")
    with safe_open(str(single), framework="pt") as f:
        return dict.fromkeys(f.keys(), single)


def check_names(expected: set[str], found: set[str], where: str | Path) -> None:
    """Raises: CheckpointWeightsError listing (up to 20 of each) the names missing from
    ``found`` and those it has beyond ``expected``; ``where`` names the checkpoint."""
    missing, unexpected = sorted(expected - found), sorted(found - expected)
    if not missing and not unexpected:
        return
    parts = []
    for label, names in (("missing", missing), ("unexpected", unexpected)):
        if names:
            more = f" (+{len(names) - _LISTED} more)" if len(names) > _LISTED else ""
            parts.append(f"{len(names)} {label}: {', '.join(names[:_LISTED])}{more}")
    raise CheckpointWeightsError(f"weights in {where} do not match the model: " + "; ".join(parts))


def shard_names(shapes: dict[str, torch.Size], dtype: torch.dtype, shard_bytes: int = SHARD_BYTES) -> list[list[str]]:
    """The names of ``shapes``, in order, cut into shards of at most ``shard_bytes`` bytes
    of ``dtype`` (a bigger tensor alone)."""
    shards: list[list[str]] = [[]]
    size = 0
    for name, shape in shapes.items():
        nbytes = math.prod(shape) * dtype.itemsize
        if shards[-1] and size + nbytes > shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(name)
        size += nbytes
    return shards


def write_safetensors(
    out_dir: Path,
    shapes: dict[str, torch.Size],
    dtype: torch.dtype,
    tensor: Callable[[str], torch.Tensor],
    shard_bytes: int = SHARD_BYTES,
) -> None:
    """Write the tensors named by ``shapes`` into ``out_dir``: ``model.safetensors``, or
    shards of at most ``shard_bytes`` and ``model.safetensors.index.json``.

    Args:
        shapes: name -> shape, in the order the tensors are written.
        dtype: the stored dtype (each tensor is cast to it and moved to the CPU).
        tensor: ``tensor(name)``, called once per name while its shard is written.
    """
    shards = shard_names(shapes, dtype, shard_bytes)
    files = [SINGLE_FILE] if len(shards) == 1 else [
        f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))
    ]  # fmt: skip
    weight_map = {}
    for file, names in zip(files, shards, strict=True):
        tensors = {name: tensor(name).to(dtype).cpu() for name in names}
        save_file(tensors, str(out_dir / file), metadata={"format": "pt"})
        del tensors
        weight_map.update(dict.fromkeys(names, file))
    if len(files) > 1:
        total = sum(math.prod(s) * dtype.itemsize for s in shapes.values())
        index = {"metadata": {"total_size": total}, "weight_map": weight_map}
        (out_dir / INDEX_FILE).write_text(json.dumps(index, indent=2), encoding="utf-8")
