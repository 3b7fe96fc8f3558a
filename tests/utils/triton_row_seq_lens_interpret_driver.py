"""Runs the Triton row-geometry kernel (row_seq_lens.py) on CPU tensors under TRITON_INTERPRET=1 and
compares it with MLACommonMetadataBuilder's torch path (launched by test_mla_row_seq_lens.py)."""
import os
import random
from types import SimpleNamespace

import torch

assert os.environ.get("TRITON_INTERPRET") == "1", "run with TRITON_INTERPRET=1"

from vllm.v1.attention.backends.mla import common, row_seq_lens  # noqa: E402
from vllm.v1.worker.gpu.cp_utils import get_dcp_local_seq_lens  # noqa: E402


def main() -> None:
    if not row_seq_lens.HAS_TRITON:
        print("NO_TRITON")
        return
    for seed in range(40):
        rng = random.Random(seed)
        dcp, inter = rng.choice([(1, 1), (2, 1), (2, 4), (4, 1), (4, 4)])
        rank = rng.randrange(dcp)
        num_decodes = rng.randint(1, 40)
        q = rng.choice([1, 2, 5, 8])
        q_lens = [q] * num_decodes
        if rng.random() < 0.3:
            q_lens = [rng.randint(1, 8) for _ in range(num_decodes)]  # varlen verify
        qsl = [0]
        for n in q_lens:
            qsl.append(qsl[-1] + n)
        pad = rng.randint(0, 9)  # CUDA-graph padding tokens past the last block
        num_tokens = qsl[-1] + pad
        glob = torch.tensor([rng.randint(max(q_lens), 3000) for _ in range(num_decodes)],
                            dtype=torch.int32)
        local = get_dcp_local_seq_lens(glob, dcp, rank, inter).to(torch.int32)
        causal = rng.random() < 0.7 and max(q_lens) > 1
        parallel = SimpleNamespace(decode_context_parallel_size=dcp, cp_kv_cache_interleave_size=inter)
        builder = common.MLACommonMetadataBuilder(SimpleNamespace(block_size=64), [],
                                                  SimpleNamespace(parallel_config=parallel), "cpu",
                                                  dcp_rank=rank)
        cm = SimpleNamespace(seq_lens=glob, query_start_loc=torch.tensor(qsl, dtype=torch.int32))
        ref_out, ref_req, ref_pos = [t.clone() for t in builder._row_seq_lens(
            cm, num_decodes, num_tokens, causal, local)]
        out = torch.full((num_tokens + 3,), -5, dtype=torch.int32)
        req = torch.full((num_tokens + 3,), -5, dtype=torch.int64)
        pos = torch.full((num_tokens + 3,), -5, dtype=torch.int64)
        row_seq_lens.row_seq_lens_triton(out, req, pos, cm.query_start_loc, local, glob,
                                         num_decodes, num_tokens, causal, dcp, rank, inter)
        assert torch.equal(out[:num_tokens], ref_out), (seed, out[:num_tokens], ref_out)
        assert torch.equal(req[:num_tokens], ref_req), (seed, req[:num_tokens], ref_req)
        live = qsl[-1]  # positions of padding tokens are never read
        assert torch.equal(pos[:live], ref_pos[:live]), (seed, pos[:live], ref_pos[:live])
        assert (out[num_tokens:] == -5).all()  # nothing past num_tokens is written
    print("TRITON_INTERPRET_OK")


if __name__ == "__main__":
    main()
