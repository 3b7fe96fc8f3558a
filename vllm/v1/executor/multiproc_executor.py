"""One worker process per rank (spawn context), driven over pipes by the engine process.

Every call is sent to all ranks and every rank answers ("ok", result) or ("error", traceback). The
engine waits on the pipes AND the process sentinels, so a rank that raises or dies ends the wait at
once with a RuntimeError naming the rank, instead of leaving the engine blocked on a rank that is
itself blocked in a collective with the dead one. After a failure every worker is terminated.

One exception: an `execute_model` that raises an Exception is answered ("step_error", traceback)
and the worker keeps serving. When EVERY rank reports a step error (a request's data fails the
same way on all ranks, e.g. an overflowing sampling parameter), the executor raises StepError and
stays usable, so the engine fails that request alone and recomputes the others (their runner
state is dropped through the next step's preempted ids). When only some ranks report one, the
others are likely blocked in a collective with them: after a short grace the executor fails as
before.

Liveness: a monitor thread watches the worker processes between calls too, so a rank that dies
while the engine is idle is reported at once through the failure callbacks (AsyncLLM turns that
into a clean engine death); `liveness_problem()` also names ranks that are stopped (SIGSTOP,
state T in /proc), which can make no progress. `execute_model` waits at most
VLLM_EXECUTE_MODEL_TIMEOUT_SECONDS (upstream's name, default 300 s) for a step.
"""
from __future__ import annotations

import os
import socket
import threading
import time
import traceback
from multiprocessing.connection import wait as wait_for_any

import torch.multiprocessing as mp

from vllm.v1.executor.abstract import Executor, StepError, WorkerError, resolve_qualname

# Model load (+ a FlashInfer JIT build on first use) can take minutes on a cold node.
STARTUP_TIMEOUT_S = float(os.environ.get("VLLM_WORKER_STARTUP_TIMEOUT_S", "1200"))
# No healthy step takes this long; past it the engine gives up instead of hanging.
RPC_TIMEOUT_S = float(os.environ.get("VLLM_WORKER_RPC_TIMEOUT_S", "900"))
_SHUTDOWN_GRACE_S = 5.0
# How long the other ranks may take to report once one rank reported a step error (a
# data-caused failure reaches every rank at the same point of the step).
_STEP_ERROR_GRACE_S = float(os.environ.get("VLLM_WORKER_STEP_ERROR_GRACE_S", "5"))
_SPAWN_HINT = ("; its stderr has the reason. Workers are spawned, which re-imports the main "
               "script: a script that builds the engine at top level needs an "
               "`if __name__ == '__main__':` guard")


def get_open_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def worker_main(worker_cls: str, vllm_config, rank: int, init_method: str, conn) -> None:
    """Entry point of a worker process: start up, then serve calls until shutdown or EOF."""
    worker = None
    try:
        worker = resolve_qualname(worker_cls)(vllm_config, rank, init_method)
        worker.init_device()
        worker.load_model()
        conn.send(("ok", None))
    except BaseException:  # noqa: BLE001 - report anything, then exit
        _send_quietly(conn, ("error", traceback.format_exc()))
        return
    while True:
        try:
            method, args, kwargs = conn.recv()
        except (EOFError, OSError):
            break  # the engine is gone
        if method == "shutdown":
            try:
                worker.shutdown()
            finally:
                _send_quietly(conn, ("ok", None))
            break
        try:
            result = getattr(worker, method)(*args, **kwargs)
        except Exception:  # noqa: BLE001
            if method == "execute_model":  # the engine may isolate the request and go on
                _send_quietly(conn, ("step_error", traceback.format_exc()))
                continue
            _send_quietly(conn, ("error", traceback.format_exc()))
            break  # the engine stops all ranks after any other failure
        except BaseException:  # noqa: BLE001
            _send_quietly(conn, ("error", traceback.format_exc()))
            break
        conn.send(("ok", result))


def _is_stopped(pid: int | None) -> bool:
    """True if the process is stopped (state T / t in /proc/PID/stat; Linux only)."""
    if pid is None:
        return False
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii", errors="replace") as f:
            state = f.read().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state in ("T", "t")


def _send_quietly(conn, message) -> None:
    try:
        conn.send(message)
    except (BrokenPipeError, EOFError, OSError):
        pass


