import pytest
import torch


@pytest.fixture(autouse=True)
def one_cpu_thread():
    """The toy models are tiny: with several threads, synchronization overhead dominates
    (and explodes on a loaded 2-core machine)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
