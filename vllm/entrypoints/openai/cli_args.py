"""Server flags of `vllm serve` (kept apart from api_server.py so parsing never imports FastAPI)."""
from __future__ import annotations

import argparse


def port_number(text: str) -> int:
    try:
        port = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a port number; give an int in "
                                         "[0, 65535]") from None
    if not 0 <= port <= 65535:  # 0 = any free port
        raise argparse.ArgumentTypeError(f"{port} is outside the TCP port range [0, 65535] "
                                         "(0 = any free port)")
    return port


def byte_count(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a byte count; give an int > 0") \
            from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"{value} must be > 0 bytes")
    return value


def add_server_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("server")
    group.add_argument("--host", default="127.0.0.1",
                       help="interface to listen on (default 127.0.0.1; use 0.0.0.0 for all)")
    group.add_argument("--port", type=port_number, default=8000, help="TCP port (default 8000)")
    group.add_argument("--max-request-body-size", type=byte_count, default=None, metavar="BYTES",
                       help="refuse request bodies above this many bytes with HTTP 413 (default: "
                            "the VLLM_HTTP_MAX_JSON_BODY_SIZE environment variable, else 32 MiB, "
                            "the limit of upstream's Rust frontend)")
    group.add_argument("--api-key", default=None,
                       help="require `Authorization: Bearer KEY` on every /v1 route (default: the "
                            "VLLM_API_KEY environment variable; unset = no key)")
    group.add_argument("--disable-uvicorn-access-log", action="store_true", default=False,
                       help="no access log line per HTTP request")
    group.add_argument("--disable-log-stats", action="store_true", default=False,
                       help="no periodic throughput / queue / KV-usage / spec-decode log lines")
    group.add_argument("--uvicorn-log-level", default="warning",
                       choices=["critical", "error", "warning", "info", "debug", "trace"])
