#!/usr/bin/env bash
# The GPU benchmark of maxtext-nvfp4 as ONE script for an offline H200 machine (../shared/device/README.md),
# sized to <= 8 minutes of work: every stage runs under its own time limit, and the limits add up to the
# budget (a stage starts only with the time left; what a killed stage wrote so far is kept).
#
#   stage  what                                                                    limit  (STAGES, T_<STAGE>)
#   setup  install the wheel bundle .whl/ into $SITE (skipped when maxtext imports)    30 s
#   env    date, commit, GPU, jax; stop here unless jax sees the expected platform     15 s
#   tests  bit-exactness on the GPU backend: tests/core/test_numerics.py, test_gemm.py, test_prng.py,
#          test_gemm_kernels.py (the Pallas NVFP4 GEMM compiled by Triton)
#          (less its 2 slowest non-bit tests), test_quantizer_hlo.py; pytest -n 8     90 s
#   mlp    mlp_bench.py SwiGLU 8192x4096x14336 fwd+bwd bf16/nvfp4/fp8/sdg, one process
#          per variant (correctness check first, compiled memory, device peak)       110 s
#   hlo    optimized-HLO counts: mlp_bench --dump-hlo (bf16, nvfp4) and
#          quantizer_hlo.py (passes over memory of each quantizer call), XLA dump      40 s
#   quant  quantize_bench.py 1D/2D/RHT quantizer vs a copy, 8192x4096 and 8192x14336   25 s
#   step   maxtext_step_bench.py 4-layer Llama-3-8B shape, seq 4096, pdbs 2:
#          bf16, nvfp4 (emulate, full recipe), fp8 -- in that order                  170 s
#                                                                              total  480 s
#   kernels (only when named in STAGES) kernel_profile.py: the MLP's per-kernel device times
#          under jax.profiler (bf16, nvfp4) and the Pallas quantizer kernels per tile choice
#          (each choice's bits checked against the default's); 38-39 s on the H200        60 s
#   dqgemm (only when named in STAGES) the MLP's bf16 and nvfp4, then nvfp4 with
#          MAXTEXT_NVFP4_GEMM_IMPL=auto (the Pallas GEMM reading NVFP4 codes + scales)       60 s
#   moe    (only when named in STAGES) maxtext_step_bench.py --preset gpu-moe-proxy: the one-GPU
#          Mixtral-style proxy (recipes/proxy_1gpu_moe_*, 4 layers), bf16 and nvfp4   140 s
#
# Usage (from anywhere):
#   bash benchmarks/gpu/run.sh [OUT_DIR]        run (GPU sizes; refuses to run them without a GPU)
#   bash benchmarks/gpu/run.sh --budget         print the planned stages, limits and estimates; run nothing
#   bash benchmarks/gpu/run.sh --cpu [OUT_DIR]  the same stages at tiny sizes on CPU (proves the script)
#   bash benchmarks/gpu/run.sh --prepare        here, with network: build .whl/ and .stub/ (the shared
#                                               make_wheel_bundle.sh) and check what travels against the
#                                               64 MiB limit (the golden vectors travel in tests/golden/)
# Then, with the device tool: run(command="bash benchmarks/gpu/run.sh", timeout_s=540,
#                                 carry=[".whl", ".stub"])      (+ ".jaxcache", see below)
# Choose stages with STAGES="tests mlp" (setup and env always run); change a limit with T_MLP=150 etc.;
# the variants of a stage with MLP_VARIANTS=nvfp4, STEP_VARIANTS=fp8,nvfp4, MOE_VARIANTS=bf16,nvfp4; the
# kernels stage's tile sweeps with KERNEL_PROGRAMS=values_rht_sr,codes_rht (default all).
# Results: logs and JSON under OUT_DIR (default ./bench_out). On the device (OUT set by the tool, no
# OUT_DIR given) they are written to /tmp/bench_work and packed after every stage into $OUT/bench.tgz
# (+ hlo.tgz, status.txt, summary.md), since at most 8 files come back from $OUT.
# Compilation cache: every stage shares one persistent JAX cache (JAX_COMPILATION_CACHE_DIR; MaxText's
# jax_cache_dir too), so a program compiled twice (mlp_bench compiles each variant 3 times) compiles once.
# On the device it is returned as $OUT/jaxcache.tgz when <= 15 MiB; unpacked into .jaxcache/ (ignored) and
# carried, it lets the next machine skip those compilations (same image assumed; unverified).
set -uo pipefail

