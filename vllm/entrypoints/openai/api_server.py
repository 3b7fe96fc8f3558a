"""FastAPI app of the OpenAI-compatible server and the `vllm serve` runner.

Endpoints: /v1/completions, /v1/chat/completions (JSON or SSE), /v1/models, /tokenize,
/detokenize, /ping, /health (503 once the engine died), /metrics (Prometheus text), /version and
/debug/engine_state (the engine's metrics snapshot as JSON).
Errors always use the OpenAI shape {"error": {"message", "type", "param", "code"}}, rendered in
one place (the APIError handler) - also 404 / 405, bodies that are not UTF-8 JSON, and bugs (500);
request bodies that fail validation get HTTP 400 (upstream vLLM's choice) instead of FastAPI's
422. With an API key (--api-key or VLLM_API_KEY) every /v1 route answers 401 unless
`Authorization: Bearer KEY` matches (constant-time compare).

Robustness (issue 14): bodies beyond --max-request-body-size get 413 before they are parsed; a
non-streaming request whose client disconnects is cancelled, which aborts it in the engine; when
the engine dies the server logs one line and exits non-zero (run_server returns 1).
"""
from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
import json
import logging
import os
import secrets


import pydantic
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

import vllm
from vllm.entrypoints.openai.protocol import (ERROR_TYPES, APIError, ChatCompletionRequest,
                                              CompletionRequest, DetokenizeRequest, ModelCard,
                                              ModelList, TokenizeRequest, error_body, now_s)
from vllm.entrypoints.openai.serving import OpenAIServing
from vllm.v1.engine.async_llm import AsyncLLM
from vllm.v1.metrics.prometheus import CONTENT_TYPE


# Default request-body cap. Upstream's Rust frontend caps JSON bodies at 32 MiB
# (VLLM_HTTP_MAX_JSON_BODY_SIZE); the Python server had none. Override with
# --max-request-body-size or that environment variable.
DEFAULT_MAX_BODY_BYTES = 32 * 1024 * 1024
# How often a non-streaming request checks whether its client is still connected.
DISCONNECT_POLL_S = 0.25


def _short_repr(value, limit: int = 60) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[:limit] + f"... ({len(text)} chars)"


def _validation_message(error: RequestValidationError) -> tuple[str, str | None]:
    problems, first_param = [], None
    for item in error.errors()[:5]:
        loc = [str(part) for part in item.get("loc", ()) if part != "body"]
        param = ".".join(loc) or None
        first_param = first_param or param
        msg = item.get("msg", "invalid value")
        if item.get("type") == "json_invalid":
            problems.append(f"the body is not valid JSON: {msg} at position "
                            f"{(item.get('ctx') or {}).get('position', '?')}")
            continue
        # Name the field AND the value it got (bounded: the value may be megabytes).
        got = f"={_short_repr(item['input'])}" if "input" in item and param else ""
        problems.append(f"{param or 'body'}{got}: {msg}")
    return "invalid request: " + "; ".join(problems), first_param


def default_max_body_size() -> int:
    raw = os.environ.get("VLLM_HTTP_MAX_JSON_BODY_SIZE", "")
    return int(raw) if raw.strip().isdigit() else DEFAULT_MAX_BODY_BYTES


class _BodyTooLarge(Exception):
    pass


class GuardMiddleware:
    """Pure ASGI middleware (BaseHTTPMiddleware would hide client disconnects from handlers):
    the API key check, the body-size limit (413 from Content-Length before reading, or as soon
    as a chunked body crosses the limit) and the access log."""

    def __init__(self, app, expected_auth: bytes | None, max_body: int, log_requests: bool):
        self.app = app
        self.expected_auth = expected_auth
        self.max_body = max_body
        self.log_requests = log_requests

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        status = {"code": 500}
        headers = dict(scope.get("headers") or ())
        path = scope.get("path", "")

        async def send_wrapper(message):
            if message["type"] == "http.response.start":
                status["code"] = message["status"]
            await send(message)

        async def reply(code: int, message: str):
            body = JSONResponse(APIError(message, code).body(), status_code=code)
            await body(scope, receive, send_wrapper)

        try:
            if (self.expected_auth is not None and path.startswith("/v1")
                    and scope.get("method") != "OPTIONS"):
                given = headers.get(b"authorization", b"")
                if not secrets.compare_digest(given, self.expected_auth):
                    return await reply(401, "invalid or missing API key: send "
                                            "`Authorization: Bearer <key>`")
            declared = headers.get(b"content-length", b"")
            if declared.isdigit() and int(declared) > self.max_body:
                return await reply(413, self._too_large(int(declared)))
            received = 0

            async def limited_receive():
                nonlocal received
                message = await receive()
                if message["type"] == "http.request":
                    received += len(message.get("body", b""))
                    if received > self.max_body:
                        raise _BodyTooLarge()
                return message

            try:
                await self.app(scope, limited_receive, send_wrapper)
            except _BodyTooLarge:
                await reply(413, self._too_large(received, at_least=True))
        finally:
            if self.log_requests:
                _access_log_scope(scope, status["code"])

    def _too_large(self, size: int, at_least: bool = False) -> str:
        return (f"the request body is {'more than ' if at_least else ''}{size} bytes, above this "
                f"server's limit of {self.max_body} bytes (--max-request-body-size); send a "
                "smaller request")


