"""A real `vllm serve` on the tiny model (DSpark speculative decoding) on 127.0.0.1.

Oracle: plain greedy decoding of the same tiny target by an in-process LLMEngine without
speculative decoding; the server's greedy completions must match it exactly.
"""
import asyncio
import json
import time

import httpx
import pytest

from tests.utils.server_process import ServerProcess

pytestmark = pytest.mark.slow

MODEL_NAME = "tiny-dspark"
MAX_MODEL_LEN = 256
PROMPTS = ["Hello, my name is", "The capital of France is", "1, 2, 3,"]


@pytest.fixture(scope="module")
def tiny_paths():
    from vllm.model_executor.models.tiny import write_tiny_models

    return write_tiny_models()  # the shared, cached tiny family (written once per machine)


@pytest.fixture(scope="module")
def server(tiny_paths, tmp_path_factory):
    spec = {"method": "dspark", "model": tiny_paths.dspark, "num_speculative_tokens": 4}
    proc = ServerProcess([tiny_paths.target, "--speculative-config", json.dumps(spec),
                          "--max-model-len", str(MAX_MODEL_LEN), "--served-model-name", MODEL_NAME,
                          "--device", "cpu"],
                         str(tmp_path_factory.mktemp("logs") / "serve.log"))
    yield proc
    proc.stop()


@pytest.fixture(scope="module")
def greedy_reference(tiny_paths):
    """Plain greedy completions (no speculative decoding) of PROMPTS, 12 tokens each."""
    from vllm.engine.arg_utils import EngineArgs
    from vllm.sampling_params import SamplingParams
    from vllm.v1.engine.llm_engine import LLMEngine

    engine = LLMEngine.from_vllm_config(EngineArgs(
        model=tiny_paths.target, max_model_len=MAX_MODEL_LEN, device="cpu").create_engine_config())
    try:
        for i, prompt in enumerate(PROMPTS):
            engine.add_request(f"ref{i}", prompt, SamplingParams(max_tokens=12, temperature=0.0,
                                                                 ignore_eos=True))
        finals = {}
        while engine.has_unfinished_requests():
            for out in engine.step():
                if out.finished:
                    finals[out.request_id] = out.outputs[0].text
        return [finals[f"ref{i}"] for i in range(len(PROMPTS))]
    finally:
        engine.shutdown()


def engine_state(server):
    return httpx.get(f"{server.base_url}/debug/engine_state", timeout=5).json()


def wait_pool_free(server, timeout=30.0):
    deadline = time.time() + timeout
    state = engine_state(server)
    while time.time() < deadline:
        state = engine_state(server)
        if (state["num_requests_running"] == 0 and state["num_requests_waiting"] == 0
                and state["num_free_blocks"] == state["num_total_blocks"]):
            return state
        time.sleep(0.1)
    raise AssertionError(f"KV pool not free after {timeout} s: {state}")


def completion(server, **body):
    return httpx.post(f"{server.base_url}/v1/completions", timeout=60,
                      json={"model": MODEL_NAME, "temperature": 0.0, "ignore_eos": True, **body})


def test_httpx_completion_matches_plain_greedy(server, greedy_reference):
    for prompt, expected in zip(PROMPTS, greedy_reference):
        r = completion(server, prompt=prompt, max_tokens=12)
        assert r.status_code == 200, r.text
        body = r.json()
        assert body["choices"][0]["text"] == expected
        assert body["usage"]["completion_tokens"] == 12


def test_httpx_streaming_equals_non_streaming(server, greedy_reference):
    with httpx.stream("POST", f"{server.base_url}/v1/completions", timeout=60,
                      json={"model": MODEL_NAME, "prompt": PROMPTS[0], "max_tokens": 12,
                            "temperature": 0.0, "ignore_eos": True, "stream": True}) as r:
        assert r.status_code == 200
        lines = [line for line in r.iter_lines() if line]
    assert lines[-1] == "data: [DONE]"
    chunks = [json.loads(line[len("data: "):]) for line in lines[:-1]]
    assert "".join(c["choices"][0]["text"] for c in chunks) == greedy_reference[0]
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"


