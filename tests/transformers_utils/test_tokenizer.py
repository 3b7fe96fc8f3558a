"""Tokenizers from local directories: Kimi-style tiktoken.model rebuilt with `tokenizers` (checked
against a brute-force tiktoken encoder on a self-made vocabulary), special/added tokens, chat
templates (tokenizer_config.json, chat_template.jinja, --chat-template), trust_remote_code,
--tokenizer, DecodeStream detokenization, one-line errors for corrupt files."""
import json
import os
import random
import shutil

import pytest

from tests.utils.tiktoken_oracle import tiktoken_encode, train_ranks, write_kimi_style_tokenizer
from vllm.model_executor.models.tiny import write_byte_tokenizer
from vllm.transformers_utils.tiktoken_bpe import KIMI_PAT_STR, load_tiktoken_ranks
from vllm.transformers_utils.tokenizer import get_tokenizer
from vllm.v1.engine.detokenizer import IncrementalDetokenizer

TEXTS = ["the quick brown fox", "The dog's bark; they're here, WE'VE seen it.", "1234567 numbers 89",
         "你好世界，你好朋友。", "mixed 中文and English", "line\n\nnew  spaces\ttab", "ünïcödé café — 🙂🙂",
         "HTTPServer camelCase", "   ", "", "a<|im_end|>b", "[BOS]hello[EOS]"]


@pytest.fixture(scope="module")
def kimi(tmp_path_factory):
    d = str(tmp_path_factory.mktemp("kimi"))
    ranks = train_ranks()
    specials = write_kimi_style_tokenizer(d, ranks)
    return d, ranks, specials


def _random_texts(n=200):
    rng = random.Random(0)
    alphabet = list("abcdeHTW xyz'.,;:!?0123456789\n\t ") + ["你", "好", "世", "界", "é", "ü", "🙂", "—", "'s", "'re"]
    return ["".join(rng.choice(alphabet) for _ in range(rng.randint(1, 40))) for _ in range(n)]


def test_tiktoken_tokenizer_equals_brute_force_tiktoken(kimi):
    d, ranks, specials = kimi
    assert load_tiktoken_ranks(os.path.join(d, "tiktoken.model")) == ranks
    tok = get_tokenizer(d)  # no tokenizer.json, an auto_map: still loads without remote code
    assert len(ranks) > 300  # merges really happened
    for text in TEXTS + _random_texts():
        want = tiktoken_encode(text, ranks, KIMI_PAT_STR, specials)
        assert tok.encode(text, add_special_tokens=False) == want, text
        assert tok.decode(want, skip_special_tokens=False) == text


def test_kimi_split_pattern_separates_han(kimi):
    d, ranks, specials = kimi
    tok = get_tokenizer(d)
    pieces = tok.backend.pre_tokenizer.pre_tokenize_str("你好world HTTPServer")
    b2u_text = [p for p, _ in pieces]
    assert len(b2u_text) == 3  # 你好 | world | ĠHTTPServer (Han run split from Latin)


def test_tiktoken_special_tokens_and_reserved_ids(kimi):
    d, ranks, specials = kimi
    tok = get_tokenizer(d)
    base = len(ranks)
    assert tok.bos_token_id == specials["[BOS]"] == base and tok.eos_token_id == specials["[EOS]"]
    assert len(tok) == base + 256  # Kimi's 256 reserved special ids, unnamed ones filled in
    assert tok.convert_ids_to_tokens([base + 100]) == [f"<|reserved_token_{base + 100}|>"]
    ids = tok.encode("hi<|im_end|>", add_special_tokens=False)
    assert ids[-1] == specials["<|im_end|>"]
    assert tok.decode(ids) == "hi" and tok.decode(ids, skip_special_tokens=False) == "hi<|im_end|>"


def test_decode_stream_detokenization_matches_full_decode(kimi):
    d, _, _ = kimi
    tok = get_tokenizer(d)
    text = "héllo 你好 wörld 🙂 done"
    ids = tok.encode(text, add_special_tokens=False)
    detok = IncrementalDetokenizer(tok, prompt_token_ids=tok.encode("prompt: ", add_special_tokens=False))
    assert detok._stream is not None  # the tokenizers DecodeStream path
    for t in ids:
        detok.update([t])
        assert "\ufffd" not in detok.output_text
    assert detok.output_text == text


