"""Speculative decoding: the shared draft-metadata base and the four speculators."""
from __future__ import annotations


def get_speculator_cls(method: str) -> type:
    """Speculator class for a SpeculativeConfig.method (eagle, mtp, dflash, dspark)."""
    if method == "eagle":
        from vllm.v1.worker.gpu.spec_decode.eagle.speculator import EagleSpeculator
        return EagleSpeculator
    if method == "mtp":
        from vllm.v1.worker.gpu.spec_decode.mtp.speculator import MTPSpeculator
        return MTPSpeculator
    if method == "dflash":
        from vllm.v1.worker.gpu.spec_decode.dflash.speculator import DFlashSpeculator
        return DFlashSpeculator
    if method == "dspark":
        from vllm.v1.worker.gpu.spec_decode.dspark.speculator import DSparkSpeculator
        return DSparkSpeculator
    raise ValueError(f"speculative method {method!r} is not supported; use one of "
                     "'eagle', 'mtp', 'dflash', 'dspark'.")
