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
    (dict(logprobs=-1), "logprobs=-1"),
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
