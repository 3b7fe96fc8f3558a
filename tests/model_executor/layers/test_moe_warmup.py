"""vllm/model_executor/layers/moe_warmup.py: the start-up launches compile every MoE kernel form
that any token count up to the budget launches.

Oracle: brute force. Every token count 1..max is run through the routed path as DeepseekMoE's
forward launches it on CUDA, with the kernels swapped for recorders; each launch is keyed by
Triton's own launch-time binder for sm_90 (argument specialisation and constexprs: the key of
its compiled-kernel cache). The warm-up's launches must hold every key the brute force saw, for
the tiny model's router and a DeepSeek-V3-shaped one."""
from __future__ import annotations

from contextlib import ExitStack
from types import SimpleNamespace
from unittest import mock

import pytest
import torch

from tests.utils.triton_aot import cuda_target, launch_variant, record_launches

pytest.importorskip("triton")

_KERNELS = (("moe_routing", "_route_kernel"), ("moe_routing", "_align_kernel"),
            ("moe_kernels", "_moe_gate_up_kernel"), ("moe_kernels", "_moe_down_kernel"))


def _moe(num_experts, top_k, n_group, topk_group, dtype=torch.bfloat16):
    from vllm.model_executor.layers.fused_moe import DeepseekMoE
    config = SimpleNamespace(
        num_experts_per_tok=top_k, n_routed_experts=num_experts, n_group=n_group,
        topk_group=topk_group, scoring_func="sigmoid", norm_topk_prob=True,
        routed_scaling_factor=2.5, hidden_size=64, topk_method="noaux_tc", hidden_act="silu",
        moe_intermediate_size=32, n_shared_experts=0)
    moe = DeepseekMoE(config).to(dtype)
    for p in moe.parameters():
        torch.nn.init.normal_(p)
    return moe


class _RoutingRecorder:
    """A recorder of _route_kernel (tests/utils/triton_aot.py's, re-classed) whose launches also
    write valid expert ids (token t, slot j -> (t + j) % E): past the alignment kernel's limit
    the torch alignment runs for real and reads them."""

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            self.launches.append((args, kwargs))
            weights, ids, num_experts = args[3], args[4], args[5]
            t = torch.arange(ids.shape[0])[:, None] + torch.arange(ids.shape[1])
            ids.copy_(t % num_experts)
            weights.fill_(1.0 / ids.shape[1])
        return launch


def _variants(run) -> dict[str, set[str]]:
    """{kernel: launch variants} of the launches `run()` makes with every MoE kernel recorded,
    the experts dispatched as on CUDA (these CPU tensors take the Triton path)."""
    from vllm.model_executor.layers import moe_kernels, moe_routing
    modules = {"moe_routing": moe_routing, "moe_kernels": moe_kernels}
    with ExitStack() as stack:
        stack.enter_context(mock.patch.object(moe_kernels, "experts_use_triton",
                                              lambda x: True))
        recorders = {name: stack.enter_context(record_launches(modules[m], name))
                     for m, name in _KERNELS}
        recorders["_route_kernel"].__class__ = _RoutingRecorder
        run()
    return {name: {launch_variant(rec.kernel, args, kwargs) for args, kwargs in rec.launches}
            for name, rec in recorders.items()}


@pytest.mark.parametrize("router, max_tokens", [
    ((4, 2, 1, 1), 4200),      # the tiny model: every tile set, alignment fused to 1,024 tokens
    ((256, 8, 8, 4), 1100),    # DeepSeek-V3 per rank: grouped routing, alignment to 8 tokens
], ids=["tiny", "v3"])
def test_the_warm_up_launches_every_kernel_form_of_every_token_count(router, max_tokens):
    from vllm.model_executor.layers import moe_warmup as mw
    cuda_target()
    moe = _moe(*router)
    counts = mw.warmup_token_counts(max_tokens, moe.num_experts, moe.top_k,
                                    lambda t: moe.routes_fused_tokens(t, True))
    with torch.inference_mode():
        warmed = _variants(lambda: mw.launch_forms(moe, counts))
        every = _variants(lambda: mw.launch_forms(moe, range(1, max_tokens + 1)))
    for name, variants in every.items():
        assert variants, name  # each kernel launches somewhere in the range
        missing = variants - warmed[name]
        assert not missing, (name, len(missing), len(variants))
    # few launches do it: one per form, not one per count
    assert len(counts) < 40 and len(counts) * 20 < max_tokens


