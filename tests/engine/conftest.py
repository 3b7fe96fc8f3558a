"""tests/engine: single-threaded torch. The tiny model's ops are too small for intra-op threads to
help, and on a shared 2-core runner they mostly contend (spawned workers size their own threads)."""
import pytest
import torch


@pytest.fixture(autouse=True)
def _single_thread_torch():
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)
