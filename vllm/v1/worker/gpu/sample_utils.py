"""Sampling extras of the model runner: penalties, logits processors, logprobs.

Everything the runner needs sits behind three calls (the rewritten runner ports exactly these):

    logits = sampling_states.process_logits(raw_logits, rows)         # before (rejection) sampling
    logprobs = sampling_states.after_sampling(raw_logits, rows, sampled)  # counts + logprobs
    prompt_lps = sampling_states.prompt_logprobs(model, hidden, rows)  # prefill rows only

Per-request device state lives in rows of persistent tensors indexed by the runner's request slot.
The dense [max_num_reqs, V] tensors are allocated the first time a request needs them. Rows are
written when a request is admitted (one host->device copy per admission, not per token); per step
the work is gathers, one scatter and elementwise ops, with no host sync. Nothing here runs for a
batch whose requests use none of the features.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from vllm.sampling_params import SamplingParams
from vllm.v1.sample.logprobs import LogprobsLists, compute_logprobs, gather_logprobs
from vllm.v1.sample.ops.logits_processors import (apply_logit_bias, apply_min_p, apply_min_tokens,
                                                  apply_token_mask)
from vllm.v1.sample.ops.penalties import apply_penalties, segment_draft_counts



def sampling_row_index(num_reqs: int, rows: list[int]):
    """A numpy index for a step's sampling rows (sorted row ids): a slice when every row
    samples (rows is then 0..num_reqs-1; indexing with a Python list converts the whole list,
    ~4 us for 64 rows, several times a step)."""
    return slice(0, len(rows)) if len(rows) == num_reqs else rows


@dataclass
class BatchRows:
    """How this step's logits rows map to requests (built once per step by the runner).

    Request i owns len(drafts[i]) + 1 consecutive rows: its verification rows then the bonus row
    (a prefill / plain decode row is the single bonus row)."""

    req_ids: list[str]
    slots: list[int]
    # Drafts verified per request: host lists, or (a runner that keeps drafts on the device)
    # `num_draft` per request plus the flat device tensor `draft_tokens` [sum(num_draft)].
    drafts: list[list[int]] | None = None
    # Host token history of each request (prompt + outputs), read only for multi-token bad words.
    token_ids: list[list[int]] | None = None
    num_draft: list[int] | None = None
    draft_tokens: torch.Tensor | None = None

    def draft_counts(self) -> list[int]:
        if self.drafts is not None:
            return [len(d) for d in self.drafts]
        return [int(n) for n in (self.num_draft if self.num_draft is not None
                                 else [0] * len(self.slots))]

    def row_counts(self) -> list[int]:
        return [n + 1 for n in self.draft_counts()]

    def flat_drafts(self, device) -> torch.Tensor:
        if self.draft_tokens is not None:
            return self.draft_tokens.to(device=device, dtype=torch.int64)
        return _ids([t for d in (self.drafts or ()) for t in d], device)

    def host_drafts(self) -> list[list[int]]:
        """Host drafts (multi-token bad words only; a device-draft runner pays one D2H here)."""
        if self.drafts is not None:
            return self.drafts
        flat = self.draft_tokens.tolist() if self.draft_tokens is not None else []
        out, pos = [], 0
        for n in self.draft_counts():
            out.append(flat[pos:pos + n])
            pos += n
        return out


class SamplingStates:
    """Per-slot sampling state for the requests resident in the runner."""

    def __init__(self, max_num_reqs: int, vocab_size: int, device: torch.device):
        self.max_num_reqs = max_num_reqs
        self.vocab_size = vocab_size
        self.device = torch.device(device)
        n = max_num_reqs
        f32 = dict(dtype=torch.float32, device=self.device)
        self.presence = torch.zeros(n, **f32)
        self.frequency = torch.zeros(n, **f32)
        self.repetition = torch.ones(n, **f32)
        self.min_p = torch.zeros(n, **f32)
        self.temperature = torch.zeros(n, **f32)
        self.min_tokens = torch.zeros(n, dtype=torch.int64, device=self.device)
        self.num_output = torch.zeros(n, dtype=torch.int64, device=self.device)
        # Dense per-slot tables, allocated on first need.
        self.output_counts: torch.Tensor | None = None  # [n, V] int32
        self.prompt_mask: torch.Tensor | None = None  # [n, V] bool
        self.logit_bias: torch.Tensor | None = None  # [n, V] float32
        self.banned: torch.Tensor | None = None  # [n, V] bool (allowed_token_ids complement, bad words)
        self.stop_mask: torch.Tensor | None = None  # [n, V] bool (min_tokens)
        # Host-side: which slots use what, and per-request facts that survive preemption.
        self._features: dict[int, frozenset[str]] = {}
        self._params: dict[int, object] = {}
        self._num_prompt_tokens: dict[str, int] = {}
        self._prompt_logprobs_done: set[str] = set()
        # Prompt logprobs of a prompt prefilled in chunks: the finished chunks' rows, delivered
        # together when the last chunk is done (the engine takes one list per request).
        self._prompt_logprobs_partial: dict[str, list[LogprobsLists]] = {}
        # Requests that asked for prompt logprobs and have not had them yet: the runner asks
        # only while this is non-empty (no per-request work in the common step).
        self._prompt_logprobs_pending: set[str] = set()
        self._slot_of: dict[str, int] = {}
        # Slots whose request uses any feature: any_active is then a set test, no per-row loop
        # (the common batch has none, and the runner asks every step).
        self._featured_slots: set[int] = set()
        # Slots whose steps must complete on the host (features or logprobs): async scheduling
        # overlaps a step only when none of its rows is here.
        self._host_slots: set[int] = set()

    # ---- request lifetime ------------------------------------------------------------------
    def _table(self, name: str, dtype: torch.dtype) -> torch.Tensor:
        table = getattr(self, name)
        if table is None:
            table = torch.zeros(self.max_num_reqs, self.vocab_size, dtype=dtype, device=self.device)
            setattr(self, name, table)
        return table

    def add_request(self, req_id: str, slot: int, token_ids: list[int], params) -> None:
        """Called on admission (also re-admission after a preemption: token_ids then holds the
        prompt plus the outputs so far; the original prompt length is remembered per request)."""
        num_prompt = self._num_prompt_tokens.setdefault(req_id, len(token_ids))
        prompt, output = token_ids[:num_prompt], token_ids[num_prompt:]
        features = set()
        if not isinstance(params, SamplingParams):
            params = None  # runner tests pass None (greedy, no extras)
        if params is not None:
            self._check_token_ids(params)
            if params.uses_penalties:
                features.add("penalties")
                self.presence[slot] = float(params.presence_penalty)
                self.frequency[slot] = float(params.frequency_penalty)
                self.repetition[slot] = float(params.repetition_penalty)
                counts = self._table("output_counts", torch.int32)
                counts[slot].zero_()
                if output:
                    counts[slot].index_add_(0, _ids(output, self.device),
                                            torch.ones(len(output), dtype=torch.int32,
                                                       device=self.device))
                mask = self._table("prompt_mask", torch.bool)
                mask[slot].zero_()
                mask[slot, _ids(prompt, self.device)] = True
            if params.logit_bias:
                features.add("logit_bias")
                bias = self._table("logit_bias", torch.float32)
                bias[slot].zero_()
                bias[slot, _ids(list(params.logit_bias), self.device)] = torch.tensor(
                    list(params.logit_bias.values()), dtype=torch.float32).to(self.device)
            banned_ids = self._banned_ids(params)
            if banned_ids is not None:
                features.add("banned")
                banned = self._table("banned", torch.bool)
                if params.allowed_token_ids is not None:
                    banned[slot].fill_(True)
                    banned[slot, _ids(params.allowed_token_ids, self.device)] = False
                else:
                    banned[slot].zero_()
                if banned_ids:
                    banned[slot, _ids(banned_ids, self.device)] = True
            if any(len(w) > 1 for w in (params._bad_words_token_ids or ())):
                features.add("bad_word_seqs")
            if params.min_tokens > 0 and params.all_stop_token_ids:
                features.add("min_tokens")
                self.min_tokens[slot] = int(params.min_tokens)
                stop = self._table("stop_mask", torch.bool)
                stop[slot].zero_()
                stop[slot, _ids(sorted(params.all_stop_token_ids), self.device)] = True
            if params.min_p > 0:
                features.add("min_p")
                self.min_p[slot] = float(params.min_p)
                self.temperature[slot] = float(params.temperature)
        self.num_output[slot] = len(output)
        self._features[slot] = frozenset(features)
        if features:
            self._featured_slots.add(slot)
        else:
            self._featured_slots.discard(slot)
        if features or (params is not None and (params.logprobs is not None
                                                or params.prompt_logprobs is not None)):
            self._host_slots.add(slot)
        else:
            self._host_slots.discard(slot)
        self._params[slot] = params
        self._slot_of[req_id] = slot
        if (params is not None and params.prompt_logprobs is not None
                and req_id not in self._prompt_logprobs_done):
            self._prompt_logprobs_pending.add(req_id)

    def remove_request(self, req_id: str, slot: int | None, finished: bool) -> None:
        self._slot_of.pop(req_id, None)
        if slot is not None:
            self._features.pop(slot, None)
            self._featured_slots.discard(slot)
            self._host_slots.discard(slot)
            self._params.pop(slot, None)
        if finished:
            self._num_prompt_tokens.pop(req_id, None)
            self._prompt_logprobs_done.discard(req_id)
            self._prompt_logprobs_partial.pop(req_id, None)
            self._prompt_logprobs_pending.discard(req_id)

    def _check_token_ids(self, params) -> None:
        for name, ids in (("logit_bias", list(params.logit_bias or ())),
                          ("allowed_token_ids", params.allowed_token_ids or ())):
            bad = [t for t in ids if t >= self.vocab_size]
            if bad:
                raise ValueError(f"{name} has token ids {bad[:5]} outside the vocabulary "
                                 f"[0, {self.vocab_size}); pass valid token ids")

    @staticmethod
    def _banned_ids(params) -> list[int] | None:
        """Single-token bad words are banned outright (multi-token ones per row, see
        _bad_word_pairs); None when the request bans nothing this way."""
        words = getattr(params, "_bad_words_token_ids", None) or []
        ids = sorted({seq[0] for seq in words if len(seq) == 1})
        if not ids and params.allowed_token_ids is None:
            return None
        return ids

    def _bad_word_pairs(self, rows: BatchRows) -> tuple[list[int], list[int]]:
        """(row, token) pairs banned by multi-token bad words: a word's last token is banned when
        the tokens before the row end with the word's other tokens (upstream semantics). The
        history is the runner's host copy plus the row's drafts: no device data is read."""
        out_rows, out_tokens = [], []
        row = 0
        drafts = rows.host_drafts()
        for i, slot in enumerate(rows.slots):
            params = self._params.get(slot)
            words = [w for w in (getattr(params, "_bad_words_token_ids", None) or ())
                     if len(w) > 1]
            n_rows = len(drafts[i]) + 1
            if words and rows.token_ids is not None:
                # Upstream matches against the output only (not the prompt).
                history = rows.token_ids[i][self._num_prompt_tokens.get(rows.req_ids[i], 0):]
                for j in range(n_rows):
                    seen = history + drafts[i][:j]
                    for word in words:
                        prefix = word[:-1]
                        if len(seen) >= len(prefix) and seen[len(seen) - len(prefix):] == prefix:
                            out_rows.append(row + j)
                            out_tokens.append(word[-1])
            row += n_rows
        return out_rows, out_tokens

    # ---- per step --------------------------------------------------------------------------
    def _active(self, rows: BatchRows, feature: str) -> bool:
        return any(feature in self._features.get(s, ()) for s in rows.slots)

    def needs_host_tokens(self, slots) -> bool:
        """Whether any of these slots samples from host-side token history (penalties, bad
        words, min_tokens, ...) or returns logprobs: such a step must complete on the host
        before the next one is prepared (async scheduling overlaps only the others)."""
        host = self._host_slots
        return bool(host) and not host.isdisjoint(int(s) for s in slots)

    def any_active(self, rows: BatchRows) -> bool:
        featured = self._featured_slots
        return bool(featured) and not featured.isdisjoint(rows.slots)

    def process_logits(self, logits: torch.Tensor, rows: BatchRows) -> torch.Tensor:
        """Processed logits (new tensor) for sampling; `logits` (raw) is left untouched."""
        if not self.any_active(rows):
            return logits
        counts_per_req = rows.row_counts()
        # Per logits row: its request's slot, its position inside the request, the request's
        # first row, and (for drafts) the row of each draft. Built on the host with numpy and
        # sent in one copy.
        row_slot, row_offset, row_start, draft_rows = _row_index(rows.slots, counts_per_req,
                                                                 self.device)
        out = logits.float()
        if self._active(rows, "banned"):
            out = apply_token_mask(out, self.banned[row_slot])
        if self._active(rows, "bad_word_seqs"):
            bad_rows, bad_tokens = self._bad_word_pairs(rows)
            if bad_rows:
                out = out.index_put((_ids(bad_rows, self.device), _ids(bad_tokens, self.device)),
                                    torch.tensor(float("-inf"), device=self.device))
        if self._active(rows, "min_tokens"):
            out = apply_min_tokens(out, self.num_output[row_slot] + row_offset,
                                   self.min_tokens[row_slot], self.stop_mask[row_slot])
        if self._active(rows, "logit_bias"):
            out = apply_logit_bias(out, self.logit_bias[row_slot])
        if self._active(rows, "penalties"):
            counts = self.output_counts[row_slot]
            if draft_rows.numel():
                # Verification row j has also "generated" drafts 0..j-1 (greedy speculative
                # output with penalties must equal plain greedy with them).
                draft_tokens = rows.flat_drafts(self.device)
                counts = counts + segment_draft_counts(row_start, draft_rows, draft_tokens,
                                                       int(row_slot.shape[0]), self.vocab_size)
            out = apply_penalties(out, counts, self.prompt_mask[row_slot], self.presence[row_slot],
                                  self.frequency[row_slot], self.repetition[row_slot])
        if self._active(rows, "min_p"):
            out = apply_min_p(out, self.min_p[row_slot], self.temperature[row_slot])
        return out

    def after_sampling(self, raw_logits: torch.Tensor, rows: BatchRows,
                       sampled: list[list[int]]) -> dict[str, LogprobsLists] | None:
        """Count the emitted tokens (penalties, min_tokens) and return the logprobs of requests
        that asked for them: req_id -> one entry per emitted token (emitted token k of a request
        is scored at its k-th row, where the target produced it)."""
        slots = rows.slots
        wanted = [(i, p.logprobs) for i, p in
                  enumerate(self._params.get(s) for s in slots)
                  if p is not None and p.logprobs is not None]
        active = self.any_active(rows)
        if not active and not wanted:
            return None  # the common case: nothing to count, nothing to score
        counts_per_req = rows.row_counts()
        n_emitted = [len(s) for s in sampled]
        emitted = _ids([t for s in sampled for t in s], self.device)
        if active:
            slot_of_token = _repeat(slots, n_emitted, self.device)
            self.num_output.index_add_(0, _ids(slots, self.device),
                                       _ids(n_emitted, self.device))
            if self.output_counts is not None and self._active(rows, "penalties"):
                self.output_counts.index_put_(
                    (slot_of_token, emitted),
                    torch.ones_like(emitted, dtype=torch.int32), accumulate=True)
        if not wanted:
            return None
        starts = _starts(counts_per_req)
        row_idx, token_rows, per_req = [], [], []
        for i, _ in wanted:
            row_idx.extend(range(starts[i], starts[i] + n_emitted[i]))
            per_req.append(n_emitted[i])
        token_start = _starts(n_emitted)
        for i, _ in wanted:
            token_rows.extend(range(token_start[i], token_start[i] + n_emitted[i]))
        ks = [k for _, k in wanted]
        k_max = -1 if -1 in ks else max(ks)  # one top-k for the batch, cut per request below
        lps = compute_logprobs(raw_logits[_ids(row_idx, raw_logits.device)])
        tensors = gather_logprobs(lps, k_max, emitted[_ids(token_rows, self.device)])
        lists = tensors.tolists()
        result, pos = {}, 0
        for (i, k), n in zip(wanted, per_req):
            part = lists.slice(pos, pos + n)
            width = (self.vocab_size if k == -1 else k) + 1
            part.logprob_token_ids = [ids[:width] for ids in part.logprob_token_ids]
            part.logprobs = [v[:width] for v in part.logprobs]
            result[rows.req_ids[i]] = part
            pos += n
        return result

    @property
    def wants_prompt_logprobs(self) -> bool:
        """Some admitted request still waits for its prompt logprobs."""
        return bool(self._prompt_logprobs_pending)

    def prompt_logprobs(self, compute_logits, hidden: torch.Tensor, req_ids: list[str],
                        query_start_loc: list[int], token_ids: list[list[int]],
                        num_computed: list[int]) -> dict[str, LogprobsLists] | None:
        """Prompt logprobs of the prompt rows prefilled this step: position p scores prompt
        token p+1 (upstream returns None for the first prompt token; the engine adds it). A row
        covers positions [num_computed, num_computed + its query length) of its request; a
        prompt prefilled in chunks is scored chunk by chunk and delivered with its last chunk."""
        result = {}
        for i, req_id in enumerate(req_ids):
            if req_id not in self._prompt_logprobs_pending:
                continue
            params = self._params_of(req_id)
            num_prompt = self._num_prompt_tokens.get(req_id, 0)
            first = num_computed[i]
            if params is None or first >= num_prompt:
                continue  # a decode row: the prompt was scored already
            start, stop = query_start_loc[i], query_start_loc[i + 1]
            if first == 0:  # (re)started from position 0: drop a preempted run's chunks
                self._prompt_logprobs_partial[req_id] = []
            chunks = self._prompt_logprobs_partial.setdefault(req_id, [])
            end = min(first + (stop - start), num_prompt - 1)  # last scored position + 1
            if end > first:
                logits = compute_logits(hidden[start:start + end - first])
                targets = _ids(token_ids[i][first + 1:end + 1], logits.device)
                chunks.append(gather_logprobs(compute_logprobs(logits), params.prompt_logprobs,
                                              targets).tolists())
            if first + (stop - start) >= num_prompt:  # the prompt's last chunk
                self._prompt_logprobs_partial.pop(req_id, None)
                result[req_id] = LogprobsLists(
                    [row for c in chunks for row in c.logprob_token_ids],
                    [row for c in chunks for row in c.logprobs],
                    [rank for c in chunks for rank in c.sampled_token_ranks])
                self._prompt_logprobs_done.add(req_id)
                self._prompt_logprobs_pending.discard(req_id)
        return result or None

    def _params_of(self, req_id: str):
        slot = self._slot_of.get(req_id)
        return None if slot is None else self._params.get(slot)


def _ids(values, device) -> torch.Tensor:
    return torch.tensor(list(values), dtype=torch.int64).to(device, non_blocking=True)


def _starts(counts: list[int]) -> list[int]:
    starts, total = [], 0
    for c in counts:
        starts.append(total)
        total += c
    return starts


def _row_index(slots: list[int], counts: list[int], device):
    """(row_slot [R], row_offset [R], row_start [R], draft_rows [D]) for requests owning
    `counts` consecutive rows each (the last row of a request is its bonus row, the others
    verify drafts)."""
    counts_np = np.asarray(counts, dtype=np.int64)
    starts = np.concatenate(([0], np.cumsum(counts_np)[:-1])).astype(np.int64)
    total = int(counts_np.sum())
    row_start = np.repeat(starts, counts_np)
    row_offset = np.arange(total, dtype=np.int64) - row_start
    row_slot = np.repeat(np.asarray(slots, dtype=np.int64), counts_np)
    is_draft = row_offset < np.repeat(counts_np - 1, counts_np)
    draft_rows = np.nonzero(is_draft)[0].astype(np.int64)
    packed = torch.from_numpy(np.concatenate([row_slot, row_offset, row_start, draft_rows]))
    packed = packed.to(device, non_blocking=True)
    return (packed[:total], packed[total:2 * total], packed[2 * total:3 * total],
            packed[3 * total:])


def _repeat(values: list[int], counts: list[int], device) -> torch.Tensor:
    return torch.repeat_interleave(torch.tensor(values, dtype=torch.int64),
                                   torch.tensor(counts, dtype=torch.int64)).to(device)
