"""LoadConfig: where the weights come from (upstream's `--load-format`)."""
from __future__ import annotations

from dataclasses import dataclass

from vllm.config._checks import check_choice

# auto / safetensors: read *.safetensors from the model directory; dummy: seeded random weights of
# the right shapes (a directory with only config.json + tokenizer suffices), for benchmarks at real dims.
LOAD_FORMATS = ("auto", "safetensors", "dummy")


@dataclass
class LoadConfig:
    load_format: str = "auto"

    def __post_init__(self):
        self.load_format = check_choice("load_format", self.load_format, LOAD_FORMATS)
