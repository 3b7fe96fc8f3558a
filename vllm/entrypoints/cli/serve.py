"""`vllm serve [MODEL_DIR]`: the OpenAI-compatible server (default: tiny model + DSpark)."""
from __future__ import annotations

import argparse

from vllm.entrypoints.cli.engine_setup import add_model_and_engine_args, create_vllm_config
from vllm.entrypoints.openai.cli_args import add_server_args


def register(subparsers) -> None:
    parser = subparsers.add_parser(
        "serve", help="start the OpenAI-compatible HTTP server",
        description="Serve a local model over the OpenAI API (/v1/completions, "
                    "/v1/chat/completions, /v1/models, /health, /metrics).")
    add_model_and_engine_args(parser, "local model directory (default: the built-in tiny model "
                                      "with its DSpark drafter)")
    add_server_args(parser)
    parser.set_defaults(dispatch=run)


def run(args: argparse.Namespace) -> int:
    from vllm.entrypoints.openai.api_server import run_server
    from vllm.transformers_utils.tokenizer import get_tokenizer_for
    from vllm.v1.engine.async_llm import AsyncLLM

    config, display = create_vllm_config(args)
    names = args.served_model_name
    names = ([names] if isinstance(names, str) else list(names)) if names else [display]
    llm = AsyncLLM.from_vllm_config(config, model_name=names[0])
    # The HTTP thread tokenizes with its own instance: tokenizer objects are not shared across
    # threads (the engine thread detokenizes concurrently).
    return run_server(llm, args, model_dir=config.model_config.model,
                      tokenizer=get_tokenizer_for(config.model_config), served_model_names=names)