logger = logging.getLogger("vllm.entrypoints.openai.api_server")


def build_app(llm: AsyncLLM, tokenizer=None, model_name: str | None = None,
              model_aliases: tuple[str, ...] = (), api_key: str | None = None,
              log_requests: bool = True, max_request_body_size: int | None = None) -> FastAPI:
    """`model_aliases`: other names accepted in the `model` field (more served names, the model
    directory). `api_key`: None reads VLLM_API_KEY; empty / unset = no key required.
    `max_request_body_size`: bytes (None: VLLM_HTTP_MAX_JSON_BODY_SIZE or 32 MiB)."""
    model_name = model_name or llm.model_name
    serving = OpenAIServing(llm, tokenizer if tokenizer is not None else llm.tokenizer, model_name,
                            llm.max_model_len)
    app = FastAPI(title="vllm-dspark-dcp OpenAI-compatible server", version=vllm.__version__)
    app.state.llm = llm
    app.state.serving = serving
    key = api_key if api_key is not None else os.environ.get("VLLM_API_KEY")
    expected = f"Bearer {key}".encode() if key else None

    app.add_middleware(GuardMiddleware, expected_auth=expected,
                       max_body=max_request_body_size or default_max_body_size(),
                       log_requests=log_requests)

    @app.exception_handler(APIError)
    async def _api_error(_: Request, error: APIError):
        return JSONResponse(error.body(), status_code=error.status_code)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(_: Request, error: RequestValidationError):
        message, param = _validation_message(error)
        return JSONResponse(error_body(message, "BadRequestError", 400, param), status_code=400)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, error: StarletteHTTPException):
        code = error.status_code
        if code == 404:
            message = f"{request.url.path} is not an endpoint of this server (see /docs)"
        elif code == 405:
            message = f"{request.method} is not allowed on {request.url.path}"
        elif code == 400 and "parsing the body" in str(error.detail):
            message = "the request body is not valid UTF-8 JSON; send a UTF-8 encoded JSON object"
        else:
            message = str(error.detail)
        return JSONResponse(error_body(message, ERROR_TYPES.get(code, "APIError"), code),
                            status_code=code, headers=getattr(error, "headers", None))

    @app.exception_handler(Exception)
    async def _internal_error(request: Request, error: Exception):
        logger.error("internal error on %s %s: %s: %s", request.method, request.url.path,
                     type(error).__name__, error, exc_info=error)
        return JSONResponse(error_body(f"internal server error: {type(error).__name__}: {error}",
                                       "InternalServerError", 500), status_code=500)

    async def _until_disconnect(raw: Request, make):
        """Run a handler; cancel it (which aborts its engine requests) once the client hangs
        up. Streaming responses return at once and are cancelled by Starlette themselves."""
        task = asyncio.ensure_future(make())
        try:
            while True:
                done, _ = await asyncio.wait({task}, timeout=DISCONNECT_POLL_S)
                if done:
                    return task.result()
                if await raw.is_disconnected():
                    task.cancel()
                    logger.info("client disconnected from %s: request aborted", raw.url.path)
                    return Response(status_code=499)
        finally:
            if not task.done():
                task.cancel()

    async def _respond(result):
        if isinstance(result, dict):
            return JSONResponse(result)
        return StreamingResponse(result, media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache"})

    parse_pool = concurrent.futures.ThreadPoolExecutor(max_workers=1,
                                                       thread_name_prefix="vllm-parse")

    async def parse_body(raw: Request, model):
        """JSON + validation of a (possibly huge) body on a worker thread, not the event loop."""
        body = await raw.body()

        def parse():
            try:
                data = json.loads(body)
            except UnicodeDecodeError:
                raise APIError("the request body is not valid UTF-8 JSON; send a UTF-8 encoded "
                               "JSON object", 400) from None
            except json.JSONDecodeError as error:
                raise APIError(f"the body is not valid JSON: {error.msg} at position "
                               f"{error.pos}", 400) from None
            if not isinstance(data, dict):
                raise APIError(f"the body must be a JSON object, got {type(data).__name__}", 400)
            try:
                return model.model_validate(data)
            except pydantic.ValidationError as error:
                raise RequestValidationError(error.errors()) from None

        return await asyncio.get_running_loop().run_in_executor(parse_pool, parse)

    @app.post("/v1/completions")
    async def completions(raw: Request):
        request = await parse_body(raw, CompletionRequest)
        serving.check_model(request.model, model_aliases)
        request.model = None  # alias accepted above
        return await _until_disconnect(
            raw, lambda: _respond_after(serving.create_completion(request)))

    @app.post("/v1/chat/completions")
    async def chat_completions(raw: Request):
        request = await parse_body(raw, ChatCompletionRequest)
        serving.check_model(request.model, model_aliases)
        request.model = None
        return await _until_disconnect(
            raw, lambda: _respond_after(serving.create_chat_completion(request)))

    async def _respond_after(coro):
        return await _respond(await coro)

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
        return JSONResponse(await serving.run_tokenizer(serving.tokenize, request))

    @app.post("/detokenize")
    async def detokenize(request: DetokenizeRequest):
        serving.check_model(request.model, model_aliases)
        request.model = None
        return JSONResponse(await serving.run_tokenizer(serving.detokenize, request))

    @app.api_route("/ping", methods=["GET", "POST"])
    async def ping():
        return await health()

    @app.get("/health")
    async def health():
        problem = llm.health_problem()
        if problem is None:
            return Response(status_code=200)
        return JSONResponse(error_body(f"engine is unhealthy: {problem}",
                                       "ServiceUnavailableError", 503), status_code=503)

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


def _access_log_scope(scope, status: int) -> None:
    client = scope.get("client")
    where = f"{client[0]}:{client[1]}" if client else "-"
    logger.info('%s - "%s %s HTTP/%s" %d', where, scope.get("method"), scope.get("path"),
                scope.get("http_version", "1.1"), status)


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
               served_model_names: list[str] | None = None) -> int:
    """Serve until stopped; returns the exit code (1 if the engine died: a supervisor restarts
    the server instead of finding a zombie that answers 500 to everything)."""
    import uvicorn

    from vllm.utils.gc_utils import freeze_gc_heap, unfreeze_gc_heap
    from vllm.v1.metrics.loggers import LoggingStatLogger

    configure_logging()
    names = list(served_model_names or [llm.model_name])
    app = build_app(llm, tokenizer=tokenizer, model_name=names[0],
                    model_aliases=(*names[1:], model_dir), api_key=getattr(args, "api_key", None),
                    log_requests=not getattr(args, "disable_uvicorn_access_log", False),
                    max_request_body_size=getattr(args, "max_request_body_size", None))
    if not getattr(args, "disable_log_stats", False):
        stat_logger = LoggingStatLogger(llm.get_metrics)

        @app.on_event("startup")
        async def _start_stat_logger():
            app.state.stat_logger_task = asyncio.create_task(stat_logger.run())

    server = uvicorn.Server(uvicorn.Config(app, host=args.host, port=args.port,
                                           log_level=args.uvicorn_log_level,
                                           timeout_graceful_shutdown=2))

    def _on_engine_dead(error: BaseException) -> None:
        # Called from an engine-side thread; uvicorn polls this flag in its main loop.
        logger.info("shutting down the API server because the engine is dead")
        server.should_exit = True

    llm.add_dead_callback(_on_engine_dead)
    print(f"vllm serve: model `{names[0]}` on http://{args.host}:{args.port}/v1 "
          f"(health: /health, metrics: /metrics)", flush=True)
    # Start-up is done (engine built, app ready): keep the collector off the start-up heap
    # for as long as this process serves (vllm/utils/gc_utils.py says why).
    num_frozen = freeze_gc_heap()
    logger.info("froze %d start-up objects out of the garbage collector's reach", num_frozen)
    try:
        server.run()
    finally:
        unfreeze_gc_heap()
        dead = llm.dead_error is not None
        llm.shutdown(timeout=2.0 if dead else 10.0)
    if dead or not server.started:
        return 1  # engine death, or uvicorn could not start (it logged why: port in use, ...)
    return 0
