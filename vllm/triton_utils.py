"""The one Triton import guard: kernels run on CUDA when Triton loads, torch paths elsewhere.

Triton ships with CUDA builds of torch; a CPU machine may lack it or fail to load it, so any
import failure means "use the torch path" (HAS_TRITON False, triton/tl None).
"""
try:
    import triton
    import triton.language as tl

    HAS_TRITON = True
except Exception:  # noqa: BLE001 - any import failure means "use the torch path"
    triton = None
    tl = None
    HAS_TRITON = False



def next_pow2(n: int) -> int:
    """The smallest power of two >= n (1 for n <= 1): a kernel's padded block size. Plain
    Python, so the support checks that size kernels also run where Triton does not load."""
    return 1 << max(int(n) - 1, 0).bit_length()


__all__ = ["HAS_TRITON", "next_pow2", "triton", "tl"]
