import pytest

from vllm.model_executor.models.tiny import write_byte_tokenizer
from vllm.transformers_utils.tokenizer import get_tokenizer
from vllm.v1.engine.detokenizer import IncrementalDetokenizer


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    d = tmp_path_factory.mktemp("bytetok")
    write_byte_tokenizer(str(d))
    return get_tokenizer(str(d))


def test_incremental_text_equals_full_decode_even_across_multibyte_chars(tokenizer):
    text = "héllo wörld — ✓ 日本語 🙂 done"
    ids = tokenizer.encode(text)
    assert len(ids) > len(text)  # multi-byte characters span several tokens
    detok = IncrementalDetokenizer(tokenizer, prompt_token_ids=tokenizer.encode("prompt: "))
    seen = []
    for i, t in enumerate(ids):
        detok.update([t])
        assert "\ufffd" not in detok.output_text  # never emits half a character
        seen.append(detok.output_text)
    assert detok.output_text == text
    assert seen == sorted(seen, key=len)  # text only grows
    # Feeding several tokens at once (a speculative burst) gives the same text.
    burst = IncrementalDetokenizer(tokenizer, prompt_token_ids=[])
    for k in range(0, len(ids), 3):
        burst.update(ids[k:k + 3])
    assert burst.output_text == text


@pytest.mark.parametrize("include", [False, True])
def test_stop_string_cuts_the_text(tokenizer, include):
    detok = IncrementalDetokenizer(tokenizer, [], stop=["STOP", "xyz"], include_stop_str_in_output=include)
    ids = tokenizer.encode("abc ST")
    assert detok.update(ids) is None
    matched = detok.update(tokenizer.encode("OP and more"))
    assert matched == "STOP"
    assert detok.output_text == ("abc STOP" if include else "abc ")
    assert detok.update(tokenizer.encode("xyz")) is None  # stopped: no further text
    assert detok.output_text == ("abc STOP" if include else "abc ")


def test_earliest_stop_string_wins(tokenizer):
    detok = IncrementalDetokenizer(tokenizer, [], stop=["later", "ear"])
    assert detok.update(tokenizer.encode("the earlier later")) == "ear"
    assert detok.output_text == "the "


def test_step_token_equals_update_one_token_at_a_time(tokenizer):
    """The engine's inlined path (step_token, no stop strings) against update(): the same text
    after every token, on random byte sequences with multi-byte characters and special ids."""
    import random
    rng = random.Random(5)
    pool = tokenizer.encode("héllo wörld — ✓ 日本語 🙂 ab") + list(range(0, 300, 7))
    for skip in (True, False):
        for _ in range(20):
            prompt = [rng.choice(pool) for _ in range(rng.randint(0, 8))]
            fast = IncrementalDetokenizer(tokenizer, prompt, skip_special_tokens=skip)
            plain = IncrementalDetokenizer(tokenizer, prompt, skip_special_tokens=skip)
            assert fast.step_token is not None  # a tokenizers-backed tokenizer, no stops
            for _ in range(rng.randint(1, 30)):
                token = rng.choice(pool)
                delta = fast.step_token(token)
                if delta:
                    fast.output_text += delta
                assert plain.update([token]) is None
                assert fast.output_text == plain.output_text
    assert IncrementalDetokenizer(tokenizer, [1], stop=["x"]).step_token is None
