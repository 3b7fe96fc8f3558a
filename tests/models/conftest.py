"""tests/models: run torch single-threaded. These models are tiny; on a loaded 2-core runner
intra-op threads mostly contend (measured: one paged run 6 s with 2 threads, 0.1 s with 1)."""
import pytest
import torch


@pytest.fixture(autouse=True)
def _single_thread_torch():
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)
