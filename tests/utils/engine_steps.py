"""Driving a real LLMEngine step by step in tests: a greedy request and a loop to completion."""
from vllm.sampling_params import SamplingParams


def greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)


def run_to_completion(engine, finals: dict) -> None:
    """Step until nothing is left; every finished RequestOutput lands in finals[request_id]."""
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                finals[out.request_id] = out


def run_with_arrivals(engine, requests: dict, arrivals: dict | None = None, *,
                      max_steps: int = 2000, finish_once: bool = False) -> dict:
    """Add each request (id -> (prompt, params)) at its arrival step (id -> step, default 0),
    step to completion and return id -> (token ids, finish reason, text) of the final outputs.
    `finish_once`: also assert no request reports finished twice."""
    arrivals = arrivals or {}
    finals, step = {}, 0
    pending = dict(requests)
    while pending or engine.has_unfinished_requests():
        for rid in [r for r in pending if arrivals.get(r, 0) <= step]:
            prompt, params = pending.pop(rid)
            engine.add_request(rid, prompt, params)
        for out in engine.step():
            if out.finished:
                if finish_once:
                    assert out.request_id not in finals, "a request finished twice"
                finals[out.request_id] = out
        step += 1
        assert step < max_steps, "engine did not finish"
    return {rid: (list(o.outputs[0].token_ids), o.outputs[0].finish_reason,
                  o.outputs[0].text) for rid, o in finals.items()}


def record_launches(engine) -> list:
    """Wrap the engine's executor launch (async scheduling) to record, in order,
    ["launch", n, done at launch, drafts verified, tokens] and ("collect", n) events. A launch
    is recorded when it starts: the runner may collect an earlier step inside it."""
    events = []
    executor = engine.executor
    launch = executor.execute_model_async

    def recording_launch(so):
        index = sum(1 for e in events if e[0] == "launch")
        event = ["launch", index, None, bool(so.scheduled_spec_decode_tokens),
                 so.total_num_scheduled_tokens]
        events.append(event)
        handle = launch(so)
        event[2] = handle.done
        get = handle.get_output

        def recording_get():
            events.append(("collect", index))
            return get()
        handle.get_output = recording_get
        return handle
    executor.execute_model_async = recording_launch
    return events


def collected_before_next_launch(events, n: int) -> bool:
    """In record_launches' events: step n was collected before step n + 1 was launched."""
    order = [tuple(e[:2]) for e in events]
    nxt = ("launch", n + 1)
    return nxt not in order or order.index(("collect", n)) < order.index(nxt)
