"""Build models from local directories: config.json + *.safetensors."""
from vllm.model_executor.model_loader.loader import get_draft_model, get_model, iterate_safetensors

__all__ = ["get_model", "get_draft_model", "iterate_safetensors"]
