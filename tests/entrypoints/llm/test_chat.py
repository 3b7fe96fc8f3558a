"""LLM.chat renders with the checkpoint's chat template exactly as Hugging Face's
apply_chat_template(messages, add_generation_prompt=True), and generates from those tokens."""
import pytest

from tests.utils.chat_checkpoint import MESSAGES, expected_prompt_ids, write_chat_checkpoint
from vllm import LLM, SamplingParams
from vllm.model_executor.models.tiny import write_tiny_models

GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)


@pytest.fixture(scope="module")
def chat_model(tmp_path_factory):
    return write_chat_checkpoint(write_tiny_models().target, str(tmp_path_factory.mktemp("chat")))


def test_llm_chat_uses_the_checkpoint_template(chat_model):
    text, ids = expected_prompt_ids(chat_model)
    assert text.startswith("<|bos|><|system|>") and ids[0] == 256 and ids.count(256) == 1  # one BOS
    with LLM(model=chat_model, device="cpu", max_model_len=128) as llm:
        out = llm.chat(MESSAGES, GREEDY, use_tqdm=False)[0]
        assert out.prompt_token_ids == ids
        plain = llm.generate([ids], GREEDY, use_tqdm=False)[0]
        assert out.outputs[0].token_ids == plain.outputs[0].token_ids
        # several conversations at once, and a per-call template override
        both = llm.chat([MESSAGES, MESSAGES[1:]], GREEDY, use_tqdm=False)
        assert [o.prompt_token_ids for o in both] == [ids, expected_prompt_ids(chat_model, MESSAGES[1:])[1]]
        custom = llm.chat(MESSAGES, GREEDY, use_tqdm=False,
                          chat_template="{% for m in messages %}{{ m['content'] }}|{% endfor %}")[0]
        assert custom.prompt_token_ids == list("Be terse.|Name a colour.|".encode())


def test_chat_template_flag_overrides(tmp_path, chat_model):
    template = tmp_path / "t.jinja"
    template.write_text("{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}{% endfor %}>>")
    with LLM(model=chat_model, device="cpu", max_model_len=128, chat_template=str(template)) as llm:
        out = llm.chat(MESSAGES, GREEDY, use_tqdm=False)[0]
        assert out.prompt_token_ids == list("<system>Be terse.<user>Name a colour.>>".encode())
