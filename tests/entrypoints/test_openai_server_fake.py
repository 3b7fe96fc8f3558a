"""The OpenAI app in-process on a fake engine: response shapes, SSE framing, HTTP errors, metrics.

Expected texts come from fake_engine.expected_text (an independent formula), not from the server.
"""
import asyncio
import json

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.utils.fake_engine import FakeEngine, FakeTokenizer, expected_text
from vllm.entrypoints.openai.api_server import build_app
from vllm.entrypoints.openai.chat_template import render_role_prefixed
from vllm.v1.engine.async_llm import AsyncLLM

MAX_MODEL_LEN = 64


def serve(engine=None):
    engine = engine or FakeEngine(max_model_len=MAX_MODEL_LEN)
    llm = AsyncLLM(engine, model_name="fake", max_model_len=MAX_MODEL_LEN)
    return engine, llm, build_app(llm, tokenizer=FakeTokenizer(), model_aliases=("/models/fake",))


def call(app, method, path, **kwargs):
    async def go():
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
            return await client.request(method, path, **kwargs)
    return asyncio.run(go())


def sse_events(text):
    events = [line[len("data: "):] for line in text.split("\n\n") if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    return [json.loads(e) for e in events[:-1]]


@pytest.fixture
def app():
    engine, llm, app = serve()
    yield app
    llm.shutdown()


def test_completion_non_streaming(app):
    r = call(app, "POST", "/v1/completions", json={"model": "fake", "prompt": "hey", "max_tokens": 5})
    assert r.status_code == 200, r.text
    body = r.json()
    prompt_ids = FakeTokenizer().encode("hey")
    assert body["object"] == "text_completion"
    assert body["choices"][0]["text"] == expected_text(prompt_ids, 5)
    assert body["choices"][0]["finish_reason"] == "length"
    assert body["usage"] == {"prompt_tokens": 3, "completion_tokens": 5, "total_tokens": 8}


def test_completion_batch_prompts_and_alias(app):
    r = call(app, "POST", "/v1/completions",
             json={"model": "/models/fake", "prompt": [[1, 2], [7]], "max_tokens": 3})
    assert r.status_code == 200, r.text
    choices = sorted(r.json()["choices"], key=lambda c: c["index"])
    assert [c["text"] for c in choices] == [expected_text([1, 2], 3), expected_text([7], 3)]


def test_completion_streaming_deltas_concatenate(app):
    r = call(app, "POST", "/v1/completions",
             json={"model": "fake", "prompt": [3], "max_tokens": 6, "stream": True,
                   "stream_options": {"include_usage": True}})
    assert r.status_code == 200
    assert r.headers["content-type"].startswith("text/event-stream")
    events = sse_events(r.text)
    text = "".join(c["text"] for e in events for c in e["choices"])
    assert text == expected_text([3], 6)
    assert len([e for e in events if e["choices"]]) == 6  # one token per fake step
    assert events[-2]["choices"][0]["finish_reason"] == "length"
    assert events[-1]["usage"]["completion_tokens"] == 6


def test_chat_non_streaming_and_streaming(app):
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    prompt_ids = FakeTokenizer().encode(render_role_prefixed(messages))
    r = call(app, "POST", "/v1/chat/completions",
             json={"model": "fake", "messages": messages, "max_tokens": 4})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["object"] == "chat.completion"
    assert body["choices"][0]["message"] == {"role": "assistant",
                                             "content": expected_text(prompt_ids, 4)}
    assert body["usage"]["prompt_tokens"] == len(prompt_ids)
    r = call(app, "POST", "/v1/chat/completions",
             json={"model": "fake", "messages": messages, "max_tokens": 4, "stream": True})
    events = sse_events(r.text)
    assert events[0]["choices"][0]["delta"]["role"] == "assistant"
    text = "".join(e["choices"][0]["delta"].get("content", "") for e in events)
    assert text == expected_text(prompt_ids, 4)
    assert events[-1]["choices"][0]["finish_reason"] == "length"


def test_role_prefixed_template_is_documented_format():
    text = render_role_prefixed([{"role": "system", "content": "S"}, {"role": "user", "content": "U"},
                                 {"role": "assistant", "content": "A"},
                                 {"role": "user", "content": [{"type": "text", "text": "V"}]}])
    assert text == "System: S\nUser: U\nAssistant: A\nUser: V\nAssistant:"


@pytest.mark.parametrize("body, status, needle", [
    ({"prompt": "x" * MAX_MODEL_LEN, "max_tokens": 1}, 400, f"has {MAX_MODEL_LEN} tokens"),
    ({"prompt": "x" * 60, "max_tokens": 10}, 400, "70 tokens (60 in the prompt, 10 in the completion)"),
    ({"prompt": "x", "temperature": -1}, 400, "temperature"),
    ({"prompt": "x", "top_p": 0}, 400, "top_p"),
    ({"prompt": "x", "max_tokens": 0}, 400, "max_tokens"),
    ({"prompt": "x", "n": 0}, 400, "n=0"),
    ({"prompt": "x", "best_of": 3}, 400, "best_of=3"),
    ({"prompt": "x", "response_format": {"type": "json_object"}}, 400, "json_object"),
    ({"prompt": "x", "max_tokens": "lots"}, 400, "max_tokens"),
    ({"max_tokens": 3}, 400, "prompt"),
    ({"prompt": ""}, 400, "empty"),
    ({"prompt": "x", "model": "gpt-9"}, 404, "gpt-9"),
])
def test_completion_errors_use_openai_shape(app, body, status, needle):
    r = call(app, "POST", "/v1/completions", json={"model": "fake", **body})
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["code"] == status
    assert needle in error["message"]


def test_too_long_prompt_message_states_length_and_limit(app):
    r = call(app, "POST", "/v1/completions", json={"prompt": list(range(1, 71)), "stream": True})
    assert r.status_code == 400
    msg = r.json()["error"]["message"]
    assert "70 tokens" in msg and f"max_model_len) is {MAX_MODEL_LEN}" in msg


def test_chat_rejects_unknown_role_and_non_text_parts(app):
    r = call(app, "POST", "/v1/chat/completions",
             json={"messages": [{"role": "wizard", "content": "hi"}]})
    assert r.status_code == 400 and "wizard" in r.json()["error"]["message"]
    r = call(app, "POST", "/v1/chat/completions",
             json={"messages": [{"role": "user", "content": [{"type": "image_url"}]}]})
    assert r.status_code == 400 and "image_url" in r.json()["error"]["message"]


def test_models_health_metrics(app):
    r = call(app, "GET", "/v1/models")
    assert r.json()["data"][0]["id"] == "fake"
    assert r.json()["data"][0]["max_model_len"] == MAX_MODEL_LEN
    assert call(app, "GET", "/health").status_code == 200
    call(app, "POST", "/v1/completions", json={"prompt": "abc", "max_tokens": 4})
    text = call(app, "GET", "/metrics").text
    samples = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            labels = dict(sample.labels)
            assert labels.pop("model_name") == "fake" and labels.pop("engine") == "0", sample
            samples[(sample.name, tuple(sorted(labels.items())))] = sample.value
    assert samples[("vllm:request_success_total", (("finished_reason", "length"),))] == 1.0
    assert samples[("vllm:generation_tokens_total", ())] == 4.0
    assert samples[("vllm:time_to_first_token_seconds_count", ())] == 1.0
    assert samples[("vllm:request_time_per_output_token_seconds_count", ())] == 1.0
    assert samples[("vllm:kv_cache_usage_perc", ())] == 0.0
    # the fake engine reports 4 drafts with 6 accepted tokens: 1 + 6/4
    assert samples[("vllm:spec_decode_mean_acceptance_length", ())] == 2.5
    assert samples[("vllm:spec_decode_num_accepted_tokens_per_pos_total",
                    (("position", "2"),))] == 1.0
    assert not [name for name, _ in samples if name.endswith("_created")]


def test_engine_crash_gives_500_and_unhealthy():
    engine, llm, app = serve(FakeEngine(max_model_len=MAX_MODEL_LEN, fail_after_steps=1))
    try:
        r = call(app, "POST", "/v1/completions", json={"prompt": "abc", "max_tokens": 10})
        assert r.status_code == 500
        assert "simulated device failure" in r.json()["error"]["message"]
        health = call(app, "GET", "/health")
        assert health.status_code == 503
        assert "simulated device failure" in health.json()["error"]["message"]
        r = call(app, "POST", "/v1/completions", json={"prompt": "abc", "max_tokens": 1})
        assert r.status_code == 500
    finally:
        llm.shutdown()
