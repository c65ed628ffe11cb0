#!/usr/bin/env bash
# Every maxtext-nvfp4 benchmark on an offline H200 machine (see ../shared/device/README.md), in one go:
#   0. install the wheel bundle (.whl/, built beforehand by `bash ../shared/device/make_wheel_bundle.sh`,
#      travelling with the working tree together with .stub/) into /tmp/site;
#   1. correctness first: the numerics and GEMM tests on the GPU backend (bit-exactness of the emulation
#      under XLA:GPU), then mlp_bench's own NVFP4-vs-bf16 check (inside stage 2, before any timing);
#   2. mlp_bench.py   SwiGLU MLP 8192 x 4096 x 14336, fwd and fwd+bwd, bf16 / nvfp4 / fp8 / scaled_dot_general,
#                     one process per variant (clean peak device memory);
#   3. quantize_bench.py  1D / 2D / RHT quantizer vs a plain copy (bandwidth ratio);
#   4. maxtext_step_bench.py  MaxText 4-layer Llama-3-8B-shaped model, seq 4096, pdbs 2: bf16 / fp8 / nvfp4.
# Logs and JSON go to $OUT (the device tool's output folder) or ./bench_out, or the first argument.
# The short summary table is printed last (and saved as summary.md).
#
# Usage (from anywhere):  bash benchmarks/gpu/run.sh [OUT_DIR]
# Stages can be chosen:   STAGES="mlp step" bash benchmarks/gpu/run.sh
# Per-stage time limits (seconds): T_TESTS, T_MLP, T_QUANT, T_STEP. Shapes/presets: MLP_ARGS, QUANT_ARGS,
# STEP_ARGS (e.g. MLP_ARGS="--preset tiny --iters 2" STEP_ARGS="--preset cpu-demo --steps 4 --skip 2" to
# exercise the script on a CPU).
# Expected wall time on an H200: tests ~2-4 min, mlp ~3-5 min, quant ~1 min, step ~5-8 min. Where one
# command may run at most 10 minutes, split it: STAGES="tests mlp quant" then STAGES="step".
set -uo pipefail

cd "$(dirname "$0")/../.." || exit 1
ROOT=$PWD
OUT_DIR=${1:-${OUT:-$ROOT/bench_out}}
mkdir -p "$OUT_DIR" || exit 1
OUT_DIR=$(cd "$OUT_DIR" && pwd)
STAGES=${STAGES:-"tests mlp quant step"}
PY=${PYTHON:-python3}

# 0. MaxText and its missing dependencies, offline. Skipped when maxtext already imports (e.g. a dev venv).
if ! $PY -c "import maxtext" 2>/dev/null; then
  ls .whl/*.whl >/dev/null 2>&1 || { echo "no .whl/*.whl: run 'bash ../shared/device/make_wheel_bundle.sh' first"; exit 1; }
  $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH=/tmp/site:$ROOT/.stub:$ROOT || exit 1
else
  export PYTHONPATH=$ROOT${PYTHONPATH:+:$PYTHONPATH}
fi
export HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1
# Keep XLA from grabbing 75% of HBM up front, so peak_bytes_in_use reflects what each run really needs
# (device_peak numbers are then comparable between variants).
export XLA_PYTHON_CLIENT_PREALLOCATE=${XLA_PYTHON_CLIENT_PREALLOCATE:-false}

{
  date -u +"date: %Y-%m-%dT%H:%M:%SZ"
  echo "git: $(git rev-parse --short HEAD 2>/dev/null || echo unknown)$(git diff --quiet 2>/dev/null || echo ' (dirty)')"
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>/dev/null || echo "nvidia-smi: n/a"
  lscpu 2>/dev/null | grep -m1 "Model name" || true
  $PY -c "import jax, jaxlib; print('jax', jax.__version__, 'jaxlib', jaxlib.__version__); print(jax.devices())" 2>&1
} | tee "$OUT_DIR/env.txt"

has() { case " $STAGES " in *" $1 "*) return 0 ;; esac; return 1; }
status() { echo "$1: $2" >> "$OUT_DIR/status.txt"; }
: > "$OUT_DIR/status.txt"

# 1. Correctness on the GPU backend (conftest defaults JAX_PLATFORMS to cpu; override it here).
if has tests; then
  echo "== tests (JAX_PLATFORMS=cuda) =="
  JAX_PLATFORMS=cuda timeout "${T_TESTS:-240}" $PY -m pytest -x -q -p no:cacheprovider \
    tests/test_numerics.py tests/test_gemm.py > "$OUT_DIR/tests.log" 2>&1
  rc=$?
  tail -3 "$OUT_DIR/tests.log"
  status tests "rc=$rc ($(tail -1 "$OUT_DIR/tests.log"))"
fi

# 2. MLP (its correctness check runs before any timing; a failed check exits 1).
if has mlp; then
  echo "== mlp_bench =="
  timeout "${T_MLP:-600}" $PY benchmarks/mlp_bench.py ${MLP_ARGS:---preset h200} --isolate --warmup 5 --iters 30 \
    --json "$OUT_DIR/mlp.json" > "$OUT_DIR/mlp.log" 2>&1
  rc=$?
  status mlp "rc=$rc"
  # Profile of the same shapes (optimized HLO op counts; HLO text kept for reading).
  timeout 300 $PY benchmarks/mlp_bench.py ${MLP_ARGS:---preset h200} --variants bf16,nvfp4 --dump-hlo "$OUT_DIR/hlo" \
    --json "$OUT_DIR/mlp_hlo.json" > "$OUT_DIR/mlp_hlo.log" 2>&1 || status mlp_hlo "rc=$?"
fi

# 3. Quantizer bandwidth vs a plain copy.
if has quant; then
  echo "== quantize_bench =="
  timeout "${T_QUANT:-300}" $PY benchmarks/quantize_bench.py ${QUANT_ARGS:-} > "$OUT_DIR/quantize.log" 2>&1
  status quant "rc=$?"
fi

# 4. MaxText steps.
if has step; then
  echo "== maxtext_step_bench =="
  timeout "${T_STEP:-1500}" $PY benchmarks/maxtext_step_bench.py ${STEP_ARGS:---preset gpu-llama3-8b-4layer} \
    --out-dir "$OUT_DIR/step" --json "$OUT_DIR/step.json" > "$OUT_DIR/step.log" 2>&1
  status step "rc=$?"
fi

# Summary last.
{
  echo "## maxtext-nvfp4 GPU benchmarks"
  cat "$OUT_DIR/env.txt"
  echo
  echo "stage status:"; cat "$OUT_DIR/status.txt"
  for name in mlp step; do
    if [ -f "$OUT_DIR/$name.json" ]; then
      echo
      $PY -c "import json,sys; d=json.load(open(sys.argv[1])); print(d['header']); print(d['table'])" "$OUT_DIR/$name.json"
    fi
  done
  if [ -f "$OUT_DIR/quantize.log" ]; then
    echo
    echo "quantize_bench (tail):"
    tail -n 15 "$OUT_DIR/quantize.log"
  fi
} > "$OUT_DIR/summary.md" 2>&1
cat "$OUT_DIR/summary.md"
# Exit 0 only if every stage that ran exited 0.
if grep -qv "^[a-z_]*: rc=0" "$OUT_DIR/status.txt"; then exit 1; fi
exit 0
