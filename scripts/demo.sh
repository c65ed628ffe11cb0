#!/usr/bin/env bash
# The README's main command: set up .venv (idempotent), build the embedded real-text dataset, and train
# the CPU demo recipe with emulated NVFP4. Extra args are passed to the trainer as key=value overrides.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
export HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 TF_CPP_MIN_LOG_LEVEL=3
.venv/bin/maxtext-nvfp4 prepare-data
exec .venv/bin/python -m maxtext_nvfp4.train recipes/demo_nvfp4.yml "$@"
