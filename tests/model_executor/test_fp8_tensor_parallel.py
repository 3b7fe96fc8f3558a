"""FP8 block-quantised checkpoint under TP=2 (two gloo worker processes): every rank loads its
block-aligned shard of the fp8 weights and block scales; greedy output equals TP=1 and the
dequantised float checkpoint's greedy output."""
import json
import os

import pytest
from safetensors.torch import load_file

from vllm import LLM, SamplingParams
from vllm.model_executor.layers.quantization.fp8_utils import FP8_DTYPE
from vllm.model_executor.model_loader.fp8_writer import write_fp8_checkpoint
from vllm.model_executor.models.tiny import write_checkpoint, write_random_target

# moe_intermediate 256: the shared / routed experts' 128-row halves stay block-aligned at TP=2
CONFIG = dict(num_hidden_layers=2, moe_intermediate_size=256)
PROMPTS = [[5, 17, 29, 41, 53, 65, 77, 89], [200, 3, 99, 12]]
GREEDY = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)


def _dequantised_copy(fp8_dir, dst):
    tensors = load_file(os.path.join(fp8_dir, "model.safetensors"))
    out = {}
    for name, t in tensors.items():
        if name.endswith("_scale_inv"):
            continue
        if t.dtype == FP8_DTYPE:
            s = tensors[name + "_scale_inv"]
            t = t.float() * s.repeat_interleave(128, 0)[:t.shape[0]].repeat_interleave(128, 1)[:, :t.shape[1]]
        out[name] = t
    with open(os.path.join(fp8_dir, "config.json"), encoding="utf-8") as f:
        config = json.load(f)
    del config["quantization_config"]
    return write_checkpoint(dst, config, out)


@pytest.mark.slow
def test_fp8_tp2_greedy_equals_tp1_and_dequantised(tmp_path):
    src = write_random_target(str(tmp_path / "fp32"), seed=21, **CONFIG)
    fp8 = write_fp8_checkpoint(src, str(tmp_path / "fp8"))
    ref_dir = _dequantised_copy(fp8, str(tmp_path / "deq"))
    results = {}
    for name, model, tp in (("deq", ref_dir, 1), ("fp8_tp1", fp8, 1), ("fp8_tp2", fp8, 2)):
        with LLM(model=model, device="cpu", max_model_len=64, tensor_parallel_size=tp) as llm:
            results[name] = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]
    assert results["fp8_tp1"] == results["deq"]
    assert results["fp8_tp2"] == results["fp8_tp1"]
