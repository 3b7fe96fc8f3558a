"""In-process checks of the server's guards (fake engine): body-size limit for declared and
chunked bodies, tokenization off the event-loop thread, OpenAI-shaped 500 for bugs."""
import asyncio
import threading

import httpx

from tests.utils.fake_engine import FakeEngine, FakeTokenizer
from vllm.entrypoints.openai.api_server import build_app
from vllm.v1.engine.async_llm import AsyncLLM

LIMIT = 1000


class SpyTokenizer(FakeTokenizer):
    def __init__(self):
        self.threads = []

    def encode(self, text):
        self.threads.append(threading.current_thread().name)
        return super().encode(text)


def make(tokenizer=None):
    llm = AsyncLLM(FakeEngine(max_model_len=64), model_name="fake", max_model_len=64)
    return llm, build_app(llm, tokenizer=tokenizer or FakeTokenizer(),
                          max_request_body_size=LIMIT)


def call(app, method, path, **kwargs):
    async def go():
        transport = httpx.ASGITransport(app=app, raise_app_exceptions=False)
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
            return await client.request(method, path, **kwargs)
    return asyncio.run(go())


def check_413(r):
    assert r.status_code == 413, r.text
    error = r.json()["error"]
    assert error["code"] == 413 and str(LIMIT) in error["message"]


def test_declared_body_above_limit_is_413():
    llm, app = make()
    try:
        check_413(call(app, "POST", "/v1/completions", json={"prompt": "x" * 2 * LIMIT}))
        ok = call(app, "POST", "/v1/completions", json={"prompt": "abc", "max_tokens": 2})
        assert ok.status_code == 200
    finally:
        llm.shutdown()


def test_chunked_body_above_limit_is_413():
    llm, app = make()

    async def chunks():
        yield b'{"prompt": "'
        for _ in range(10):
            yield b"x" * 200
        yield b'"}'

    try:
        check_413(call(app, "POST", "/v1/completions", content=chunks(),
                       headers={"content-type": "application/json"}))
    finally:
        llm.shutdown()


def test_tokenization_runs_off_the_event_loop_thread():
    tokenizer = SpyTokenizer()
    llm, app = make(tokenizer)
    try:
        r = call(app, "POST", "/v1/completions", json={"prompt": "abc", "max_tokens": 2})
        assert r.status_code == 200
        assert tokenizer.threads and all(name.startswith("vllm-tokenizer")
                                         for name in tokenizer.threads), tokenizer.threads
    finally:
        llm.shutdown()


def test_unexpected_exception_is_openai_shaped_500(monkeypatch):
    llm, app = make()

    def broken(self, request):
        raise KeyError("bug")

    monkeypatch.setattr("vllm.entrypoints.openai.serving.OpenAIServing.detokenize", broken)
    try:
        r = call(app, "POST", "/detokenize", json={"tokens": [1]})
        assert r.status_code == 500
        assert r.json()["error"]["type"] == "InternalServerError"
        assert "KeyError" in r.json()["error"]["message"]
    finally:
        llm.shutdown()
