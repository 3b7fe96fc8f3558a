"""A deterministic fake "model" + runner that checks the scheduler's KV bookkeeping.

The fake target's next token is a fixed function of the whole prefix, so plain greedy decoding is
easy to compute independently (`reference_greedy`). The fake runner keeps a simulated paged KV
cache: every processed token is written to the slot its block table gives it, and before any
token is computed the runner checks that every earlier position's slot still holds exactly that
request's token. Chunked prefill: a row whose chunk stops short of the prompt end writes its KV
and samples nothing (an empty token list), as the real runner does. A scheduler that hands out a block still in use, loses blocks, or miscounts
computed tokens makes it fail loudly.
"""
from __future__ import annotations

from vllm.v1.outputs import ModelRunnerOutput

VOCAB = 97
EOS = 3


def next_token(prefix: list[int]) -> int:
    h = len(prefix)
    for t in prefix[-4:]:
        h = (h * 131 + t * 7 + 11) % 1_000_003
    return h % VOCAB


def reference_greedy(prompt: list[int], max_tokens: int, eos: int | None = EOS,
                     max_model_len: int = 10**9) -> list[int]:
    tokens = list(prompt)
    out = []
    while True:
        tok = next_token(tokens)
        tokens.append(tok)
        out.append(tok)
        if tok == eos or len(out) >= max_tokens or len(tokens) >= max_model_len:
            return out


def fake_drafts(prefix: list[int], k: int) -> list[int]:
    """k drafts that follow the target except at 'unlucky' spots (so some get rejected)."""
    drafts, tokens = [], list(prefix)
    for j in range(k):
        tok = next_token(tokens)
        if (len(tokens) * 7 + j) % 5 == 0:
            tok = (tok + 1) % VOCAB
        drafts.append(tok)
        tokens.append(tok)
    return drafts


class FakeRunner:

    def __init__(self, tokens_per_block: int, num_spec_tokens: int = 0):
        self.tokens_per_block = tokens_per_block
        self.num_spec_tokens = num_spec_tokens
        self.kv: dict[tuple[int, int], tuple[str, int, int]] = {}
        self.reqs: dict[str, dict] = {}
        self.num_steps = 0
        self.num_partial_prefill_rows = 0  # rows that ran a prefill chunk short of the prompt end

    def _slot(self, state, position):
        index = position // self.tokens_per_block
        assert index < len(state["blocks"]), (
            f"position {position} has no block (only {len(state['blocks'])} allocated)")
        return state["blocks"][index], position % self.tokens_per_block

    def _check_context(self, rid, state, upto):
        for pos in range(upto):
            got = self.kv.get(self._slot(state, pos))
            assert got == (rid, pos, state["tokens"][pos]), (
                f"KV of {rid} at position {pos} is {got}, expected {(rid, pos, state['tokens'][pos])}")

    def execute_model(self, so) -> ModelRunnerOutput:
        self.num_steps += 1
        for rid in so.finished_req_ids | so.preempted_req_ids:
            self.reqs.pop(rid, None)
        for new in so.scheduled_new_reqs:
            assert new.num_computed_tokens == 0
            self.reqs[new.req_id] = {"tokens": list(new.prompt_token_ids),
                                     "blocks": list(new.block_ids), "computed": 0}
        cached = so.scheduled_cached_reqs
        for rid, new_blocks, computed in zip(cached.req_ids, cached.new_block_ids,
                                             cached.num_computed_tokens):
            state = self.reqs[rid]
            assert computed == state["computed"], (rid, computed, state["computed"])
            state["blocks"].extend(new_blocks)
        assert so.total_num_scheduled_tokens == sum(so.num_scheduled_tokens.values())

        req_ids, sampled, spec = [], [], []
        for rid, num_new in so.num_scheduled_tokens.items():
            state = self.reqs[rid]
            drafts = list(so.scheduled_spec_decode_tokens.get(rid, []))
            start = state["computed"]
            end = start + num_new - len(drafts)  # known tokens processed through this step
            assert end <= len(state["tokens"]), (rid, start, num_new, len(state["tokens"]))
            assert not drafts or end == len(state["tokens"]), "drafts only after the prefill"
            inputs = state["tokens"][start:end] + drafts
            # Write the KV of every input token (drafts included), then verify.
            seq = state["tokens"] + drafts
            for offset, tok in enumerate(inputs):
                self.kv[self._slot(state, start + offset)] = (rid, start + offset, tok)
            self._check_context(rid, state, end)
            # The drafter writes up to k + 1 positions past the processed tokens, on every row.
            self._slot(state, start + num_new + self.num_spec_tokens)
            if end < len(state["tokens"]):
                # Chunked prefill, prompt not finished: KV written, nothing sampled or drafted.
                self.num_partial_prefill_rows += 1
                state["computed"] = end
                req_ids.append(rid)
                sampled.append([])
                spec.append([])
                continue
            accepted = []
            for j, d in enumerate(drafts):
                if d != next_token(seq[:len(state["tokens"]) + j]):
                    break
                accepted.append(d)
            bonus = next_token(state["tokens"] + accepted)
            state["tokens"] += accepted + [bonus]
            state["computed"] = start + len(inputs) - (len(drafts) - len(accepted))
            req_ids.append(rid)
            sampled.append(accepted + [bonus])
            spec.append(fake_drafts(state["tokens"], self.num_spec_tokens))
        return ModelRunnerOutput(
            req_ids=req_ids, sampled_token_ids=sampled,
            spec_token_ids=spec if self.num_spec_tokens else None,
            num_draft_tokens=[len(so.scheduled_spec_decode_tokens.get(r, [])) for r in req_ids],
            num_accepted_tokens=[len(s) - 1 for s in sampled])


class FakeWorker:
    """Worker-shaped wrapper for executor/engine tests (no model, no torch.distributed)."""

    def __init__(self, vllm_config, rank=0, distributed_init_method=None):
        self.vllm_config = vllm_config
        self.rank = rank
        self.runner = None

    def init_device(self):
        pass

    def load_model(self):
        cfg = self.vllm_config
        dcp = cfg.parallel_config.decode_context_parallel_size
        self.runner = FakeRunner(cfg.cache_config.block_size * dcp, cfg.num_speculative_tokens)

    def determine_num_available_blocks(self):
        override = self.vllm_config.cache_config.num_gpu_blocks_override
        return override if override is not None else 1000 + self.rank  # ranks disagree: min wins

    def initialize_kv_cache(self, num_blocks):
        self.num_blocks = num_blocks

    def execute_model(self, so):
        out = self.runner.execute_model(so)
        return out if self.rank == 0 else None

    def check_health(self):
        return True

    def shutdown(self):
        pass


class RaisingWorker(FakeWorker):
    """Rank 1 raises on its second step; the others would wait for it in a collective."""

    def execute_model(self, so):
        if self.rank == 1 and self.runner.num_steps >= 1:
            raise ValueError("injected failure in rank 1")
        return super().execute_model(so)


class DyingWorker(FakeWorker):
    """Rank 1's process exits abruptly on its first step (no Python exception to report)."""

    def execute_model(self, so):
        if self.rank == 1:
            import os
            os._exit(17)
        return super().execute_model(so)


class HangingPeerWorker(FakeWorker):
    """Rank 0 blocks forever (as in a collective with a dead peer) while rank 1 raises."""

    def execute_model(self, so):
        if self.rank == 0:
            import time
            time.sleep(3600)
        raise RuntimeError("rank 1 gave up")
