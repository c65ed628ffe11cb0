#!/usr/bin/env bash
# The README's test command: set up .venv (idempotent) and run the CPU test suite.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
export JAX_PLATFORMS=cpu HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 TF_CPP_MIN_LOG_LEVEL=3
exec .venv/bin/python -m pytest -q "$@"
