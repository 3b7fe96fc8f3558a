"""A realistic vLLM launch line, unchanged, on the tiny model (CPU), driven by the real `openai`
client:

    vllm serve MODEL -tp 2 -dcp 2 --dcp-kv-cache-interleave-size 1 --gpu-memory-utilization 0.85
        --max-model-len 4k --served-model-name a b
        --speculative-config '{"method":"dspark","model":DIR,"num_speculative_tokens":4}'
        --api-key K --enforce-eager

(`--max-model-len 4k` = 4000: the tiny model's max_position_embeddings is 4096, so upstream
would refuse 32k; that refusal and the 32k / 32K / auto parsing are checked in
tests/entrypoints/test_arg_utils.py.)

Oracles: an in-process plain engine (TP=1, no speculation) on the same checkpoint gives the
greedy texts, the greedy-with-penalties texts and the logprobs the server must reproduce (its own
logprobs are checked against Hugging Face log_softmax in tests/v1/engine/test_sampling_features.py).
One server for the whole module.
"""
import json
import math

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.utils.server_process import ServerProcess

pytestmark = pytest.mark.slow

API_KEY = "K-test-secret"
PROMPT = "The capital of France is"
MAX_TOKENS = 10
PENALTIES = dict(presence_penalty=1.5, frequency_penalty=1.0, repetition_penalty=1.3)


@pytest.fixture(scope="module")
def tiny():
    from vllm.model_executor.models.tiny import write_tiny_models
    return write_tiny_models()


@pytest.fixture(scope="module")
def server(tiny, tmp_path_factory):
    spec = json.dumps({"method": "dspark", "model": str(tiny.dspark), "num_speculative_tokens": 4})
    args = [str(tiny.target), "-tp", "2", "-dcp", "2", "--dcp-kv-cache-interleave-size", "1",
            "--gpu-memory-utilization", "0.85", "--max-model-len", "4k",
            "--served-model-name", "a", "b", "--speculative-config", spec,
            "--api-key", API_KEY, "--enforce-eager", "--device", "cpu"]
    proc = ServerProcess(args, str(tmp_path_factory.mktemp("logs") / "serve.log"),
                         startup_timeout=600, env={"VLLM_LOG_STATS_INTERVAL": "1"})
    yield proc
    proc.stop()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server.base_url}/v1", api_key=API_KEY, max_retries=0,
                         timeout=300)


@pytest.fixture(scope="module")
def reference(tiny):
    """Plain engine (no speculation, TP=1): what the server must reproduce."""
    from vllm import SamplingParams
    from vllm.engine.arg_utils import EngineArgs
    from vllm.v1.engine.llm_engine import LLMEngine

    engine = LLMEngine.from_engine_args(EngineArgs(model=str(tiny.target), max_model_len=4000,
                                                   device="cpu"))
    cases = {
        "greedy": SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True,
                                 logprobs=2),
        "penalties": SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True,
                                    logit_bias={65: 6.0}, **PENALTIES),
    }
    try:
        for name, params in cases.items():
            engine.add_request(name, PROMPT, params)
        finals = {}
        while engine.has_unfinished_requests():
            for out in engine.step():
                if out.finished:
                    finals[out.request_id] = out.outputs[0]
        return finals
    finally:
        engine.shutdown()


def test_401_without_the_key(server):
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": API_KEY}):
        r = httpx.get(f"{server.base_url}/v1/models", headers=headers)
        assert r.status_code == 401, (headers, r.text)
        assert r.json()["error"]["code"] == 401
    r = httpx.post(f"{server.base_url}/v1/completions", json={"model": "a", "prompt": "x"})
    assert r.status_code == 401
    bad = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad.completions.create(model="a", prompt="x", max_tokens=1)
    # Non-/v1 routes stay open (health checks, scrapers).
    assert httpx.get(f"{server.base_url}/health").status_code == 200
    assert httpx.get(f"{server.base_url}/ping").status_code == 200


def test_models_and_both_served_names(client, reference):
    ids = [m.id for m in client.models.list().data]
    assert ids == ["a", "b"]
    for name in ("a", "b"):
        out = client.completions.create(model=name, prompt=PROMPT, max_tokens=MAX_TOKENS,
                                        temperature=0.0, extra_body={"ignore_eos": True})
        assert out.choices[0].text == reference["greedy"].text
        assert out.choices[0].finish_reason == "length"
        assert out.system_fingerprint


