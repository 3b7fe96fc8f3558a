"""MLA KV-cache write ops: `concat_and_cache_mla` (PAD slots -1 skipped) and the fused
`rope_concat_and_cache_mla` (rope of q_pe and k_pe + the latent write), against brute force on CPU,
under the Triton interpreter, and on the GPU (sync-free, CUDA-graph capturable); plus the MLA
layer: what `forward` stores equals `rotated_latent_kv` (the DFlash/DSpark context KV)."""
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from tests.utils.triton_interpreter import run_interpreter_driver
from vllm.model_executor.layers.rotary_embedding import RotaryEmbedding, rope_torch
from vllm.v1.attention.ops.mla_kv_cache import concat_and_cache_mla, rope_concat_and_cache_mla

DRIVER = Path(__file__).parents[2].joinpath("utils", "triton_fused_ops_interpret_driver.py")


def _expected_cache(cache, kv_c, k_pe, slots):
    """Brute force: row by row, skipping -1."""
    expected = cache.clone().view(-1, cache.shape[-1])
    for i, s in enumerate(slots.tolist()):
        if s >= 0:
            expected[s] = torch.cat([kv_c[i], k_pe[i]]).to(cache.dtype)
    return expected.view(cache.shape)


def test_concat_and_cache_writes_rows_and_skips_pad():
    gen = torch.Generator().manual_seed(0)
    cache = torch.full((3, 4, 576), 5.0)
    latent = torch.randn(6, 576, generator=gen)
    kv_c, k_pe = latent[:, :512], latent[:, 512:]  # strided views, as from the kv_a split
    slots = torch.tensor([5, -1, 0, 11, -1])  # 5 slots for 6 tokens: the last is not stored
    expected = _expected_cache(cache, kv_c, k_pe, slots)
    concat_and_cache_mla(kv_c, k_pe, cache, slots)
    assert torch.equal(cache, expected)


def test_concat_and_cache_names_bad_shapes():
    with pytest.raises(ValueError, match="cache last dim 570"):
        concat_and_cache_mla(torch.zeros(2, 512), torch.zeros(2, 64), torch.zeros(1, 4, 570), torch.tensor([0, 1]))
    with pytest.raises(ValueError, match="3 slots but kv_c has 2"):
        concat_and_cache_mla(torch.zeros(2, 512), torch.zeros(2, 64), torch.zeros(1, 4, 576), torch.tensor([0, 1, 2]))


@pytest.mark.parametrize("interleaved", [True, False])
def test_rope_concat_and_cache_equals_rope_then_write(interleaved):
    gen = torch.Generator().manual_seed(1)
    rope = RotaryEmbedding(head_size=64, max_position=128, base=10000.0, interleaved=interleaved)
    positions = torch.tensor([3, 0, 127, 64, 9])
    q_pe = torch.randn(5, 4, 64, generator=gen)
    k_pe, kv_c = torch.randn(5, 64, generator=gen), torch.randn(5, 512, generator=gen)
    slots = torch.tensor([7, -1, 2, 15])
    cache = torch.zeros(2, 8, 576)
    k_out = torch.empty(5, 64)
    q_rot = rope_concat_and_cache_mla(positions, q_pe, k_pe, kv_c, rope.cos_cache, rope.sin_cache, interleaved,
                                      cache, slots, k_pe_out=k_out)
    q_ref, k_ref = rope(positions, q_pe, k_pe)
    assert torch.equal(q_rot, q_ref) and torch.equal(k_out, k_ref)
    assert torch.equal(cache, _expected_cache(torch.zeros(2, 8, 576), kv_c, k_ref, slots))


def test_rope_concat_and_cache_refuses_mismatched_tokens():
    rope = RotaryEmbedding(head_size=64, max_position=16, base=10000.0, interleaved=True)
    with pytest.raises(ValueError, match="q_pe has 3 tokens, k_pe 2"):
        rope_concat_and_cache_mla(torch.arange(3), torch.zeros(3, 1, 64), torch.zeros(2, 64), torch.zeros(2, 512),
                                  rope.cos_cache, rope.sin_cache, True, torch.zeros(1, 4, 576), torch.arange(2))


