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

__all__ = ["HAS_TRITON", "triton", "tl"]
