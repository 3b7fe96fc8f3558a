#!/usr/bin/env bash
# One lean GPU pass when device time is short (twenty-fifth session): the graph-step advance and
# page-list rebuild GPU tests, the engine exactness / sync-budget tests they touch, the issue #10
# V3-rank overhead, the host probe with the advance off and on, and the tiny B=1 headline, all
# with the two switches on (VLLM_GRAPH_STEP_ADVANCE, VLLM_PLAN_PAGE_LIST_REBUILD: on by default
# since this pass succeeded in the twenty-sixth session; the probe turns the advance off for its
# first run).
# Each part is bounded; logs and JUnit XML go to $OUT (or ./out); a summary is printed last.
set -uo pipefail
export VLLM_GRAPH_STEP_ADVANCE="${VLLM_GRAPH_STEP_ADVANCE:-1}"
export VLLM_PLAN_PAGE_LIST_REBUILD="${VLLM_PLAN_PAGE_LIST_REBUILD:-1}"
out="${OUT:-out}"; mkdir -p "$out"; out="$(cd "$out" && pwd)"
source .gpu/env.sh || exit 1
python3 -c "import zipfile; zipfile.ZipFile('.gpu/flashinfer_prefill_csrc.zip').extractall('/tmp/gpu-site')"
if [ -f .gpu/jit.tgz ] && [ ! -e "$HOME/.cache/jit-restored" ]; then
  find /tmp/gpu-site -exec touch -h -d "2020-01-01" {} +
  (root="$(pwd)"; cd "$HOME" && tar xzf "$root/.gpu/jit.tgz" && touch .cache/jit-restored)
fi
nvidia-smi --query-gpu=name --format=csv,noheader | tee "$out/gpus.txt"
summary=()
timeout 240 python3 -m pytest -m gpu -q -p no:cacheprovider -rA --junitxml="$out/junit_lean.xml" \
  tests/v1/attention/test_flashinfer_mla_gpu.py tests/v1/worker/test_cudagraph_runner_gpu.py \
  tests/v1/e2e/test_gpu_exactness.py tests/v1/spec_decode/test_early_draft_launch_gpu.py \
  -k "${LEAN_K:-carried or advanced or lowered or (graphs_equal and FLASHINFER) or dcp1 or launch}" \
  >"$out/pytest_lean.log" 2>&1
summary+=("tests rc=$? $(tail -n 1 "$out/pytest_lean.log")")
grep -E "^(FAILED|ERROR)" "$out/pytest_lean.log" | head -n 20
timeout 150 python3 benchmarks/engine/benchmark_decode.py --model benchmarks/configs/deepseek_v3_tp8_rank \
  --load-format dummy --draft-model benchmarks/configs/deepseek_v3_tp8_rank_dspark --num-spec-tokens 4 \
  --batch-sizes 1 32 --methods none dspark --modes graphs --steps 40 --steps-per-block 20 \
  --profile-steps 3 --out "$out/v3" >"$out/v3.log" 2>&1
summary+=("v3 rc=$?"); grep -E "^(method|none|dspark) " "$out/v3.log"
for adv in 0 1; do
  VLLM_GRAPH_STEP_ADVANCE=$adv timeout 60 python3 scripts/probe_spec_step.py --device cuda --dtype bfloat16 \
    --attention-backend FLASHINFER_MLA --batch 1 8 --modes plain draft --steps 60 >"$out/probe$adv.log" 2>&1
  summary+=("probe advance=$adv rc=$?"); grep -E "step .* ms, graph|engine.step \(wall|_prepare_inputs|builder build" "$out/probe$adv.log"
done
timeout 100 python3 benchmarks/engine/benchmark_spec_policy.py --batch-sizes 1 --variants none always \
  --repeats 3 --out "$out/tiny" >"$out/tiny.log" 2>&1
summary+=("tiny rc=$?"); grep -v "^{" "$out/tiny.log" | tail -n 4
printf '%s\n' "${summary[@]}"
