"""Server flags of `vllm serve` (kept apart from api_server.py so parsing never imports FastAPI)."""
from __future__ import annotations

import argparse


def add_server_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("server")
    group.add_argument("--host", default="127.0.0.1",
                       help="interface to listen on (default 127.0.0.1; use 0.0.0.0 for all)")
    group.add_argument("--port", type=int, default=8000, help="TCP port (default 8000)")
    group.add_argument("--api-key", default=None,
                       help="require `Authorization: Bearer KEY` on every /v1 route (default: the "
                            "VLLM_API_KEY environment variable; unset = no key)")
    group.add_argument("--disable-uvicorn-access-log", action="store_true", default=False,
                       help="no access log line per HTTP request")
    group.add_argument("--disable-log-stats", action="store_true", default=False,
                       help="no periodic throughput / queue / KV-usage / spec-decode log lines")
    group.add_argument("--uvicorn-log-level", default="warning",
                       choices=["critical", "error", "warning", "info", "debug", "trace"])
