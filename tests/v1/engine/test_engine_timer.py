"""The engine's per-request timer keeps no per-step gaps (RequestTimer(keep_bursts=False)): its
TTFT, TPOT, phases and token count equal a full timer's on random bursts, and it holds O(1)
state however many steps a request runs."""
import random

from vllm.v1.metrics.stats import RequestTimer


def test_timer_without_bursts_equals_full_timer():
    rng = random.Random(3)
    for _ in range(50):
        full = RequestTimer(arrival_time=0.0, num_prompt_tokens=5)
        lean = RequestTimer(arrival_time=0.0, num_prompt_tokens=5, keep_bursts=False)
        now = 0.0
        for _ in range(rng.randint(0, 40)):
            now += rng.uniform(0.001, 0.1)
            n = rng.choice([0, 1, 1, 1, 2, 5])
            full.record_tokens(n, now)
            lean.record_tokens(n, now)
        assert lean.bursts == []
        assert (lean.ttft, lean.tpot, lean.e2e_latency, lean.phases(),
                lean.num_generation_tokens) == (full.ttft, full.tpot, full.e2e_latency,
                                                full.phases(), full.num_generation_tokens)
        # the full timer's gaps still add up to its decode time
        if full.num_generation_tokens >= 2:
            assert abs(sum(full.inter_token_latencies())
                       - (full.last_token_time - full.first_token_time)) < 1e-9
