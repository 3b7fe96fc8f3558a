"""Real multi-process DCP on gloo: q all-gather, sharded TORCH_MLA decode, LSE merge +
reduce-scatter; every rank's heads must equal the dense float64 oracle."""

import pytest
import torch
import torch.multiprocessing as mp

from tests.utils.mla_dcp_helpers import build_rank, make_case, reference_decode
from vllm.distributed import parallel_state as ps
from vllm.v1.attention.backends.mla.torch_mla import (
    TorchMLAImpl,
    TorchMLAMetadataBuilder,
)
from vllm.v1.attention.ops.dcp_combine import cp_lse_ag_out_rs, dcp_all_gather_q

CASES = [  # (seq_lens, query_lens, causal, interleave)
    ([2, 9, 37, 3], [1, 1, 1, 1], True, 1),
    ([5, 10, 41, 3], [4, 3, 4, 2], True, 2),
    ([5, 19, 40, 3], [3, 3, 3, 3], False, 1),
]



def _worker(rank: int, world: int, rendezvous: str, heads_per_rank: int) -> None:
    torch.set_num_threads(1)
    ps.init_distributed_environment(world, rank, "gloo", f"file://{rendezvous}")
    try:
        ps.initialize_model_parallel(world, world)
        dcp = ps.get_dcp_group()
        assert (dcp.world_size, dcp.rank_in_group) == (world, rank)
        heads = heads_per_rank * world
        for i, (seq_lens, qlens, causal, interleave) in enumerate(CASES):
            case = make_case(seq_lens, qlens, num_heads=heads, causal=causal, seed=100 + i)
            mine = slice(rank * heads_per_rank, (rank + 1) * heads_per_rank)
            q = dcp_all_gather_q(case.q[:, mine].contiguous(), dcp)
            assert torch.equal(q, case.q)  # token-major concat of every rank's heads
            md, cache, _, builder = build_rank(case, TorchMLAMetadataBuilder, world, rank,
                                               interleave, block_size=4)
            # without an explicit rank the builder takes it from the live DCP group
            auto = TorchMLAMetadataBuilder(builder.kv_cache_spec, ["l"], builder.vllm_config,
                                           "cpu")
            assert auto.dcp_rank == rank and auto.dcp_world_size == world
            out, lse = TorchMLAImpl(num_heads=heads, scale=case.scale).forward_decode(
                q, cache, md.decode)
            local, local_lse = cp_lse_ag_out_rs(out, lse, dcp, lse_base_on_e=True,
                                                return_lse=True)
            ref_out, ref_lse = reference_decode(case)
            torch.testing.assert_close(local, ref_out[:, mine], rtol=1e-11, atol=1e-11)
            torch.testing.assert_close(local_lse, ref_lse[:, mine], rtol=1e-11, atol=1e-11)
        # DCP groups are consecutive blocks of TP ranks: tp=4, dcp=2 -> {0,1}, {2,3}
        if world == 4:
            ps.destroy_model_parallel()
            ps.initialize_model_parallel(4, 2)
            dcp = ps.get_dcp_group()
            assert dcp.ranks == ([0, 1] if rank < 2 else [2, 3])
            assert dcp.rank_in_group == rank % 2
            x = torch.full((2, 4), float(rank))
            gathered = dcp.all_gather(x, dim=1)
            assert torch.equal(gathered, torch.cat([torch.full((2, 4), float(r))
                                                    for r in dcp.ranks], dim=1))
            scattered = dcp.reduce_scatter(torch.arange(8.).view(2, 4) + rank, dim=1)
            base = torch.arange(8.).view(2, 4) * 2 + sum(dcp.ranks)
            assert torch.equal(scattered, base[:, 2 * dcp.rank_in_group:2 * dcp.rank_in_group + 2])
            assert torch.equal(ps.get_tp_group().all_reduce(torch.ones(3)), torch.full((3,), 4.))
    finally:
        ps.destroy_distributed_environment()


@pytest.mark.slow
@pytest.mark.parametrize("world", [2, 4])
def test_dcp_decode_over_gloo_matches_dense_oracle(world, tmp_path):
    # fork: the children inherit the imported torch (spawn re-imports it per rank, tens of
    # seconds on a loaded 2-core CI box); each child drops to one intra-op thread first.
    # A file rendezvous in this test's own directory: a free TCP port picked here could be taken
    # by another test run on the machine before the ranks bind it (seen with parallel suites).
    mp.start_processes(_worker, args=(world, str(tmp_path / "rendezvous"), 2), nprocs=world,
                       join=True, start_method="fork")
