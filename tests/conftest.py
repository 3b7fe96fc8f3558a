"""Shared pytest set-up.

- GPU tests are skipped (with a reason) when CUDA is absent.
- One intra-op thread per process: CI has 2 cores and many tests spawn several worker processes;
  oversubscribed OpenMP pools made small CPU kernels 10-50x slower there. Spawned workers inherit
  the environment variable.
"""
import os

os.environ.setdefault("OMP_NUM_THREADS", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip_gpu = pytest.mark.skip(reason="needs a CUDA GPU; run `pytest -m gpu` on the GPU node")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)


@pytest.fixture(scope="session")
def cpu_world_pool():
    """Spawned gloo ranks kept for the session (tests/utils/world_pool.py): the CPU DCP worlds
    of several end-to-end modules start their interpreters once instead of once per world."""
    from tests.utils.world_pool import WorldPool
    pool = WorldPool()
    yield pool
    pool.close()
