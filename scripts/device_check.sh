#!/usr/bin/env bash
# One-shot GPU check for the torch engine (issue 8). Not run in CI; run it on a GPU machine:
#   OUT=/some/dir bash scripts/device_check.sh
# Installs any wheels carried in wheels/ (small pure-Python ones the bench needs), then runs
# scripts/device_check.py under an 8-minute cap. Without an NVIDIA GPU it says so and exits 0.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-results/device-check}"
mkdir -p "$OUT"
PY="${PYTHON:-python3}"
if [ -d .venv ]; then PY=.venv/bin/python; fi

if ! command -v nvidia-smi >/dev/null 2>&1 || ! nvidia-smi -L >/dev/null 2>&1; then
  echo "device_check: no NVIDIA GPU here; skipping" | tee "$OUT/skipped.txt"
  exit 0
fi
nvidia-smi -L | tee "$OUT/gpu.txt"

if compgen -G "wheels/*.whl" >/dev/null; then
  "$PY" -m pip install --no-index --find-links wheels wheels/*.whl 2>&1 | tail -n 3
fi
if ! "$PY" -c "import torch; assert torch.cuda.is_available()" 2>/dev/null; then
  echo "device_check: torch with CUDA is not importable; skipping" | tee "$OUT/skipped.txt"
  exit 0
fi

timeout --signal=TERM --kill-after=20 480 "$PY" scripts/device_check.py --out "$OUT" "$@"
