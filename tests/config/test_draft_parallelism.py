"""speculative_config draft_tensor_parallel_size / draft_decode_context_parallel_size: defaults,
allowed values and one-line refusals naming the value and the fix."""
import pytest

from vllm.config import ParallelConfig, SpeculativeConfig, VllmConfig


def _config(tp=2, dcp=2, **spec):
    return VllmConfig(parallel_config=ParallelConfig(tensor_parallel_size=tp,
                                                     decode_context_parallel_size=dcp),
                      speculative_config=SpeculativeConfig(method="eagle",
                                                           num_speculative_tokens=2, **spec))


def test_defaults_are_the_targets():
    spec = _config(tp=4, dcp=2).speculative_config
    assert spec.draft_tensor_parallel_size == 4
    assert spec.draft_decode_context_parallel_size == 2


@pytest.mark.parametrize("draft_dcp", [1, 2])
def test_draft_dcp_one_or_the_targets(draft_dcp):
    spec = _config(draft_decode_context_parallel_size=draft_dcp).speculative_config
    assert spec.draft_decode_context_parallel_size == draft_dcp


def test_json_keys_reach_the_config():
    cfg = VllmConfig(parallel_config=ParallelConfig(tensor_parallel_size=2,
                                                    decode_context_parallel_size=2),
                     speculative_config='{"method": "dspark", "num_speculative_tokens": 2, '
                                        '"draft_decode_context_parallel_size": 1, '
                                        '"draft_tensor_parallel_size": 2}')
    assert cfg.speculative_config.draft_decode_context_parallel_size == 1
    assert cfg.speculative_config.draft_tensor_parallel_size == 2


@pytest.mark.parametrize("kwargs,parts", [
    (dict(tp=4, dcp=4, draft_decode_context_parallel_size=2),
     ["draft_decode_context_parallel_size=2", "decode_context_parallel_size=4", "set it to 1 or 4"]),
    (dict(tp=2, dcp=1, draft_decode_context_parallel_size=2),
     ["draft_decode_context_parallel_size=2", "decode_context_parallel_size=1", "set it to 1"]),
    (dict(tp=2, dcp=2, draft_tensor_parallel_size=1),
     ["draft_tensor_parallel_size=1 is not implemented", "tensor_parallel_size=2",
      "set it to 2"]),
])
def test_refusals_name_value_and_fix(kwargs, parts):
    with pytest.raises(ValueError) as err:
        _config(**kwargs)
    message = str(err.value)
    assert "\n" not in message
    for part in parts:
        assert part in message


@pytest.mark.parametrize("field", ["draft_tensor_parallel_size",
                                   "draft_decode_context_parallel_size"])
@pytest.mark.parametrize("value", [0, -1, "2", True])
def test_non_positive_ints_are_refused(field, value):
    with pytest.raises(ValueError, match=f"{field}={value!r} is invalid"):
        SpeculativeConfig(method="eagle", num_speculative_tokens=2, **{field: value})