def test_with_the_routing_kernels_off_the_expert_kernels_are_still_warmed():
    """VLLM_FUSED_MOE_ROUTING=0 keeps the torch routing and alignment, not the torch experts:
    the warm-up's launches still hold every expert-kernel key of every count, and launch no
    routing or alignment kernel."""
    from vllm.model_executor.layers import moe_warmup as mw
    cuda_target()
    moe, max_tokens = _moe(4, 2, 1, 1), 4200
    counts = mw.warmup_token_counts(max_tokens, 4, 2, lambda t: moe.routes_fused_tokens(t, False),
                                    aligns_fused=False)
    with torch.inference_mode():
        warmed = _variants(lambda: mw.launch_forms(moe, counts, kernels_on=False))
        every = _variants(lambda: mw.launch_forms(moe, range(1, max_tokens + 1), kernels_on=False))
    for name in ("_moe_gate_up_kernel", "_moe_down_kernel"):
        assert every[name] and every[name] <= warmed[name], name
    assert not every["_route_kernel"] and not every["_align_kernel"]
    assert len(counts) == 4  # one per tile set


def test_varying_counts_do_not_split_a_form():
    """The counts the kernels read at run time are unspecialised: launches of one form at a
    multiple of 16 pairs and at other counts share one compiled kernel (without it every form
    compiled twice or three times, and the warm-up's one launch per form missed the others)."""
    from vllm.model_executor.layers import moe_warmup as mw
    cuda_target()
    moe = _moe(4, 2, 1, 1)
    same_form = [t for t in range(3, 64)
                 if mw.kernel_form(t, 4, 2, True) == mw.kernel_form(8, 4, 2, True)]
    assert any(t * 2 % 16 == 0 for t in same_form) and any(t * 2 % 16 for t in same_form)
    with torch.inference_mode():
        variants = _variants(lambda: mw.launch_forms(moe, same_form))
    assert {name: len(v) for name, v in variants.items()} == {name: 1 for _, name in _KERNELS}


def test_counts_are_the_first_of_each_form():
    from vllm.model_executor.layers import moe_warmup as mw
    counts = mw.warmup_token_counts(300, 4, 2, lambda t: t <= 100)
    forms = [mw.kernel_form(t, 4, 2, t <= 100) for t in range(1, 301)]
    # brute force: a count is listed exactly when no smaller count has its form
    expected = [t for t in range(1, 301) if forms[t - 1] not in forms[: t - 1]]
    assert counts == expected
    assert 1 in counts and 101 in counts  # the first count, the first unfused routing


def test_warm_moe_kernels_leaves_cpu_models_alone(monkeypatch):
    """On the CPU the kernels never run: nothing is launched (the runner calls it on CUDA only;
    the layer's own check holds too)."""
    from vllm.model_executor.layers import moe_warmup as mw
    calls = []
    monkeypatch.setattr(mw, "launch_forms", lambda moe, counts: calls.append(counts))
    mw.warm_moe_kernels([torch.nn.Sequential(_moe(4, 2, 1, 1, torch.float32)), None], 64)
    assert calls == []


def test_warm_moe_kernels_warms_the_experts_where_routing_kernels_are_off(monkeypatch):
    """Where the expert kernels run but the routing and alignment kernels do not (here: the
    layer's own `_kernels_on` is False), the layer is still warmed, with the routing switch as
    forward has it, over the expert kernels' forms only."""
    from vllm.model_executor.layers import moe_kernels
    from vllm.model_executor.layers import moe_warmup as mw
    calls = []
    monkeypatch.setattr(moe_kernels, "experts_use_triton", lambda x: True)
    monkeypatch.setattr(mw, "launch_forms",
                        lambda moe, counts, kernels_on=True: calls.append((counts, kernels_on)))
    layer = _moe(4, 2, 1, 1)
    mw.warm_moe_kernels([torch.nn.Sequential(layer, _moe(4, 2, 1, 1))], 4200)
    assert calls == [(mw.warmup_token_counts(4200, 4, 2, lambda t: False, aligns_fused=False),
                      False)]  # two equal layers: warmed once
