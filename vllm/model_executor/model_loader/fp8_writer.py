"""Write the FP8 block-quantised copy of a float checkpoint directory, in the format DeepSeek-V3/R1
and Kimi-K2 ship: float8_e4m3fn `X.weight` + float32 `X.weight_scale_inv`
[ceil(N/128), ceil(K/128)] (the per-block multiplier, amax/448) for every linear projection of the
decoder layers, and config.json gaining
    "quantization_config": {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                            "weight_block_size": [128, 128]}
Embeddings, the LM head, the MoE router (`mlp.gate`), norms and the MTP `eh_proj` stay as they are,
as in the official checkpoints. Dims that are not multiples of the block get partial edge blocks.
"""
from __future__ import annotations

import json
import os
import re
import shutil

from safetensors.torch import save_file

from vllm.model_executor.layers.quantization.fp8_utils import block_quantize

# decoder-layer projections: attention (q_a/q_b/q/kv_a/kv_b/o) and MLP / expert gate/up/down
QUANTIZED_WEIGHT = re.compile(r"^.*\.layers\.\d+\..*(?<!eh)_proj(_with_mqa)?\.weight$")


def quantization_config(block: tuple[int, int]) -> dict:
    return {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
            "weight_block_size": [int(block[0]), int(block[1])]}


def write_fp8_checkpoint(src_dir: str, dst_dir: str, block: tuple[int, int] = (128, 128)) -> str:
    """Quantise every decoder-layer projection of `src_dir` into `dst_dir` (one model.safetensors);
    other files (tokenizer, chat template, ...) are copied. Returns dst_dir."""
    from vllm.model_executor.model_loader.loader import iterate_safetensors
    from vllm.transformers_utils.config import load_hf_config

    config = load_hf_config(src_dir).to_dict()
    if config.get("quantization_config"):
        raise ValueError(f"{src_dir}/config.json already has a quantization_config; quantise an "
                         "unquantised checkpoint")
    os.makedirs(dst_dir, exist_ok=True)
    tensors = {}
    for name, tensor in iterate_safetensors(src_dir):
        if QUANTIZED_WEIGHT.match(name) and tensor.dim() == 2:
            q, scale = block_quantize(tensor, block)
            tensors[name] = q
            tensors[name + "_scale_inv"] = scale
        else:
            tensors[name] = tensor.contiguous()
    save_file(tensors, os.path.join(dst_dir, "model.safetensors"))
    for entry in os.listdir(src_dir):
        path = os.path.join(src_dir, entry)
        skip = entry == "config.json" or entry.endswith(".safetensors") or entry == "model.safetensors.index.json"
        if os.path.isfile(path) and not skip:
            shutil.copyfile(path, os.path.join(dst_dir, entry))
    config["quantization_config"] = quantization_config(block)
    with open(os.path.join(dst_dir, "config.json"), "w", encoding="utf-8") as f:
        json.dump(config, f, indent=2)  # last: its presence marks a complete directory
    return dst_dir
