"""The periodic log lines use upstream's wording and interval rates (hand-computed values)."""
from vllm.v1.metrics.loggers import LoggingStatLogger


def test_interval_lines_hand_computed():
    snaps = [
        {"num_prompt_tokens": 0, "num_generation_tokens": 0, "num_requests_running": 0,
         "num_requests_waiting": 0, "kv_cache_usage": 0.0,
         "spec_decode": {"num_drafts": 0, "num_draft_tokens": 0, "num_accepted_tokens": 0,
                         "accepted_per_position": [0, 0]}},
        {"num_prompt_tokens": 100, "num_generation_tokens": 50, "num_requests_running": 2,
         "num_requests_waiting": 1, "kv_cache_usage": 0.25,
         "spec_decode": {"num_drafts": 10, "num_draft_tokens": 20, "num_accepted_tokens": 12,
                         "accepted_per_position": [8, 4]}},
    ]
    state = {"i": 0}
    logger = LoggingStatLogger(lambda: snaps[state["i"]], interval_s=10)
    logger.lines(now=logger._last_time)  # baseline
    state["i"] = 1
    lines = logger.lines(now=logger._last_time + 10.0)
    assert lines[0] == ("Engine 000: Avg prompt throughput: 10.0 tokens/s, Avg generation "
                        "throughput: 5.0 tokens/s, Running: 2 reqs, Waiting: 1 reqs, GPU KV cache "
                        "usage: 25.0%, Prefix cache hit rate: 0.0%")
    assert lines[1] == ("SpecDecoding metrics: Mean acceptance length: 2.20, Accepted throughput: "
                        "1.20 tokens/s, Drafted throughput: 2.00 tokens/s, Accepted: 12 tokens, "
                        "Drafted: 20 tokens, Per-position acceptance rate: 0.800, 0.400, "
                        "Avg Draft acceptance rate: 60.0%")
    # Next interval without new drafts: no SpecDecoding line, zero throughput.
    lines = logger.lines(now=logger._last_time + 5.0)
    assert len(lines) == 1 and "Avg prompt throughput: 0.0 tokens/s" in lines[0]


def test_speculation_policy_line_hand_computed():
    def snap(drafted, skipped):
        return {"spec_decode": {"num_drafts": 0, "num_draft_tokens": 0, "num_accepted_tokens": 0,
                                "policy": {"mode": "auto", "num_drafted": drafted,
                                           "num_skipped": skipped}}}
    snaps = [snap(4, {"explore": 2}), snap(10, {"cost": 30, "explore": 2})]
    state = {"i": 0}
    logger = LoggingStatLogger(lambda: snaps[state["i"]], interval_s=10)
    logger.lines(now=logger._last_time)
    state["i"] = 1
    lines = logger.lines(now=logger._last_time + 10.0)
    assert lines[-1] == ("Speculation policy (auto): drafted 6 request-steps, skipped 30 "
                         "(cost: 30, explore: 0)")
    # Nothing new: no policy line.
    assert not any("Speculation policy" in line for line in logger.lines(now=logger._last_time + 1))
