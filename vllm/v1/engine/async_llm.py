"""AsyncLLM: an asyncio front for the synchronous LLMEngine, used by the OpenAI server.

The engine is not thread-safe, so exactly one background thread owns it. Coroutines talk to that
thread through a command queue (add / abort); the thread steps the engine while any request is
pending and hands each RequestOutput to the request's asyncio queue with `call_soon_threadsafe`.
Because new requests are drained from the queue before every step, concurrent requests land in
the same engine batch.

Failure model:
* bad input found by the engine at `add_request` time (ValueError) is raised to the caller;
* a failure the engine pins on one request inside a step (LLMEngine.take_request_errors) fails
  that request alone with RequestFailedError; everyone else keeps being served;
* an exception escaping `engine.step()`, a worker process that dies (the executor's monitor
  reports it even while idle) or a step running past the watchdog
  (VLLM_EXECUTE_MODEL_TIMEOUT_SECONDS, upstream's name, default 300 s) kills the engine: one
  ERROR line is logged, every waiting request receives EngineDeadError, later requests are
  refused with it, `is_healthy` turns False and the death callbacks run (the server exits
  non-zero on them, so a supervisor can restart it);
* `is_healthy` is also False while the engine cannot make progress: a worker is stopped
  (SIGSTOP) or one step has been running for longer than the stall limit;
* a consumer that stops iterating before its request finished (client disconnect) aborts the
  request, so the engine frees its KV blocks and keeps serving everyone else.
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import itertools
import logging
import os
import queue
import threading
import time
from typing import Any, AsyncIterator, Callable

from vllm.v1.metrics.prometheus import PrometheusMetrics
from vllm.v1.metrics.stats import RequestTimer


logger = logging.getLogger(__name__)

# Upstream's name and default: a step that has not returned after this long is a hung engine.
DEFAULT_EXECUTE_MODEL_TIMEOUT_S = 300.0
# /health turns unhealthy once one step has been running this long (or the watchdog, if shorter).
HEALTH_STALL_S = 30.0


def execute_model_timeout_s() -> float:
    raw = os.environ.get("VLLM_EXECUTE_MODEL_TIMEOUT_SECONDS", "")
    try:
        value = float(raw) if raw else DEFAULT_EXECUTE_MODEL_TIMEOUT_S
    except ValueError:
        raise ValueError(f"VLLM_EXECUTE_MODEL_TIMEOUT_SECONDS={raw!r} is invalid: give a number "
                         "of seconds > 0") from None
    if not value > 0:
        raise ValueError(f"VLLM_EXECUTE_MODEL_TIMEOUT_SECONDS={raw!r} is invalid: give a number "
                         "of seconds > 0")
    return value


def one_line(error: BaseException | str) -> str:
    """A multi-line error (worker tracebacks) as one log-friendly line: its first and last."""
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    if not lines:
        return type(error).__name__ if isinstance(error, BaseException) else "unknown error"
    if len(lines) <= 2:
        return " ".join(lines)
    return f"{lines[0]} ... {lines[-1]}"


class EngineDeadError(RuntimeError):
    """The engine loop raised; no request can be served until the server restarts."""


class RequestFailedError(RuntimeError):
    """This request (alone) failed inside an engine step; the engine keeps serving."""


_ABORTED = object()  # queue sentinel: the request was aborted, end the stream quietly
_request_counter = itertools.count()


def _resolve(future) -> bool:
    """Complete an admission future; False when its waiter cancelled it already."""
    try:
        future.set_result(None)
    except (concurrent.futures.InvalidStateError, asyncio.InvalidStateError):
        return False
    return True


def _fail(future, error: BaseException) -> None:
    """Fail an admission future unless its waiter is gone (a cancelled future)."""
    try:
        future.set_exception(error)
    except (concurrent.futures.InvalidStateError, asyncio.InvalidStateError):
        pass


def _num_output_tokens(output) -> int:
    """All samples' tokens (n > 1: one RequestOutput carries every sample)."""
    return sum(len(c.token_ids) for c in output.outputs)