def _mla_layer(device, dtype):
    from vllm.model_executor.layers.attention.mla_attention import MLAAttention
    from vllm.model_executor.models.tiny import tiny_target_config
    from vllm.transformers_utils.config import HFConfig
    torch.manual_seed(2)
    with torch.device(device):
        layer = MLAAttention(HFConfig(tiny_target_config()), layer_name="model.layers.0.self_attn")
    for p in layer.parameters():
        torch.nn.init.normal_(p, std=0.05)
        p.data = p.data.to(dtype)  # parameters only: the rope tables stay float32, as in the model
    return layer


def _forward_with_cache(layer, positions, x, slots, num_blocks=4, block_size=8):
    from vllm.forward_context import set_forward_context
    layer.kv_cache = torch.zeros(num_blocks, block_size, 576, dtype=x.dtype, device=x.device)
    # no decode rows and no prefill part: forward stops after the KV write (o_proj of zeros)
    metadata = SimpleNamespace(slot_mapping=slots, num_decode_tokens=0, prefill=None)
    with set_forward_context({layer.layer_name: metadata}):
        layer(positions, x)
    return layer.kv_cache


def _check_layer_stores_rotated_latent(device, dtype):
    layer = _mla_layer(device, dtype)
    positions = torch.tensor([0, 1, 2, 40, 41, 7], device=device)
    x = torch.randn(6, layer.hidden_size, device=device).to(dtype)
    slots = torch.tensor([0, 1, -1, 9, 31, 12], device=device)
    with torch.no_grad():
        cache = _forward_with_cache(layer, positions, x, slots)
        kv_c, k_pe = layer.rotated_latent_kv(positions, x)
    expected = _expected_cache(torch.zeros_like(cache).cpu(), kv_c.cpu(), k_pe.cpu(), slots.cpu())
    assert torch.equal(cache.cpu(), expected)  # bit for bit what the DFlash context KV gets
    return layer, positions, x, kv_c, k_pe


def test_mla_forward_stores_rotated_latent_kv():
    _, positions, x, kv_c, k_pe = _check_layer_stores_rotated_latent("cpu", torch.float32)
    assert not torch.equal(k_pe, torch.zeros_like(k_pe))


def test_write_latent_kv_stores_what_forward_stores():
    # The block drafters' context-KV write (one fused rope + write) against the layer's own
    # forward, bit for bit, with a PAD slot and a mapping shorter than the tokens.
    layer = _mla_layer("cpu", torch.float32)
    positions = torch.tensor([0, 1, 2, 40, 41, 7])
    x = torch.randn(6, layer.hidden_size)
    slots = torch.tensor([0, 1, -1, 9, 31])
    with torch.no_grad():
        expected = _forward_with_cache(layer, positions, x, slots).clone()
        layer.kv_cache = torch.zeros_like(expected)
        layer.write_latent_kv(positions, x, slots)
    assert torch.equal(layer.kv_cache, expected)
    assert expected.abs().sum() > 0


@pytest.mark.slow
def test_kv_cache_kernel_under_interpreter():
    """The Triton rope + KV-write kernel, run by Triton's CPU interpreter, equals the torch path:
    PAD slots and tokens past the mapping store nothing; the cached k_pe is the returned one."""
    run_interpreter_driver(DRIVER, ("kv_cache",))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("heads", [16, 128])
