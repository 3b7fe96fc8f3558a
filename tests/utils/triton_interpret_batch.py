"""Run several Triton interpreter drivers in ONE interpreter (TRITON_INTERPRET=1) and print, as the
last stdout line, a JSON list of [driver, args, returncode, stdout, stderr] per driver, as if each
had run alone: `sys.argv`, stdout and stderr are the driver's own while it runs, SystemExit gives
its exit status and an uncaught exception exit status 1 with the traceback on its stderr.

Starting Python + torch + triton costs about 3 s on the 2-core CI box, as much as several of the
checks themselves; the drivers only read their arguments and the kernels they import.

    python -m tests.utils.triton_interpret_batch DRIVER_PATH[::ARG,ARG...] ...

Every interpreter run of the suite goes through here (one driver alone too), so that the
corrections of triton_interpreter_fixes.py apply to all of them.
"""
from __future__ import annotations

import contextlib
import io
import json
import runpy
import sys
import traceback


def run_one(driver: str, args: list[str]) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    saved_argv = sys.argv
    sys.argv = [driver, *args]
    code = 0
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            try:
                runpy.run_path(driver, run_name="__main__")
            except SystemExit as exc:
                code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
                if not isinstance(exc.code, (int, type(None))):
                    print(exc.code, file=sys.stderr)
            except BaseException:
                traceback.print_exc()
                code = 1
    finally:
        sys.argv = saved_argv
    return code, out.getvalue(), err.getvalue()


def main(specs: list[str]) -> None:
    # Triton releases whose interpreter needs a correction get it before any driver runs.
    from tests.utils import triton_interpreter_fixes
    triton_interpreter_fixes.apply()
    results = []
    for spec in specs:
        driver, _, joined = spec.partition("::")
        args = joined.split(",") if joined else []
        results.append([driver, args, *run_one(driver, args)])
    print(json.dumps(results))


if __name__ == "__main__":
    main(sys.argv[1:])