class RequestStream:
    """Async iterator over one request's RequestOutputs (cumulative, as the engine emits them)."""

    def __init__(self, request_id: str, owner: "AsyncLLM", loop: asyncio.AbstractEventLoop,
                 num_prompt_tokens: int):
        self.request_id = request_id
        self.timer = RequestTimer(num_prompt_tokens=num_prompt_tokens)
        self._owner = owner
        self._loop = loop
        self._queue: asyncio.Queue = asyncio.Queue()
        self._num_tokens_seen = 0  # engine-thread only
        self.finished = False

    def _deliver(self, item: Any) -> None:
        """Called from the engine thread."""
        try:
            self._loop.call_soon_threadsafe(self._queue.put_nowait, item)
        except RuntimeError:
            pass  # the consumer's event loop is closed: nobody is listening any more

    def __aiter__(self):
        return self._iterate()

    async def _iterate(self):
        try:
            while True:
                item = await self._queue.get()
                if item is _ABORTED:
                    return
                if isinstance(item, BaseException):
                    raise item
                if item.finished:
                    self.finished = True
                yield item
                if self.finished:
                    return
        finally:
            if not self.finished:
                self._owner.abort_nowait(self.request_id)


class AsyncLLM:
    def __init__(self, engine, model_name: str | None = None, max_model_len: int | None = None,
                 start: bool = True):
        self.engine = engine
        config = getattr(engine, "vllm_config", None)
        model_config = getattr(config, "model_config", None)
        self.model_name = model_name or getattr(model_config, "model", None) or "model"
        self.max_model_len = max_model_len or getattr(model_config, "max_model_len", None)
        self.metrics = PrometheusMetrics(self.model_name, self.get_metrics)
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._streams: dict[str, RequestStream] = {}  # engine-thread only
        self._snapshot: dict[str, Any] = {}
        self._dead_error: BaseException | None = None
        self._dead_callbacks: list[Callable[[BaseException], None]] = []
        # _streams is touched by the engine thread and, when it is stuck, by the watchdog.
        self._lock = threading.RLock()
        self._step_started: float | None = None  # perf_counter of the step in flight
        self._watchdog_s = execute_model_timeout_s()
        self._stopping = threading.Event()
        self._thread = threading.Thread(target=self._run_engine_loop, name="vllm-engine-loop",
                                        daemon=True)
        self._watchdog = threading.Thread(target=self._run_watchdog, name="vllm-step-watchdog",
                                          daemon=True)
        executor = getattr(engine, "executor", None)
        register = getattr(executor, "register_failure_callback", None)
        if register is not None:
            # A worker that dies while the engine is idle is noticed at once, not at the next
            # request.
            register(lambda reason: self._commands.put(("dead", reason)))
        self._refresh_snapshot()
        if start:
            self._thread.start()
            self._watchdog.start()

    @classmethod
    def from_vllm_config(cls, vllm_config, model_name: str | None = None) -> "AsyncLLM":
        from vllm.v1.engine.llm_engine import LLMEngine

        engine = LLMEngine.from_vllm_config(vllm_config)
        return cls(engine, model_name=model_name,
                   max_model_len=getattr(vllm_config.model_config, "max_model_len", None))

    # ---- public API --------------------------------------------------------------------------
    @property
    def tokenizer(self):
        return self.engine.tokenizer

    @property
    def is_healthy(self) -> bool:
        return self.health_problem() is None

    def health_problem(self) -> str | None:
        """None when the engine can make progress, else why not (for /health)."""
        if self._dead_error is not None:
            return f"engine is dead: {one_line(self._dead_error)}"
        if not self._thread.is_alive():
            return "engine thread stopped"
        started = self._step_started
        stall = min(HEALTH_STALL_S, self._watchdog_s)
        if started is not None and time.perf_counter() - started > stall:
            return (f"engine step running for {time.perf_counter() - started:.1f} s "
                    f"(stall limit {stall:.0f} s)")
        probe = getattr(getattr(self.engine, "executor", None), "liveness_problem", None)
        return probe() if probe is not None else None

    def add_dead_callback(self, callback: Callable[[BaseException], None]) -> None:
        """Called once, from an engine-side thread, when the engine dies."""
        self._dead_callbacks.append(callback)
        if self._dead_error is not None:
            callback(self._dead_error)

    @property
    def dead_error(self) -> BaseException | None:
        return self._dead_error

    def get_metrics(self) -> dict[str, Any]:
        """Latest engine metrics snapshot (refreshed by the engine thread after every change)."""
        return self._snapshot

    async def add_request(self, request_id: str | None, prompt: str | list[int], sampling_params,
                          num_prompt_tokens: int | None = None) -> RequestStream:
        """Admit a request; raises the engine's ValueError for bad input, EngineDeadError if dead."""
        self._raise_if_dead()
        request_id = request_id or f"req-{next(_request_counter)}"
        if num_prompt_tokens is None:
            num_prompt_tokens = len(prompt) if isinstance(prompt, list) else 0
        stream = RequestStream(request_id, self, asyncio.get_running_loop(), num_prompt_tokens)
        admitted: concurrent.futures.Future = concurrent.futures.Future()
        self._commands.put(("add", request_id, prompt, sampling_params, stream, admitted))
        try:
            await asyncio.wrap_future(admitted)
        except asyncio.CancelledError:
            # The client went away while we waited for admission: the add may still land.
            self.abort_nowait(request_id)
            raise
        return stream

    async def generate(self, prompt: str | list[int], sampling_params,
                       request_id: str | None = None) -> AsyncIterator:
        """Yield the request's RequestOutputs until it finishes (cumulative text and token ids)."""
        stream = await self.add_request(request_id, prompt, sampling_params)
        async for output in stream:
            yield output

    async def abort(self, request_id: str) -> None:
        self.abort_nowait(request_id)

    def abort_nowait(self, request_id: str) -> None:
        """Thread-safe, non-blocking abort (safe inside `finally` of a cancelled coroutine)."""
        self._commands.put(("abort", request_id))

    def shutdown(self, timeout: float = 10.0) -> None:
        """Stop the engine thread, then the engine (its worker processes, if any)."""
        self._stopping.set()
        self._commands.put(("stop",))
        if self._thread.is_alive():
            self._thread.join(timeout)
        engine_shutdown = getattr(self.engine, "shutdown", None)
        if engine_shutdown is not None and not self._thread.is_alive():
            engine_shutdown()
        elif self._dead_error is not None:
            # The engine thread is stuck in a step the watchdog gave up on: end the worker
            # processes anyway so none outlives the server (a stopped one would hold its GPU).
            executor = getattr(self.engine, "executor", None)
            if getattr(executor, "processes", None) is not None:
                executor.shutdown(graceful=False)

    # ---- engine thread -----------------------------------------------------------------------
    def _raise_if_dead(self) -> None:
        if self._dead_error is not None:
            raise EngineDeadError(f"engine loop died: {self._dead_error!r}") from self._dead_error

    def _refresh_snapshot(self) -> None:
        try:
            self._snapshot = self.engine.get_metrics()
        except Exception:  # metrics must never take the engine down
            pass

    def _run_engine_loop(self) -> None:
        while not self._stopping.is_set():
            try:
                self._loop_once()
            except BaseException as error:  # noqa: BLE001 - any engine failure is fatal
                self._step_started = None
                self._fail_all(error)

    def _run_watchdog(self) -> None:
        """Turns a step that never returns (a hung worker, a deadlocked collective) into the
        same clean death as a crash; the stuck engine thread is a daemon and dies with us."""
        while not self._stopping.wait(0.25):
            started = self._step_started
            if (self._dead_error is None and started is not None
                    and time.perf_counter() - started > self._watchdog_s):
                self._fail_all(TimeoutError(
                    f"an engine step did not finish within VLLM_EXECUTE_MODEL_TIMEOUT_SECONDS="
                    f"{self._watchdog_s:g} s (hung worker?)"))

    def _loop_once(self) -> None:
        alive = self._dead_error is None
        self._handle_commands(block=not (alive and self.engine.has_unfinished_requests()))
        if self._dead_error is not None or not self.engine.has_unfinished_requests():
            return
        self._step_started = time.perf_counter()
        outputs = self.engine.step()
        self._step_started = None
        if self._dead_error is not None:
            return  # the watchdog gave up on this step meanwhile
        self.metrics.record_iteration(int(getattr(self.engine, "last_iteration_tokens", 0) or 0))
        take_errors = getattr(self.engine, "take_request_errors", None)
        errors = take_errors() if take_errors is not None else {}
        # Snapshot first: a client that got its last token and reads /metrics right away must
        # see the step that made it (its blocks freed), not the one before.
        self._refresh_snapshot()
        self._dispatch(outputs, time.perf_counter(), errors)

    def _handle_commands(self, block: bool) -> None:
        changed = False
        try:
            command = self._commands.get(timeout=0.5) if block else self._commands.get_nowait()
        except queue.Empty:
            return
        while True:
            changed |= self._handle_command(command)
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                break
        if changed:
            self._refresh_snapshot()

    def _handle_command(self, command) -> bool:
        kind = command[0]
        if kind == "stop":
            self._stopping.set()
            return False
        if kind == "dead":
            if self._dead_error is None:
                self._fail_all(RuntimeError(command[1]))
            return False
        if kind == "abort":
            with self._lock:
                stream = self._streams.pop(command[1], None)
            if stream is None:
                return False  # already finished (or never admitted): nothing to free
            self.engine.abort_request([stream.request_id])  # raising here kills the loop
            self.metrics.record_aborted()
            stream._deliver(_ABORTED)
            return True
        _, request_id, prompt, params, stream, admitted = command
        if admitted.cancelled():
            return False  # the client left before its request reached the engine
        if self._dead_error is not None:
            _fail(admitted, EngineDeadError(f"engine loop died: {self._dead_error!r}"))
            return False
        if request_id in self._streams:
            _fail(admitted, ValueError(
                f"request id {request_id!r} is already running; use a unique request id"))
            return False
        try:
            self.engine.add_request(request_id, prompt, params)
        except Exception as error:  # bad input: the caller reports it, the engine is fine
            _fail(admitted, error)
            return False
        with self._lock:
            self._streams[request_id] = stream
        self.metrics.record_admitted(stream.timer.num_prompt_tokens)
        if not _resolve(admitted):
            # Cancelled between the check above and now (the client left): free it again.
            with self._lock:
                self._streams.pop(request_id, None)
            self.engine.abort_request([request_id])
            self.metrics.record_aborted()
        return True

    def _dispatch(self, outputs, now: float, errors: dict[str, str] | None = None) -> None:
        with self._lock:
            self._dispatch_locked(outputs, now, errors or {})

    def _dispatch_locked(self, outputs, now: float, errors: dict[str, str]) -> None:
        for request_id, message in errors.items():
            stream = self._streams.pop(request_id, None)
            if stream is not None:
                self.metrics.record_aborted()
                stream._deliver(RequestFailedError(message))
        for output in outputs:
            stream = self._streams.get(output.request_id)
            if stream is None:
                continue  # aborted while the step ran
            num_tokens = _num_output_tokens(output)
            new_tokens = num_tokens - stream._num_tokens_seen
            stream._num_tokens_seen = num_tokens
            stream.timer.record_tokens(new_tokens, now)
            self.metrics.record_tokens(stream.timer, new_tokens)
            if output.finished:
                del self._streams[output.request_id]
                reason = output.outputs[0].finish_reason if output.outputs else None
                self.metrics.record_finished(stream.timer, reason, getattr(output, "metrics", None))
            stream._deliver(output)

    def _fail_all(self, error: BaseException) -> None:
        with self._lock:
            first = self._dead_error is None
            if first:
                self._dead_error = error
            streams = list(self._streams.values())
            self._streams.clear()
        if first:
            # Log and notify before the waiters hear of it: whoever reacts to a failed request
            # finds the death already recorded.
            logger.error("Engine is dead (%s): %s", type(error).__name__, one_line(error))
            for callback in self._dead_callbacks:
                try:
                    callback(error)
                except Exception:  # noqa: BLE001 - one bad callback must not hide the others
                    logger.exception("engine-death callback failed")
        dead = EngineDeadError(f"engine loop died: {error!r}")
        for stream in streams:
            stream._deliver(dead)
