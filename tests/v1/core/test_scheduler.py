import random

import pytest
from hypothesis import given, settings, strategies as st

from vllm.v1.core.sched.request import RequestStatus
from vllm.v1.core.sched.scheduler import Scheduler

from tests.utils.fake_model import EOS, FakeRunner, fake_drafts, reference_greedy
from tests.utils.sched_helpers import make_config, make_request, run_to_completion


def prompts(n, seed=0, lo=3, hi=20):
    rng = random.Random(seed)
    # Avoid EOS inside prompts only for readability; it would not matter.
    return [[rng.randrange(4, 97) for _ in range(rng.randint(lo, hi))] for _ in range(n)]


def test_admission_while_blocks_last():
    cfg = make_config(max_model_len=16, block_size=4)
    # Each 6-token prompt needs cdiv(6 + 1, 4) = 2 blocks; 5 blocks admit two requests.
    sched = Scheduler(cfg, num_blocks=5)
    for i in range(3):
        sched.add_request(make_request(f"r{i}", [10 + i] * 6))
    so = sched.schedule()
    assert [n.req_id for n in so.scheduled_new_reqs] == ["r0", "r1"]
    assert so.num_scheduled_tokens == {"r0": 6, "r1": 6}
    assert [len(n.block_ids) for n in so.scheduled_new_reqs] == [2, 2]
    assert sched.get_stats()["num_requests_waiting"] == 1
    assert sched.get_stats()["kv_cache_usage"] == pytest.approx(4 / 5)


