"""Real multi-process DCP on gloo for MLA prefill with cached context (forward_mla_prefill):
TP = DCP, every rank owns its heads' q and kv_b_proj rows and stores only its shard of the
context. The q all-gather, the one-time all-gather of the group's kv_b_proj rows, the
rank-local context passes and the LSE merge + reduce-scatter must give every rank's heads the
dense float64 answer (= DCP 1), with interleave 1 and 4; no KV is all-gathered."""

import pytest
import torch
import torch.multiprocessing as mp

from tests.utils.mla_prefill_helpers import (
    NOPE,
    build_prefill_rank,
    fake_layer,
    make_prefill_case,
    reference_prefill,
)
from vllm.distributed import parallel_state as ps
from vllm.v1.attention.backends.mla.prefill import forward_mla_prefill

# (context_lens, query_lens): a fresh prompt next to rows with context; a 1-token context
# (stored by rank 0 only) and contexts of several passes (chunk 5).
CASE = ([0, 1, 19, 45], [6, 3, 8, 5])
HEADS_PER_RANK = 2



def _worker(rank: int, world: int, rendezvous: str, interleave: int) -> None:
    torch.set_num_threads(1)
    ps.init_distributed_environment(world, rank, "gloo", f"file://{rendezvous}")
    try:
        ps.initialize_model_parallel(world, world)
        case = make_prefill_case(*CASE, num_heads=HEADS_PER_RANK * world, seed=world + interleave)
        mine = slice(rank * HEADS_PER_RANK, (rank + 1) * HEADS_PER_RANK)
        meta, cache = build_prefill_rank(case, n=world, rank=rank, interleave=interleave,
                                         block_size=4, chunk=5)
        c_kv, k_pe = case.new_tokens()
        layer = fake_layer(case.w_kv_b[mine], case.scale, cache)
        gathers = []
        real_gather = ps.get_dcp_group().all_gather

        def counting_gather(t, dim=-1):
            gathers.append(tuple(t.shape))
            return real_gather(t, dim)

        ps.get_dcp_group().all_gather = counting_gather
        q = case.q[:, mine]
        for _ in range(2):  # the second call reuses the gathered kv_b_proj rows
            out = forward_mla_prefill(layer, q[..., :NOPE], q[..., NOPE:], c_kv, k_pe, meta)
        ref, _ = reference_prefill(case)
        torch.testing.assert_close(out, ref[:, mine], rtol=1e-10, atol=1e-10)
        weight_rows = case.w_kv_b[mine].reshape(-1, case.w_kv_b.shape[-1]).shape
        # per call: q and the LSEs; the weight rows once; never a KV-sized tensor
        assert gathers.count(weight_rows) == 1
        assert all(s[0] != cache.shape[0] for s in gathers)
    finally:
        ps.destroy_distributed_environment()


@pytest.mark.slow
@pytest.mark.parametrize("interleave", [1, 4])
@pytest.mark.parametrize("world", [2, 4])
def test_dcp_prefill_context_over_gloo_matches_dense_oracle(world, interleave, tmp_path):
    # file rendezvous in the test's own directory (no TCP port race with other runs)
    mp.start_processes(_worker, args=(world, str(tmp_path / "rendezvous"), interleave), nprocs=world,
                       join=True, start_method="fork")
