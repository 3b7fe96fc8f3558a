"""The runner's steady-decode layout (`_steady_decode_layout`) against the general layout.

Brute force over random resident states and random scheduler outputs (plain decodes, prefill
chunks, the first token of a re-admitted request, admissions, drafts, rows past max_model_len):
whenever the fast layout answers, it equals the general layout row for row; it declines every
step that has a row the general layout treats differently; and it declines (so the general
layout raises) for a row that would pass max_model_len.
"""
from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from vllm.v1.core.sched.output import CachedRequestData, NewRequestData, SchedulerOutput
from vllm.v1.worker.gpu.buffer_utils import CpuGpuBuffer
from vllm.v1.worker.gpu.model_runner import GPUModelRunner
from vllm.v1.worker.gpu.request_states import RequestStates

MAX_REQS = 16


def _bare_runner(max_model_len: int) -> GPUModelRunner:
    """Only the state the two layout functions read (no model, no KV cache)."""
    runner = GPUModelRunner.__new__(GPUModelRunner)
    runner.device = torch.device("cpu")
    runner.max_model_len = max_model_len
    runner.num_spec_tokens = 0
    runner.max_num_tokens = 256
    runner.requests = RequestStates(MAX_REQS, "cpu")
    runner._forced = CpuGpuBuffer(MAX_REQS, 1, dtype=torch.int64, device="cpu")
    runner._has_draft_probs = np.zeros(MAX_REQS, dtype=bool)
    return runner


def _scheduler_output(new_reqs, num_scheduled: dict, spec: dict) -> SchedulerOutput:
    """The step's SchedulerOutput: rows not newly admitted are cached requests."""
    cached = CachedRequestData(req_ids=[r for r in num_scheduled if r not in
                                        {n.req_id for n in new_reqs}])
    return SchedulerOutput(scheduled_new_reqs=new_reqs, scheduled_cached_reqs=cached,
                           num_scheduled_tokens=num_scheduled,
                           total_num_scheduled_tokens=sum(num_scheduled.values()),
                           scheduled_spec_decode_tokens=spec)


def _random_step(runner: GPUModelRunner, rng: random.Random, kinds: list[str]):
    """Resident requests of the given kinds and the scheduler output that schedules them."""
    num_scheduled, new_reqs = {}, []
    spec = {}
    for i, kind in enumerate(kinds):
        req_id = f"r{i}"
        prompt = [rng.randrange(100) for _ in range(rng.randint(2, 12))]
        if kind == "new":
            new_reqs.append(NewRequestData(req_id, prompt, [0], 0))
            state = runner.requests.add(req_id, prompt, 0, None)
            num_scheduled[req_id] = len(prompt)
            continue
        outputs = [rng.randrange(100) for _ in range(rng.randint(1, 5))]
        if kind == "readmitted":  # prefilled again with its outputs; the last token is known
            state = runner.requests.add(req_id, prompt + outputs, len(prompt) + len(outputs) - 1,
                                        None)
            num_scheduled[req_id] = 1
            continue
        state = runner.requests.add(req_id, prompt, 0, None)
        state.token_ids.extend(outputs)  # sampled here after the prompt
        if kind == "decode":
            runner.requests.set_num_computed(state, len(state.token_ids) - 1)
            num_scheduled[req_id] = 1
        elif kind == "draft":
            runner.requests.set_num_computed(state, len(state.token_ids) - 1)
            num_scheduled[req_id] = 2
            spec[req_id] = [-1]
        elif kind == "chunk":  # an unfinished prefill: the next chunk of the prompt
            state.token_ids[:] = prompt
            runner.requests.set_num_computed(state, 1)
            num_scheduled[req_id] = rng.randint(1, len(prompt) - 1)
        elif kind == "too_long":
            runner.requests.set_num_computed(state, len(state.token_ids) - 1)
            runner.max_model_len = len(state.token_ids) - 1
            num_scheduled[req_id] = 1
    return _scheduler_output(new_reqs, num_scheduled, spec)


@pytest.mark.parametrize("seed", range(3))
def test_steady_layout_equals_general_layout(seed):
    rng = random.Random(seed)
    taken = declined = 0
    for _ in range(150):
        runner = _bare_runner(max_model_len=64)
        n = rng.randint(1, MAX_REQS)
        if rng.random() < 0.5:
            kinds = ["decode"] * n
        else:
            kinds = [rng.choice(["decode", "decode", "new", "readmitted", "chunk", "too_long"])
                     for _ in range(n)]
        so = _random_step(runner, rng, kinds)
        fast = runner._steady_decode_layout(so)
        plain = all(k == "decode" for k in kinds)
        if "too_long" in kinds:
            assert fast is None
            with pytest.raises(ValueError, match="max_model_len"):
                runner._general_layout(so)
            continue
        general = runner._general_layout(so)
        if fast is None:
            declined += 1
            assert not plain, "a step of plain decodes must take the fast layout"
            continue
        taken += 1
        assert plain
        rows, counts, drafts, samples, host_ids = fast
        g_rows, g_counts, g_drafts, g_samples, g_host_ids = general
        assert [r.req_id for r in rows] == [r.req_id for r in g_rows]
        assert all(a is b for a, b in zip(rows, g_rows))
        assert (counts, drafts, samples, host_ids) == (g_counts, g_drafts, g_samples, g_host_ids)
    assert taken > 20 and declined > 10


