"""Checking in tests that code does not wait for the device: the aten ops it dispatches
(:class:`DispatchedOps`; ops dispatch the same on every device, so a CPU run shows which
ones a CUDA run would launch) and torch's CUDA sync debug mode (:func:`no_host_syncs`),
which also sees the blocking copies a CPU run cannot tell from others."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch.utils._python_dispatch import TorchDispatchMode

HOST_SYNC_OPS = frozenset((
    "aten._local_scalar_dense",  # .item(), int(t), float(t), bool(t)
    "aten.is_nonzero",
    "aten.equal",
    "aten.nonzero",
    "aten.masked_select",
    "aten._unique2",
    "aten.unique_dim",
    "aten.unique_consecutive",
    "aten.bincount",
    "aten.repeat_interleave",
))  # fmt: skip
"""aten ops (overload packets) whose result on CUDA needs device values on the host: a
Python scalar, or an output whose size depends on the values (``repeat_interleave``: with
tensor repeats and no ``output_size``). Boolean-mask indexing dispatches as ``aten.index``:
only the sync debug mode sees its wait."""


class DispatchedOps(TorchDispatchMode):
    """The aten ops dispatched inside it, in order (``names``: ``aten.fill_.Scalar``, ...;
    composite ops are seen decomposed, ``linear`` as ``t`` + ``addmm``)."""

    def __init__(self) -> None:
        super().__init__()
        self.names: list[str] = []
        self.packets: list[str] = []  # the names without the overload: "aten.fill_"

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.names.append(str(func))
        self.packets.append(str(func.overloadpacket))
        return func(*args, **(kwargs or {}))

    def host_syncs(self) -> list[str]:
        """The dispatched ops of :data:`HOST_SYNC_OPS`, in order."""
        return [
            name
            for name, packet in zip(self.names, self.packets, strict=True)
            if packet in HOST_SYNC_OPS
        ]


@contextmanager
def no_host_syncs() -> Iterator[None]:
    """torch's CUDA sync debug mode ``"error"`` inside: it raises at the first blocking copy,
    ``.item()`` / ``.tolist()`` / ``.cpu()`` of a device tensor or ``nonzero`` on the device.
    The mode it found (``torch.cuda.get_sync_debug_mode()``: 0 default, 1 warn, 2 error) is
    restored on exit, so a caller's own ``"warn"`` or an outer ``no_host_syncs`` stays on.
    Needs CUDA (torch's sync debug mode initializes it; a CPU build raises)."""
    previous = torch.cuda.get_sync_debug_mode()
    torch.cuda.set_sync_debug_mode("error")
    try:
        yield
    finally:
        torch.cuda.set_sync_debug_mode(previous)