@pytest.mark.parametrize("interleaved", [True, False])
def test_fused_write_triton_matches_torch_on_gpu(dtype, heads, interleaved):
    rope = RotaryEmbedding(head_size=64, max_position=163840, base=10000.0, interleaved=interleaved).cuda()
    gen = torch.Generator(device="cuda").manual_seed(3)
    tokens = 37
    positions = torch.randint(0, 163840, (tokens,), device="cuda", generator=gen)
    q = torch.randn(tokens, heads, 192, device="cuda", generator=gen).to(dtype)
    q_pe = q[..., 128:]
    latent = torch.randn(tokens, 576, device="cuda", generator=gen).to(dtype)
    kv_c, k_pe = latent[:, :512], latent[:, 512:]
    slots = torch.randperm(64 * 16, device="cuda", generator=gen)[:tokens - 2]
    slots[::5] = -1  # PAD; the last two tokens have no slot at all
    cache = torch.full((64, 16, 576), 3.0, device="cuda", dtype=dtype)
    k_out = torch.empty(tokens, 64, device="cuda", dtype=dtype)
    scratch = cache.clone()  # compile both launches first, outside the sync check
    rope_concat_and_cache_mla(positions, q_pe, k_pe, kv_c, rope.cos_cache, rope.sin_cache, interleaved, scratch,
                              slots, k_pe_out=k_out)
    concat_and_cache_mla(kv_c, k_out, scratch, slots[:tokens - 2])
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        q_rot = rope_concat_and_cache_mla(positions, q_pe, k_pe, kv_c, rope.cos_cache, rope.sin_cache, interleaved,
                                          cache, slots, k_pe_out=k_out)
        plain = torch.full_like(cache, 3.0)
        concat_and_cache_mla(kv_c, k_out, plain, slots[:tokens - 2])
    finally:
        torch.cuda.set_sync_debug_mode("default")
    cos, sin = rope.cos_cache[positions], rope.sin_cache[positions]
    tol = dict(rtol=1.6e-2, atol=1.6e-2) if dtype == torch.bfloat16 else dict(rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(q_rot, rope_torch(q_pe, cos[:, None], sin[:, None], interleaved), **tol)
    torch.testing.assert_close(k_out, rope_torch(k_pe, cos, sin, interleaved), **tol)
    expected = _expected_cache(torch.full((64, 16, 576), 3.0, dtype=dtype), kv_c.cpu(), k_out.cpu(), slots.cpu())
    assert torch.equal(cache.cpu(), expected) and torch.equal(plain.cpu(), expected)


@pytest.mark.gpu
def test_fused_write_in_cuda_graph():
    rope = RotaryEmbedding(head_size=64, max_position=4096, base=10000.0, interleaved=True).cuda()
    tokens = 8
    positions = torch.arange(tokens, device="cuda")
    q_pe = torch.randn(tokens, 16, 64, device="cuda").bfloat16()
    k_pe, kv_c = torch.randn(tokens, 64, device="cuda").bfloat16(), torch.randn(tokens, 512, device="cuda").bfloat16()
    slots = torch.arange(tokens, device="cuda")
    cache = torch.zeros(4, 16, 576, device="cuda", dtype=torch.bfloat16)
    args = (rope.cos_cache, rope.sin_cache, True, cache)
    rope_concat_and_cache_mla(positions, q_pe, k_pe, kv_c, *args, slots)  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        q_rot = rope_concat_and_cache_mla(positions, q_pe, k_pe, kv_c, *args, slots)
    cache.zero_()
    positions.copy_(torch.arange(100, 100 + tokens, device="cuda"))
    slots.copy_(torch.tensor([3, -1, 20, 21, -1, 40, 41, 63], device="cuda"))
    graph.replay()
    torch.cuda.synchronize()
    # the replay read the new positions and slots: it equals an eager call on them
    eager_cache = torch.zeros_like(cache)
    q_eager = rope_concat_and_cache_mla(positions, q_pe, k_pe, kv_c, rope.cos_cache, rope.sin_cache, True,
                                        eager_cache, slots)
    assert torch.equal(q_rot, q_eager) and torch.equal(cache, eager_cache)
    assert int((cache.view(-1, 576).abs().sum(-1) > 0).sum()) == 6  # the two PAD tokens stored nothing
    q_ref, _ = rope(positions, q_pe, k_pe)
    torch.testing.assert_close(q_rot, q_ref, rtol=1.6e-2, atol=1.6e-2)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_mla_forward_stores_rotated_latent_kv_on_gpu(dtype):
    _, _, _, kv_c, k_pe = _check_layer_stores_rotated_latent("cuda", dtype)
    assert kv_c.is_cuda and k_pe.dtype == dtype