@pytest.mark.parametrize("num_spec,dcp", [(0, 1), (3, 1), (3, 2)])
def test_preemption_by_recompute_gives_the_same_greedy_output(num_spec, dcp):
    ps = prompts(12, seed=num_spec + dcp)
    max_tokens = 40
    expected = {f"r{i}": reference_greedy(p, max_tokens) for i, p in enumerate(ps)}

    def run(num_blocks):
        cfg = make_config(max_model_len=128, block_size=4, dcp=dcp, num_spec=num_spec)
        sched = Scheduler(cfg, num_blocks=num_blocks)
        runner = FakeRunner(4 * dcp, num_spec)
        for i, p in enumerate(ps):
            sched.add_request(make_request(f"r{i}", p, max_tokens=max_tokens))
        outputs, reasons = run_to_completion(sched, runner)
        assert sched.kv_cache_manager.num_free_blocks == num_blocks  # nothing leaked
        return outputs, reasons, sched

    relaxed, _, relaxed_sched = run(num_blocks=1000)
    tight_blocks = -(-(128 + num_spec + 1) // (4 * dcp))  # exactly one full-length request
    tight, reasons, tight_sched = run(num_blocks=tight_blocks)
    assert relaxed == expected
    assert tight == expected
    assert relaxed_sched.num_preemptions == 0
    assert tight_sched.num_preemptions > 0
    assert all(r in ("stop", "length") for r in reasons.values())


def test_preempted_request_is_requeued_at_front_with_its_outputs_as_prompt():
    cfg = make_config(max_model_len=32, block_size=4)
    sched = Scheduler(cfg, num_blocks=9)
    runner = FakeRunner(4)
    sched.add_request(make_request("old", [5] * 7, max_tokens=25, ignore_eos=True))
    sched.add_request(make_request("new", [6] * 7, max_tokens=25, ignore_eos=True))
    outputs = {"old": [], "new": []}

    def step(so):
        for core in sched.update_from_output(so, runner.execute_model(so)):
            outputs[core.request_id].extend(core.new_token_ids)

    preempted_step = None
    for _ in range(60):
        so = sched.schedule()
        if so.preempted_req_ids:
            preempted_step = so
            break
        step(so)
    assert preempted_step is not None
    assert preempted_step.preempted_req_ids == {"new"}  # the newest running request
    victim = sched.requests["new"]
    assert sched.waiting[0] is victim and victim.status == RequestStatus.PREEMPTED
    assert victim.num_computed_tokens == 0 and len(victim.output_token_ids) > 0
    assert list(preempted_step.num_scheduled_tokens) == ["old"]
    assert not preempted_step.scheduled_new_reqs  # no admissions in a preempting step
    generated_so_far = list(victim.output_token_ids)
    step(preempted_step)
    readmitted = None
    while readmitted is None:
        so = sched.schedule()
        readmitted = next((n for n in so.scheduled_new_reqs if n.req_id == "new"), None)
        step(so)
    assert readmitted.prompt_token_ids == [6] * 7 + generated_so_far
    assert readmitted.num_computed_tokens == 0
    while sched.has_unfinished_requests():
        step(sched.schedule())
    assert outputs["old"] == reference_greedy([5] * 7, 25, eos=None)
    assert outputs["new"] == reference_greedy([6] * 7, 25, eos=None)


def test_abort_frees_all_blocks_and_is_reported_to_the_runner():
    cfg = make_config(max_model_len=64, block_size=4, num_spec=2)
    sched = Scheduler(cfg, num_blocks=100)
    runner = FakeRunner(4, 2)
    for i, p in enumerate(prompts(5, seed=3)):
        sched.add_request(make_request(f"r{i}", p, max_tokens=30, ignore_eos=True))
    for _ in range(3):
        so = sched.schedule()
        sched.update_from_output(so, runner.execute_model(so))
    assert sched.kv_cache_manager.num_free_blocks < 100
    sched.finish_requests(["r0", "r3", "missing"], RequestStatus.FINISHED_ABORTED)
    so = sched.schedule()
    assert {"r0", "r3"} <= so.finished_req_ids
    assert "r0" not in so.num_scheduled_tokens
    sched.update_from_output(so, runner.execute_model(so))
    sched.finish_requests([f"r{i}" for i in range(5)], RequestStatus.FINISHED_ABORTED)
    assert sched.kv_cache_manager.num_free_blocks == 100
    assert sched.get_stats()["kv_cache_usage"] == 0.0
    assert not sched.has_unfinished_requests()


def test_abort_of_a_waiting_request():
    sched = Scheduler(make_config(max_model_len=16), num_blocks=5)
    sched.add_request(make_request("a", [9] * 6))
    sched.add_request(make_request("b", [9] * 6))
    sched.add_request(make_request("c", [9] * 6))
    sched.schedule()
    sched.finish_requests("c", RequestStatus.FINISHED_ABORTED)
    assert len(sched.waiting) == 0 and "c" not in sched.requests


def _decode_until_done(sched, runner):
    return run_to_completion(sched, runner)


def test_stop_conditions():
    cfg = make_config(max_model_len=40, block_size=4)
    sched = Scheduler(cfg, num_blocks=200)
    runner = FakeRunner(4)
    # Find a prompt whose greedy continuation hits EOS early, and use its tokens as stop ids.
    eos_prompt = next(p for p in prompts(400, seed=9) if EOS in reference_greedy(p, 12, eos=None))
    free_run = reference_greedy(eos_prompt, 12, eos=None)
    cut = free_run.index(EOS)
    sched.add_request(make_request("eos", eos_prompt, max_tokens=12))
    sched.add_request(make_request("ignore", eos_prompt, max_tokens=12, ignore_eos=True))
    stop_tok = free_run[1]
    sched.add_request(make_request("stopid", eos_prompt, max_tokens=12, ignore_eos=True,
                                   stop_token_ids=[stop_tok]))
    sched.add_request(make_request("len", [50] * 5, max_tokens=4, ignore_eos=True))
    sched.add_request(make_request("ctx", [51] * 30, max_tokens=100, ignore_eos=True))
    sched.add_request(make_request("min", eos_prompt, max_tokens=12,
                                   min_tokens=cut + 2))
    outputs, reasons = _decode_until_done(sched, runner)
    assert outputs["eos"] == free_run[:cut + 1] and reasons["eos"] == "stop"
    assert outputs["ignore"] == free_run and reasons["ignore"] == "length"
    assert outputs["stopid"] == free_run[:free_run.index(stop_tok) + 1]
    assert reasons["stopid"] == "stop"
    assert len(outputs["len"]) == 4 and reasons["len"] == "length"
    assert len(outputs["ctx"]) == 40 - 30 and reasons["ctx"] == "length"  # max_model_len
    # EOS as output token number cut+1 < min_tokens is not a stop; generation goes on.
    assert outputs["min"][cut] == EOS and len(outputs["min"]) > cut + 1


def test_eos_inside_accepted_drafts_truncates_the_step():
    """With drafts, several tokens arrive at once; stop at the EOS among them."""
    cfg = make_config(max_model_len=64, block_size=4, num_spec=4)
    sched = Scheduler(cfg, num_blocks=200)
    runner = FakeRunner(4, 4)
    eos_prompts = [p for p in prompts(400, seed=21) if EOS in reference_greedy(p, 20, eos=None)]
    for i, p in enumerate(eos_prompts[:6]):
        sched.add_request(make_request(f"r{i}", p, max_tokens=20))
    outputs, reasons = run_to_completion(sched, runner)
    for i, p in enumerate(eos_prompts[:6]):
        assert outputs[f"r{i}"] == reference_greedy(p, 20)
        assert reasons[f"r{i}"] == "stop"


def test_num_computed_tokens_and_spec_stats():
    cfg = make_config(max_model_len=64, block_size=4, num_spec=3)
    sched = Scheduler(cfg, num_blocks=200)
    runner = FakeRunner(4, 3)
    prompt = [11, 22, 33, 44, 55]
    sched.add_request(make_request("r", prompt, max_tokens=30, ignore_eos=True))
    so = sched.schedule()
    assert so.num_scheduled_tokens == {"r": 5} and not so.scheduled_spec_decode_tokens
    sched.update_from_output(so, runner.execute_model(so))
    req = sched.requests["r"]
    assert req.num_computed_tokens == 5 and req.num_tokens == 6
    tokens = prompt + req.output_token_ids
    assert req.spec_token_ids == fake_drafts(tokens, 3)
    so = sched.schedule()
    assert so.num_scheduled_tokens == {"r": 4}
    assert so.scheduled_spec_decode_tokens == {"r": fake_drafts(tokens, 3)}
    ro = runner.execute_model(so)
    sched.update_from_output(so, ro)
    k = ro.num_accepted_tokens[0]
    assert req.num_computed_tokens == 5 + 1 + k and req.num_tokens == 5 + 1 + 1 + k
    stats = sched.get_stats()["spec_decode"]
    assert stats["num_drafts"] == 1 and stats["num_draft_tokens"] == 3
    assert stats["num_accepted_tokens"] == k
    assert stats["accepted_per_position"] == [1] * k + [0] * (3 - k)
    assert stats["mean_acceptance_length"] == 1 + k


def test_drafts_are_trimmed_at_max_model_len():
    cfg = make_config(max_model_len=12, block_size=4, num_spec=4)
    sched = Scheduler(cfg, num_blocks=50)
    runner = FakeRunner(4, 4)
    sched.add_request(make_request("r", [40] * 9, max_tokens=50, ignore_eos=True))
    so = sched.schedule()
    sched.update_from_output(so, runner.execute_model(so))
    so = sched.schedule()  # 10 tokens: the last sits at 9, room for 2 drafts up to position 11
    assert len(so.scheduled_spec_decode_tokens["r"]) == 2
    sched.update_from_output(so, runner.execute_model(so))  # the runner must see its new blocks
    outputs, reasons = run_to_completion(sched, runner)
    assert reasons["r"] == "length"


def test_prompt_too_long_is_a_clear_error():
    chunked = Scheduler(make_config(max_model_len=32, max_num_batched_tokens=20), num_blocks=100)
    with pytest.raises(ValueError, match=r"33 tokens.*max_model_len=32"):
        chunked.add_request(make_request("a", [1] * 33))
    chunked.add_request(make_request("b", [1] * 25))  # chunked prefill: longer than the budget is fine
    sched = Scheduler(make_config(max_model_len=32, max_num_batched_tokens=20,
                                  enable_chunked_prefill=False), num_blocks=100)
    with pytest.raises(ValueError, match=r"33 tokens.*max_model_len=32"):
        sched.add_request(make_request("a", [1] * 33))
    with pytest.raises(ValueError, match=r"25 tokens.*max_num_batched_tokens=20"):
        sched.add_request(make_request("b", [1] * 25))
    with pytest.raises(ValueError, match="empty"):
        sched.add_request(make_request("c", []))
    sched.add_request(make_request("d", [1] * 3))
    with pytest.raises(ValueError, match="already in use"):
        sched.add_request(make_request("d", [1] * 3))


def test_kv_cache_too_small_for_one_request_is_a_clear_error():
    with pytest.raises(ValueError, match="max_model_len=64"):
        Scheduler(make_config(max_model_len=64, block_size=4), num_blocks=10)


def test_running_batch_is_capped_so_decode_steps_fit_the_token_budget():
    cfg = make_config(max_model_len=32, num_spec=3, max_num_seqs=16, max_num_batched_tokens=20)
    sched = Scheduler(cfg, num_blocks=500)
    assert sched.max_num_running_reqs == 5
    runner = FakeRunner(4, 3)
    for i, p in enumerate(prompts(9, seed=4, lo=2, hi=4)):
        sched.add_request(make_request(f"r{i}", p, max_tokens=10))
    for _ in range(5):
        so = sched.schedule()
        assert so.total_num_scheduled_tokens <= 20
        assert len(sched.running) <= 5
        sched.update_from_output(so, runner.execute_model(so))


@settings(max_examples=40, deadline=None)
@given(st.data())
def test_random_workloads_keep_outputs_exact_and_blocks_consistent(data):
    num_spec = data.draw(st.sampled_from([0, 2]), label="num_spec")
    dcp = data.draw(st.sampled_from([1, 2]), label="dcp")
    max_model_len = 48
    min_blocks = -(-(max_model_len + num_spec + 1) // (4 * dcp))
    num_blocks = data.draw(st.integers(min_blocks, 4 * min_blocks), label="num_blocks")
    chunked = data.draw(st.booleans(), label="chunked")
    # Chunked: any budget that fits one decode step; whole-prompt prefill keeps a roomy budget.
    budget = data.draw(st.integers(1 + num_spec, 24), label="budget") if chunked else 512
    cfg = make_config(max_model_len=max_model_len, block_size=4, dcp=dcp, num_spec=num_spec,
                      max_num_seqs=data.draw(st.integers(1, 6), label="max_num_seqs"),
                      max_num_batched_tokens=budget, enable_chunked_prefill=chunked)
    sched = Scheduler(cfg, num_blocks=num_blocks)
    runner = FakeRunner(4 * dcp, num_spec)
    n = data.draw(st.integers(1, 8), label="num_requests")
    specs = {}
    for i in range(n):
        prompt = data.draw(st.lists(st.integers(4, 96), min_size=1, max_size=20), label=f"p{i}")
        max_tokens = data.draw(st.integers(1, 30), label=f"max_tokens{i}")
        specs[f"r{i}"] = (prompt, max_tokens)
        sched.add_request(make_request(f"r{i}", prompt, max_tokens=max_tokens))
    aborted = set(data.draw(st.lists(st.sampled_from(sorted(specs)), max_size=2), label="aborts"))
    abort_step = data.draw(st.integers(0, 10), label="abort_step")
    outputs = {}
    for step in range(2000):
        if not sched.has_unfinished_requests():
            break
        if step == abort_step:
            sched.finish_requests(aborted, RequestStatus.FINISHED_ABORTED)
        so = sched.schedule()
        for core in sched.update_from_output(so, runner.execute_model(so)):
            outputs.setdefault(core.request_id, []).extend(core.new_token_ids)
        kv = sched.kv_cache_manager
        held = [b for blocks in kv.req_to_blocks.values() for b in blocks]
        assert len(held) == len(set(held)), "a block is held by two requests"
        assert len(held) + kv.num_free_blocks == num_blocks
    assert not sched.has_unfinished_requests()
    assert sched.kv_cache_manager.num_free_blocks == num_blocks
    for rid, (prompt, max_tokens) in specs.items():
        expected = reference_greedy(prompt, max_tokens, max_model_len=max_model_len)
        got = outputs.get(rid, [])
        if rid in aborted:
            assert got == expected[:len(got)]  # aborted: a prefix of the right answer
        else:
            assert got == expected


# ---- chunked prefill ------------------------------------------------------------------------
@pytest.mark.parametrize("budget,num_spec,dcp", [
    (b, k, d) for b in (1, 4, 7, 16, 64) for k, d in ((0, 1), (2, 1), (2, 2)) if b >= 1 + k])
def test_chunked_prefill_gives_the_same_greedy_output(budget, num_spec, dcp):
    ps = prompts(6, seed=budget + num_spec, lo=1, hi=70)
    expected = {f"r{i}": reference_greedy(p, 12) for i, p in enumerate(ps)}
    cfg = make_config(max_model_len=128, block_size=4, dcp=dcp, num_spec=num_spec,
                      max_num_batched_tokens=budget)
    sched = Scheduler(cfg, num_blocks=1000)
    runner = FakeRunner(4 * dcp, num_spec)
    for i, p in enumerate(ps):
        sched.add_request(make_request(f"r{i}", p, max_tokens=12))
    steps = []
    outputs = {}
    while sched.has_unfinished_requests():
        so = sched.schedule()
        assert so.total_num_scheduled_tokens <= budget
        steps.append(so)
        for core in sched.update_from_output(so, runner.execute_model(so)):
            outputs.setdefault(core.request_id, []).extend(core.new_token_ids)
            assert core.new_token_ids or core.finished  # partial prefills emit nothing
    assert outputs == expected
    assert sched.kv_cache_manager.num_free_blocks == 1000
    if max(len(p) for p in ps) > budget:
        assert runner.num_partial_prefill_rows > 0


def test_decodes_are_scheduled_before_prefill_chunks_and_drafts_wait_for_the_prefill():
    cfg = make_config(max_model_len=128, block_size=4, num_spec=2, max_num_batched_tokens=10)
    sched = Scheduler(cfg, num_blocks=1000)
    runner = FakeRunner(4, 2)
    sched.add_request(make_request("short", [7] * 3, max_tokens=50, ignore_eos=True))
    so = sched.schedule()
    assert so.num_scheduled_tokens == {"short": 3}
    sched.update_from_output(so, runner.execute_model(so))
    sched.add_request(make_request("long", [9] * 40, max_tokens=5, ignore_eos=True))
    so = sched.schedule()
    # The decode (1 token + 2 drafts) is served first; the new prompt gets the remaining 7.
    assert list(so.num_scheduled_tokens) == ["short", "long"]
    assert so.num_scheduled_tokens == {"short": 3, "long": 7}
    assert "long" not in so.scheduled_spec_decode_tokens
    sched.update_from_output(so, runner.execute_model(so))
    assert sched.requests["long"].num_computed_tokens == 7
    assert sched.requests["long"].output_token_ids == []
    assert sched.requests["long"].spec_token_ids == []  # no drafts for an unfinished prefill
    chunks = []
    while sched.requests["long"].output_token_ids == []:
        so = sched.schedule()
        assert list(so.num_scheduled_tokens)[0] == "short"  # decodes first, every step
        assert "long" not in so.scheduled_spec_decode_tokens
        chunks.append(so.num_scheduled_tokens["long"])
        sched.update_from_output(so, runner.execute_model(so))
    assert chunks == [7, 7, 7, 7, 5]  # 40 - 7 prompt tokens left, 7 per step after the decode
    so = sched.schedule()  # now "long" decodes, with drafts
    assert so.num_scheduled_tokens["long"] == 1 + len(so.scheduled_spec_decode_tokens["long"])
    assert len(so.scheduled_spec_decode_tokens["long"]) == 2


def test_preemption_mid_prefill_recomputes_and_gives_the_same_output():
    # 17 blocks of 4 tokens: "a" (8 tokens, decoding) and "b" (60-token prompt) cannot both
    # hold their KV, so "b" is preempted in the middle of its prefill (or "a" later on).
    cfg = make_config(max_model_len=64, block_size=4, max_num_batched_tokens=8)
    sched = Scheduler(cfg, num_blocks=17)
    runner = FakeRunner(4)
    sched.add_request(make_request("a", [5] * 8, max_tokens=40, ignore_eos=True))
    sched.add_request(make_request("b", [6] * 50, max_tokens=4, ignore_eos=True))
    outputs = {}
    preempted_mid_prefill = False
    for _ in range(500):
        if not sched.has_unfinished_requests():
            break
        b = sched.requests.get("b")
        before = (b.num_computed_tokens, b.num_tokens) if b is not None else None
        so = sched.schedule()
        if "b" in so.preempted_req_ids and before is not None and 0 < before[0] < before[1] - 1:
            preempted_mid_prefill = True
        for core in sched.update_from_output(so, runner.execute_model(so)):
            outputs.setdefault(core.request_id, []).extend(core.new_token_ids)
    assert not sched.has_unfinished_requests()
    assert preempted_mid_prefill
    assert outputs["a"] == reference_greedy([5] * 8, 40, eos=None)
    assert outputs["b"] == reference_greedy([6] * 50, 4, eos=None)
    assert sched.kv_cache_manager.num_free_blocks == 17


def test_chunked_prefill_flag_and_budget_errors():
    from vllm.engine.arg_utils import EngineArgs
    import argparse
    parser = EngineArgs.add_cli_args(argparse.ArgumentParser())
    assert EngineArgs.from_cli_args(parser.parse_args([])).create_engine_config(
        ).enable_chunked_prefill is True
    args = parser.parse_args(["--no-enable-chunked-prefill", "--max-num-batched-tokens", "64"])
    cfg = EngineArgs.from_cli_args(args).create_engine_config()
    assert cfg.enable_chunked_prefill is False and cfg.max_num_batched_tokens == 64
    with pytest.raises(ValueError, match="enable_chunked_prefill='yes'"):
        make_config(enable_chunked_prefill="yes")
    with pytest.raises(ValueError, match="max_num_batched_tokens=2 cannot fit one decode step"):
        Scheduler(make_config(num_spec=2, max_num_batched_tokens=2), num_blocks=100)