def test_openai_client_completions_and_chat(server, greedy_reference):
    openai = pytest.importorskip("openai")
    client = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="EMPTY", max_retries=0)
    assert [m.id for m in client.models.list().data] == [MODEL_NAME]
    out = client.completions.create(model=MODEL_NAME, prompt=PROMPTS[1], max_tokens=12,
                                    temperature=0.0, extra_body={"ignore_eos": True})
    assert out.choices[0].text == greedy_reference[1]
    stream = client.completions.create(model=MODEL_NAME, prompt=PROMPTS[1], max_tokens=12,
                                       temperature=0.0, stream=True,
                                       extra_body={"ignore_eos": True})
    assert "".join(chunk.choices[0].text for chunk in stream) == greedy_reference[1]
    chat = client.chat.completions.create(model=MODEL_NAME, max_tokens=6, temperature=0.0,
                                          messages=[{"role": "user", "content": "hi"}],
                                          extra_body={"ignore_eos": True})
    assert chat.choices[0].message.role == "assistant"
    assert chat.usage.completion_tokens == 6
    stream = client.chat.completions.create(model=MODEL_NAME, max_tokens=6, temperature=0.0,
                                            messages=[{"role": "user", "content": "hi"}],
                                            stream=True, extra_body={"ignore_eos": True})
    streamed = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    assert streamed == chat.choices[0].message.content
    with pytest.raises(openai.BadRequestError, match="max_model_len"):
        client.completions.create(model=MODEL_NAME, prompt="x" * (MAX_MODEL_LEN + 5), max_tokens=1)


def test_http_400_cases(server):
    r = completion(server, prompt="y" * (MAX_MODEL_LEN + 10), max_tokens=1)
    assert r.status_code == 400
    message = r.json()["error"]["message"]
    assert f"{MAX_MODEL_LEN + 10} tokens" in message and str(MAX_MODEL_LEN) in message
    for bad in ({"temperature": -0.5}, {"top_p": 1.5}, {"max_tokens": -3}, {"top_k": -7}):
        r = completion(server, prompt="hi", **bad)
        assert r.status_code == 400, (bad, r.text)
        assert next(iter(bad)) in r.json()["error"]["message"]


def test_200_concurrent_requests_none_lost(server):
    before = engine_state(server)["num_finished_requests"]

    async def run():
        limits = httpx.Limits(max_connections=200, max_keepalive_connections=200)
        async with httpx.AsyncClient(base_url=server.base_url, timeout=120, limits=limits) as c:
            async def one(i):
                return await c.post("/v1/completions", json={
                    "model": MODEL_NAME, "prompt": f"request number {i}:", "max_tokens": 3,
                    "temperature": 0.0, "ignore_eos": True})
            return await asyncio.gather(*(one(i) for i in range(200)))

    responses = asyncio.run(run())
    assert [r.status_code for r in responses] == [200] * 200
    assert all(r.json()["usage"]["completion_tokens"] == 3 for r in responses)
    assert len({r.json()["id"] for r in responses}) == 200
    state = wait_pool_free(server)
    assert state["num_finished_requests"] - before == 200


def test_abort_storm_frees_kv_pool_and_server_keeps_serving(server, greedy_reference):
    num_streams = 24

    async def storm():
        async with httpx.AsyncClient(base_url=server.base_url, timeout=60) as c:
            async def hang_up(i):
                async with c.stream("POST", "/v1/completions", json={
                        "model": MODEL_NAME, "prompt": f"long story {i}", "max_tokens": 200,
                        "temperature": 0.0, "ignore_eos": True, "stream": True}) as r:
                    assert r.status_code == 200
                    async for line in r.aiter_lines():
                        if line.startswith("data: {"):
                            return True  # got a token: leave mid-stream (closes the connection)
                return False
            return await asyncio.gather(*(hang_up(i) for i in range(num_streams)))

    assert all(asyncio.run(storm()))
    state = wait_pool_free(server)
    assert state["kv_cache_usage"] == 0.0
    metrics = httpx.get(f"{server.base_url}/metrics").text
    aborted = [line for line in metrics.splitlines() if line.startswith("vllm:request_aborted_total")]
    assert aborted and float(aborted[0].split()[-1]) >= num_streams
    assert httpx.get(f"{server.base_url}/health").status_code == 200
    r = completion(server, prompt=PROMPTS[2], max_tokens=12)
    assert r.status_code == 200 and r.json()["choices"][0]["text"] == greedy_reference[2]


