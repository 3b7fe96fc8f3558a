#!/usr/bin/env bash
# Adds FlashInfer's prefill kernel sources to the offline GPU bundle. ../shared/gpu/stage.sh keeps
# only the MLA decode sources; the engine's prefill (BatchPrefillWithRaggedKVCacheWrapper, head
# dims 192/128) JIT-builds from flashinfer/data/csrc/batch_prefill*. Run it here (needs PyPI) after
# stage.sh; on the GPU node scripts/gpu_validation.sh unpacks it next to the bundle.
set -euo pipefail
cd "$(git rev-parse --show-toplevel)"
[ -d .gpu ] || { echo "run bash ../shared/gpu/stage.sh first" >&2; exit 1; }
tmp="$(mktemp -d)"; trap 'rm -rf "$tmp"' EXIT
python3 -m pip download -q --no-deps -d "$tmp" "flashinfer-python==${FI_VERSION:-0.7.2.post1}"
python3 - "$tmp" .gpu/flashinfer_prefill_csrc.zip <<'PY'
import pathlib, sys, zipfile
src = next(pathlib.Path(sys.argv[1]).glob("flashinfer_python-*.whl"))
root = "flashinfer/data/csrc/"
with zipfile.ZipFile(src) as zin, zipfile.ZipFile(sys.argv[2], "w", zipfile.ZIP_DEFLATED) as zout:
    for info in zin.infolist():
        rest = info.filename[len(root):] if info.filename.startswith(root) else None
        if rest and "/" not in rest and ("prefill" in rest or "pod" in rest or rest.endswith(".h")):
            zout.writestr(info, zin.read(info))
PY
echo "wrote .gpu/flashinfer_prefill_csrc.zip"
