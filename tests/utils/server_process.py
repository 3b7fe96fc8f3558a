"""Start a real `vllm serve` subprocess on 127.0.0.1 (free port) for the end-to-end tests."""
from __future__ import annotations

import os
import socket
import subprocess
import sys
import time

import httpx


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerProcess:
    def __init__(self, args: list[str], log_path: str, startup_timeout: float = 120.0,
                 env: dict[str, str] | None = None):
        self.port = free_port()
        self.base_url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_path
        self._log = open(log_path, "w")
        env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
        cmd = [sys.executable, "-m", "vllm.entrypoints.cli.main", "serve", *args,
               "--host", "127.0.0.1", "--port", str(self.port)]
        self.proc = subprocess.Popen(cmd, stdout=self._log, stderr=subprocess.STDOUT, env=env)
        self._wait_ready(startup_timeout)

    def log(self) -> str:
        with open(self.log_path) as f:
            return f.read()

    def _wait_ready(self, timeout: float) -> None:
        deadline = time.time() + timeout
        while time.time() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"vllm serve exited with {self.proc.returncode}:\n{self.log()}")
            try:
                if httpx.get(f"{self.base_url}/health", timeout=1.0).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        self.stop()
        raise RuntimeError(f"vllm serve not ready after {timeout} s:\n{self.log()}")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log.close()
