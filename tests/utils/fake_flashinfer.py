"""Recording stand-ins for the FlashInfer entry points (flashinfer is not importable on CPU).

`FakeBatchMLAPagedAttentionWrapper` records plan/run keyword arguments AND executes the
planned CSR requests by brute force in float64 with FlashInfer's documented semantics
(causal=True aligns the query rows bottom-right on the kv range; causal=False lets every row
see the whole range; LSE base 2 unless basee/return_lse_base_on_e), so a wrong page list,
kv length or row grouping shows up as a wrong answer.
"""
from __future__ import annotations

import math
from types import SimpleNamespace

import torch


class FakePlanMetadata:
    def __init__(self, **fields):
        self.__dict__.update(fields)

    @classmethod
    def csr(cls, qo_indptr, kv_indptr, kv_indices, kv_len_arr):
        return cls(kind="csr", qo_indptr=qo_indptr, kv_indptr=kv_indptr, kv_indices=kv_indices,
                   kv_len_arr=kv_len_arr)


class FakeBatchMLAPagedAttentionWrapper:
    instances: list = []
    garbage_for_empty = False  # emulate a kernel that leaves junk in kv_len == 0 rows

    def __init__(self, float_workspace_buffer, use_cuda_graph=False, backend="auto", **kw):
        self.backend = backend
        self.plans, self.runs = [], []
        FakeBatchMLAPagedAttentionWrapper.instances.append(self)

    def plan(self, *args, **kwargs):
        assert not args, "plan() must be called with keyword arguments only"
        assert kwargs["metadata"].kind == "csr"
        self.plans.append(kwargs)

    def run(self, *args, **kwargs):
        assert not args, "run() must be called with keyword arguments only"
        self.runs.append(kwargs)
        plan = self.plans[-1]
        base_e = kwargs.get("return_lse_base_on_e", False)
        # mirror FlashInfer's contract check: the run's LSE mode must match the plan's
        assert plan["lse_mode"] == ("basee" if base_e else "base2")
        md = plan["metadata"]
        q, cache = kwargs["query"], kwargs["kv_cache"]
        assert q.shape[1] == plan["num_heads"] and cache.shape[1] == plan["page_size"]
        flat = cache.reshape(-1, cache.shape[-1]).double()
        ps = plan["page_size"]
        out = torch.zeros(q.shape[0], q.shape[1], plan["head_dim_ckv"], dtype=torch.float64)
        lse = torch.full(q.shape[:2], float("-inf"), dtype=torch.float64)
        qo, kvp, idx, kvl = (md.qo_indptr.tolist(), md.kv_indptr.tolist(),
                             md.kv_indices.tolist(), md.kv_len_arr.tolist())
        for i, kv_len in enumerate(kvl):
            pages = idx[kvp[i]:kvp[i + 1]]
            assert len(pages) == -(-kv_len // ps), "page count must cover exactly kv_len"
            slots = [p * ps + o for p in pages for o in range(ps)][:kv_len]
            kv = flat[torch.tensor(slots, dtype=torch.long)] if slots else flat[:0]
            start, end = qo[i], qo[i + 1]
            if kv_len == 0 and self.garbage_for_empty:
                out[start:end], lse[start:end] = float("nan"), 0.0
            if end == start or kv_len == 0:
                continue
            k = torch.arange(end - start).unsqueeze(1)
            visible = (kv_len - (end - start - 1 - k)) if plan["causal"] else torch.full_like(k, kv_len)
            mask = torch.arange(kv_len).unsqueeze(0) < visible            # [rows, kv]
            s = torch.einsum("rhd,kd->rhk", q[start:end].double(), kv) * plan["sm_scale"]
            s = s.masked_fill(~mask.unsqueeze(1), float("-inf"))
            row_lse = torch.logsumexp(s, -1)
            alive = torch.isfinite(row_lse).unsqueeze(-1)
            probs = torch.where(alive, torch.softmax(s, -1), torch.zeros_like(s))
            lse[start:end] = row_lse
            out[start:end] = torch.einsum("rhk,kd->rhd", probs, kv[:, :plan["head_dim_ckv"]])
        if not base_e:
            lse = lse / math.log(2.0)
        # float32 LSE like the kernel, except for float64 inputs (exactness tests)
        return out.to(q.dtype), (lse if q.dtype == torch.float64 else lse.float())


class RecordingTrtllmDecode:
    def __init__(self):
        self.calls = []

    def __call__(self, **kwargs):
        self.calls.append(kwargs)
        q = kwargs["query"]
        lead = q.shape[:-2]
        heads = q.shape[-2]
        out = torch.zeros(*lead, heads, kwargs["kv_lora_rank"], dtype=q.dtype)
        lse = torch.zeros(*lead, heads, dtype=torch.float32)
        return out, lse


def install(monkeypatch, float_inputs: bool = True):
    """Patch flashinfer_mla to use the fakes; returns the namespace for inspection.

    float_inputs lets the float32/float64 exactness tests through the fa3 dtype gate."""
    from vllm.v1.attention.backends.mla import flashinfer_mla
    if float_inputs:
        monkeypatch.setattr(flashinfer_mla, "_FA3_DTYPES",
                            flashinfer_mla._FA3_DTYPES + (torch.float32, torch.float64))
    FakeBatchMLAPagedAttentionWrapper.instances = []
    FakeBatchMLAPagedAttentionWrapper.garbage_for_empty = False
    fake = SimpleNamespace(
        mla=SimpleNamespace(BatchMLAPagedAttentionWrapper=FakeBatchMLAPagedAttentionWrapper,
                            MLAPlanMetadata=FakePlanMetadata),
        decode=SimpleNamespace(trtllm_batch_decode_with_kv_cache_mla=RecordingTrtllmDecode()))
    monkeypatch.setattr(flashinfer_mla, "_import_flashinfer", lambda: fake)
    return fake


class FakeBatchPrefillWithRaggedKVCacheWrapper:
    """Stand-in for flashinfer.prefill.BatchPrefillWithRaggedKVCacheWrapper: records plan()
    keyword arguments and runs the planned ragged batch by brute force in float64 with the
    documented semantics (causal=True aligns query rows bottom-right on the kv range; LSE base 2).
    Rows with kv_len == 0 get junk (NaN output, LSE 0), as a kernel is free to leave there."""

    def __init__(self):
        self.plans: list[dict] = []

    def plan(self, **kwargs):
        self.plans.append(kwargs)

    def run(self, q, k, v, return_lse=False):
        plan = self.plans[-1]
        qo, kv = plan["qo_indptr"].tolist(), plan["kv_indptr"].tolist()
        assert q.shape[0] == qo[-1] and k.shape[0] == v.shape[0] == kv[-1]
        assert q.shape[1] == plan["num_qo_heads"] and q.shape[2] == plan["head_dim_qk"]
        assert v.shape[2] == plan["head_dim_vo"] and q.dtype == plan["q_data_type"]
        out = torch.full((q.shape[0], q.shape[1], v.shape[2]), float("nan"), dtype=q.dtype)
        lse = torch.zeros(q.shape[:2], dtype=torch.float32)
        for i in range(len(qo) - 1):
            nq, nk = qo[i + 1] - qo[i], kv[i + 1] - kv[i]
            if nq == 0 or nk == 0:
                continue
            qs, ks, vs = (x.double() for x in (q[qo[i]:qo[i + 1]], k[kv[i]:kv[i + 1]],
                                               v[kv[i]:kv[i + 1]]))
            s = torch.einsum("qhd,khd->hqk", qs, ks) * plan["sm_scale"]
            if plan["causal"]:
                keep = torch.arange(nk)[None, :] <= (torch.arange(nq) + nk - nq)[:, None]
                s = s.masked_fill(~keep, float("-inf"))
            lse[qo[i]:qo[i + 1]] = (torch.logsumexp(s, -1) / math.log(2.0)).transpose(0, 1).float()
            out[qo[i]:qo[i + 1]] = torch.einsum("hqk,khd->qhd", torch.softmax(s, -1),
                                                vs).to(q.dtype)
        return (out, lse) if return_lse else out


class NativeReplanWrapper:
    """A stand-in for fa3's BatchMLAPagedAttentionWrapper that models what decides between a
    full plan and a native re-plan (flashinfer_mla._native_replan): plan() leaves a planned
    backend holding the plan's causal flag, the graph buffers and a JIT module whose native
    planner the re-plan calls. run() returns zeros of the right shape (plan counting only)."""

    def __init__(self, float_workspace_buffer, use_cuda_graph=False, backend="auto", **bufs):
        self.use_cuda_graph, self.bufs = use_cuda_graph, bufs
        self.plan_causal_flags: list[bool] = []

    def plan(self, *, metadata, causal, **kwargs):
        self.plan_causal_flags.append(causal)
        b = self.bufs
        self._planned_backend = SimpleNamespace(
            _cached_module=SimpleNamespace(
                plan_with_staged_workspace_bytes=lambda *a: (("plan_info",), 0)),
            _backend="fa3", _causal=causal, _use_cuda_graph=self.use_cuda_graph,
            device=torch.device("cpu"), _qo_indptr_buf=b.get("qo_indptr"),
            _kv_indptr_buf=b.get("kv_indptr"), _kv_indices_buf=b.get("kv_indices"),
            _kv_len_arr_buf=b.get("kv_len_arr"), _float_workspace_buffer=None,
            _int_workspace_buffer=None, _pin_memory_int_workspace_buffer=None)

    def run(self, *, query, kv_cache, return_lse, return_lse_base_on_e):
        return (query.new_zeros(query.shape[0], query.shape[1], 512),
                torch.zeros(query.shape[:2], dtype=torch.float32))


def install_native_replan(monkeypatch, wrapper_cls=None):
    """Patch flashinfer_mla to build NativeReplanWrapper wrappers (or `wrapper_cls`), with
    FlashInfer's workload check (`_fa_common`) stubbed in sys.modules, and float32 inputs
    allowed. `monkeypatch`: pytest's fixture, or a pytest.MonkeyPatch() outside tests."""
    import sys
    from types import ModuleType

    from vllm.v1.attention.backends.mla import flashinfer_mla
    fa_common = ModuleType("_fa_common")
    fa_common._validate_fa_plan_workload = lambda *a: None
    for name in ("flashinfer", "flashinfer.mla", "flashinfer.mla._batch_mla",
                 "flashinfer.mla._batch_mla._backends"):
        monkeypatch.setitem(sys.modules, name, ModuleType(name))
    monkeypatch.setitem(sys.modules, "flashinfer.mla._batch_mla._backends._fa_common", fa_common)
    monkeypatch.setattr(flashinfer_mla, "_FA3_DTYPES",
                        flashinfer_mla._FA3_DTYPES + (torch.float32,))
    fake = SimpleNamespace(mla=SimpleNamespace(
        BatchMLAPagedAttentionWrapper=wrapper_cls or NativeReplanWrapper,
        MLAPlanMetadata=SimpleNamespace(csr=lambda *a: SimpleNamespace(kind="csr"))))
    monkeypatch.setattr(flashinfer_mla, "_import_flashinfer", lambda: fake)
    return fake


def plan_model_native(fws, iws, pws, qo, kv_indptr, kv_len, num_heads, head_dim, causal):
    """FlashInfer's native MLA planner (plan_with_staged_workspace_bytes), modelled: the plan
    model of flashinfer_mla_plan_model.py (132 SMs) writes a real plan layout into the int
    workspace and its pinned twin, so the builder reads skeletons back and refreshes plans as
    on the GPU."""
    from tests.utils.flashinfer_mla_plan_model import model_plan
    info, scratch, _ = model_plan(qo.numpy(), kv_len.numpy(), kv_indptr.numpy(), num_heads,
                                  num_sm=132, causal=bool(causal))
    pws[: scratch.numel()] = scratch
    iws[: scratch.numel()] = scratch
    return info, scratch.numel()


def plan_model_raw(fws, iws, pws, qo, kv_indptr, kv_len, num_heads, head_dim, causal):
    """FlashInfer's JIT planner (`_module.plan`), modelled: the plan model's plan written
    into the page-locked scratch `pws` only (the device workspace is the caller's to fill)."""
    from tests.utils.flashinfer_mla_plan_model import model_plan
    info, scratch, _ = model_plan(qo.numpy(), kv_len.numpy(), kv_indptr.numpy(), num_heads,
                                  num_sm=132, causal=bool(causal))
    pws[: scratch.numel()] = scratch
    return info, scratch.numel()


class PlanModelWrapper:
    """A stand-in fa3 wrapper on the CPU whose plans are real plan layouts: plan() (the first
    plan of a wrapper) leaves a planned backend with the graph buffers, 2 MiB int workspaces
    and `native` (default plan_model_native) as the JIT planner, which the builder's native
    re-plans call; the builder's skeleton read-back, plan refreshes and device lowerings then
    run on these CPU tensors. run() is not modelled."""

    native = staticmethod(plan_model_native)
    # The JIT module's own planner (`_module.plan`: writes the page-locked scratch only); None
    # leaves it out, and native re-plans go through plan_with_staged_workspace_bytes.
    raw = None

    def __init__(self, workspace, use_cuda_graph=False, backend="fa3", qo_indptr=None,
                 kv_indptr=None, kv_indices=None, kv_len_arr=None):
        self._graph, self._bufs = use_cuda_graph, (qo_indptr, kv_indptr, kv_indices,
                                                    kv_len_arr)
        self._iws = torch.zeros(1 << 21, dtype=torch.uint8)
        self._pws = torch.zeros(1 << 21, dtype=torch.uint8)

    def plan(self, metadata, causal, **kwargs):
        qo, kvp, kvi, kvl = self._bufs
        self._planned_backend = SimpleNamespace(
            _cached_module=SimpleNamespace(
                plan_with_staged_workspace_bytes=self.native,
                **({} if self.raw is None else {"_module": SimpleNamespace(plan=self.raw)})),
            _backend="fa3", _causal=causal, _use_cuda_graph=self._graph,
            device=torch.device("cpu"), _qo_indptr_buf=qo, _kv_indptr_buf=kvp,
            _kv_indices_buf=kvi, _kv_len_arr_buf=kvl, _float_workspace_buffer=None,
            _int_workspace_buffer=self._iws, _pin_memory_int_workspace_buffer=self._pws,
            _plan_info=None)
