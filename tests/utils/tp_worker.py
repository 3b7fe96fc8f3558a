"""Body of one rank in the TP=2 (gloo) tests: build the target sharded over TP (and the KV cache
over DCP), run the prompt, save logits and shard facts for the parent test to check."""
from __future__ import annotations

import torch

from tests.utils.paged_harness import PagedRequest, PagedRunner
from vllm.config import ModelConfig, ParallelConfig, VllmConfig
from vllm.distributed import parallel_state as ps
from vllm.forward_context import dense_attention_context
from vllm.model_executor.model_loader import get_model


def run_rank(rank: int, world: int, model_dir: str, rendezvous: str, out_dir: str,
             prompt_a: list[int], prompt_b: list[int]) -> None:
    torch.set_num_threads(1)
    ps.init_distributed_environment(world, rank, backend="gloo", init_method=f"file://{rendezvous}")
    results = {}
    for dcp in (1, world):
        ps.initialize_model_parallel(tensor_parallel_size=world, decode_context_parallel_size=dcp)
        cfg = VllmConfig(model_config=ModelConfig(model=model_dir, dtype="float32", device="cpu",
                                                  attention_backend="TORCH_MLA"),
                         parallel_config=ParallelConfig(tensor_parallel_size=world,
                                                        decode_context_parallel_size=dcp))
        model = get_model(cfg)
        dcp_rank = ps.get_dcp_group().rank_in_group
        with torch.no_grad(), dense_attention_context():
            prefill = model.compute_logits(model(torch.tensor(prompt_a), torch.arange(len(prompt_a))))
        runner = PagedRunner(model, block_size=4, num_blocks=32, dcp_size=dcp, dcp_rank=dcp_rank)
        req_a = PagedRequest(prompt_a, chunks=[8, 1, 1, 3, 1, 2, 1, 5])
        req_b = PagedRequest(prompt_b, chunks=[5, 1, 4, 1, 2], start_step=2)
        paged_a, paged_b = runner.run([req_a, req_b])
        cache = next(iter(runner.layers.values())).kv_cache
        results[dcp] = {
            "prefill": prefill, "paged_a": paged_a, "paged_b": paged_b,
            "stored_tokens": int((cache.abs().sum(-1) != 0).sum()),
            "param_shapes": {n: tuple(p.shape) for n, p in model.named_parameters()},
            "param_bytes": sum(p.numel() * p.element_size() for p in model.parameters()),
            "q_b_proj": model.model.layers[0].self_attn.q_b_proj.weight.clone(),
        }
        del model, runner
        ps.destroy_model_parallel()
    torch.save(results, f"{out_dir}/rank{rank}.pt")
    ps.destroy_distributed_environment()
