"""Reusable spawned processes for the CPU (gloo) DCP worlds of the end-to-end tests.

`runner_harness.spawn_world` starts fresh interpreters for every world; on the 2-core CI box the
start-up alone (importing torch and the engine in every rank) costs 7 s for a DCP=2 world and 12 s
for DCP=4, about as much as the work the world then does. A pool keeps its ranks alive for the
whole session: each job still builds its own process group on a fresh port and tears it down
(`dcp_world_main` destroys the groups in its `finally`), so a job sees the same distributed state
as in a new process; only the imports are shared.

A job that fails or times out closes the pool (a rank may be stuck in a collective); the next job
starts fresh processes."""
from __future__ import annotations

import multiprocessing as mp
import pickle
import queue as queue_module
import traceback

from tests.utils.runner_harness import dcp_world_main, free_port

# Stands for the results queue in a job's arguments: a multiprocessing.Queue cannot travel through
# another queue, so every rank receives the pool's queue at spawn time and substitutes it.
RESULTS = "<world_pool results queue>"
FINISH_TIMEOUT_S = 60.0  # ranks other than 0 finishing their teardown after rank 0 reported


def _serve(rank: int, jobs, results, done) -> None:
    while True:
        job = jobs.get()
        if job is None:
            return
        target, args = job
        args = tuple(results if isinstance(a, str) and a == RESULTS else a for a in args)
        try:
            target(*args)
        except BaseException:  # the target reports its own error on `results`; keep serving
            done.put((rank, traceback.format_exc()))
        else:
            done.put((rank, None))


class WorldPool:
    """Ranks 0..n-1 of spawned, long-lived processes; grown on demand to the largest world."""

    def __init__(self) -> None:
        self._ctx = mp.get_context("spawn")
        self._procs: list = []
        self._jobs: list = []
        self._results = None
        self._done = None

    def _grow(self, size: int) -> None:
        if self._results is None:
            self._results, self._done = self._ctx.Queue(), self._ctx.Queue()
        while len(self._procs) < size:
            rank = len(self._procs)
            jobs = self._ctx.Queue()
            proc = self._ctx.Process(target=_serve, args=(rank, jobs, self._results, self._done),
                                     daemon=True)
            proc.start()
            self._procs.append(proc)
            self._jobs.append(jobs)

    def run(self, target, world_size: int, args_of_rank, label: str,
            timeout_s: float = 300.0):
        """Same contract as `runner_harness.spawn_world`: run target(*args_of_rank(rank, port,
        queue)) on ranks 0..world_size-1 and return the unpickled payload rank 0 reports as
        ("ok", pickled, ...); a rank's ("error", text, ...) is raised as RuntimeError(text)."""
        self._grow(world_size)
        port = free_port()
        for rank in range(world_size):
            self._jobs[rank].put((target, tuple(args_of_rank(rank, port, RESULTS))))
        try:
            message = self._results.get(timeout=timeout_s)
        except queue_module.Empty:
            self.close()
            raise RuntimeError(f"DCP={world_size} {label} produced no result in {timeout_s}s") \
                from None
        if message[0] != "ok":
            self.close()
            raise RuntimeError(message[1])
        # Every rank must have torn its groups down before the next job reuses it.
        for _ in range(world_size):
            try:
                rank, error = self._done.get(timeout=FINISH_TIMEOUT_S)
            except queue_module.Empty:
                self.close()
                raise RuntimeError(f"DCP={world_size} {label}: a rank did not finish within "
                                   f"{FINISH_TIMEOUT_S}s after rank 0 reported") from None
            if error is not None:
                self.close()
                raise RuntimeError(f"rank {rank}:\n{error}")
        return pickle.loads(message[1])

    def run_dcp_world(self, world_size: int, interleave: int, paths, cases, scenario, oracle,
                      stale_cases=(), timeout_s: float = 300.0):
        """`runner_harness.spawn_dcp_world` (CPU, gloo) on the pool's ranks."""
        return self.run(
            dcp_world_main, world_size,
            lambda r, port, q: (r, world_size, port, interleave, paths, cases, scenario, oracle,
                                list(stale_cases), q, False),
            "world", timeout_s)

    def close(self) -> None:
        for jobs in self._jobs:
            jobs.put(None)
        for proc in self._procs:
            proc.join(timeout=3)
            if proc.is_alive():
                proc.terminate()
                proc.join(timeout=3)
        self._procs, self._jobs, self._results, self._done = [], [], None, None