def test_completion_logprobs_equal_the_plain_engine(client, reference):
    # Byte-level tokens often decode to the same "\ufffd": ask for "token_id:N" keys (upstream's
    # return_tokens_as_token_ids) so every top-k entry stays distinct.
    out = client.completions.create(model="a", prompt=PROMPT, max_tokens=MAX_TOKENS,
                                    temperature=0.0, logprobs=2,
                                    extra_body={"ignore_eos": True,
                                                "return_tokens_as_token_ids": True})
    lp = out.choices[0].logprobs
    ref = reference["greedy"]
    assert len(lp.token_logprobs) == len(ref.token_ids) == MAX_TOKENS
    for j, token in enumerate(ref.token_ids):
        assert lp.tokens[j] == f"token_id:{token}"
        assert math.isclose(lp.token_logprobs[j], ref.logprobs[j][token].logprob, abs_tol=1e-3)
        expected = {f"token_id:{t}": e.logprob for t, e in ref.logprobs[j].items()}
        assert set(lp.top_logprobs[j]) == set(expected) and 2 <= len(expected) <= 3
        for key, value in expected.items():
            assert math.isclose(lp.top_logprobs[j][key], value, abs_tol=1e-3)


def test_echo_and_prompt_logprobs(client, server):
    out = client.completions.create(model="a", prompt=PROMPT, max_tokens=3, temperature=0.0,
                                    echo=True, logprobs=1,
                                    extra_body={"return_tokens_as_token_ids": True,
                                                "prompt_logprobs": 1})
    choice = out.choices[0]
    prompt_ids = httpx.post(f"{server.base_url}/tokenize", json={"prompt": PROMPT},
                            headers={"Authorization": f"Bearer {API_KEY}"}).json()["tokens"]
    assert choice.text.startswith(PROMPT)
    lp = choice.logprobs
    assert lp.tokens[:len(prompt_ids)] == [f"token_id:{t}" for t in prompt_ids]
    assert lp.token_logprobs[0] is None and len(lp.tokens) == len(prompt_ids) + 3
    prompt_lps = choice.model_extra["prompt_logprobs"]
    assert prompt_lps[0] is None and len(prompt_lps) == len(prompt_ids)
    for j in range(1, len(prompt_ids)):
        entry = prompt_lps[j][str(prompt_ids[j])]
        assert math.isclose(entry["logprob"], lp.token_logprobs[j], abs_tol=1e-6)


def test_penalties_under_speculation_equal_plain_greedy(client, reference):
    out = client.completions.create(model="a", prompt=PROMPT, max_tokens=MAX_TOKENS,
                                    temperature=0.0, presence_penalty=1.5, frequency_penalty=1.0,
                                    logit_bias={"65": 6.0},
                                    extra_body={"ignore_eos": True, "repetition_penalty": 1.3})
    assert out.choices[0].text == reference["penalties"].text
    assert out.choices[0].text != reference["greedy"].text


def test_n2_seeded_reproducible_and_distinct(client):
    kwargs = dict(model="a", prompt=PROMPT, max_tokens=MAX_TOKENS, temperature=1.0, seed=123, n=2,
                  extra_body={"ignore_eos": True})
    first = client.completions.create(**kwargs)
    second = client.completions.create(**kwargs)
    texts = [c.text for c in sorted(first.choices, key=lambda c: c.index)]
    assert [c.index for c in sorted(first.choices, key=lambda c: c.index)] == [0, 1]
    assert texts == [c.text for c in sorted(second.choices, key=lambda c: c.index)]
    assert texts[0] != texts[1]
    assert first.usage.completion_tokens == 2 * MAX_TOKENS


def test_streaming_completion_and_stop_reason(client, reference):
    chunks = list(client.completions.create(model="a", prompt=PROMPT, max_tokens=MAX_TOKENS,
                                            temperature=0.0, stream=True,
                                            extra_body={"ignore_eos": True}))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == reference["greedy"].text
    stop = reference["greedy"].text[3:5]
    out = client.completions.create(model="a", prompt=PROMPT, max_tokens=MAX_TOKENS,
                                    temperature=0.0, stop=[stop])
    assert out.choices[0].finish_reason == "stop"
    assert out.choices[0].model_extra["stop_reason"] == stop