cd "$(dirname "$0")/../.." || exit 1
ROOT=$PWD
PY=${PYTHON:-python3}
SITE=${SITE:-/tmp/site}
ACTION=run MODE=gpu OUT_ARG=""
for arg in "$@"; do
  case $arg in
    --budget) ACTION=budget ;;
    --prepare) ACTION=prepare ;;
    --cpu) MODE=cpu ;;
    -h | --help) sed -n '2,/^set -uo/p' "$0" | sed '$d' | sed 's/^# \{0,1\}//'; exit 0 ;;
    -*) echo "run.sh: unknown option '$arg'; use --budget, --cpu, --prepare or an output folder" >&2; exit 2 ;;
    *) OUT_ARG=$arg ;;
  esac
done

# ---------------------------------------------------------------------------------------------------
# The plan: one row per stage. Limits (s) on the H200 and on CPU (--cpu: tiny sizes, shared 2-core box);
# "expect" is the estimated H200 wall time (nothing of this package has run on a GPU yet: estimates from
# the issue's prototype numbers, see benchmarks/RESULTS.md "GPU preparation").
# ---------------------------------------------------------------------------------------------------
ALL_STAGES="setup env tests kernels mlp dqgemm hlo quant step moe"
declare -A LIMIT_GPU=([setup]=30 [env]=15 [tests]=90 [kernels]=60 [mlp]=110 [dqgemm]=60 [hlo]=40 [quant]=25 [step]=170 [moe]=140)
declare -A LIMIT_CPU=([setup]=120 [env]=60 [tests]=300 [kernels]=300 [mlp]=300 [dqgemm]=300 [hlo]=200 [quant]=120 [step]=600 [moe]=600)
# H200 estimates; measured 2026-11-30 (benchmarks/RESULTS.md): tests 41, mlp 106, hlo 11, quant 5, step
# ~65 per variant (compile included).
declare -A EXPECT_GPU=([setup]=5 [env]=8 [tests]=45 [kernels]=39 [mlp]=106 [dqgemm]=45 [hlo]=25 [quant]=5 [step]=200 [moe]=130)
declare -A WHAT=(
  [setup]="pip install .whl/*.whl into $SITE (offline; skipped when maxtext already imports)"
  [env]="date, commit, nvidia-smi, jax version and devices; stops unless jax sees a GPU (--cpu: CPU)"
  [tests]="GPU bit-exactness: test_numerics, test_fp8, test_gemm (-k not switch_under_jit/remat_and_scan), test_quantizer_hlo"
  [kernels]="MLP fwd+bwd per-kernel device times (profiler; bf16, nvfp4); Pallas quantizer kernels per tile choice"
  [mlp]="SwiGLU 8192x4096x14336 fwd+bwd: bf16, nvfp4 (full recipe), fp8, sdg; --isolate, 3 warmup + 20 iters"
  [dqgemm]="the mlp stage's bf16 and nvfp4 again, nvfp4 with MAXTEXT_NVFP4_GEMM_IMPL=auto (the Pallas GEMM reading codes + scales)"
  [hlo]="optimized-HLO counts: MLP fwd+bwd bf16/nvfp4 (--dump-hlo) and quantizer_hlo.py at 8192x4096; XLA dump + gpu_target_config (no cache)"
  [quant]="quantizer 1d/2d/rht vs copy at 8192x4096 and 8192x14336, 10 iters"
  [step]="MaxText llama3-8b 4 layers, seq 4096, pdbs 2: bf16, nvfp4, fp8; 20 steps, median of steps 8..19"
  [moe]="MaxText MoE proxy (8 experts top-2, einsum path, 4 layers): bf16, nvfp4; 15 steps, median of 5..14"
)
STAGES=${STAGES:-"tests mlp hlo quant step"}
has() { case " setup env $STAGES " in *" $1 "*) return 0 ;; esac; return 1; }
limit() {  # the stage's limit: T_<STAGE> if set, else the mode's table
  local var="T_${1^^}"
  if [ -n "${!var:-}" ]; then echo "${!var}"; elif [ "$MODE" = cpu ]; then echo "${LIMIT_CPU[$1]}"; else echo "${LIMIT_GPU[$1]}"; fi
}
PLANNED=0
for s in $ALL_STAGES; do has "$s" && PLANNED=$((PLANNED + $(limit "$s"))); done
BUDGET_S=${BUDGET_S:-$PLANNED}

