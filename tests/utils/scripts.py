"""Run or import a tool of `scripts/` the way its tests need it: as a subprocess of this Python
with the project on PYTHONPATH (one OpenMP thread, text output captured), or loaded as a module
for its pure helpers."""
from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).parents[2]


def script_path(name: str) -> Path:
    return ROOT / "scripts" / name


def run_script(name: str, *args: str, check: bool = True,
               timeout: float = 300) -> subprocess.CompletedProcess:
    """`python scripts/<name> <args>` from the project root; raises on a non-zero exit unless
    `check` is False."""
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    return subprocess.run([sys.executable, str(script_path(name)), *map(str, args)],
                          check=check, cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=timeout)


def load_script(name: str):
    """scripts/<name> imported as a module (its `main` does not run)."""
    path = script_path(name)
    spec = importlib.util.spec_from_file_location(f"scripts_{path.stem}", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # (dataclasses look their module up while it loads)
    spec.loader.exec_module(module)
    return module
