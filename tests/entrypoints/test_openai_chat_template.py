"""`vllm serve` on a chat-templated tiny checkpoint: /v1/chat/completions renders exactly Hugging
Face's apply_chat_template(messages, add_generation_prompt=True) (prompt token count and greedy
reply equal plain greedy decoding of those tokens), and --chat-template FILE overrides it."""
import httpx
import pytest

from tests.utils.chat_checkpoint import MESSAGES, expected_prompt_ids, write_chat_checkpoint
from tests.utils.server_process import ServerProcess

pytestmark = pytest.mark.slow
MAX_TOKENS = 8


@pytest.fixture(scope="module")
def chat_model(tmp_path_factory):
    from vllm.model_executor.models.tiny import write_tiny_models
    return write_chat_checkpoint(write_tiny_models().target, str(tmp_path_factory.mktemp("chat")))


def _reference(model_dir, ids):
    from vllm import LLM, SamplingParams
    with LLM(model=model_dir, device="cpu", max_model_len=128) as llm:
        out = llm.generate([ids], SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True),
                           use_tqdm=False)[0]
        return out.outputs[0].text


def _chat(server, model):
    r = httpx.post(f"{server.base_url}/v1/chat/completions", timeout=60,
                   json={"model": model, "messages": MESSAGES, "max_tokens": MAX_TOKENS,
                         "temperature": 0.0, "ignore_eos": True})
    assert r.status_code == 200, r.text
    return r.json()


def test_server_renders_the_checkpoint_template(chat_model, tmp_path):
    _, ids = expected_prompt_ids(chat_model)
    expected = _reference(chat_model, ids)
    server = ServerProcess([chat_model, "--max-model-len", "128", "--device", "cpu",
                            "--served-model-name", "chat"], str(tmp_path / "serve.log"))
    try:
        body = _chat(server, "chat")
    finally:
        server.stop()
    assert body["usage"]["prompt_tokens"] == len(ids)
    assert body["choices"][0]["message"]["content"] == expected


def test_server_chat_template_flag(chat_model, tmp_path):
    template = tmp_path / "t.jinja"
    template.write_text("{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}{% endfor %}>>")
    ids = list("<system>Be terse.<user>Name a colour.>>".encode())
    expected = _reference(chat_model, ids)
    server = ServerProcess([chat_model, "--max-model-len", "128", "--device", "cpu", "--served-model-name",
                            "chat", "--chat-template", str(template)], str(tmp_path / "serve.log"))
    try:
        body = _chat(server, "chat")
    finally:
        server.stop()
    assert body["usage"]["prompt_tokens"] == len(ids)
    assert body["choices"][0]["message"]["content"] == expected