if [ "$ACTION" = budget ]; then
  printf "plan (%s mode): stages run in this order, each killed at its limit; none starts past the budget\n" "$MODE"
  printf "%-6s %8s %11s  %s\n" stage "limit s" "H200 est. s" what
  tot_e=0
  for s in $ALL_STAGES; do
    has "$s" || continue
    est=${EXPECT_GPU[$s]}
    [ "$MODE" = cpu ] && est=-  # the estimates are for the H200 sizes
    printf "%-6s %8s %11s  %s\n" "$s" "$(limit "$s")" "$est" "${WHAT[$s]}"
    tot_e=$((tot_e + EXPECT_GPU[$s]))
  done
  [ "$MODE" = cpu ] && tot_e=-
  printf "%-6s %8s %11s  %s\n" total "$PLANNED" "$tot_e" "budget ${BUDGET_S} s (BUDGET_S); summary and packing add ~5 s"
  [ "$MODE" = cpu ] && { echo "(--cpu runs every stage at tiny sizes: the 'what' column names the GPU sizes)"; exit 0; }
  commit=$(git rev-parse --short HEAD 2>/dev/null)$(git diff --quiet HEAD -- 2>/dev/null || echo +dirty)
  echo "device call: run(command=\"BENCH_COMMIT=$commit bash benchmarks/gpu/run.sh\", timeout_s=$((BUDGET_S + 60)), carry=[\".whl\", \".stub\"])"
  echo "(the device's copy of the tree may lack .git: BENCH_COMMIT records which commit ran)"
  exit 0
fi

if [ "$ACTION" = prepare ]; then
  SHARED=${SHARED_DIR:-$ROOT/../shared}
  exclude=$(git rev-parse --git-path info/exclude)
  mkdir -p "$(dirname "$exclude")"  # make_wheel_bundle.sh appends to .git/info/exclude and fails without the folder
  bash "$SHARED/device/make_wheel_bundle.sh" || { echo "run.sh --prepare: $SHARED/device/make_wheel_bundle.sh failed" >&2; exit 1; }
  grep -qxF /.jaxcache/ "$exclude" 2>/dev/null || echo /.jaxcache/ >> "$exclude"
  carry=".whl .stub"
  [ -d .jaxcache ] && carry="$carry .jaxcache"
  tracked=$(git ls-files -z | du -c --files0-from=- -b 2>/dev/null | tail -1 | cut -f1)
  untracked=$(git ls-files -z --others --exclude-standard | du -c --files0-from=- -b 2>/dev/null | tail -1 | cut -f1)
  carried=$(du -cb $carry | tail -1 | cut -f1)
  total=$(( ${tracked:-0} + ${untracked:-0} + carried ))
  echo "travels: tracked $((${tracked:-0} / 1048576)) MiB + untracked $((${untracked:-0} / 1048576)) MiB + carry ($carry) $((carried / 1048576)) MiB = $((total / 1048576)) MiB (limit 64)"
  [ "$total" -le $((64 * 1048576)) ] || { echo "run.sh --prepare: over the 64 MiB limit" >&2; exit 1; }
  echo "carry=[\"${carry// /\", \"}\"]"
  exit 0
fi

# ---------------------------------------------------------------------------------------------------
# Run
# ---------------------------------------------------------------------------------------------------
T0=$(date +%s)
PACK=""
if [ -n "$OUT_ARG" ]; then
  WORK=$OUT_ARG
elif [ -n "${OUT:-}" ]; then
  WORK=/tmp/bench_work PACK=$OUT
else
  WORK=$ROOT/bench_out
fi
mkdir -p "$WORK" || exit 1
WORK=$(cd "$WORK" && pwd)
if [ -d "$ROOT/.jaxcache" ]; then CACHE=$ROOT/.jaxcache; else CACHE=${BENCH_JAX_CACHE:-/tmp/bench_jax_cache_$MODE}; fi
mkdir -p "$CACHE"
export JAX_COMPILATION_CACHE_DIR=$CACHE JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS=0
export HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 PYTHONUNBUFFERED=1
# Keep XLA from grabbing 75% of HBM up front, so peak_bytes_in_use reflects what each run really needs.
export XLA_PYTHON_CLIENT_PREALLOCATE=${XLA_PYTHON_CLIENT_PREALLOCATE:-false}
if [ "$MODE" = cpu ]; then PLATFORM=cpu; else PLATFORM=cuda; fi
: > "$WORK/status.txt"

