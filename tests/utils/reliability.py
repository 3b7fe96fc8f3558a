"""Helpers of the fault-injection suite (tests/reliability): HTTP calls, engine state, worker pids."""
from __future__ import annotations

import os
import re
import threading
import time

import httpx

GREEDY = {"temperature": 0.0, "ignore_eos": True}


def post(base_url: str, path: str = "/v1/completions", timeout: float = 60.0, **kwargs):
    return httpx.post(f"{base_url}{path}", timeout=timeout, **kwargs)


def completion_text(base_url: str, body: dict) -> str:
    r = post(base_url, json=body)
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["text"]


def engine_state(base_url: str) -> dict:
    return httpx.get(f"{base_url}/debug/engine_state", timeout=10).json()


def wait_requests_running(base_url: str, timeout: float = 60.0) -> dict:
    """Waits until the engine runs at least one request (a load generator's first requests are in
    flight); returns the state. Used instead of a fixed sleep before injecting a fault."""
    start, state = time.time(), {}
    while time.time() - start < timeout:
        state = engine_state(base_url)
        if state["num_requests_running"] > 0:
            return state
        time.sleep(0.05)
    raise AssertionError(f"no request running after {timeout} s of load: {state}")


def wait_kv_free(base_url: str, timeout: float = 30.0) -> tuple[dict, float]:
    """Waits until no request runs or waits and every KV block is free; returns the state and
    the seconds it took."""
    start = time.time()
    state = engine_state(base_url)
    while time.time() - start < timeout:
        state = engine_state(base_url)
        if (state["num_requests_running"] == 0 and state["num_requests_waiting"] == 0
                and state["num_free_blocks"] == state["num_total_blocks"]):
            return state, time.time() - start
        time.sleep(0.05)
    raise AssertionError(f"KV cache not back to 0 after {timeout} s: {state}")


def metric_value(base_url: str, name: str) -> float:
    text = httpx.get(f"{base_url}/metrics", timeout=10).text
    total = 0.0
    for line in text.splitlines():
        if line.startswith(name + "{") or line.startswith(name + " "):
            total += float(line.rsplit(" ", 1)[1])
    return total


class HealthSampler:
    """Polls /health from a thread; `latencies` in seconds, `codes` the status codes seen."""

    def __init__(self, base_url: str, interval: float = 0.02):
        self.base_url, self.interval = base_url, interval
        self.latencies: list[float] = []
        self.codes: list[int] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self):
        with httpx.Client(timeout=10) as client:
            while not self._stop.is_set():
                start = time.perf_counter()
                code = client.get(f"{self.base_url}/health").status_code
                self.latencies.append(time.perf_counter() - start)
                self.codes.append(code)
                self._stop.wait(self.interval)

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()


_PROBE = """
import json, sys, time, httpx
url, interval, stop_file = sys.argv[1], float(sys.argv[2]), sys.argv[3]
import os
out = []
with httpx.Client(timeout=10) as client:
    while not os.path.exists(stop_file):
        start = time.perf_counter()
        code = client.get(url).status_code
        out.append((time.perf_counter() - start, code))
        time.sleep(interval)
print(json.dumps(out))
"""


class HealthProbeProcess:
    """Like HealthSampler, but polls from a separate process, so the latencies measure the
    server and not the GIL of a test process that is busy sending megabytes."""

    def __init__(self, base_url: str, stop_file: str, interval: float = 0.02):
        self.args = [f"{base_url}/health", str(interval), stop_file]
        self.stop_file = stop_file
        self.latencies: list[float] = []
        self.codes: list[int] = []

    def __enter__(self):
        import subprocess
        import sys

        self.proc = subprocess.Popen([sys.executable, "-c", _PROBE, *self.args],
                                     stdout=subprocess.PIPE, text=True)
        time.sleep(1.0)  # the probe's own start-up (httpx import) is not the server's latency
        return self

    def __exit__(self, *exc):
        import json

        open(self.stop_file, "w").close()
        out, _ = self.proc.communicate(timeout=30)
        samples = json.loads(out)
        self.latencies = [s[0] for s in samples]
        self.codes = [s[1] for s in samples]


def child_pids(pid: int) -> list[int]:
    """Direct children of `pid`, oldest first (Linux /proc)."""
    children = []
    for task in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{task}/children") as f:
                children += [int(c) for c in f.read().split()]
        except OSError:
            pass
    return sorted(set(children))


def worker_pids(server_pid: int) -> list[int]:
    """The engine's worker processes (multiprocessing spawn children, not the resource tracker),
    in start order = rank order."""
    pids = []
    for child in child_pids(server_pid):
        try:
            with open(f"/proc/{child}/cmdline", "rb") as f:
                cmdline = f.read().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if "spawn_main" in cmdline and "resource_tracker" not in cmdline:
            pids.append(child)
    return pids


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    index = min(len(ordered) - 1, max(0, int(round(q / 100 * (len(ordered) - 1)))))
    return ordered[index]


def last_error_lines(log: str) -> list[str]:
    return [line for line in log.splitlines() if re.search(r"\bERROR\b", line)]
