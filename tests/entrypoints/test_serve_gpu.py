"""GPU runs of the user surface (the lead runs `pytest -m gpu` on the H200 node).

* `vllm generate` with no model: tiny model + DSpark on CUDA, exit 0, acceptance printed.
* `vllm serve` under TP=2/DCP=2 on FLASHINFER_MLA (needs 2 GPUs): completions with exact token
  counts, streaming, an abort storm after which the KV pool is fully free again.
"""
import asyncio
import json
import subprocess
import sys
import time

import httpx
import pytest
import torch

from tests.utils.server_process import ServerProcess

pytestmark = pytest.mark.gpu


def test_generate_default_tiny_dspark_on_cuda():
    out = subprocess.run([sys.executable, "-m", "vllm.entrypoints.cli.main", "generate",
                          "--device", "cuda", "--max-tokens", "16", "--no-progress"],
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "speculative method dspark" in out.stdout
    line = next(l for l in out.stdout.splitlines() if l.startswith("mean acceptance length:"))
    assert float(line.split()[3]) >= 1.0


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs for TP=2 / DCP=2")
def test_serve_tp2_dcp2_flashinfer(tmp_path):
    from vllm.model_executor.models.tiny import write_tiny_models

    paths = write_tiny_models()
    spec = {"method": "dspark", "model": paths.dspark, "num_speculative_tokens": 4}
    server = ServerProcess([paths.target, "-tp", "2", "-dcp", "2", "--attention-backend",
                            "FLASHINFER_MLA", "--block-size", "32", "--max-model-len", "512",
                            "--speculative-config", json.dumps(spec), "--served-model-name", "t"],
                           str(tmp_path / "serve.log"), startup_timeout=600)
    try:
        body = {"model": "t", "prompt": "Hello", "max_tokens": 24, "temperature": 0.0,
                "ignore_eos": True}
        r = httpx.post(f"{server.base_url}/v1/completions", json=body, timeout=120)
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["completion_tokens"] == 24
        with httpx.stream("POST", f"{server.base_url}/v1/completions", timeout=120,
                          json={**body, "stream": True}) as s:
            chunks = [json.loads(l[6:]) for l in s.iter_lines() if l.startswith("data: {")]
        assert "".join(c["choices"][0]["text"] for c in chunks) == r.json()["choices"][0]["text"]

        async def storm():
            async with httpx.AsyncClient(base_url=server.base_url, timeout=120) as c:
                async def hang_up(i):
                    async with c.stream("POST", "/v1/completions", json={
                            **body, "prompt": f"story {i}", "max_tokens": 400, "stream": True}) as s:
                        async for line in s.aiter_lines():
                            if line.startswith("data: {"):
                                return
                await asyncio.gather(*(hang_up(i) for i in range(32)))

        asyncio.run(storm())
        deadline = time.time() + 60
        while time.time() < deadline:
            state = httpx.get(f"{server.base_url}/debug/engine_state").json()
            if state["num_requests_running"] == 0 and state["num_free_blocks"] == state["num_total_blocks"]:
                break
            time.sleep(0.2)
        assert state["num_free_blocks"] == state["num_total_blocks"], state
        assert httpx.get(f"{server.base_url}/health").status_code == 200
        metrics = httpx.get(f"{server.base_url}/metrics").text
        mean_len = next(l for l in metrics.splitlines()
                        if l.startswith("vllm:spec_decode_mean_acceptance_length"))
        assert float(mean_len.split()[-1]) >= 1.0
    finally:
        server.stop()