def test_steady_layout_declines_drafts():
    runner = _bare_runner(max_model_len=64)
    so = _random_step(runner, random.Random(0), ["decode", "draft"])
    assert runner._steady_decode_layout(so) is None


K = 4


def _spec_runner(max_model_len: int) -> GPUModelRunner:
    runner = _bare_runner(max_model_len)
    runner.num_spec_tokens = K
    runner.requests = RequestStates(MAX_REQS, "cpu", K)
    runner._forced = CpuGpuBuffer(MAX_REQS, K, dtype=torch.int64, device="cpu")
    return runner


def _random_verify_step(runner: GPUModelRunner, rng: random.Random, kinds: list[str]):
    """Started requests verifying drafts, plus rows the fast verify layout must decline: forced
    (scheduler-provided) draft ids, a count that does not match the drafts, more drafts than k,
    a prefill chunk, an admission, a row past max_model_len."""
    num_scheduled, spec, new_reqs = {}, {}, []
    for i, kind in enumerate(kinds):
        req_id = f"r{i}"
        prompt = [rng.randrange(100) for _ in range(rng.randint(2, 12))]
        if kind == "new":
            new_reqs.append(NewRequestData(req_id, prompt, [0], 0))
            runner.requests.add(req_id, prompt, 0, None)
            num_scheduled[req_id] = len(prompt)
            continue
        state = runner.requests.add(req_id, prompt, 0, None)
        state.token_ids.extend(rng.randrange(100) for _ in range(rng.randint(1, 5)))
        runner.requests.set_num_computed(state, len(state.token_ids) - 1)
        n = rng.randint(0, K)
        drafts = [-1] * n
        count = 1 + n
        if kind == "forced":
            n = max(n, 1)
            drafts = [rng.randrange(100) for _ in range(n)]
            count = 1 + n
        elif kind == "bad_count":
            count = 1 + n + rng.choice([-1, 1]) if n else 2
        elif kind == "too_many":
            drafts, count = [-1] * (K + 1), K + 2
        elif kind == "chunk":
            state.token_ids[:] = prompt
            runner.requests.set_num_computed(state, 1)
            drafts, count = [], rng.randint(1, len(prompt) - 1)
        elif kind == "too_long":
            runner.max_model_len = len(state.token_ids) - 1
        if drafts or rng.random() < 0.5:  # a row without drafts may also be absent from spec
            spec[req_id] = drafts
        num_scheduled[req_id] = count
    return _scheduler_output(new_reqs, num_scheduled, spec)


@pytest.mark.parametrize("seed", range(3))
def test_steady_verify_layout_equals_general_layout(seed):
    rng = random.Random(seed)
    taken = declined = 0
    for _ in range(150):
        runner = _spec_runner(max_model_len=64)
        n = rng.randint(1, MAX_REQS)
        if rng.random() < 0.5:
            kinds = ["draft"] * n
        else:
            kinds = [rng.choice(["draft", "draft", "draft", "forced", "bad_count", "too_many",
                                 "chunk", "new", "too_long"]) for _ in range(n)]
        so = _random_verify_step(runner, rng, kinds)
        fast = runner._steady_verify_layout(so)
        steady = all(k == "draft" for k in kinds)
        if fast is None:
            declined += 1
            assert not steady, "a step of placeholder-draft decodes must take the fast layout"
            continue
        taken += 1
        assert steady
        general = runner._general_layout(so)
        rows, counts, drafts, samples, host_ids = fast
        g_rows, g_counts, g_drafts, g_samples, g_host_ids = general
        assert all(a is b for a, b in zip(rows, g_rows)) and len(rows) == len(g_rows)
        assert (counts, drafts, samples, host_ids) == (g_counts, g_drafts, g_samples, g_host_ids)
    assert taken > 20 and declined > 20


def test_steady_verify_layout_leaves_errors_to_the_general_layout():
    """Rows the general layout rejects are declined, so the error is still raised there."""
    for kind, match in (("bad_count", "num_scheduled_tokens must be"),
                        ("too_long", "max_model_len")):
        runner = _spec_runner(max_model_len=64)
        so = _random_verify_step(runner, random.Random(1), ["draft", kind])
        assert runner._steady_verify_layout(so) is None
        with pytest.raises(ValueError, match=match):
            runner._general_layout(so)
