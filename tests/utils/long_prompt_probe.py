"""Run one long greedy request through vllm.LLM in THIS process and print a JSON line with the
wall time, the RSS before generate() and the peak RSS during it (for the long-context test, run
as a subprocess so that the peak belongs to this request alone).

    python -m tests.utils.long_prompt_probe MODEL_DIR NUM_TOKENS BUDGET
"""
from __future__ import annotations

import json
import resource
import sys
import time


def _rss_kb(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"{field} missing from /proc/self/status")


def main(model_dir: str, num_tokens: int, budget: int) -> None:
    from vllm import LLM, SamplingParams
    llm = LLM(model=model_dir, max_model_len=num_tokens + 16, max_num_batched_tokens=budget,
              device="cpu", block_size=16, num_gpu_blocks_override=(num_tokens + 64) // 16 + 8)
    prompt = [(7 * i * i + 3 * i) % 250 + 4 for i in range(num_tokens)]
    base = _rss_kb("VmRSS")
    try:  # reset the high-water mark so the peak is this request's (Linux >= 4.0)
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        peak_field = "VmHWM"
    except OSError:  # no reset: the process-lifetime peak over-states the growth (safe side)
        peak_field = None
    start = time.time()
    out = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True),
                       use_tqdm=False)
    seconds = time.time() - start
    peak = _rss_kb(peak_field) if peak_field else resource.getrusage(
        resource.RUSAGE_SELF).ru_maxrss
    print(json.dumps({"seconds": seconds, "rss_before_kb": base, "peak_rss_kb": peak,
                      "token_ids": list(out[0].outputs[0].token_ids)}))


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]))
