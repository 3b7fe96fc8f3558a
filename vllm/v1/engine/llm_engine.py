"""LLMEngine: requests in, RequestOutputs out, one scheduler step at a time.

add_request tokenizes and validates; step() = schedule -> executor (all ranks run the model, rank 0
answers) -> scheduler update (token-level stops) -> incremental detokenization (stop strings) ->
cumulative RequestOutputs. Metrics cover queues, KV usage, TTFT/TPOT and spec-decode acceptance.
"""
from __future__ import annotations

import atexit
import copy
import itertools
import logging
import time
import weakref
from collections import deque
from dataclasses import dataclass

from vllm.inputs import parse_prompt
from vllm.logprobs import logprobs_row_to_dict
from vllm.outputs import CompletionOutput, RequestOutput
from vllm.sampling_params import SamplingParams
from vllm.v1.core.sched.request import Request, RequestStatus
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.engine.detokenizer import IncrementalDetokenizer
from vllm.v1.engine.output_views import PrefixView
from vllm.v1.executor.abstract import DEFAULT_WORKER_CLS, Executor, StepError
from vllm.v1.metrics.stats import RequestTimer
from vllm.v1.sample.metadata import is_greedy

logger = logging.getLogger(__name__)

# Latency samples kept for get_metrics() (the most recent ones).
_MAX_LATENCY_SAMPLES = 4096
# A step that raises is pinned on one request (see _recover_from_failed_step); this many failed
# steps in a row means the fault is not requests' data but the engine's, which is fatal.
MAX_CONSECUTIVE_FAILED_STEPS = 8


def resolve_model_paths(vllm_config) -> None:
    """model None -> the built-in tiny checkpoint (written on first use); likewise the drafter."""
    model_config = vllm_config.model_config
    spec = vllm_config.speculative_config
    needs_target = model_config.model is None
    needs_drafter = spec is not None and spec.model is None
    if not (needs_target or needs_drafter):
        return
    if needs_drafter and spec.method is None:
        raise ValueError("speculative_config needs a method or a model")
    from vllm.model_executor.models.tiny import write_tiny_models
    paths = write_tiny_models()
    if needs_target:
        model_config.model = str(paths.target)
    if needs_drafter:
        drafter_dir = getattr(paths, spec.method, None)
        if drafter_dir is None:
            raise ValueError(f"no built-in tiny drafter for speculative method {spec.method!r}; "
                             "set speculative_config.model to a drafter checkpoint directory")
        spec.model = str(drafter_dir)
    vllm_config.resolve_speculative_config()  # defaults from the now-known drafter config
    vllm_config.resolve_async_scheduling()  # its automatic choice depends on the method


@dataclass
class _RequestState:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    detokenizer: IncrementalDetokenizer | None
    timer: RequestTimer
    params: SamplingParams | None = None
    parent_id: str | None = None  # n > 1: the user's request id (this is one child)
    index: int = 0  # CompletionOutput.index
    logprobs: list | None = None  # SampleLogprobs when params.logprobs is set
    cumulative_logprob: float | None = None
    prompt_logprobs: list | None = None


@dataclass
class _ParentState:
    """n > 1 (upstream's ParentRequest): one user request fanned out into n child requests that
    schedule, draft and verify on their own; their outputs are merged back into one
    RequestOutput with n CompletionOutputs (cumulative)."""

    request_id: str
    child_ids: list[str]
    completions: list[CompletionOutput]
    finished: list[bool]
    prompt: str | None
    prompt_token_ids: list[int]
    prompt_logprobs: list | None = None