def test_chat_streaming_and_not_with_logprobs_and_n(client):
    messages = [{"role": "user", "content": "Say something."}]
    out = client.chat.completions.create(model="b", messages=messages, max_completion_tokens=8,
                                         temperature=0.0, logprobs=True, top_logprobs=2)
    choice = out.choices[0]
    assert choice.message.role == "assistant" and choice.finish_reason in ("stop", "length")
    assert len(choice.logprobs.content) == out.usage.completion_tokens
    assert all(len(c.top_logprobs) == 2 for c in choice.logprobs.content)
    stream = client.chat.completions.create(model="b", messages=messages,
                                            max_completion_tokens=8, temperature=0.0,
                                            stream=True)
    text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    assert text == choice.message.content
    two = client.chat.completions.create(model="b", messages=messages, max_completion_tokens=8,
                                         temperature=1.0, seed=5, n=2)
    assert sorted(c.index for c in two.choices) == [0, 1]
    # Streaming n=2 with the same seed: per-choice deltas rebuild the same two texts.
    texts = {0: "", 1: ""}
    for chunk in client.chat.completions.create(model="b", messages=messages,
                                                max_completion_tokens=8, temperature=1.0,
                                                seed=5, n=2, stream=True):
        for c in chunk.choices:
            texts[c.index] += c.delta.content or ""
    assert texts == {c.index: c.message.content for c in two.choices}


def test_tokenize_detokenize(server):
    headers = {"Authorization": f"Bearer {API_KEY}"}
    r = httpx.post(f"{server.base_url}/tokenize", json={"model": "a", "prompt": PROMPT},
                   headers=headers)
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["count"] == len(body["tokens"]) and body["max_model_len"] == 4000
    r = httpx.post(f"{server.base_url}/detokenize", json={"model": "a", "tokens": body["tokens"]},
                   headers=headers)
    assert r.status_code == 200 and PROMPT in r.json()["prompt"]


# Upstream vLLM metric names (vllm/v1/metrics/loggers.py PrometheusStatLogger), as exposed.
UPSTREAM_METRICS = [
    "vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc",
    "vllm:num_preemptions_total", "vllm:prompt_tokens_total", "vllm:generation_tokens_total",
    "vllm:request_success_total", "vllm:iteration_tokens_total_bucket",
    "vllm:time_to_first_token_seconds_bucket", "vllm:inter_token_latency_seconds_bucket",
    "vllm:request_time_per_output_token_seconds_bucket", "vllm:e2e_request_latency_seconds_bucket",
    "vllm:request_queue_time_seconds_bucket", "vllm:request_prefill_time_seconds_bucket",
    "vllm:request_decode_time_seconds_bucket", "vllm:request_inference_time_seconds_bucket",
    "vllm:request_prompt_tokens_bucket", "vllm:request_generation_tokens_bucket",
    "vllm:spec_decode_num_drafts_total", "vllm:spec_decode_num_draft_tokens_total",
    "vllm:spec_decode_num_accepted_tokens_total",
    "vllm:spec_decode_num_accepted_tokens_per_pos_total",
]


def test_metrics_upstream_names_and_labels(client, server):
    client.completions.create(model="a", prompt=PROMPT, max_tokens=4)
    text = httpx.get(f"{server.base_url}/metrics").text
    samples = [s for f in text_string_to_metric_families(text) for s in f.samples
               if s.name.startswith("vllm:")]
    names = {s.name for s in samples}
    missing = [n for n in UPSTREAM_METRICS if n not in names]
    assert not missing, missing
    assert not [n for n in names if n.endswith("_created")]
    for sample in samples:
        assert sample.labels.get("model_name") == "a" and sample.labels.get("engine") == "0", sample
    value = {s.name: s.value for s in samples if s.name == "vllm:spec_decode_num_drafts_total"}
    assert value["vllm:spec_decode_num_drafts_total"] > 0


def test_access_and_periodic_stat_log_lines(client, server):
    import time
    client.completions.create(model="a", prompt=PROMPT, max_tokens=6)
    deadline = time.time() + 30
    while time.time() < deadline and "SpecDecoding metrics:" not in server.log():
        client.completions.create(model="a", prompt=PROMPT, max_tokens=6)
        time.sleep(0.5)
    log = server.log()
    assert '"POST /v1/completions HTTP/1.1" 200' in log
    assert "Engine 000: Avg prompt throughput:" in log and "GPU KV cache usage:" in log
    assert "SpecDecoding metrics: Mean acceptance length:" in log
    assert "Per-position acceptance rate:" in log
