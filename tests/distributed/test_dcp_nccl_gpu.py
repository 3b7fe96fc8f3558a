"""Real 2-GPU DCP over NCCL: q all-gather, FlashInfer (or TORCH_MLA) decode per GPU on its KV
shard, Triton LSE merge + reduce-scatter; each rank's heads vs the float64 oracle.

On the 2-GPU node:  source .gpu/env.sh && pytest -m gpu tests/distributed/test_dcp_nccl_gpu.py -q
"""
import socket

import pytest
import torch
import torch.multiprocessing as mp

from tests.utils.mla_dcp_helpers import build_rank, make_case, reference_decode

pytestmark = pytest.mark.gpu
HEADS_PER_RANK, BLOCK = 16, 64
CASES = [([700, 2049, 64, 9], [1, 1, 1, 1], True), ([700, 2049, 64, 9], [4, 4, 4, 4], True),
         ([700, 2049, 64, 12], [8, 8, 8, 8], False)]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank: int, world: int, port: int) -> None:
    from vllm.distributed import parallel_state as ps
    from vllm.v1.attention.ops.dcp_combine import cp_lse_ag_out_rs, dcp_all_gather_q
    from vllm.v1.attention.selector import get_attn_backend
    torch.cuda.set_device(rank)
    ps.init_distributed_environment(world, rank, "nccl", f"tcp://127.0.0.1:{port}")
    try:
        ps.initialize_model_parallel(world, world)
        dcp = ps.get_dcp_group()
        backend = get_attn_backend("auto", device=torch.device("cuda", rank))
        heads = HEADS_PER_RANK * world
        mine = slice(rank * HEADS_PER_RANK, (rank + 1) * HEADS_PER_RANK)
        for i, (seq_lens, qlens, causal) in enumerate(CASES):
            case = make_case(seq_lens, qlens, num_heads=heads, causal=causal, seed=i,
                             dtype=torch.bfloat16)
            q = dcp_all_gather_q(case.q[:, mine].cuda(), dcp)
            assert torch.equal(q.cpu(), case.q)
            kwargs = dict(kernel_family="hopper") if backend.get_name() == "FLASHINFER_MLA" else {}
            md, cache, _, _ = build_rank(case, backend.get_builder_cls(), world, rank, 1, BLOCK,
                                         fill=0.0, device=f"cuda:{rank}", builder_kwargs=kwargs)
            impl = backend.get_impl_cls()(num_heads=heads, scale=case.scale)
            out, lse = impl.forward_decode(q, cache, md.decode)
            local = cp_lse_ag_out_rs(out, lse, dcp, lse_base_on_e=backend.lse_base_on_e)
            ref, _ = reference_decode(case)
            torch.testing.assert_close(local.double().cpu(), ref[:, mine], rtol=2e-2, atol=2e-2)
        print(f"rank {rank}: backend {backend.get_name()} DCP={world} over NCCL OK", flush=True)
    finally:
        ps.destroy_distributed_environment()


def test_dcp2_over_nccl_matches_oracle():
    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 GPUs (run on the nvidia-h200-x2 node)")
    mp.spawn(_worker, args=(2, _free_port()), nprocs=2, join=True)
