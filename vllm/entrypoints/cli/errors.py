"""User errors vs bugs at the command line.

A user error (bad flag, bad JSON, missing model directory, impossible parallel layout) ends the
process with exit code 1 and ONE line on stderr naming the problem; a traceback would only bury it.
Set VLLM_DEBUG=1 to get the traceback anyway. Anything else is a bug and keeps its traceback.
"""
from __future__ import annotations

import argparse
import json
import os
import sys

USER_ERRORS = (ValueError, FileNotFoundError, NotADirectoryError, json.JSONDecodeError)


def _runtime_failures() -> tuple[type[BaseException], ...]:
    from vllm.v1.engine.async_llm import EngineDeadError
    from vllm.v1.executor.abstract import WorkerError

    return (WorkerError, EngineDeadError)


# Failures at run time that are not CLI bugs (a worker died or hung): one line, exit code 1.
RUNTIME_FAILURES = _runtime_failures()


class CLIError(ValueError):
    """A problem with what the user asked for; the message says what and how to fix it."""


def one_line(error: BaseException) -> str:
    text = " ".join(part.strip() for part in str(error).splitlines() if part.strip())
    return text or type(error).__name__


def debug_enabled() -> bool:
    return os.environ.get("VLLM_DEBUG", "") not in ("", "0", "false", "False")


def report_and_exit(prog: str, error: BaseException, code: int = 1) -> None:
    print(f"{prog}: error: {one_line(error)}", file=sys.stderr, flush=True)
    sys.exit(code)


class OneLineArgumentParser(argparse.ArgumentParser):
    """argparse prints its usage block before an error; we print one line with a --help hint."""

    def error(self, message: str):
        print(f"{self.prog}: error: {message} (see `{self.prog} --help`)", file=sys.stderr,
              flush=True)
        sys.exit(2)
