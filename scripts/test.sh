#!/usr/bin/env bash
# The README's test command: set up .venv (idempotent) and run the CPU test suite.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
export JAX_PLATFORMS=cpu HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 TF_CPP_MIN_LOG_LEVEL=3
# Two workers on CI's 2 cores (up to 4 elsewhere); --dist loadfile keeps each test file, and so its
# module-scoped MaxText runs, on one worker. Pass -n 0 to run serially.
workers=$(nproc 2>/dev/null || echo 2); [ "$workers" -gt 4 ] && workers=4
exec .venv/bin/python -m pytest -q -n "$workers" --dist loadfile "$@"