pack() {  # copy what is done so far into $OUT (device only): <= 8 files come back
  [ -n "$PACK" ] || return 0
  tar czf "$PACK/bench.tgz" -C "$WORK" --exclude=./hlo . 2>/dev/null
  [ -d "$WORK/hlo" ] && tar czf "$PACK/hlo.tgz" -C "$WORK" hlo 2>/dev/null
  cp "$WORK/status.txt" "$PACK/" 2>/dev/null
  return 0
}

# stage NAME CMD...: run CMD (a bash string, output to $WORK/NAME.log) under min(limit, budget left).
stage() {
  local name=$1 cmd=$2 lim left t1 rc
  lim=$(limit "$name")
  left=$((BUDGET_S - ($(date +%s) - T0)))
  [ "$left" -lt "$lim" ] && lim=$left
  if [ "$lim" -lt 5 ]; then
    echo "$name: skipped (budget of ${BUDGET_S} s spent)" | tee -a "$WORK/status.txt"
    return 1
  fi
  echo "== $name (limit ${lim} s) =="
  t1=$(date +%s)
  timeout --kill-after=5 "$lim" bash -c "$cmd" > "$WORK/$name.log" 2>&1
  rc=$?
  local note=""
  [ "$rc" = 124 ] || [ "$rc" = 137 ] && note=" TIMEOUT"
  echo "$name: rc=$rc$note wall=$(($(date +%s) - t1))s limit=${lim}s | $(grep -v '^\s*$' "$WORK/$name.log" | tail -1 | cut -c1-160)" \
    | tee -a "$WORK/status.txt"
  pack
  return "$rc"
}

# setup: MaxText and its missing dependencies, offline (../shared/device/README.md, step 2).
if $PY -c "import maxtext" 2>/dev/null; then
  export PYTHONPATH=$ROOT${PYTHONPATH:+:$PYTHONPATH}
  echo "setup: rc=0 wall=0s (maxtext importable: nothing installed)" | tee -a "$WORK/status.txt"
