"""FastAPI app of the OpenAI-compatible server and the `vllm serve` runner.

Endpoints: /v1/completions, /v1/chat/completions (JSON or SSE), /v1/models, /tokenize,
/detokenize, /ping, /health (503 once the engine died), /metrics (Prometheus text), /version and
/debug/engine_state (the engine's metrics snapshot as JSON).
Errors always use the OpenAI shape {"error": {"message", "type", "param", "code"}}, rendered in
one place (the APIError handler); request bodies that fail validation get HTTP 400 (upstream
vLLM's choice) instead of FastAPI's 422. With an API key (--api-key or VLLM_API_KEY) every /v1
route answers 401 unless `Authorization: Bearer KEY` matches (constant-time compare).
"""
from __future__ import annotations

import argparse
import asyncio
import logging
import os
import secrets

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse

import vllm
from vllm.entrypoints.openai.protocol import (APIError, ChatCompletionRequest, CompletionRequest,
                                              DetokenizeRequest, ModelCard, ModelList,
                                              TokenizeRequest, error_body, now_s)
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


logger = logging.getLogger("vllm.entrypoints.openai.api_server")


def build_app(llm: AsyncLLM, tokenizer=None, model_name: str | None = None,
              model_aliases: tuple[str, ...] = (), api_key: str | None = None,
              log_requests: bool = True) -> FastAPI:
    """`model_aliases`: other names accepted in the `model` field (more served names, the model
    directory). `api_key`: None reads VLLM_API_KEY; empty / unset = no key required."""
    model_name = model_name or llm.model_name
    serving = OpenAIServing(llm, tokenizer if tokenizer is not None else llm.tokenizer, model_name,
                            llm.max_model_len)
    app = FastAPI(title="vllm-dspark-dcp OpenAI-compatible server", version=vllm.__version__)
    app.state.llm = llm
    app.state.serving = serving
    key = api_key if api_key is not None else os.environ.get("VLLM_API_KEY")
    expected = f"Bearer {key}".encode() if key else None

    @app.middleware("http")
    async def _auth_and_access_log(request: Request, call_next):
        if (expected is not None and request.url.path.startswith("/v1")
                and request.method != "OPTIONS"):
            given = request.headers.get("Authorization", "").encode()
            if not secrets.compare_digest(given, expected):
                response = JSONResponse(APIError("invalid or missing API key: send "
                                                 "`Authorization: Bearer <key>`", 401).body(),
                                        status_code=401)
                _access_log(request, response.status_code)
                return response
        response = await call_next(request)
        if log_requests:
            _access_log(request, response.status_code)
        return response

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
        root = model_aliases[-1] if model_aliases else model_name
        names = [model_name, *[a for a in model_aliases[:-1]]] if model_aliases else [model_name]
        cards = [ModelCard(id=name, created=now_s(), root=root, max_model_len=llm.max_model_len)
                 for name in names]
        return ModelList(data=cards).model_dump()

    @app.post("/tokenize")
    async def tokenize(request: TokenizeRequest):
        serving.check_model(request.model, model_aliases)
        request.model = None
        return JSONResponse(serving.tokenize(request))

    @app.post("/detokenize")
    async def detokenize(request: DetokenizeRequest):
        serving.check_model(request.model, model_aliases)
        request.model = None
        return JSONResponse(serving.detokenize(request))

    @app.api_route("/ping", methods=["GET", "POST"])
    async def ping():
        return await health()

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


def _access_log(request: Request, status: int) -> None:
    client = request.client
    where = f"{client.host}:{client.port}" if client else "-"
    logger.info('%s - "%s %s HTTP/%s" %d', where, request.method, request.url.path,
                request.scope.get("http_version", "1.1"), status)


def configure_logging() -> None:
    """vLLM-style lines on stdout: `INFO 12-01 08:00:00 [api_server.py:42] message`."""
    root = logging.getLogger("vllm")
    if root.handlers:
        return
    handler = logging.StreamHandler()
    handler.setFormatter(logging.Formatter("%(levelname)s %(asctime)s [%(filename)s:%(lineno)d] "
                                           "%(message)s", datefmt="%m-%d %H:%M:%S"))
    root.addHandler(handler)
    root.setLevel(os.environ.get("VLLM_LOGGING_LEVEL", "INFO"))
    root.propagate = False


def run_server(llm: AsyncLLM, args: argparse.Namespace, model_dir: str, tokenizer=None,
               served_model_names: list[str] | None = None) -> None:
    import uvicorn

    from vllm.v1.metrics.loggers import LoggingStatLogger

    configure_logging()
    names = list(served_model_names or [llm.model_name])
    app = build_app(llm, tokenizer=tokenizer, model_name=names[0],
                    model_aliases=(*names[1:], model_dir), api_key=getattr(args, "api_key", None),
                    log_requests=not getattr(args, "disable_uvicorn_access_log", False))
    if not getattr(args, "disable_log_stats", False):
        stat_logger = LoggingStatLogger(llm.get_metrics)

        @app.on_event("startup")
        async def _start_stat_logger():
            app.state.stat_logger_task = asyncio.create_task(stat_logger.run())

    print(f"vllm serve: model `{names[0]}` on http://{args.host}:{args.port}/v1 "
          f"(health: /health, metrics: /metrics)", flush=True)
    try:
        uvicorn.run(app, host=args.host, port=args.port, log_level=args.uvicorn_log_level,
                    timeout_graceful_shutdown=5)
    finally:
        llm.shutdown()
