"""distributed_executor_backend="external_launcher": two torchrun processes (gloo, CPU), each one
rank of TP=2 x DCP=2 running its own engine, produce the same tokens on both ranks, and their
greedy output equals a single-process plain engine's."""
import json
import os
import subprocess
import sys

import pytest

from tests.utils.server_process import free_port
from vllm import LLM, SamplingParams
from vllm.model_executor.models.tiny import write_tiny_models

pytestmark = pytest.mark.slow


def test_torchrun_ranks_agree_and_match_single_process(tmp_path):
    tiny = write_tiny_models()
    driver = os.path.join(os.path.dirname(__file__), "..", "..", "utils",
                          "external_launcher_driver.py")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1", "--nproc-per-node",
           "2", "--master-addr", "127.0.0.1", "--master-port", str(free_port()), driver,
           str(tiny.target), str(tiny.dspark), str(tmp_path)]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    ranks = [json.load(open(tmp_path / f"rank{r}.json")) for r in (0, 1)]
    assert ranks[0] == ranks[1]
    for pair in ranks[0]["sampled"]:
        assert pair[0] != pair[1] and all(len(t) == 8 for t in pair)
    with LLM(model=str(tiny.target), device="cpu", max_model_len=256, max_num_seqs=4) as llm:
        ref = llm.generate([[5, 17, 29, 41, 53], [200, 3, 9]],
                           SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True),
                           use_tqdm=False)
    assert ranks[0]["greedy"] == [o.outputs[0].token_ids for o in ref]


def test_external_launcher_without_torchrun_is_refused(monkeypatch):
    for var in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(var, raising=False)
    with pytest.raises(ValueError, match="needs the torchrun environment"):
        LLM(model=str(write_tiny_models().target), device="cpu", max_model_len=64,
            distributed_executor_backend="external_launcher")