def write_byte_tokenizer_dir(path) -> None:
    os.makedirs(path, exist_ok=True)
    write_byte_tokenizer(str(path))


TEMPLATE = ("{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}<|eos|>{% endfor %}"
            "{% if add_generation_prompt %}<|assistant|>{% endif %}")
MESSAGES = [{"role": "system", "content": "Be terse."}, {"role": "user", "content": "Hi!"}]


def test_chat_template_sources_and_override(tmp_path):
    from vllm.entrypoints.openai.chat_template import apply_chat_template
    a = tmp_path / "in_config"
    write_byte_tokenizer_dir(a)
    cfg = json.loads((a / "tokenizer_config.json").read_text())
    (a / "tokenizer_config.json").write_text(json.dumps({**cfg, "chat_template": TEMPLATE}))
    tok = get_tokenizer(str(a))
    want = "<|bos|><|system|>Be terse.<|eos|><|user|>Hi!<|eos|><|assistant|>"
    assert apply_chat_template(tok, MESSAGES) == want == tok.hf.apply_chat_template(
        MESSAGES, tokenize=False, add_generation_prompt=True)
    b = tmp_path / "jinja_file"
    write_byte_tokenizer_dir(b)
    (b / "chat_template.jinja").write_text(TEMPLATE.replace("<|assistant|>", "A:"))
    assert apply_chat_template(get_tokenizer(str(b)), MESSAGES).endswith("<|eos|>A:")
    override = tmp_path / "override.jinja"
    override.write_text("{% for m in messages %}[{{ m['content'] }}]{% endfor %}")
    assert apply_chat_template(get_tokenizer(str(a), chat_template=str(override)), MESSAGES) == "[Be terse.][Hi!]"
    plain = tmp_path / "plain"
    write_byte_tokenizer_dir(plain)
    assert apply_chat_template(get_tokenizer(str(plain)), MESSAGES) == "System: Be terse.\nUser: Hi!\nAssistant:"
    with pytest.raises(ValueError, match="neither an existing file nor a Jinja template"):
        get_tokenizer(str(a), chat_template=str(tmp_path / "missing.jinja"))


def test_remote_code_needs_the_flag_and_corrupt_config_is_one_line(tmp_path):
    d = tmp_path / "remote"
    write_byte_tokenizer_dir(d)
    cfg = json.loads((d / "tokenizer_config.json").read_text())
    cfg["auto_map"] = {"AutoTokenizer": ["tokenization_custom.CustomTokenizer", None]}
    cfg["tokenizer_class"] = "CustomTokenizer"
    (d / "tokenizer_config.json").write_text(json.dumps(cfg))
    os.remove(d / "tokenizer.json")
    (d / "tokenization_custom.py").write_text("raise RuntimeError('remote code ran')\n")
    with pytest.raises(ValueError, match="pass --trust-remote-code"):
        get_tokenizer(str(d))
    bad = tmp_path / "corrupt"
    write_byte_tokenizer_dir(bad)
    (bad / "tokenizer_config.json").write_text('{"bos_token": ')
    with pytest.raises(ValueError, match=r"tokenizer_config.json is not valid JSON: .* line 1 column") as info:
        get_tokenizer(str(bad))
    assert "\n" not in str(info.value)


def test_engine_honours_tokenizer_flag(tmp_path):
    """--tokenizer: the engine tokenizes with that directory, not the model's."""
    from vllm.engine.arg_utils import EngineArgs
    from vllm.model_executor.models.tiny import write_tiny_models
    from vllm.v1.engine.llm_engine import LLMEngine
    tiny = write_tiny_models()
    model = tmp_path / "model"
    shutil.copytree(tiny.target, model)
    os.remove(model / "tokenizer.json")  # the model directory alone has no usable tokenizer
    os.remove(model / "tokenizer_config.json")
    with pytest.raises(ValueError, match="no tokenizer in"):
        LLMEngine.from_engine_args(EngineArgs(model=str(model), device="cpu", max_model_len=64))
    engine = LLMEngine.from_engine_args(EngineArgs(model=str(model), tokenizer=tiny.target, device="cpu",
                                                   max_model_len=64))
    try:
        assert engine.tokenizer.source == tiny.target
        assert engine.tokenizer.encode("ab") == [97, 98]
    finally:
        engine.shutdown()
