"""`vllm generate -tp 2 -dcp 2` whose rank 1 is SIGKILLed mid-generation (issue 14, failure 7):
exit code 1 and one error line naming the rank, no traceback."""
import os
import signal
import subprocess
import sys
import threading
import time

from tests.utils.reliability import worker_pids


def test_sigkill_of_rank1_during_generate_is_one_line():
    cmd = [sys.executable, "-m", "vllm.entrypoints.cli.main", "generate", "-tp", "2", "-dcp", "2",
           "--distributed-backend", "gloo", "--device", "cpu", "--max-tokens", "100"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    stderr: list[str] = []
    started = threading.Event()

    def read():
        for chunk in iter(lambda: proc.stderr.read(1), ""):
            stderr.append(chunk)
            if "Generating" in "".join(stderr[-64:]):  # the progress bar: decoding has begun
                started.set()

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    try:
        assert started.wait(240), "".join(stderr)[-2000:]
        workers = worker_pids(proc.pid)
        assert len(workers) == 2, workers
        time.sleep(0.5)
        os.kill(workers[1], signal.SIGKILL)
        code = proc.wait(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    reader.join(timeout=10)
    text = "".join(stderr)
    lines = [line.strip() for line in text.replace("\r", "\n").splitlines()
             if line.strip() and "Generating" not in line]
    assert code == 1, text[-2000:]
    assert "Traceback" not in text, text[-2000:]
    assert len(lines) == 1, lines
    assert lines[0].startswith("vllm generate: error: worker rank 1 died"), lines[0]
