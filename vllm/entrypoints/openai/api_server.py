"""FastAPI app of the OpenAI-compatible server and the `vllm serve` runner.

Endpoints: /v1/completions, /v1/chat/completions (JSON or SSE), /v1/models, /health (503 once
the engine died), /metrics (Prometheus text), /version and /debug/engine_state (the engine's
metrics snapshot as JSON: queue sizes, KV cache usage, speculative-decoding counters).
Errors always use the OpenAI shape {"error": {"message", "type", "param", "code"}}; request
bodies that fail validation get HTTP 400 (upstream vLLM's choice) instead of FastAPI's 422.
"""
from __future__ import annotations

import argparse
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse

import vllm
from vllm.entrypoints.openai.protocol import (APIError, ChatCompletionRequest, CompletionRequest,
                                              error_body, now_s)
from vllm.entrypoints.openai.serving import OpenAIServing
from vllm.v1.engine.async_llm import AsyncLLM
from vllm.v1.metrics.prometheus import CONTENT_TYPE


def _validation_message(error: RequestValidationError) -> tuple[str, str | None]:
    problems, first_param = [], None
    for item in error.errors():
        loc = [str(part) for part in item.get("loc", ()) if part != "body"]
        param = ".".join(loc) or None
        first_param = first_param or param
        problems.append(f"{param or 'body'}: {item.get('msg', 'invalid value')}")
    return "invalid request: " + "; ".join(problems), first_param


def build_app(llm: AsyncLLM, tokenizer=None, model_name: str | None = None,
              model_aliases: tuple[str, ...] = ()) -> FastAPI:
    """`model_aliases`: other names accepted in the `model` field (e.g. the model directory)."""
    model_name = model_name or llm.model_name
    serving = OpenAIServing(llm, tokenizer if tokenizer is not None else llm.tokenizer, model_name,
                            llm.max_model_len)
    app = FastAPI(title="vllm-dspark-dcp OpenAI-compatible server", version=vllm.__version__)
    app.state.llm = llm
    app.state.serving = serving

    @app.exception_handler(APIError)
    async def _api_error(_: Request, error: APIError):
        return JSONResponse(error.body(), status_code=error.status_code)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(_: Request, error: RequestValidationError):
        message, param = _validation_message(error)
        return JSONResponse(error_body(message, "BadRequestError", 400, param), status_code=400)

    async def _respond(result):
        if isinstance(result, dict):
            return JSONResponse(result)
        return StreamingResponse(result, media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache"})

    @app.post("/v1/completions")
    async def completions(request: CompletionRequest):
        serving.check_model(request.model, model_aliases)
        request.model = None  # alias accepted above
        return await _respond(await serving.create_completion(request))

    @app.post("/v1/chat/completions")
    async def chat_completions(request: ChatCompletionRequest):
        serving.check_model(request.model, model_aliases)
        request.model = None
        return await _respond(await serving.create_chat_completion(request))

    @app.get("/v1/models")
    async def models():
        card: dict[str, Any] = {"id": model_name, "object": "model", "created": now_s(),
                                "owned_by": "vllm", "root": model_aliases[0] if model_aliases else
                                model_name, "max_model_len": llm.max_model_len}
        return {"object": "list", "data": [card]}

    @app.get("/health")
    async def health():
        if llm.is_healthy:
            return Response(status_code=200)
        reason = llm.dead_error or "engine thread stopped"
        return JSONResponse(error_body(f"engine is unhealthy: {reason!r}", "ServiceUnavailableError",
                                       503), status_code=503)

    @app.get("/metrics")
    async def metrics():
        return Response(llm.metrics.render(), media_type=CONTENT_TYPE)

    @app.get("/version")
    async def version():
        return {"version": vllm.__version__}

    @app.get("/debug/engine_state")
    async def engine_state():
        return llm.get_metrics()

    return app


def run_server(llm: AsyncLLM, args: argparse.Namespace, model_dir: str, tokenizer=None) -> None:
    import uvicorn

    app = build_app(llm, tokenizer=tokenizer, model_name=llm.model_name, model_aliases=(model_dir,))
    print(f"vllm serve: model `{llm.model_name}` on http://{args.host}:{args.port}/v1 "
          f"(health: /health, metrics: /metrics)", flush=True)
    try:
        uvicorn.run(app, host=args.host, port=args.port, log_level=args.uvicorn_log_level,
                    timeout_graceful_shutdown=5)
    finally:
        llm.shutdown()
