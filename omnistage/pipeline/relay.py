"""Serialization of stage messages between processes.

Control data is pickled (all processes are ours); tensors take the transport their device
and the receiver's node call for, never configured. To a process on the same node:

- CUDA tensors: a CUDA IPC handle (``torch.multiprocessing.reductions.reduce_tensor``);
  the receiver maps the same device memory, nothing is copied through the host.
- CPU tensors and numpy arrays of at least ``SHM_MIN_BYTES``: one POSIX shared-memory
  segment each; the receiver copies the data out and unlinks the segment at once.
- Smaller CPU tensors/arrays: inline in the pickle (a segment costs more than the copy).

To a process on another node (Ray placement; ``shared_memory=False``) every tensor is
inline in the message, which crosses the network once over the transport's TCP socket:
CPU tensors as their raw bytes, CUDA tensors copied to the host and rebuilt on the same
device index at the receiver (there is no NCCL path: see docs/ray.md for why and what that
costs).

Segments are named ``<prefix><n>`` (the transport's prefix names the sender and the
receiver) so a pipeline can sweep the segments of messages that were never received
(:func:`sweep_segments`): those of a process that died, when it is replaced, and all of
them when the pipeline stops.
"""

from __future__ import annotations

import io
import itertools
import os
import pickle
from multiprocessing import resource_tracker, shared_memory
from typing import Any

import numpy as np
import torch
from torch.multiprocessing.reductions import reduce_tensor

from omnistage.core.errors import StageFailureError

SHM_MIN_BYTES = 64 * 1024
_counter = itertools.count()


class RelayError(StageFailureError):
    """A message could not be serialized for another process (e.g. an unpicklable object
    in a payload); it fails the request it belongs to."""

    def __init__(self, cause: str) -> None:
        super().__init__("relay", cause)


class _Pickler(pickle.Pickler):
    def __init__(self, file: io.BytesIO, prefix: str, shared_memory: bool) -> None:
        super().__init__(file, protocol=pickle.HIGHEST_PROTOCOL)
        self.prefix, self.shared_memory = prefix, shared_memory
        self.segments: list[str] = []

    def persistent_id(self, obj: Any) -> Any:
        if isinstance(obj, torch.Tensor):
            if not self.shared_memory:
                if obj.is_cuda:
                    return ("cuda_host", obj.device.index, *_raw(obj.detach().cpu()))
                return ("raw_torch", *_raw(obj.detach())) if obj.nbytes >= SHM_MIN_BYTES else None
            if obj.is_cuda:
                return ("cuda", reduce_tensor(obj))
            if obj.nbytes >= SHM_MIN_BYTES:
                return ("shm_torch", *self._segment(obj.detach()))
        elif (
            self.shared_memory and isinstance(obj, np.ndarray) and obj.dtype != object and obj.nbytes >= SHM_MIN_BYTES
        ):
            return ("shm_numpy", *self._segment(obj))
        return None

    def _segment(self, data: torch.Tensor | np.ndarray) -> tuple[str, torch.dtype, tuple[int, ...]]:
        descriptor = _to_segment(self.prefix, data)
        self.segments.append(descriptor[0])
        return descriptor


class _Unpickler(pickle.Unpickler):
    def persistent_load(self, pid: Any) -> Any:
        kind = pid[0]
        if kind == "cuda":
            rebuild, args = pid[1]
            return rebuild(*args)
        if kind == "raw_torch":
            return _from_raw(*pid[1:])
        if kind == "cuda_host":
            return _from_raw(*pid[2:]).to(f"cuda:{pid[1]}")
        tensor = _from_segment(*pid[1:])
        return tensor if kind == "shm_torch" else tensor.numpy()


def _raw(tensor: torch.Tensor) -> tuple[torch.dtype, tuple[int, ...], np.ndarray]:
    """A CPU tensor as ``(dtype, shape, its bytes as a uint8 array)`` (any dtype, bfloat16
    included; numpy pickles the array as one buffer)."""
    flat = tensor.contiguous().reshape(-1)
    return tensor.dtype, tuple(tensor.shape), flat.view(torch.uint8).numpy()


def _from_raw(dtype: torch.dtype, shape: tuple[int, ...], data: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(data).view(dtype).reshape(shape)


def _to_segment(prefix: str, data: torch.Tensor | np.ndarray) -> tuple[str, torch.dtype, tuple[int, ...]]:
    """``data`` copied into a new segment: ``(its name, the torch dtype, the shape)``. A
    numpy array is copied by numpy, so a read-only one (a cached reference clip) needs no
    writable torch view of it."""
    name = f"{prefix}{next(_counter)}"
    segment = shared_memory.SharedMemory(name=name, create=True, size=max(data.nbytes, 1))
    # The receiver unlinks the segment; the creator's tracker must not unlink it again.
    resource_tracker.unregister(segment._name, "shared_memory")  # type: ignore[attr-defined]
    if isinstance(data, np.ndarray):
        dtype = torch.from_numpy(np.empty(0, dtype=data.dtype)).dtype  # the dtype's torch name
        if data.size:
            np.frombuffer(segment.buf, dtype=data.dtype, count=data.size)[:] = data.reshape(-1)
    else:
        dtype = data.dtype
        if data.numel():
            torch.frombuffer(segment.buf, dtype=dtype, count=data.numel()).copy_(data.reshape(-1))
    segment.close()
    return name, dtype, tuple(data.shape)


def _from_segment(name: str, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
    segment = shared_memory.SharedMemory(name=name)  # registers; unlink() unregisters
    count = int(np.prod(shape)) if shape else 1
    view = torch.frombuffer(segment.buf, dtype=dtype, count=count) if count else None
    tensor = view.clone().reshape(shape) if view is not None else torch.empty(shape, dtype=dtype)
    del view
    segment.close()
    segment.unlink()
    return tensor


def dumps(obj: object, prefix: str, *, shared_memory: bool = True) -> bytes:
    """Serialize ``obj``; large CPU tensors go to segments named ``prefix<n>`` (CUDA tensors
    as IPC handles), or with ``shared_memory=False`` (a receiver on another node) every
    tensor inline.

    Raises:
        RelayError: ``obj`` cannot be serialized; no segment is left behind.
    """
    buffer = io.BytesIO()
    pickler = _Pickler(buffer, prefix, shared_memory)
    try:
        pickler.dump(obj)
    except Exception as exc:
        for name in pickler.segments:
            _unlink(name)
        raise RelayError(f"cannot send {type(obj).__name__} to another process: {type(exc).__name__}: {exc}") from exc
    return buffer.getvalue()


def _unlink(name: str) -> None:
    segment = shared_memory.SharedMemory(name=name)
    segment.close()
    segment.unlink()


def loads(data: bytes) -> object:
    """Inverse of :func:`dumps`; unlinks the segments it reads."""
    return _Unpickler(io.BytesIO(data)).load()


def sweep_segments(prefix: str) -> int:
    """Unlink leftover segments named ``prefix*`` (Linux ``/dev/shm``); returns the count."""
    root = "/dev/shm"
    if not os.path.isdir(root):
        return 0
    names = [n for n in os.listdir(root) if n.startswith(prefix)]
    for name in names:
        os.unlink(os.path.join(root, name))
    return len(names)
