"""One torchrun rank of tests/v1/engine/test_external_launcher.py: runs its own LLM with
distributed_executor_backend="external_launcher" and writes what it generated to
OUT_DIR/rank{RANK}.json."""
import json
import os
import sys


def main(model_dir: str, drafter_dir: str, out_dir: str) -> None:
    from vllm import LLM, SamplingParams

    spec = {"method": "dspark", "model": drafter_dir, "num_speculative_tokens": 3}
    llm = LLM(model=model_dir, tensor_parallel_size=2, decode_context_parallel_size=2,
              distributed_executor_backend="external_launcher", device="cpu",
              max_model_len=256, max_num_seqs=4, speculative_config=spec)
    try:
        prompts = [[5, 17, 29, 41, 53], [200, 3, 9]]
        greedy = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=8,
                                                      ignore_eos=True), use_tqdm=False)
        sampled = llm.generate(prompts, SamplingParams(temperature=1.0, seed=3, max_tokens=8,
                                                       ignore_eos=True, n=2), use_tqdm=False)
        result = {"greedy": [o.outputs[0].token_ids for o in greedy],
                  "sampled": [[c.token_ids for c in o.outputs] for o in sampled]}
    finally:
        llm.shutdown()
    with open(os.path.join(out_dir, f"rank{os.environ['RANK']}.json"), "w") as f:
        json.dump(result, f)


if __name__ == "__main__":
    main(*sys.argv[1:4])