else
  ls .whl/*.whl > /dev/null 2>&1 || { echo "setup: no .whl/*.whl: run 'bash benchmarks/gpu/run.sh --prepare' here and carry .whl and .stub" | tee -a "$WORK/status.txt"; pack; exit 1; }
  stage setup "$PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target $SITE .whl/*.whl" || { pack; exit 1; }
  export PYTHONPATH=$SITE:$ROOT/.stub:$ROOT
fi

# env: what ran where; a GPU run on a machine without a GPU stops here (H200 sizes on CPU take hours).
stage env "
  date -u +'date: %Y-%m-%dT%H:%M:%SZ'
  echo \"commit: \${BENCH_COMMIT:-\$(git rev-parse --short HEAD 2>/dev/null || echo 'unknown (no .git here; pass BENCH_COMMIT)')}\"
  echo \"mode: $MODE  budget: ${BUDGET_S} s  stages: $STAGES  cache: $CACHE\"
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>/dev/null || echo 'nvidia-smi: n/a'
  lscpu 2>/dev/null | grep -m1 'Model name' || true
  JAX_PLATFORMS=$PLATFORM $PY -c \"import jax, jaxlib, sys; d = jax.devices(); print('jax', jax.__version__, 'jaxlib', jaxlib.__version__, d); sys.exit(0 if d[0].platform == ('cpu' if '$PLATFORM' == 'cpu' else 'gpu') else 3)\"
" || { echo "env: jax does not see the $PLATFORM platform (see env.log); use --cpu on a machine without a GPU" | tee -a "$WORK/status.txt"; pack; exit 1; }
cp "$WORK/env.log" "$WORK/env.txt"

if [ "$MODE" = cpu ]; then
  TESTS_ARGS="tests/core/test_quantizer_hlo.py tests/core/test_numerics.py -k 'quantizer_hlo or golden_file_present or recip_exact or gpu_lowering'"
  MLP_SHAPE="--preset tiny" MLP_TIMING="--warmup 1 --iters 2" KERNEL_ARGS="--preset tiny --iters 2"
  QUANT_SHAPE=256x512 QUANT_ARGS="--shapes 256x512 --iters 2 --warmup 1"
  STEP_ARGS="--preset cpu-demo --steps 4 --skip 2 --set max_target_length=64"
  MOE_ARGS="--preset gpu-moe-proxy --steps 3 --skip 1 --set hardware=tpu --set base_emb_dim=128 --set head_dim=32 \
    --set base_num_query_heads=4 --set base_num_kv_heads=4 --set base_mlp_dim=256 --set base_moe_mlp_dim=256 \
    --set base_num_decoder_layers=2 --set vocab_size=1024 --set max_target_length=64 --set per_device_batch_size=1"
else
  TESTS_ARGS="tests/core/test_numerics.py tests/core/test_fp8.py tests/core/test_gemm.py tests/core/test_prng.py tests/core/test_quantizer_hlo.py tests/core/test_gemm_kernels.py -k 'not switch_under_jit and not remat_and_scan'"
  MLP_SHAPE="--preset h200" MLP_TIMING="--warmup 3 --iters 20" KERNEL_ARGS="--preset h200 --iters 8"
  QUANT_SHAPE=8192x4096 QUANT_ARGS="--shapes 8192x4096,8192x14336 --iters 10 --warmup 2"
  STEP_ARGS="--preset gpu-llama3-8b-4layer --steps 20 --skip 8"
  MOE_ARGS="--preset gpu-moe-proxy"
fi
XDIST="" NPROC=$(nproc 2>/dev/null || echo 2)
NWORK=$((NPROC / 2 > 8 ? 8 : NPROC / 2))  # the H200 machine has 16 cores: 8 pytest workers
[ "$NWORK" -ge 2 ] && $PY -c "import xdist" 2>/dev/null && XDIST="-n $NWORK"

# tests: correctness on the benchmarked backend first (conftest defaults JAX_PLATFORMS to cpu).
# Known under the H200 image's jax 0.11.2 (seen on CPU there, 2026-11-30; not GPU-specific): its XLA folds a
# scalar (a * c) * (b * c) into (a * b) * c**2, so test_gemm's test_xla_rewrites_division_by_constant... and
# the seed precondition of test_single_k_block_is_bit_exact_with_te_alpha fail; gemm_alpha still equals the
# compiled TE alpha bit for bit there (test_gemm_alpha_is_te_alpha_as_compiled_bit_for_bit passes).
has tests && stage tests "JAX_PLATFORMS=$PLATFORM $PY -m pytest -q -p no:cacheprovider $XDIST --durations=10 $TESTS_ARGS"

# kernels: where the MLP's device time goes, and the quantizer kernels' tile choices (exit 1: a choice changed bits).
has kernels && stage kernels "$PY benchmarks/gpu/kernel_profile.py $KERNEL_ARGS ${KERNEL_PROGRAMS:+--programs $KERNEL_PROGRAMS} --json $WORK/kernels.json"

# mlp: each variant's correctness check runs before its timing; a failed check exits 1.
has mlp && stage mlp "$PY benchmarks/mlp_bench.py $MLP_SHAPE $MLP_TIMING --isolate --modes fwdbwd \
  --variants ${MLP_VARIANTS:-bf16,nvfp4,fp8,sdg} --json $WORK/mlp.json"

# dqgemm (only when named in STAGES): nvfp4 with the Pallas NVFP4 GEMM (core/gemm_kernels) against bf16 and the
# default nvfp4 (XLA's dot of the block values), side by side in one call: the measurement issue 51 asks for.
has dqgemm && stage dqgemm "$PY benchmarks/mlp_bench.py $MLP_SHAPE $MLP_TIMING --isolate --modes fwdbwd \
  --variants bf16,nvfp4 --json $WORK/dqgemm_xla.json && MAXTEXT_NVFP4_GEMM_IMPL=auto $PY benchmarks/mlp_bench.py \
  $MLP_SHAPE $MLP_TIMING --isolate --modes fwdbwd --variants nvfp4 --json $WORK/dqgemm_auto.json"

# hlo: what XLA makes of the same programs (counts; the HLO text goes to hlo.tgz). XLA's own dump of this
# real device's compiles (optimized HLO, buffer assignment, live ranges) and its gpu_target_config.pbtxt are
# kept in hlo/xla_dump/ and hlo/gpu_target_config.pbtxt: the config is what
# `benchmarks/gpu/deviceless.py --spec hlo/gpu_target_config.pbtxt` compiles for (predicted vs measured).
# The compilation cache is off here: a cache hit would compile nothing and dump nothing.
has hlo && stage hlo "mkdir -p $WORK/hlo/xla_dump && export JAX_ENABLE_COMPILATION_CACHE=false \
  XLA_FLAGS=\"\${XLA_FLAGS:-} --xla_dump_to=$WORK/hlo/xla_dump --xla_dump_hlo_as_text\" && \
  $PY benchmarks/mlp_bench.py $MLP_SHAPE --variants bf16,nvfp4 --modes fwdbwd \
  --dump-hlo $WORK/hlo --json $WORK/mlp_hlo.json && $PY benchmarks/quantizer_hlo.py --shape $QUANT_SHAPE \
  --dump $WORK/hlo --json $WORK/quantizer_hlo.json; rc=\$?; \
  cfg=\$(ls $WORK/hlo/xla_dump/*gpu_target_config.pbtxt 2>/dev/null | head -1); \
  [ -n \"\$cfg\" ] && cp \"\$cfg\" $WORK/hlo/gpu_target_config.pbtxt; exit \$rc"

has quant && stage quant "$PY benchmarks/quantize_bench.py $QUANT_ARGS"

# step: each run also stops at the stage's limit; results print as JSON lines as they finish.
has step && stage step "$PY benchmarks/maxtext_step_bench.py $STEP_ARGS --variants ${STEP_VARIANTS:-bf16,nvfp4,fp8} \
  --set jax_cache_dir=$CACHE --timeout $(limit step) --out-dir $WORK/step --json $WORK/step.json"

has moe && stage moe "$PY benchmarks/maxtext_step_bench.py $MOE_ARGS --variants ${MOE_VARIANTS:-bf16,nvfp4} \
  --set jax_cache_dir=$CACHE --timeout $(limit moe) --out-dir $WORK/moe --json $WORK/moe.json"

# Summary last.
{
  echo "## maxtext-nvfp4 GPU benchmarks ($MODE mode)"
  cat "$WORK/env.txt"
  echo "total wall: $(($(date +%s) - T0)) s of a ${BUDGET_S} s budget"
  echo
  echo "stage status:"; cat "$WORK/status.txt"
  for name in mlp step moe; do
    [ -f "$WORK/$name.log" ] || continue
    echo
    $PY - "$WORK/$name.json" "$WORK/$name.log" <<'PYEOF'
import json, os, sys
path, log = sys.argv[1], sys.argv[2]
if os.path.exists(path):
  d = json.load(open(path))
  print(d["header"]); print(d["table"])
else:  # the stage was cut: the runs that finished printed their JSON lines
  rows = [l for l in open(log) if l.startswith('{"variant"')]
  print(f"{os.path.basename(log)}: no JSON table (stage cut); finished runs:")
  print("".join(rows) if rows else "none")
PYEOF
  done
  [ -f "$WORK/quantizer_hlo.json" ] && { echo; $PY -c "import json,sys; d=json.load(open(sys.argv[1])); print(d['header']); print(d['table'])" "$WORK/quantizer_hlo.json"; }
  [ -f "$WORK/quant.log" ] && { echo; echo "quantize_bench:"; grep -E '^(#|\|)' "$WORK/quant.log"; }
  [ -f "$WORK/kernels.log" ] && { echo; echo "kernel_profile:"; grep -E '^(#|\||[a-z0-9_]+: top)' "$WORK/kernels.log"; }
} > "$WORK/summary.md" 2>&1
cat "$WORK/summary.md"
if [ -n "$PACK" ]; then
  pack
  cp "$WORK/summary.md" "$PACK/"
  [ "$(du -sm "$CACHE" | cut -f1)" -le 60 ] && tar czf "$PACK/jaxcache.tgz" -C "$CACHE" . 2>/dev/null
  [ "$(stat -c %s "$PACK/jaxcache.tgz" 2>/dev/null || echo 0)" -le $((15 * 1048576)) ] || rm -f "$PACK/jaxcache.tgz"
fi
# Exit 0 only if every stage that ran exited 0.
if grep -qv "^[a-z_]*: rc=0" "$WORK/status.txt"; then exit 1; fi
exit 0
