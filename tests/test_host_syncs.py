"""``no_host_syncs`` gives back the CUDA sync debug mode it found (torch's sync debug mode
needs CUDA: a CPU build raises at ``get_sync_debug_mode``, so the test is GPU-only)."""

from __future__ import annotations

import pytest
import torch

from omnistage.testing.host_syncs import no_host_syncs


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("outer", ["default", "warn", "error"])
def test_no_host_syncs_restores_the_mode_it_found(outer: str) -> None:
    before = torch.cuda.get_sync_debug_mode()
    torch.cuda.set_sync_debug_mode(outer)
    found = torch.cuda.get_sync_debug_mode()
    try:
        with no_host_syncs():
            assert torch.cuda.get_sync_debug_mode() == 2  # "error"
            with pytest.raises(RuntimeError, match="synchroniz"):
                torch.ones(1, device="cuda").item()
        assert torch.cuda.get_sync_debug_mode() == found
    finally:
        torch.cuda.set_sync_debug_mode(before)