class LLMEngine:

    def __init__(self, vllm_config, executor_class: type[Executor] | None = None,
                 worker_cls: str = DEFAULT_WORKER_CLS):
        self.vllm_config = vllm_config
        resolve_model_paths(vllm_config)
        model_config = vllm_config.model_config
        from vllm.transformers_utils.tokenizer import get_tokenizer_for
        self.tokenizer = get_tokenizer_for(model_config)  # --tokenizer / --trust-remote-code / --chat-template
        hf_config = model_config.hf_config
        self.vocab_size = int(getattr(hf_config, "vocab_size"))
        self.eos_token_id = self.tokenizer.eos_token_id
        if self.eos_token_id is None:
            eos = getattr(hf_config, "eos_token_id", None)
            self.eos_token_id = eos[0] if isinstance(eos, (list, tuple)) else eos
        self.max_model_len = int(model_config.max_model_len)
        self.seed = int(getattr(model_config, "seed", 0) or 0)

        self.executor = None
        executor_class = executor_class or Executor.get_class(vllm_config)
        self.executor = executor_class(vllm_config, worker_cls=worker_cls)
        try:
            if vllm_config.async_scheduling and not self.executor.supports_async_scheduling():
                if not getattr(vllm_config, "async_scheduling_auto", False):
                    raise ValueError(f"async_scheduling: {type(self.executor).__name__} with "
                                     f"worker {worker_cls} cannot overlap steps; drop "
                                     "--async-scheduling")
                vllm_config.async_scheduling = False
            num_blocks = self.executor.initialize_kv_cache()
            self.scheduler = Scheduler(vllm_config, num_blocks)
        except BaseException:
            self.executor.shutdown()
            raise
        logger.info("KV cache: %d blocks of %d tokens", num_blocks,
                    self.scheduler.kv_cache_manager.tokens_per_block)

        self._states: dict[str, _RequestState] = {}
        self._parents: dict[str, _ParentState] = {}
        self.last_iteration_tokens = 0
        self._request_index = itertools.count()
        self._ttft_samples: deque[float] = deque(maxlen=_MAX_LATENCY_SAMPLES)
        self._tpot_samples: deque[float] = deque(maxlen=_MAX_LATENCY_SAMPLES)
        self._num_prompt_tokens = 0
        self._num_generation_tokens = 0
        self._num_finished = 0
        self._request_errors: dict[str, str] = {}
        self._consecutive_failed_steps = 0
        # Failure isolation (see _recover_from_failed_step): requests set aside after a failed
        # step with several suspects, released one at a time as "trials".
        self._quarantine: deque[Request] = deque()
        self._trials: set[str] = set()
        self._shut_down = False
        # Async scheduling: (scheduler output, AsyncModelRunnerOutput, prompt tokens, launch
        # time) of the launched step whose output is not collected yet.
        self.async_scheduling = bool(getattr(vllm_config, "async_scheduling", False))
        self._pending = None
        self._speculative = vllm_config.speculative_config is not None
        self_ref = weakref.ref(self)
        self._atexit_hook = lambda: (self_ref() is not None and self_ref().shutdown())
        atexit.register(self._atexit_hook)

    # ---- construction ------------------------------------------------------------------------
    @classmethod
    def from_vllm_config(cls, vllm_config, **kwargs) -> LLMEngine:
        return cls(vllm_config, **kwargs)

    @classmethod
    def from_engine_args(cls, engine_args, **kwargs) -> LLMEngine:
        return cls(engine_args.create_engine_config(), **kwargs)

    # ---- requests ----------------------------------------------------------------------------
    def add_request(self, request_id: str, prompt, params=None) -> None:
        """prompt: a string, token ids, or a TextPrompt / TokensPrompt dict (vllm.inputs)."""
        if params is None:
            params = SamplingParams()
        if request_id in self._states or request_id in self._parents:
            raise ValueError(f"request id {request_id!r} is already in use; use a unique request id")
        prompt_text, prompt_token_ids = parse_prompt(prompt)
        if prompt_token_ids is None:
            prompt_token_ids = self.tokenizer.encode(prompt_text)
        bad = [t for t in prompt_token_ids if not 0 <= t < self.vocab_size]
        if bad:
            raise ValueError(f"prompt token ids {bad[:5]} are outside the vocabulary "
                             f"[0, {self.vocab_size}); pass valid token ids")
        params = self._prepare_params(params)
        n = int(getattr(params, "n", 1))
        if n == 1:
            self._add_one(request_id, prompt_text, prompt_token_ids, params)
            return
        # Upstream's fan-out: child i is "{i}_{parent}", with seed + i when a seed is given.
        child_ids = [f"{i}_{request_id}" for i in range(n)]
        parent = _ParentState(request_id, child_ids,
                              [CompletionOutput(i, "", [], None) for i in range(n)],
                              [False] * n, prompt_text, prompt_token_ids)
        added = []
        try:
            for i, child_id in enumerate(child_ids):
                child = copy.copy(params)
                child.n = 1
                if params.seed is not None:
                    child.seed = params.seed + i
                self._add_one(child_id, prompt_text, prompt_token_ids, child, parent_id=request_id,
                              index=i)
                added.append(child_id)
        except BaseException:
            if added:
                self.scheduler.finish_requests(added, RequestStatus.FINISHED_ABORTED)
                for child_id in added:
                    self._states.pop(child_id, None)
            raise
        self._parents[request_id] = parent

    def _prepare_params(self, params):
        """A private copy with the engine's facts (EOS for min_tokens, tokenized bad words)."""
        if not isinstance(params, SamplingParams):
            raise ValueError(f"sampling params must be a vllm.SamplingParams, got "
                             f"{type(params).__name__}")
        params = copy.copy(params)
        params.update_from_tokenizer(self.eos_token_id, self.tokenizer)
        for name, ids in (("logit_bias", list(params.logit_bias or ())),
                          ("allowed_token_ids", params.allowed_token_ids or ()),
                          ("stop_token_ids", params.stop_token_ids or ())):
            out = [t for t in ids if t >= self.vocab_size]
            if out:
                raise ValueError(f"{name} has token ids {out[:5]} outside the vocabulary "
                                 f"[0, {self.vocab_size}); pass valid token ids")
        for name in ("logprobs", "prompt_logprobs"):
            k = getattr(params, name)
            if k is not None and k > self.vocab_size:
                raise ValueError(f"{name}={k} is larger than the vocabulary ({self.vocab_size}); "
                                 "ask for fewer (or -1 for all)")
        return params

    def _add_one(self, request_id: str, prompt_text, prompt_token_ids: list[int], params,
                 parent_id: str | None = None, index: int = 0) -> None:
        request_index = next(self._request_index)
        if not is_greedy(params) and getattr(params, "seed", None) is None:
            # Every rank must draw the same numbers: give the request a definite seed.
            params.seed = self.seed + request_index
        max_tokens = getattr(params, "max_tokens", None)
        if max_tokens is None:
            max_tokens = max(1, self.max_model_len - len(prompt_token_ids))
        request = Request(request_id=request_id, prompt_token_ids=prompt_token_ids,
                          sampling_params=params, eos_token_id=self.eos_token_id,
                          max_tokens=int(max_tokens))
        self.scheduler.add_request(request)  # validates lengths (ValueError)
        detokenizer = None
        if getattr(params, "detokenize", True):
            detokenizer = IncrementalDetokenizer(
                self.tokenizer, prompt_token_ids,
                skip_special_tokens=getattr(params, "skip_special_tokens", True),
                stop=_as_list(getattr(params, "stop", None)),
                include_stop_str_in_output=getattr(params, "include_stop_str_in_output", False))
        self._states[request_id] = _RequestState(
            request_id, prompt_text, prompt_token_ids, [], detokenizer,
            # TTFT / TPOT / phases only: the per-step gaps are not kept (O(1) per request).
            RequestTimer(num_prompt_tokens=len(prompt_token_ids), keep_bursts=False),
            params=params,
            parent_id=parent_id, index=index,
            logprobs=[] if params.logprobs is not None else None,
            cumulative_logprob=0.0 if params.logprobs is not None else None)
        self._num_prompt_tokens += len(prompt_token_ids)

    def abort_request(self, request_ids: str | list[str]) -> None:
        if isinstance(request_ids, str):
            request_ids = [request_ids]
        expanded = []
        for req_id in request_ids:
            parent = self._parents.pop(req_id, None)
            expanded.extend(parent.child_ids if parent is not None else [req_id])
        request_ids = expanded
        self.scheduler.finish_requests(request_ids, RequestStatus.FINISHED_ABORTED)
        gone = set(request_ids)
        if self._quarantine:
            self._quarantine = deque(r for r in self._quarantine if r.request_id not in gone)
        self._trials -= gone
        for req_id in request_ids:
            self._states.pop(req_id, None)

    def has_unfinished_requests(self) -> bool:
        return (self.scheduler.has_unfinished_requests() or bool(self._quarantine)
                or self._pending is not None)

    def get_num_unfinished_requests(self) -> int:
        return self.scheduler.get_num_unfinished_requests() + len(self._quarantine)

    # ---- one step ----------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        self._release_trial()
        if self.async_scheduling:
            return self._step_async()
        if not self.scheduler.has_unfinished_requests():
            return []
        step_start = time.perf_counter()
        scheduler_output = self.scheduler.schedule()
        num_prompt_tokens = self._mark_scheduled(scheduler_output)
        try:
            runner_output = self.executor.execute_model(scheduler_output)
        except Exception as error:  # noqa: BLE001 - classified below
            return self._recover_from_failed_step(scheduler_output, error)
        return self._process_step(scheduler_output, runner_output, num_prompt_tokens, step_start)

    def _mark_scheduled(self, scheduler_output) -> int:
        """First-scheduled times of new requests; returns their prompt tokens."""
        scheduled_at = time.perf_counter()
        num_prompt_tokens = 0
        for new in scheduler_output.scheduled_new_reqs:
            new_state = self._states.get(new.req_id)
            if new_state is not None and new_state.timer.first_scheduled_time is None:
                new_state.timer.first_scheduled_time = scheduled_at
                num_prompt_tokens += len(new_state.prompt_token_ids)
        return num_prompt_tokens

    def _step_async(self) -> list[RequestOutput]:
        """Async scheduling: schedule and launch step N+1, then collect step N (whose GPU work
        ran while this host prepared N+1). Outputs trail the launch by one step.

        With a drafter only a step that verifies and proposes no drafts is left in flight: a
        step that verifies (or proposes, or that the runner completed in place) is collected
        right after its launch, before the next step is scheduled (its accepted counts or
        drafts shape that plan).

        Cost model: a step's host time is its own launch plus its own collection (the wait for
        its copy included). The period between collections is not: it holds the next step's
        launch, and when that step verifies or proposes (collected right after) it also holds
        that heavy launch, which then counted for both steps and made plain steps look as dear
        as speculative ones. In steady overlapped decoding the two agree (launches alike)."""
        pending, self._pending = self._pending, None
        launched = None
        if self.scheduler.has_unfinished_requests():
            step_start = time.perf_counter()
            scheduler_output = self.scheduler.schedule()
            num_prompt_tokens = self._mark_scheduled(scheduler_output)
            try:
                handle = self.executor.execute_model_async(scheduler_output)
            except Exception as error:  # noqa: BLE001 - classified in _recover_async
                return self._recover_async(pending, scheduler_output, error)
            # The launch's own host time (schedule + launch) rides with the step until it is
            # collected: the docstring says why.
            launched = (scheduler_output, handle, num_prompt_tokens,
                        time.perf_counter() - step_start)
        outputs: list[RequestOutput] = []
        if pending is not None:
            scheduler_output, handle, num_prompt_tokens, launch_seconds = pending
            collect_start = time.perf_counter()
            try:
                runner_output = handle.get_output()
            except Exception as error:  # noqa: BLE001
                # The step launched after the failed one was prepared from its state: both are
                # recomputed.
                self._pending = None
                outputs = self._recover_from_failed_step(scheduler_output, error)
                if launched is not None:
                    self.scheduler.requeue_for_recompute(
                        [r for r in launched[0].num_scheduled_tokens if r in self._states])
                return outputs
            outputs = self._process_step(scheduler_output, runner_output, num_prompt_tokens,
                                         collect_start - launch_seconds)
        if launched is not None and self._collect_now(launched[0], launched[1]):
            outputs = outputs + self._collect_launched(launched)
            # Two steps collected in one call: a request's newest (cumulative) output only.
            return self._dedupe_parents(outputs) if pending is not None else outputs
        self._pending = launched
        return outputs

    def _collect_now(self, scheduler_output, handle) -> bool:
        """A speculative engine's step that must be collected before the next is scheduled:
        it verifies drafts (not `advanced`), may propose drafts, or completed in place."""
        return self._speculative and (handle.done or not scheduler_output.advanced
                                      or scheduler_output.propose_drafts)

    def _collect_launched(self, launched) -> list[RequestOutput]:
        scheduler_output, handle, num_prompt_tokens, launch_seconds = launched
        collect_start = time.perf_counter()
        try:
            runner_output = handle.get_output()
        except Exception as error:  # noqa: BLE001 - classified below
            return self._recover_from_failed_step(scheduler_output, error)
        return self._process_step(scheduler_output, runner_output, num_prompt_tokens,
                                  collect_start - launch_seconds)

    def _recover_async(self, pending, scheduler_output, error: Exception) -> list:
        """A launch failed: collect the step still in flight first (its tokens are good), then
        recover the failed one as a synchronous step would."""
        outputs: list[RequestOutput] = []
        if pending is not None:
            prev_output, handle, num_prompt_tokens, launch_seconds = pending
            collect_start = time.perf_counter()
            try:
                outputs = self._process_step(prev_output, handle.get_output(),
                                             num_prompt_tokens, collect_start - launch_seconds)
            except Exception:  # noqa: BLE001 - the launch's error is the one reported
                self.scheduler.requeue_for_recompute(
                    [r for r in prev_output.num_scheduled_tokens if r in self._states])
        return outputs + self._recover_from_failed_step(scheduler_output, error)

    def _process_step(self, scheduler_output, runner_output, num_prompt_tokens: int,
                      step_start: float) -> list[RequestOutput]:
        """Scheduler update, then one output per request that gained tokens (or finished).
        `step_start`: where the step's host time began, for the cost model (async scheduling
        passes the collection's start less the launch's own time, see _step_async).

        Per request this is O(new tokens), flat in output length: outputs hold read-only
        prefix views of the request's token / logprob lists (output_views.py), the text grows by
        the detokenizer's delta, and the step's counters are summed once at the end."""
        self._consecutive_failed_steps = 0
        if self._trials:
            self._trials.difference_update(scheduler_output.num_scheduled_tokens)
        core_outputs = self.scheduler.update_from_output(scheduler_output, runner_output)
        now = time.perf_counter()
        # Host wall time of the whole step (schedule, model, update): the speculation cost
        # model's measurement. No device sync is added: the runner's step ends in its own copy.
        self.scheduler.record_step_time(scheduler_output, now - step_start)
        outputs = []
        step_logprobs = runner_output.logprobs
        step_prompt_logprobs = runner_output.prompt_logprobs
        states = self._states
        make_output = self._make_output
        num_new_tokens = 0  # output tokens (after stop-string truncation)
        num_sampled_tokens = 0  # tokens the scheduler accepted (vllm:iteration_tokens_total)
        merged = False  # some output is a parent's (n > 1): dedupe at the end
        for core in core_outputs:
            new_token_ids = core.new_token_ids
            num_new = len(new_token_ids)
            num_sampled_tokens += num_new
            req_id = core.request_id
            state = states.get(req_id)
            if state is None:
                continue
            if step_prompt_logprobs and state.prompt_logprobs is None \
                    and req_id in step_prompt_logprobs:
                state.prompt_logprobs = self._prompt_logprobs(step_prompt_logprobs[req_id])
            finish_reason = core.finish_reason
            stop_reason = core.stop_reason
            detokenizer = state.detokenizer
            if detokenizer is not None and num_new == 1 and detokenizer.step_token is not None:
                # detokenizer.update() of one token without stop strings, inlined
                delta = detokenizer.step_token(int(new_token_ids[0]))
                if delta:
                    detokenizer.output_text += delta
            elif detokenizer is not None:
                stop_str = detokenizer.update(new_token_ids)
                if stop_str is not None:
                    finish_reason, stop_reason = "stop", stop_str
                    # Tokens of a speculative step after the one that completed the stop string
                    # are not output (a plain engine never generates them).
                    new_token_ids = new_token_ids[:detokenizer.num_consumed]
                    num_new = len(new_token_ids)
                    if core.finish_reason is None:
                        self.scheduler.finish_requests(req_id, RequestStatus.FINISHED_STOPPED)
            if step_logprobs and state.logprobs is not None and req_id in step_logprobs:
                self._append_logprobs(state, step_logprobs[req_id], num_new)
            if num_new == 1:
                state.output_token_ids.append(new_token_ids[0])
            else:
                state.output_token_ids.extend(new_token_ids)
            num_new_tokens += num_new
            timer = state.timer
            if timer.keep_bursts or timer.first_token_time is None or not num_new:
                timer.record_tokens(num_new, now)
            else:  # record_tokens of a later burst without kept gaps, inlined
                timer.last_token_time = now
                timer.num_generation_tokens += num_new
            if finish_reason is None:
                # _make_output's running case, inlined (it runs for every request every step;
                # positional arguments in vllm/outputs.py's field order).
                token_ids = state.output_token_ids
                logprobs = state.logprobs
                output = RequestOutput(req_id, state.prompt, state.prompt_token_ids, [
                    CompletionOutput(
                        state.index, "" if detokenizer is None else detokenizer.output_text,
                        PrefixView(token_ids, len(token_ids)), None, stop_reason,
                        state.cumulative_logprob,
                        None if logprobs is None else PrefixView(logprobs, len(logprobs)))],
                    False, None, state.prompt_logprobs)
            else:
                output = make_output(state, True, finish_reason, stop_reason)
                self._record_finished(state)
                del states[req_id]
            if state.parent_id is not None:
                merged = True
                output = self._merge_child(state, output)
                if output is None:
                    continue
            outputs.append(output)
        self._num_generation_tokens += num_new_tokens
        # Prompt tokens prefilled + tokens generated this step (vllm:iteration_tokens_total).
        self.last_iteration_tokens = num_prompt_tokens + num_sampled_tokens
        return self._dedupe_parents(outputs) if merged else outputs

    # ---- failure isolation -------------------------------------------------------------------
    def take_request_errors(self) -> dict[str, str]:
        """Requests failed by the last step(s): user request id -> message (then forgotten)."""
        errors, self._request_errors = self._request_errors, {}
        return errors

    def _recover_from_failed_step(self, scheduler_output, error: Exception) -> list:
        """An exception in the runner that left the executor usable (in-process worker) is
        pinned on one request. Suspects are the step's requests that never completed a step: its
        first-time admissions and released trials. One suspect: it fails alone (blocks freed,
        finish_reason "error", the message in take_request_errors()). Several (or none, then
        every scheduled request is a suspect): they are set aside and released one per step as
        trials, so the next failure names its request. The step's other requests are preempted
        and recomputed, since the runner may hold half-updated state for them. A dead executor
        or MAX_CONSECUTIVE_FAILED_STEPS failures in a row are the engine's fault: re-raised."""
        self._consecutive_failed_steps += 1
        if getattr(self.executor, "is_shutdown", False) or \
                self._consecutive_failed_steps > MAX_CONSECUTIVE_FAILED_STEPS:
            raise error
        # The runner may have raised before dropping the requests that finished since the last
        # step: hand those ids to it again next step (dropping twice is harmless), or their
        # runner slots would leak.
        self.scheduler.finished_req_ids |= set(scheduler_output.finished_req_ids)
        scheduled = list(scheduler_output.num_scheduled_tokens)
        new_ids = {new.req_id for new in scheduler_output.scheduled_new_reqs}
        suspects = [r for r in scheduled if r in self._trials or (
            r in new_ids and (req := self.scheduler.requests.get(r)) is not None
            and req.num_preemptions == 0 and req.num_output_tokens == 0)]
        if isinstance(error, StepError):  # every rank raised: name the exception itself
            summary = error.summary()[:500]
        else:
            summary = f"{type(error).__name__}: {' '.join(str(error).split())[:500]}"
        outputs = []
        if len(suspects) == 1:
            outputs = self._fail_request(suspects[0], summary)
        else:
            suspects = suspects or scheduled
            self._set_aside(suspects)
        logger.warning("engine step failed (%s); %s %s, recomputing the other scheduled "
                       "request(s)", summary.splitlines()[0][:200],
                       "failed request" if outputs else "isolating request(s)", suspects)
        self.scheduler.requeue_for_recompute(
            [r for r in scheduled if r in self._states and r not in suspects])
        self.last_iteration_tokens = 0
        return outputs

    def _fail_request(self, req_id: str, summary: str) -> list[RequestOutput]:
        state = self._states.get(req_id)
        user_id = state.parent_id if state is not None and state.parent_id else req_id
        parent = self._parents.get(user_id)
        holder = parent if parent is not None else state
        prompt = getattr(holder, "prompt", None)
        prompt_ids = getattr(holder, "prompt_token_ids", [])
        self.abort_request(user_id)  # all n samples of it; frees the blocks
        self._trials.discard(req_id)
        self._request_errors[user_id] = f"the request failed inside an engine step: {summary}"
        return [RequestOutput(request_id=user_id, prompt=prompt, prompt_token_ids=prompt_ids,
                              outputs=[CompletionOutput(0, "", [], "error")], finished=True)]

    def _set_aside(self, req_ids: list[str]) -> None:
        for req_id in req_ids:
            request = self.scheduler.requests.get(req_id)
            if request is None:
                continue
            self.scheduler.finish_requests(req_id, RequestStatus.FINISHED_ABORTED)  # frees KV
            request.num_computed_tokens = 0
            request.spec_token_ids = []
            self._trials.discard(req_id)
            self._quarantine.append(request)

    def _release_trial(self) -> None:
        """One set-aside request at a time, once the previous trial completed a step."""
        if not self._quarantine or self._trials:
            return
        request = self._quarantine.popleft()
        self.scheduler.add_request(request)
        self._trials.add(request.request_id)

    def _merge_child(self, state: _RequestState, output: RequestOutput) -> RequestOutput | None:
        parent = self._parents.get(state.parent_id)
        if parent is None:
            return None  # aborted
        parent.completions[state.index] = output.outputs[0]
        parent.finished[state.index] = output.finished
        if parent.prompt_logprobs is None and output.prompt_logprobs is not None:
            parent.prompt_logprobs = output.prompt_logprobs
        finished = all(parent.finished)
        if finished:
            del self._parents[parent.request_id]
        return RequestOutput(request_id=parent.request_id, prompt=parent.prompt,
                             prompt_token_ids=parent.prompt_token_ids,
                             outputs=list(parent.completions), finished=finished,
                             prompt_logprobs=parent.prompt_logprobs)

    @staticmethod
    def _dedupe_parents(outputs: list[RequestOutput]) -> list[RequestOutput]:
        """Several children of one parent in a step: keep the parent's last (newest) output."""
        last = {o.request_id: i for i, o in enumerate(outputs)}
        return [o for i, o in enumerate(outputs) if last[o.request_id] == i]

    def _decode_token(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id], skip_special_tokens=False)

    def _append_logprobs(self, state: _RequestState, lists, num_tokens: int) -> None:
        # The scheduler may cut a step's tokens at a stop token: keep the matching prefix.
        for j in range(min(num_tokens, len(lists))):
            entry = logprobs_row_to_dict(lists.logprob_token_ids[j], lists.logprobs[j],
                                         lists.sampled_token_ranks[j], self._decode_token)
            state.logprobs.append(entry)
            state.cumulative_logprob += float(lists.logprobs[j][0])

    def _prompt_logprobs(self, lists) -> list:
        rows = [logprobs_row_to_dict(lists.logprob_token_ids[j], lists.logprobs[j],
                                     lists.sampled_token_ranks[j], self._decode_token)
                for j in range(len(lists))]
        return [None, *rows]

    def _make_output(self, state: _RequestState, finished: bool, finish_reason,
                     stop_reason) -> RequestOutput:
        detokenizer = state.detokenizer
        logprobs = state.logprobs
        token_ids = state.output_token_ids
        if finished:
            # The last output: lists of the user's own (one copy over the request's life).
            token_ids = list(token_ids)
            if logprobs is not None:
                logprobs = list(logprobs)
        else:
            # The engine only appends to these lists: a prefix view reads as a list of this
            # step's items forever (no O(output length) copy per step).
            token_ids = PrefixView(token_ids, len(token_ids))
            if logprobs is not None:
                logprobs = PrefixView(logprobs, len(logprobs))
        completion = CompletionOutput(
            state.index, "" if detokenizer is None else detokenizer.output_text, token_ids,
            finish_reason, stop_reason, state.cumulative_logprob, logprobs)
        # The prompt ids never change after add_request, so every output shares one list (as
        # upstream does) instead of copying the whole prompt for every request at every step.
        return RequestOutput(state.request_id, state.prompt, state.prompt_token_ids,
                             [completion], finished,
                             state.timer.phases() if finished else None, state.prompt_logprobs)

    def _record_finished(self, state: _RequestState) -> None:
        self._num_finished += 1
        if state.timer.ttft is not None:
            self._ttft_samples.append(state.timer.ttft)
        if state.timer.tpot is not None:
            self._tpot_samples.append(state.timer.tpot)

    # ---- metrics -----------------------------------------------------------------------------
    def get_metrics(self) -> dict:
        metrics = self.scheduler.get_stats()
        metrics.update({
            "num_prompt_tokens": self._num_prompt_tokens,
            "num_generation_tokens": self._num_generation_tokens,
            "num_finished_requests": self._num_finished,
            "ttft_s": list(self._ttft_samples),
            "tpot_s": list(self._tpot_samples),
        })
        return metrics

    # ---- lifetime ----------------------------------------------------------------------------
    def shutdown(self) -> None:
        if self._shut_down:
            return
        self._shut_down = True
        atexit.unregister(self._atexit_hook)
        if self.executor is not None:
            self.executor.shutdown()

    def __enter__(self) -> LLMEngine:
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()

    def __del__(self):
        try:
            self.shutdown()
        except Exception:  # noqa: BLE001 - interpreter teardown
            pass


def _as_list(stop) -> list[str]:
    if stop is None:
        return []
    if isinstance(stop, str):
        return [stop]
    return list(stop)