class MultiprocExecutor(Executor):

    def _init_executor(self) -> None:
        ctx = mp.get_context("spawn")
        init_method = f"tcp://127.0.0.1:{get_open_port()}"
        self.processes = []
        self.conns = []
        for rank in range(self.world_size):
            parent_conn, child_conn = ctx.Pipe(duplex=True)
            process = ctx.Process(target=worker_main, name=f"VllmWorker-rank{rank}", daemon=True,
                                  args=(self.worker_cls, self.vllm_config, rank, init_method,
                                        child_conn))
            process.start()
            child_conn.close()
            self.processes.append(process)
            self.conns.append(parent_conn)
        self._failure_callbacks: list = []
        self._gather("start-up", STARTUP_TIMEOUT_S)
        self._monitor = threading.Thread(target=self._monitor_workers, name="vllm-worker-monitor",
                                         daemon=True)
        self._monitor.start()

    def register_failure_callback(self, callback) -> None:
        """callback(reason: str), called from the monitor thread when a worker process exits
        while the executor is running."""
        self._failure_callbacks.append(callback)

    def _monitor_workers(self) -> None:
        sentinels = {process.sentinel: rank for rank, process in enumerate(self.processes)}
        while not self.is_shutdown:
            ready = wait_for_any(list(sentinels), timeout=0.5)
            if self.is_shutdown:
                return
            if ready:
                rank = sentinels[ready[0]]
                reason = f"worker rank {rank} died{self._exit_note(rank)}"
                for callback in list(self._failure_callbacks):
                    callback(reason)
                return

    def liveness_problem(self) -> str | None:
        """Why the workers cannot make progress right now, or None."""
        if self.is_shutdown:
            return "the workers are shut down"
        for rank, process in enumerate(self.processes):
            if not process.is_alive():
                return f"worker rank {rank} is not running{self._exit_note(rank)}"
            if _is_stopped(process.pid):
                return f"worker rank {rank} (pid {process.pid}) is stopped (SIGSTOP?)"
        return None

    def execute_model(self, scheduler_output):
        from vllm.v1.engine.async_llm import execute_model_timeout_s

        return self.collective_rpc("execute_model", (scheduler_output,),
                                   timeout=execute_model_timeout_s())[0]

    def collective_rpc(self, method, args=(), kwargs=None, timeout=None) -> list:
        if self.is_shutdown:
            raise RuntimeError("the executor is shut down; create a new engine")
        for rank, conn in enumerate(self.conns):
            try:
                conn.send((method, tuple(args), dict(kwargs or {})))
            except (BrokenPipeError, OSError):
                self._fail(f"worker rank {rank} is gone (pipe closed) before `{method}`"
                           f"{self._exit_note(rank)}")
        return self._gather(method, RPC_TIMEOUT_S if timeout is None else timeout)

    def _gather(self, what: str, timeout: float) -> list:
        results: list = [None] * self.world_size
        pending = set(range(self.world_size))
        step_errors: dict[int, str] = {}
        deadline = time.monotonic() + timeout
        while pending:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                if step_errors:
                    rank = min(step_errors)
                    self._fail(f"worker rank {rank} raised during `{what}` and ranks "
                               f"{sorted(pending)} did not answer (blocked in a collective "
                               f"with it?):\n{step_errors[rank]}")
                self._fail(f"worker ranks {sorted(pending)} did not answer `{what}` within "
                           f"{timeout:.0f}s")
            ready = set(wait_for_any([self.conns[r] for r in pending]
                                     + [self.processes[r].sentinel for r in pending],
                                     timeout=remaining))
            # Read answers before looking at deaths: a rank may report an error and then exit.
            for rank in sorted(pending):
                conn = self.conns[rank]
                if conn in ready or conn.poll():
                    try:
                        status, payload = conn.recv()
                    except (EOFError, OSError):
                        self._fail(f"worker rank {rank} died during `{what}`"
                                   f"{self._exit_note(rank)}")
                    if status == "error":
                        self._fail(f"worker rank {rank} raised during `{what}`:\n{payload}")
                    if status == "step_error":
                        step_errors[rank] = payload
                        deadline = min(deadline, time.monotonic() + _STEP_ERROR_GRACE_S)
                    results[rank] = payload
                    pending.discard(rank)
            for rank in sorted(pending):
                if self.processes[rank].sentinel in ready and not self.conns[rank].poll():
                    hint = _SPAWN_HINT if what == "start-up" else ""
                    self._fail(f"worker rank {rank} died during `{what}`{self._exit_note(rank)}"
                               f"{hint}")
        if step_errors:
            rank = min(step_errors)
            if len(step_errors) < self.world_size:
                ok = sorted(set(range(self.world_size)) - set(step_errors))
                self._fail(f"worker rank {rank} raised during `{what}` while ranks {ok} "
                           f"completed it (their states now differ):\n{step_errors[rank]}")
            raise StepError(f"every worker rank raised during `{what}`; rank {rank}:\n"
                            f"{step_errors[rank]}")
        return results

    def _exit_note(self, rank: int) -> str:
        process = self.processes[rank]
        # The monitor thread may be reaping the same process: a waitpid that loses that race
        # reads no status, and the winner records the exit code only once it holds the GIL
        # again. join() returns at once here (the sentinel is already ready), so sleep between
        # the looks to let the winner finish.
        for _ in range(40):
            process.join(timeout=0.05)
            if process.exitcode is not None:
                return f" (exit code {process.exitcode})"
            time.sleep(0.05)
        return ""

    def _fail(self, message: str):
        self.shutdown(graceful=False)
        raise WorkerError(message)

    def shutdown(self, graceful: bool = True) -> None:
        if self.is_shutdown:
            return
        self.is_shutdown = True
        if graceful:
            for conn in self.conns:
                _send_quietly(conn, ("shutdown", (), {}))
            deadline = time.monotonic() + _SHUTDOWN_GRACE_S
            for process in self.processes:
                process.join(timeout=max(0.0, deadline - time.monotonic()))
        for process in self.processes:
            if process.is_alive():
                # A stopped process never acts on SIGTERM (it stays pending): kill it outright.
                if _is_stopped(process.pid):
                    process.kill()
                else:
                    process.terminate()
        for process in self.processes:
            process.join(timeout=_SHUTDOWN_GRACE_S)
            if process.is_alive():
                process.kill()
                process.join(timeout=_SHUTDOWN_GRACE_S)
        for conn in self.conns:
            conn.close()
