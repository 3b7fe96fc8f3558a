"""RoPE: the torch path against a float64 complex-number rotation, the host-side position check,
and the Triton kernel against the torch path (interpreter: test_layernorm.py's driver run; GPU here)."""
import math

import pytest
import torch

from vllm.model_executor.layers.rotary_embedding import RotaryEmbedding, rope_torch


def _rope_float64(x, positions, base, interleaved):
    """Brute force: pair j rotates by angle pos * base^(-2j/d), as a complex multiplication."""
    d = x.shape[-1]
    x = x.double()
    out = torch.empty_like(x)
    for t, p in enumerate(positions.tolist()):
        for j in range(d // 2):
            a, b = (2 * j, 2 * j + 1) if interleaved else (j, j + d // 2)
            angle = p * base ** (-2 * j / d)
            z = complex(math.cos(angle), math.sin(angle))
            re, im = x[t, ..., a], x[t, ..., b]  # (re + i im) * z
            out[t, ..., a] = re * z.real - im * z.imag
            out[t, ..., b] = re * z.imag + im * z.real
    return out


@pytest.mark.parametrize("interleaved", [True, False])
def test_rope_matches_float64_rotation(interleaved):
    gen = torch.Generator().manual_seed(4)
    rope = RotaryEmbedding(head_size=16, max_position=64, base=10000.0, interleaved=interleaved)
    positions = torch.tensor([0, 5, 63, 17])
    q = torch.randn(4, 3, 16, generator=gen)
    k = torch.randn(4, 16, generator=gen)
    q_rot, k_rot = rope(positions, q, k)
    torch.testing.assert_close(q_rot.double(), _rope_float64(q, positions, 10000.0, interleaved), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(k_rot.double(), _rope_float64(k, positions, 10000.0, interleaved), rtol=1e-5, atol=1e-5)
    _, k3 = rope(positions, q, k[:, None, :])  # [T, 1, d] keys rotate the same
    assert torch.equal(k3[:, 0], k_rot)


@pytest.mark.parametrize("bad", [64, -1])
def test_rope_position_check_names_the_position(bad):
    rope = RotaryEmbedding(head_size=8, max_position=64, base=10000.0, interleaved=True)
    with pytest.raises(ValueError, match=f"position {bad} is outside"):
        rope(torch.tensor([1, bad]), torch.zeros(2, 1, 8), torch.zeros(2, 8))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("interleaved", [True, False])
@pytest.mark.parametrize("heads", [1, 16, 128])
def test_rope_triton_matches_torch_on_gpu(dtype, interleaved, heads):
    rope = RotaryEmbedding(head_size=64, max_position=163840, base=10000.0, interleaved=interleaved).cuda()
    gen = torch.Generator(device="cuda").manual_seed(5)
    for tokens in (1, 9, 300):
        positions = torch.randint(0, 163840, (tokens,), device="cuda", generator=gen)
        q = torch.randn(tokens, heads, 192, device="cuda", generator=gen).to(dtype)[..., 128:]  # q_pe view
        k = torch.randn(tokens, 576, device="cuda", generator=gen).to(dtype)[:, 512:]  # k_pe view
        rope(positions, q, k)  # compile first
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")  # the position check must not sync on CUDA
        try:
            q_rot, k_rot = rope(positions, q, k)
        finally:
            torch.cuda.set_sync_debug_mode("default")
        cos, sin = rope.cos_cache[positions], rope.sin_cache[positions]
        tol = dict(rtol=1.6e-2, atol=1.6e-2) if dtype == torch.bfloat16 else dict(rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(q_rot, rope_torch(q, cos[:, None], sin[:, None], interleaved), **tol)
        torch.testing.assert_close(k_rot, rope_torch(k, cos, sin, interleaved), **tol)
        assert q_rot.dtype == dtype and k_rot.shape == k.shape
