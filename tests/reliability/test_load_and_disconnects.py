"""Load and disconnects on a real server (issue 14, failure 2: abandoned non-streaming requests
ran to completion, holding KV and preempting live work).

Mixed load: 200 requests (completions / chat, streaming / not, several lengths) at concurrency
32; every greedy text must equal the same request sent alone. Disconnects: 50 streaming clients
that hang up after the first chunk and 20 non-streaming clients that hang up once the server
holds their requests; every one is
aborted (vllm:request_aborted counts them) and the KV cache returns to 0.
"""
import asyncio
import json
import time

import httpx

from tests.utils.reliability import GREEDY, engine_state, metric_value, percentile, wait_kv_free

PROMPTS = ["Hello, my name is", "The capital of France is", "1, 2, 3,", "def add(a, b):",
           "Once upon a time", "The quick brown fox", "In 1969, astronauts", "A B C D"]
NUM_REQUESTS, CONCURRENCY = 200, 32


def make_request(i: int) -> tuple[str, dict]:
    prompt = PROMPTS[i % len(PROMPTS)]
    max_tokens = (4, 8, 12)[(i // len(PROMPTS)) % 3]
    stream = i % 3 == 0
    if i % 2:
        return "/v1/chat/completions", {"messages": [{"role": "user", "content": prompt}],
                                        "max_tokens": max_tokens, "stream": stream, **GREEDY}
    return "/v1/completions", {"prompt": prompt, "max_tokens": max_tokens, "stream": stream,
                               **GREEDY}


def key(path: str, body: dict) -> tuple[str, str]:
    """Streaming or not, the same request must produce the same greedy text."""
    return path, json.dumps({k: v for k, v in body.items() if k != "stream"}, sort_keys=True)


async def send(client, path, body) -> str:
    if not body["stream"]:
        r = await client.post(path, json=body)
        assert r.status_code == 200, r.text
        choice = r.json()["choices"][0]
        return choice["text"] if "text" in choice else choice["message"]["content"]
    text = []
    async with client.stream("POST", path, json=body) as r:
        assert r.status_code == 200
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[6:])
            assert "error" not in event, event
            for choice in event["choices"]:
                text.append(choice.get("text") or (choice.get("delta") or {}).get("content")
                            or "")
    return "".join(text)


def test_mixed_load_matches_requests_run_alone(server, record_property):
    requests = [make_request(i) for i in range(NUM_REQUESTS)]

    async def alone():
        # Distinct requests once each, one at a time (the oracle).
        texts = {}
        async with httpx.AsyncClient(base_url=server.base_url, timeout=120) as client:
            for path, body in requests:
                if key(path, body) not in texts:
                    texts[key(path, body)] = await send(client, path, {**body, "stream": False})
        return texts

    async def loaded():
        limit = asyncio.Semaphore(CONCURRENCY)
        latencies = []

        async def one(client, path, body):
            async with limit:
                start = time.perf_counter()
                text = await send(client, path, body)
                latencies.append(time.perf_counter() - start)
                return text

        limits = httpx.Limits(max_connections=CONCURRENCY)
        async with httpx.AsyncClient(base_url=server.base_url, timeout=300,
                                     limits=limits) as client:
            texts = await asyncio.gather(*(one(client, p, b) for p, b in requests))
        return texts, latencies

    reference = asyncio.run(alone())
    start = time.perf_counter()
    texts, latencies = asyncio.run(loaded())
    wall = time.perf_counter() - start
    mismatches = [i for i, (path, body) in enumerate(requests)
                  if texts[i] != reference[key(path, body)]]
    record_property("load", {"requests": NUM_REQUESTS, "concurrency": CONCURRENCY,
                             "wall_s": round(wall, 2),
                             "p50_s": round(percentile(latencies, 50), 3),
                             "p99_s": round(percentile(latencies, 99), 3),
                             "mismatches": len(mismatches)})
    print(f"\nLOAD requests={NUM_REQUESTS} concurrency={CONCURRENCY} wall={wall:.2f}s "
          f"p50={percentile(latencies, 50):.3f}s p99={percentile(latencies, 99):.3f}s "
          f"mismatches={len(mismatches)}")
    assert mismatches == []
    wait_kv_free(server.base_url)


def test_disconnects_are_aborted_and_free_the_kv_cache(server):
    aborted_before = metric_value(server.base_url, "vllm:request_aborted_total")
    long_body = {"prompt": "Once upon a time", "max_tokens": 100, **GREEDY}

    async def stream_and_hang_up(client):
        async with client.stream("POST", "/v1/completions",
                                 json={**long_body, "stream": True}) as r:
            assert r.status_code == 200
            async for line in r.aiter_lines():
                if line.startswith("data: "):
                    break  # first chunk seen: walk away

    async def give_up_once_admitted(client, n=20):
        """n non-streaming requests; each client hangs up once the server holds all n (running
        or waiting). A fixed client timeout raced the server under load: a client could leave
        before its request arrived, and then there was nothing to abort."""
        loop = asyncio.get_running_loop()
        tasks = [asyncio.create_task(client.post("/v1/completions", json=long_body)) for _ in range(n)]
        deadline = loop.time() + 30
        while not any(t.done() for t in tasks):
            state = await asyncio.to_thread(engine_state, server.base_url)
            if state["num_requests_running"] + state["num_requests_waiting"] >= n:
                break
            assert loop.time() < deadline, f"the server never held all {n} requests: {state}"
            await asyncio.sleep(0.02)
        for t in tasks:
            t.cancel()
        results = await asyncio.gather(*tasks, return_exceptions=True)
        return [isinstance(r, asyncio.CancelledError) for r in results]

    async def main():
        async with httpx.AsyncClient(base_url=server.base_url, timeout=60,
                                     limits=httpx.Limits(max_connections=100)) as client:
            await asyncio.gather(*(stream_and_hang_up(client) for _ in range(50)))
        async with httpx.AsyncClient(base_url=server.base_url, timeout=60,
                                     limits=httpx.Limits(max_connections=100)) as client:
            return await give_up_once_admitted(client)

    gave_up = asyncio.run(main())
    assert all(gave_up)  # each non-streaming client really left before its answer
    state, seconds = wait_kv_free(server.base_url, timeout=20)
    aborted = metric_value(server.base_url, "vllm:request_aborted_total") - aborted_before
    print(f"\nDISCONNECTS streaming=50 non_streaming=20 aborted={aborted:.0f} "
          f"kv_free_after={seconds:.2f}s")
    assert aborted == 70, aborted  # none of the 70 ran to completion
    assert state["num_free_blocks"] == state["num_total_blocks"]
