"""vllm.LLM: offline batched generation on top of LLMEngine."""
from __future__ import annotations

import itertools
from collections.abc import Sequence

from tqdm.auto import tqdm

from vllm.v1.metrics.stats import RequestTimer


class LLM:
    """LLM(model=None, **EngineArgs fields). model None serves the built-in tiny checkpoint."""

    def __init__(self, model: str | None = None, **kwargs):
        from dataclasses import fields

        from vllm.engine.arg_utils import EngineArgs
        from vllm.v1.engine.llm_engine import LLMEngine
        known = {f.name for f in fields(EngineArgs)}
        unknown = sorted(set(kwargs) - known)
        if unknown:
            raise ValueError(f"LLM() got unknown engine arguments {unknown}; valid ones are the "
                             f"EngineArgs fields: {sorted(known)}")
        engine_args = EngineArgs(model=model, **kwargs)
        self.llm_engine = LLMEngine.from_engine_args(engine_args)
        self._request_counter = itertools.count()
        from vllm.v1.metrics.prometheus import PrometheusMetrics
        names = engine_args.served_model_names()
        model_name = names[0] if names else self.llm_engine.vllm_config.model_config.model
        # The same exporter the server uses; get_metrics() reads its registry.
        self.metrics = PrometheusMetrics(str(model_name), self.llm_engine.get_metrics)

    @property
    def tokenizer(self):
        return self.llm_engine.tokenizer

    def get_tokenizer(self):
        return self.llm_engine.tokenizer

    def generate(self, prompts, sampling_params=None, use_tqdm: bool = True) -> list:
        """Run every prompt to completion; outputs come back in input order.

        prompts: a string, a list of strings, one token-id list, or a list of token-id lists.
        sampling_params: one SamplingParams for all prompts, or a list with one per prompt.
        """
        from vllm.sampling_params import SamplingParams
        prompt_list = _normalize_prompts(prompts)
        if sampling_params is None:
            sampling_params = SamplingParams()
        if isinstance(sampling_params, Sequence) and not isinstance(sampling_params, (str, bytes)):
            params_list = list(sampling_params)
            if len(params_list) != len(prompt_list):
                raise ValueError(f"got {len(params_list)} SamplingParams for {len(prompt_list)} "
                                 "prompts; pass one SamplingParams or one per prompt")
        else:
            params_list = [sampling_params] * len(prompt_list)

        engine = self.llm_engine
        order: dict[str, int] = {}
        added: list[str] = []
        timers: dict[str, tuple] = {}
        try:
            for index, (prompt, params) in enumerate(zip(prompt_list, params_list)):
                request_id = str(next(self._request_counter))
                timer = RequestTimer()
                engine.add_request(request_id, prompt, params)
                order[request_id] = index
                added.append(request_id)
                timers[request_id] = (timer, 0)
            results: list = [None] * len(prompt_list)
            num_pending = len(prompt_list)
            progress = tqdm(total=len(prompt_list), desc="Processed prompts", disable=not use_tqdm)
            with progress:
                while num_pending and engine.has_unfinished_requests():
                    outputs = engine.step()
                    self.metrics.record_iteration(engine.last_iteration_tokens)
                    for output in outputs:
                        self._record(output, timers)
                        if output.finished and output.request_id in order:
                            results[order[output.request_id]] = output
                            num_pending -= 1
                            progress.update(1)
        except BaseException:
            # Leave no half-finished request of this call behind in a live engine.
            if not getattr(engine.executor, "is_shutdown", True):
                engine.abort_request(list(added))
            raise
        missing = [i for i, r in enumerate(results) if r is None]
        if missing:
            raise RuntimeError(f"prompts {missing} finished without output; the engine lost them")
        return results

    def chat(self, messages, sampling_params=None, use_tqdm: bool = True, *,
             chat_template: str | None = None, add_generation_prompt: bool = True) -> list:
        """Generate a reply to one conversation (a list of {"role", "content"} dicts) or to each
        of several. The prompt is the tokenizer's chat template rendering (see
        entrypoints/openai/chat_template.py); `chat_template` (Jinja text or a file) overrides it."""
        from vllm.entrypoints.openai.chat_template import (apply_chat_template, encode_chat_prompt,
                                                           has_chat_template)
        from vllm.transformers_utils.tokenizer import load_chat_template
        if not isinstance(messages, (list, tuple)) or not messages:
            raise ValueError("messages must be a non-empty list of {'role', 'content'} dicts (one "
                             "conversation) or a list of such lists")
        conversations = [messages] if isinstance(messages[0], dict) else list(messages)
        template = load_chat_template(chat_template)
        tokenizer = self.get_tokenizer()
        templated = template is not None or has_chat_template(tokenizer)
        prompts = []
        for conv in conversations:
            text = apply_chat_template(tokenizer, list(conv),
                                       add_generation_prompt=add_generation_prompt,
                                       chat_template=template)
            # A template's output already holds its special tokens: no second BOS.
            prompts.append({"prompt_token_ids": encode_chat_prompt(tokenizer, text, templated),
                            "prompt": text})
        return self.generate(prompts, sampling_params, use_tqdm=use_tqdm)

    def _record(self, output, timers: dict) -> None:
        """Feed the Prometheus exporter as the server's AsyncLLM does."""
        entry = timers.get(output.request_id)
        if entry is None:
            return
        timer, seen = entry
        if timer.num_prompt_tokens == 0:
            timer.num_prompt_tokens = len(output.prompt_token_ids)
            self.metrics.record_admitted(timer.num_prompt_tokens)
        num_tokens = sum(len(c.token_ids) for c in output.outputs)
        timer.record_tokens(num_tokens - seen)
        self.metrics.record_tokens(timer, num_tokens - seen)
        timers[output.request_id] = (timer, num_tokens)
        if output.finished:
            reason = output.outputs[0].finish_reason if output.outputs else None
            self.metrics.record_finished(timer, reason, output.metrics)

    def get_metrics(self) -> list:
        """Upstream-shaped metrics (vllm.v1.metrics.reader Counter / Gauge / Histogram / Vector),
        read from the same Prometheus registry a server of this engine exports at /metrics."""
        from vllm.v1.metrics.reader import get_metrics_snapshot
        return get_metrics_snapshot(self.metrics.registry)

    def shutdown(self) -> None:
        self.llm_engine.shutdown()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()


def _normalize_prompts(prompts) -> list:
    if isinstance(prompts, (str, dict)):
        return [prompts]
    prompts = list(prompts)
    if not prompts:
        raise ValueError("prompts is empty; pass a string, token ids, or a list of them")
    if all(isinstance(t, int) for t in prompts):
        return [prompts]  # a single token-id prompt
    for prompt in prompts:
        if not (isinstance(prompt, (str, dict)) or (isinstance(prompt, (list, tuple))
                                                    and all(isinstance(t, int) for t in prompt))):
            raise ValueError(f"prompt {prompt!r} is neither a string nor a list of token ids (nor "
                             "a TextPrompt / TokensPrompt dict)")
    return [p if isinstance(p, (str, dict)) else list(p) for p in prompts]
