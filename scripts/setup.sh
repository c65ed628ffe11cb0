#!/usr/bin/env bash
# Create ./.venv with a Python >= 3.12 and install maxtext-nvfp4 (+ test tools) into it. Idempotent:
# re-running only reinstalls when pyproject.toml changed.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${VENV:-.venv}
PY=$(bash scripts/find_python.sh)
if [ ! -x "$VENV/bin/python" ]; then
  echo "[setup] creating $VENV with $PY"
  "$PY" -m venv "$VENV"
fi
stamp="$VENV/.maxtext_nvfp4_installed"
want=$(sha256sum pyproject.toml | cut -c1-16)
if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
  echo "[setup] installing maxtext-nvfp4 and its dependencies (first time: a few minutes, ~2.5 GB)"
  "$VENV/bin/python" -m pip install -q --upgrade pip
  # --no-compile: byte-compiling every installed module (~2.5 GB of packages) takes longer on 2 cores than
  # compiling, on first import, the modules the tests use.
  "$VENV/bin/python" -m pip install -q --no-compile -e ".[dev]"
  echo "$want" > "$stamp"
fi
# MaxText's distillation trainer (maxtext-nvfp4 distill) runs on Tunix. google-tunix 0.1.7's own dependency list
# would downgrade transformers (its safetensors<0.8 pin), so Tunix and what it imports are installed without theirs
# (docs/posttrain.md); the stamp keeps this a one-time step.
tunix_stamp="$VENV/.maxtext_nvfp4_tunix"
tunix_want="google-tunix==0.1.7 google-metrax==0.2.4 clu==0.0.12 perfetto==0.59.1 wrapt==2.5.2"
if [ "$(cat "$tunix_stamp" 2>/dev/null)" != "$tunix_want" ]; then
  echo "[setup] installing Tunix for maxtext-nvfp4 distill ($tunix_want, without their dependencies; pandas)"
  # shellcheck disable=SC2086  # the list is word-split on purpose
  "$VENV/bin/python" -m pip install -q --no-compile --no-deps $tunix_want \
    && "$VENV/bin/python" -m pip install -q --no-compile pandas && echo "$tunix_want" > "$tunix_stamp"
fi
"$VENV/bin/python" -c 'import maxtext_nvfp4, maxtext, jax; print("[setup] ok: maxtext", maxtext.__version__ if hasattr(maxtext, "__version__") else "0.2.5", "jax", jax.__version__)'
