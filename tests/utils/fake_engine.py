"""A tiny stand-in for LLMEngine with the same interface (docs/architecture.md, Engine section).

It lets the server / AsyncLLM tests run in milliseconds and exercise what the real engine cannot
easily produce on demand (a crash inside step()). Tokens are deterministic: request output token i
is (prompt[-1] + i + 1) % VOCAB, text is one letter per token. A block pool of NUM_BLOCKS blocks of
BLOCK_SIZE tokens is allocated on admission/growth and freed on finish/abort, so tests can check
that aborted requests give their KV blocks back.
"""
from __future__ import annotations

import time

from dataclasses import dataclass, field

VOCAB = 26
BLOCK_SIZE = 4
NUM_BLOCKS = 4096


@dataclass
class FakeCompletion:
    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None = None
    cumulative_logprob: float | None = None


@dataclass
class FakeRequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[FakeCompletion]
    finished: bool


class FakeTokenizer:
    def encode(self, text: str) -> list[int]:
        return [ord(c) % VOCAB for c in text]

    def decode(self, ids) -> str:
        return "".join(chr(ord("a") + i % VOCAB) for i in ids)


@dataclass
class _Req:
    request_id: str
    prompt_ids: list[int]
    max_tokens: int
    output: list[int] = field(default_factory=list)
    blocks: int = 0


class FakeEngine:
    def __init__(self, max_model_len: int = 64, tokens_per_step: int = 1, fail_after_steps=None):
        self.tokenizer = FakeTokenizer()
        self.max_model_len = max_model_len
        self.tokens_per_step = tokens_per_step
        self.fail_after_steps = fail_after_steps
        self.requests: dict[str, _Req] = {}
        self.free_blocks = NUM_BLOCKS
        self.num_steps = 0
        self.max_batch_seen = 0
        self.aborted: list[str] = []

    def add_request(self, request_id, prompt, params):
        ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
        if len(ids) >= self.max_model_len:
            raise ValueError(f"prompt has {len(ids)} tokens; max_model_len is {self.max_model_len}")
        max_tokens = getattr(params, "max_tokens", None) or 16
        req = _Req(request_id, ids, max_tokens)
        self._grow(req, len(ids) + 1)
        self.requests[request_id] = req

    def _grow(self, req: _Req, num_tokens: int):
        need = -(-num_tokens // BLOCK_SIZE) - req.blocks
        if need > 0:
            assert need <= self.free_blocks, "fake KV pool exhausted"
            self.free_blocks -= need
            req.blocks += need

    def _free(self, req: _Req):
        self.free_blocks += req.blocks
        req.blocks = 0

    def step(self):
        # A real step waits on the device and releases the GIL; without this pause the fake
        # engine thread runs thousands of steps before the event loop can deliver a command.
        time.sleep(0.0002)
        self.num_steps += 1
        if self.fail_after_steps is not None and self.num_steps > self.fail_after_steps:
            raise RuntimeError("simulated device failure in step()")
        self.max_batch_seen = max(self.max_batch_seen, len(self.requests))
        outputs = []
        for req in list(self.requests.values()):
            for _ in range(self.tokens_per_step):
                if len(req.output) < req.max_tokens:
                    req.output.append((req.prompt_ids[-1] + len(req.output) + 1) % VOCAB)
            finished = len(req.output) >= req.max_tokens
            self._grow(req, len(req.prompt_ids) + len(req.output) + 1)
            completion = FakeCompletion(0, self.tokenizer.decode(req.output), list(req.output),
                                        "length" if finished else None)
            outputs.append(FakeRequestOutput(req.request_id, None, req.prompt_ids, [completion],
                                             finished))
            if finished:
                self._free(req)
                del self.requests[req.request_id]
        return outputs

    def abort_request(self, ids):
        for request_id in ids:
            req = self.requests.pop(request_id, None)
            if req is not None:
                self._free(req)
                self.aborted.append(request_id)

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    def get_metrics(self) -> dict:
        return {"num_requests_running": len(self.requests), "num_requests_waiting": 0,
                "kv_cache_usage": 1.0 - self.free_blocks / NUM_BLOCKS,
                "num_free_blocks": self.free_blocks, "num_total_blocks": NUM_BLOCKS,
                "spec_decode": {"num_drafts": 4, "num_draft_tokens": 12, "num_accepted_tokens": 6,
                                "accepted_per_position": [3, 2, 1], "mean_acceptance_length": 2.5}}


def expected_text(prompt_ids: list[int], max_tokens: int) -> str:
    """What FakeEngine generates for a prompt: an oracle independent of the server code."""
    return "".join(chr(ord("a") + (prompt_ids[-1] + i + 1) % VOCAB) for i in range(max_tokens))
