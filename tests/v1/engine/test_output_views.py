"""Cumulative outputs without per-step copies (vllm/v1/engine/output_views.py).

PrefixView against a brute-force list snapshot under random appends; engine outputs a user holds
stay exactly what they were when returned (tokens, text, logprobs), later outputs extend earlier
ones, finished outputs carry lists of their own, for plain / logprobs / n=2 / stop-string
requests, synchronous and async scheduling, with requests added and aborted mid-run."""
import copy
import pickle
import random

import pytest

from vllm.engine.arg_utils import EngineArgs
from vllm.model_executor.models.tiny import write_tiny_models
from vllm.sampling_params import SamplingParams
from vllm.v1.engine.llm_engine import LLMEngine
from vllm.v1.engine.output_views import PrefixView


def _check_view(view, expected: list, rng: random.Random) -> None:
    n = len(expected)
    assert len(view) == n and bool(view) == bool(expected)
    assert list(view) == expected and view.tolist() == expected
    assert view == expected and expected == view and not (view != expected)
    assert view != expected + [object()] and view != tuple(expected)
    assert repr(view) == repr(expected)
    for i in range(-n, n):
        assert view[i] == expected[i]
    for bad in (n, -n - 1):
        with pytest.raises(IndexError):
            view[bad]
    for _ in range(5):
        start, stop = rng.randint(-n - 2, n + 2), rng.randint(-n - 2, n + 2)
        step = rng.choice([1, 2, -1, -3, None])
        got = view[start:stop:step]
        assert type(got) is list and got == expected[start:stop:step]
    assert view + [1] == expected + [1] and [1] + view == [1] + expected
    assert list(reversed(view)) == expected[::-1]
    if expected:
        probe = rng.choice(expected)
        assert probe in view and view.index(probe) == expected.index(probe)
        assert view.count(probe) == expected.count(probe)
    assert -12345 not in view
    for clone in (pickle.loads(pickle.dumps(view)), copy.copy(view), copy.deepcopy(view)):
        assert type(clone) is list and clone == expected
    with pytest.raises(TypeError):
        hash(view)


def test_prefix_view_reads_as_its_snapshot_while_the_list_grows():
    rng = random.Random(0)
    for _ in range(20):
        items: list = []
        held = []  # (view, snapshot at creation)
        for _ in range(rng.randint(1, 30)):
            if rng.random() < 0.5:
                items.append(rng.randint(0, 9))
            else:
                items.extend(rng.randint(0, 9) for _ in range(rng.randint(0, 4)))
            held.append((PrefixView(items, len(items)), list(items)))
        for view, snapshot in held:  # everything appended after a view was made is invisible
            _check_view(view, snapshot, rng)
        a, b = held[-1][0], PrefixView(list(items), len(items))
        assert a == b and a + b == items + items


@pytest.fixture(scope="module")
def tiny():
    return write_tiny_models()


def _make_engine(tiny, async_scheduling: bool) -> LLMEngine:
    return LLMEngine.from_engine_args(EngineArgs(
        model=str(tiny.target), device="cpu", max_model_len=96, max_num_seqs=6,
        async_scheduling=async_scheduling))


def _snapshot(output) -> tuple:
    return tuple((c.index, list(c.token_ids), c.text, c.finish_reason,
                  None if c.logprobs is None else [dict(e) for e in c.logprobs],
                  c.cumulative_logprob) for c in output.outputs) + (output.finished,)


def _traffic(seed: int):
    """(step, request id, prompt, params) additions and (step, request id) aborts."""
    rng = random.Random(seed)
    adds, aborts = [], []
    for i in range(9):
        kind = rng.choice(["plain", "logprobs", "n2", "stop", "nodetok"])
        prompt = [rng.randint(3, 200) for _ in range(rng.randint(2, 12))]
        max_tokens = rng.randint(1, 14)
        params = {
            "plain": SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True),
            "logprobs": SamplingParams(temperature=0.0, max_tokens=max_tokens, logprobs=2),
            "n2": SamplingParams(temperature=0.8, seed=i, n=2, max_tokens=max_tokens,
                                 ignore_eos=True),
            "stop": SamplingParams(temperature=0.0, max_tokens=max_tokens, stop=["e", "a"]),
            "nodetok": SamplingParams(temperature=0.0, max_tokens=max_tokens, detokenize=False,
                                      ignore_eos=True),
        }[kind]
        adds.append((rng.randint(0, 8), f"q{i}", prompt, params))
        if rng.random() < 0.2:
            aborts.append((rng.randint(1, 10), f"q{i}"))
    return adds, aborts


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_held_outputs_never_change_and_extend_cumulatively(tiny, async_scheduling):
    adds, aborts = _traffic(seed=1 + async_scheduling)
    held = []  # (output as returned, its snapshot when returned)
    with _make_engine(tiny, async_scheduling) as engine:
        step = 0
        while step <= 10 or engine.has_unfinished_requests():
            for when, rid, prompt, params in adds:
                if when == step:
                    engine.add_request(rid, prompt, params)
            for when, rid in aborts:
                if when == step:
                    engine.abort_request(rid)
            for out in engine.step():
                held.append((out, _snapshot(out)))
            step += 1
            assert step < 200
    assert held
    by_request: dict[str, list] = {}
    for out, snap in held:
        assert _snapshot(out) == snap  # what a user held is what they were handed
        by_request.setdefault(out.request_id, []).append(out)
    finished = 0
    for outs in by_request.values():
        for before, after in zip(outs, outs[1:]):
            for b, a in zip(before.outputs, after.outputs):
                assert list(a.token_ids)[:len(b.token_ids)] == list(b.token_ids)
                assert a.text.startswith(b.text)
                if b.logprobs is not None:
                    assert list(a.logprobs)[:len(b.logprobs)] == list(b.logprobs)
        last = outs[-1]
        if last.finished:
            finished += 1
            for c in last.outputs:
                # a finished sample's output owns plain lists (n=2: a sibling may still run)
                if c.finish_reason is not None:
                    assert type(c.token_ids) is list
                    assert c.logprobs is None or type(c.logprobs) is list
    assert finished >= 5
