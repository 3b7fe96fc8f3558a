import pytest

from vllm.outputs import CompletionOutput, RequestOutput
from vllm.sampling_params import SamplingParams


def test_defaults_and_normalisation():
    p = SamplingParams()
    assert (p.n, p.temperature, p.top_p, p.top_k, p.max_tokens, p.min_tokens) == (1, 1.0, 1.0, 0, 16, 0)
    assert p.stop == [] and p.stop_token_ids == [] and p.seed is None and not p.greedy
    assert SamplingParams(stop="###").stop == ["###"]
    assert SamplingParams(stop=("a", "b")).stop == ["a", "b"]
    assert SamplingParams(temperature=0).greedy and SamplingParams(temperature=1e-6).greedy
    assert not SamplingParams(temperature=1e-4).greedy
    assert not SamplingParams(top_k=-1).top_k_enabled and SamplingParams(top_k=5).top_k_enabled


@pytest.mark.parametrize("kwargs,needle", [
    (dict(n=0), "n=0"),
    (dict(temperature=-0.5), "temperature=-0.5"),
    (dict(temperature=float("nan")), "temperature=nan"),
    (dict(top_p=0.0), "top_p=0.0"),
    (dict(top_p=1.5), "top_p=1.5"),
    (dict(top_k=-2), "top_k=-2"),
    (dict(max_tokens=0), "max_tokens=0"),
    (dict(min_tokens=-1), "min_tokens=-1"),
    (dict(min_tokens=20, max_tokens=10), "min_tokens=20"),
    (dict(seed=1.5), "seed=1.5"),
    (dict(stop=[""]), "stop entry"),
    (dict(stop_token_ids=[-3]), "stop_token_ids entry -3"),
    (dict(logprobs=-2), "logprobs=-2"),
    (dict(prompt_logprobs=1.5), "prompt_logprobs=1.5"),
    (dict(presence_penalty=2.5), "presence_penalty=2.5"),
    (dict(frequency_penalty=float("nan")), "frequency_penalty=nan"),
    (dict(repetition_penalty=0.0), "repetition_penalty=0.0"),
    (dict(min_p=1.5), "min_p=1.5"),
    (dict(logit_bias={"x": 1}), "logit_bias="),
    (dict(logit_bias={3: float("inf")}), "logit_bias entry 3"),
    (dict(allowed_token_ids=[]), "at least one token id"),
    (dict(allowed_token_ids=[-1]), "allowed_token_ids entry -1"),
    (dict(bad_words=[" "]), "bad_words entry"),
    (dict(ignore_eos="yes"), "ignore_eos='yes'"),
    (dict(skip_special_tokens=None), "skip_special_tokens=None"),
])
def test_invalid_values_name_the_field(kwargs, needle):
    with pytest.raises(ValueError, match=needle.replace("(", r"\(").replace(".", r"\.")):
        SamplingParams(**kwargs)


def test_outputs():
    c = CompletionOutput(index=0, text="hi", token_ids=[1, 2], finish_reason=None)
    assert not c.finished and c.stop_reason is None
    r = RequestOutput(request_id="r", prompt="p", prompt_token_ids=[5], outputs=[c], finished=False,
                      metrics={"num_accepted_tokens": 3})
    assert r.outputs[0].token_ids == [1, 2] and r.metrics["num_accepted_tokens"] == 3


def test_upstream_sampling_fields():
    p = SamplingParams(logit_bias={"5": -100, 7: 2.5}, bad_words="foo", min_p=0.1,
                       presence_penalty=0.5, logprobs=-1, prompt_logprobs=0)
    assert p.logit_bias == {5: -100.0, 7: 2.5} and p.bad_words == ["foo"] and p.uses_penalties
    assert not SamplingParams().uses_penalties
    p.update_from_tokenizer(eos_token_id=2)
    assert p.all_stop_token_ids == {2}
    q = SamplingParams(stop_token_ids=[9], ignore_eos=True)
    q.update_from_tokenizer(eos_token_id=2)
    assert q.all_stop_token_ids == {9}
