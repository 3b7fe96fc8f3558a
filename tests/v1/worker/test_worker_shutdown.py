"""A worker's shutdown tears down only the distributed state it set up, in its own process.

Found in CI: an engine left for the garbage collector by an earlier test was inherited by the
forked ranks of a gloo test and finalised there, and its worker's shutdown destroyed that test's
live process groups ("not initialized in the world group map")."""
import os

import torch

from vllm.distributed import parallel_state as ps
from vllm.v1.worker.gpu.worker import Worker


def _worker_owning_current_state() -> Worker:
    worker = Worker.__new__(Worker)  # only the fields shutdown reads
    worker.device = torch.device("cpu")
    worker.model_runner = object()
    ps.init_distributed_environment(1, 0)
    ps.initialize_model_parallel(1, 1)
    worker._dist_owner = (os.getpid(), ps.get_world_group())
    return worker


def test_shutdown_destroys_the_state_it_made():
    worker = _worker_owning_current_state()
    worker.shutdown()
    assert ps._WORLD is None and ps._TP is None and ps._DCP is None
    assert worker.model_runner is None


def test_a_late_shutdown_leaves_a_newer_owner_alone():
    stale = _worker_owning_current_state()
    ps.destroy_distributed_environment()
    live = _worker_owning_current_state()  # another engine's state, set up after
    world, tp = ps._WORLD, ps._TP
    stale.shutdown()
    assert ps._WORLD is world and ps._TP is tp
    live.shutdown()
    assert ps._WORLD is None


def test_a_shutdown_in_a_forked_child_leaves_the_childs_state_alone():
    worker = _worker_owning_current_state()
    worker._dist_owner = (worker._dist_owner[0] + 1, worker._dist_owner[1])  # another pid
    world = ps._WORLD
    worker.shutdown()
    assert ps._WORLD is world
    ps.destroy_distributed_environment()
