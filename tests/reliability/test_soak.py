"""Soak: preemption-heavy traffic on a 40-block KV cache (tiny model + DSpark, CPU).

24 concurrent greedy requests whose combined KV is several times the cache: the scheduler must
preempt (and recompute) again and again. Nothing may be lost: every request finishes with its
full length, its text equals the same request run alone, and the cache ends empty.
"""
import asyncio
import time

import httpx
import pytest

from tests.utils.reliability import GREEDY, engine_state, wait_kv_free
from tests.utils.server_process import ServerProcess

PROMPTS = ["Hello, my name is", "The capital of France is", "1, 2, 3,", "def add(a, b):",
           "Once upon a time", "The quick brown fox"]
NUM_REQUESTS, MAX_TOKENS = 24, 48


@pytest.fixture(scope="module")
def small_cache_server(tmp_path_factory):
    proc = ServerProcess(["--device", "cpu", "--max-model-len", "128", "--num-gpu-blocks-override",
                          "40", "--block-size", "4", "--disable-log-stats",
                          "--disable-uvicorn-access-log"],
                         str(tmp_path_factory.mktemp("logs") / "soak.log"))
    yield proc
    proc.stop()


def body(i):
    return {"prompt": PROMPTS[i % len(PROMPTS)] + " " * (i // len(PROMPTS)),
            "max_tokens": MAX_TOKENS, **GREEDY}


def test_preemption_soak_loses_nothing(small_cache_server):
    base = small_cache_server.base_url
    state = engine_state(base)
    assert state["num_total_blocks"] == 40
    with httpx.Client(base_url=base, timeout=120) as client:
        alone = [client.post("/v1/completions", json=body(i)).json()["choices"][0]
                 for i in range(NUM_REQUESTS)]
    preemptions_before = engine_state(base)["num_preemptions"]

    async def soak():
        async with httpx.AsyncClient(base_url=base, timeout=300,
                                     limits=httpx.Limits(max_connections=64)) as client:
            rs = await asyncio.gather(*(client.post("/v1/completions", json=body(i))
                                        for i in range(NUM_REQUESTS)))
        return [r.json()["choices"][0] for r in rs]

    start = time.time()
    loaded = asyncio.run(soak())
    preemptions = engine_state(base)["num_preemptions"] - preemptions_before
    print(f"\nSOAK requests={NUM_REQUESTS} blocks=40 preemptions={preemptions} "
          f"wall={time.time() - start:.2f}s")
    assert preemptions > 0  # the traffic really was preemption-heavy
    for i, (a, b) in enumerate(zip(alone, loaded)):
        assert b["finish_reason"] == "length", (i, b)
        assert b["text"] == a["text"], i
    state, _ = wait_kv_free(base)
    assert state["num_free_blocks"] == 40
