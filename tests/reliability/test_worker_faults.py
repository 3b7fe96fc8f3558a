"""Worker faults under -tp 2 -dcp 2 (gloo, tiny model, CPU): issue 14 failures 3 and 4.

SIGKILL of rank 1 (idle and under load) and SIGSTOP of rank 1 under load: the server logs one
clear ERROR line and exits non-zero within a bounded time; /health reports 503 while a stopped
worker keeps the engine from progressing. Before, the server stayed up as a zombie (500/503
forever, nothing logged) or hung with /health 200.
"""
import os
import signal
import threading
import time

import httpx
import pytest

from tests.utils.reliability import (GREEDY, last_error_lines, wait_requests_running,
                                     worker_pids)
from tests.utils.server_process import ServerProcess

WATCHDOG_S = 6  # VLLM_EXECUTE_MODEL_TIMEOUT_SECONDS for the SIGSTOP case
EXIT_BOUND_S = 30  # generous for 2 shared cores


def start(tmp_path, name, env=None):
    return ServerProcess(["--device", "cpu", "-tp", "2", "-dcp", "2", "--distributed-backend",
                          "gloo", "--max-model-len", "128", "--disable-log-stats",
                          "--disable-uvicorn-access-log"],
                         str(tmp_path / f"{name}.log"), startup_timeout=180, env=env)


def load(base_url, stop: threading.Event, results: list):
    body = {"prompt": "Once upon a time", "max_tokens": 64, **GREEDY}
    while not stop.is_set():
        try:
            results.append(httpx.post(f"{base_url}/v1/completions", json=body,
                                      timeout=60).status_code)
        except httpx.HTTPError:
            results.append("disconnected")
            return


def wait_exit(server, bound):
    start = time.time()
    try:
        code = server.proc.wait(timeout=bound)
    except Exception:
        server.stop()
        raise AssertionError(f"server still up {bound} s after the fault:\n{server.log()[-3000:]}")
    return code, time.time() - start


@pytest.mark.parametrize("under_load", [False, True], ids=["idle", "under_load"])
def test_sigkill_of_rank1_exits_nonzero(tmp_path, under_load):
    server = start(tmp_path, f"kill_{under_load}")
    try:
        workers = worker_pids(server.proc.pid)
        assert len(workers) == 2, workers
        stop, results = threading.Event(), []
        threads = [threading.Thread(target=load, args=(server.base_url, stop, results))
                   for _ in range(4 if under_load else 0)]
        for t in threads:
            t.start()
        if under_load:
            wait_requests_running(server.base_url)  # the fault hits a running batch
        os.kill(workers[1], signal.SIGKILL)
        code, seconds = wait_exit(server, EXIT_BOUND_S)
        stop.set()
        for t in threads:
            t.join(timeout=30)
        print(f"\nSIGKILL rank1 under_load={under_load}: exit code {code} after {seconds:.2f}s")
        assert code not in (0, None)
        errors = last_error_lines(server.log())
        assert any("Engine is dead" in line and "worker rank 1" in line for line in errors), \
            server.log()[-3000:]
    finally:
        server.stop()


def test_sigstop_of_rank1_turns_unhealthy_then_exits(tmp_path):
    server = start(tmp_path, "stop", env={"VLLM_EXECUTE_MODEL_TIMEOUT_SECONDS": str(WATCHDOG_S)})
    workers = []
    try:
        workers = worker_pids(server.proc.pid)
        assert len(workers) == 2, workers
        stop, results = threading.Event(), []
        threads = [threading.Thread(target=load, args=(server.base_url, stop, results))
                   for _ in range(2)]
        for t in threads:
            t.start()
        wait_requests_running(server.base_url)  # rank 1 stops inside a running batch
        os.kill(workers[1], signal.SIGSTOP)
        stopped_at = time.time()
        unhealthy_after = None
        while time.time() - stopped_at < WATCHDOG_S:
            try:
                r = httpx.get(f"{server.base_url}/health", timeout=2)
            except httpx.HTTPError:
                break
            if r.status_code == 503:
                unhealthy_after = time.time() - stopped_at
                assert "stopped" in r.json()["error"]["message"]
                break
            time.sleep(0.1)
        code, seconds = wait_exit(server, WATCHDOG_S + EXIT_BOUND_S)
        stop.set()
        for t in threads:
            t.join(timeout=30)
        print(f"\nSIGSTOP rank1: /health 503 after {unhealthy_after}s, exit code {code} after "
              f"{time.time() - stopped_at:.2f}s")
        assert unhealthy_after is not None and unhealthy_after < 3.0
        assert code not in (0, None)
        assert any("Engine is dead" in line for line in last_error_lines(server.log())), \
            server.log()[-3000:]
    finally:
        for pid in workers:
            try:
                os.kill(pid, signal.SIGKILL)  # a stopped orphan must not outlive the test
            except ProcessLookupError:
                pass
        server.stop()