def test_metrics_report_latency_and_acceptance(server):
    completion(server, prompt="metrics please", max_tokens=8)
    text = httpx.get(f"{server.base_url}/metrics").text
    for name in ("vllm:time_to_first_token_seconds_count", "vllm:request_time_per_output_token_seconds_count",
                 "vllm:kv_cache_usage_perc", "vllm:spec_decode_num_drafts_total",
                 "vllm:spec_decode_mean_acceptance_length", "vllm:request_success_total"):
        assert name in text, name
    mean_len = [line for line in text.splitlines()
                if line.startswith("vllm:spec_decode_mean_acceptance_length")]
    assert float(mean_len[0].split()[-1]) >= 1.0


def test_bench_serve_against_running_server(server, tmp_path, capsys):
    from vllm.entrypoints.cli.main import main

    out_json = tmp_path / "serve.json"
    with pytest.raises(SystemExit) as excinfo:
        main(["bench", "serve", "--backend", "vllm", "--base-url", server.base_url,
              "--dataset-name", "random", "--num-prompts", "6", "--random-input-len", "10",
              "--random-output-len", "6", "--max-concurrency", "3", "--ignore-eos",
              "--percentile-metrics", "ttft,tpot,itl,e2el", "--metric-percentiles", "50,99",
              "--save-result", "--result-dir", str(tmp_path / "results"),
              "--result-filename", "upstream.json", "--output-json", str(out_json)])
    assert excinfo.value.code == 0
    out = capsys.readouterr().out
    assert "TTFT" in out and "mean acceptance length" in out
    # Upstream's printed lines and JSON keys (vllm/benchmarks/serve.py), listed here by name.
    for label in ("Successful requests:", "Benchmark duration (s):", "Total input tokens:",
                  "Total generated tokens:", "Request throughput (req/s):",
                  "Output token throughput (tok/s):", "Total token throughput (tok/s):",
                  "Mean TTFT (ms):", "Median TTFT (ms):", "P99 TTFT (ms):", "P50 TPOT (ms):",
                  "Mean ITL (ms):", "Mean E2EL (ms):", "Acceptance rate (%):",
                  "Acceptance length:", "Drafts:", "Draft tokens:", "Accepted tokens:",
                  "Per-position acceptance (%):"):
        assert any(line.startswith(label) for line in out.splitlines()), label
    assert "{:<40} {:<10}".format("Successful requests:", 6) in out
    upstream = json.loads((tmp_path / "results" / "upstream.json").read_text())
    for key in ("date", "backend", "model_id", "tokenizer_id", "num_prompts", "request_rate",
                "burstiness", "max_concurrency", "duration", "completed", "failed",
                "total_input_tokens", "total_output_tokens", "request_throughput",
                "request_goodput", "output_throughput", "total_token_throughput", "input_lens",
                "output_lens", "ttfts", "itls", "generated_texts", "errors", "mean_ttft_ms",
                "median_ttft_ms", "std_ttft_ms", "p99_ttft_ms", "p50_tpot_ms", "mean_itl_ms",
                "mean_e2el_ms", "spec_decode_acceptance_rate", "spec_decode_acceptance_length",
                "spec_decode_num_drafts", "spec_decode_draft_tokens",
                "spec_decode_accepted_tokens", "spec_decode_per_position_acceptance_rates"):
        assert key in upstream, key
    assert upstream["completed"] == 6 and upstream["total_output_tokens"] == 36
    assert upstream["output_lens"] == [6] * 6 and len(upstream["itls"]) == 6
    assert upstream["mean_ttft_ms"] > 0 and upstream["spec_decode_acceptance_length"] >= 1.0
    result = json.loads(out_json.read_text())
    assert result["num_failed"] == 0 and result["num_requests"] == 6
    assert result["total_output_tokens"] == 6 * 6
    assert result["total_prompt_tokens"] == 6 * 10  # byte-level tokenizer: 1 char = 1 token
    assert 0 < result["ttft"]["mean_ms"] < 60_000 and result["tpot"]["mean_ms"] > 0
    spec = result["spec_decode"]
    assert spec["num_drafts"] > 0 and spec["mean_acceptance_length"] >= 1.0
