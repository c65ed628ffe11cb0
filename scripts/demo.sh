#!/usr/bin/env bash
# The README's first command: set up .venv (idempotent), build the embedded real-text dataset, train the
# CPU demo twice back to back -- BF16, then emulated NVFP4, same initial weights and batches
# (`maxtext-nvfp4 reproduce demo`) -- and end with the answer: loss gap and verdict, step-time ratio, where
# the report and plots are, and the next commands. Extra args are key=value overrides for both runs
# (`bash scripts/demo.sh steps=40`). Output: runs/demo/{bf16,nvfp4,compare}; a rerun replaces it.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
export HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 TF_CPP_MIN_LOG_LEVEL=3
.venv/bin/maxtext-nvfp4 prepare-data
rc=0
.venv/bin/maxtext-nvfp4 reproduce demo --out runs/demo --overwrite "$@" || rc=$?
if [ "$rc" -le 1 ]; then  # 0 PASS, 1 FAIL: both arms have metrics; 2 bad input, 3 a run failed (already said)
  .venv/bin/python -m maxtext_nvfp4.tools.demo_summary runs/demo
fi
exit "$rc"
