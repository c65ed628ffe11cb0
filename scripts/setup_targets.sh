#!/usr/bin/env bash
# Create ./.venv-targets: compile-only accelerator targets on a CPU machine, for the gpu and te test stages and the
# deviceless benchmarks. Nothing here runs on an accelerator; nothing here is needed to train.
#
#   XLA:GPU's compiler      jax-cuda12-plugin / jax-cuda12-pjrt at jaxlib's exact version (compile for an A100, H200,
#                           B200, ... from its target spec: maxtext_nvfp4/backends/target_specs/)
#   libtpu                  at jax's own pin (jax 0.12.0.1: libtpu==0.0.50.*), for compile-only TPU topologies
#   Transformer Engine      2.20.2: the core wheel (transformer-engine-cu12), the Python package, and the JAX extension
#                           built from its sdist with g++ at -O0 (~3 CPU-minutes; the built wheel is cached in
#                           $MAXTEXT_NVFP4_CACHE/wheels, keyed on TE, Python and jax versions and the -O0, and reused),
#                           with the CUDA 12 library wheels TE's libraries link (cuBLAS, cuDNN, NCCL, the CUDA runtime,
#                           NVRTC)
#
# The venv is layered over ./.venv (a .pth adds .venv's site-packages, editable maxtext_nvfp4 included), so it holds
# only the packages above: the user's .venv keeps no CUDA plugin (which prints "Unable to load cuDNN" tracebacks at
# every JAX start-up there). TE's libraries load on a machine without a GPU driver through a stand-in libcuda.so.1
# (tests/te/libcuda_standin.sh) that answers "no device"; tests/te/conftest.py sets the environment. Idempotent: a
# stamp (hash of this script and pyproject.toml) skips a finished build; an unfinished one is rebuilt.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${VENV_TARGETS:-.venv-targets}
BASE=${VENV_BASE:-.venv}
CACHE=${MAXTEXT_NVFP4_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/maxtext-nvfp4}
TE_VERSION=2.20.2
JAX_VERSION=0.12.0.1
# The CUDA 12 wheels jax-cuda12-plugin[with-cuda]==0.12.0.1 resolves to, restricted to what TE's libraries link
# (libtransformer_engine.so: cublas, cublasLt, cudart, cudnn*, nccl; the extension's build: their headers and
# cuRAND's / NVTX's) -- not the plugin's full set (cufft, cusolver, cusparse, nvshmem, nvcc: ~2 GB more).
# TE's import loads cuDNN, NVRTC and cuRAND; the extension's build needs the CUDA headers (nvcc's crt/, CCCL) and NVTX's.
CUDA_WHEELS=(nvidia-cublas-cu12==12.9.3.13 nvidia-cuda-runtime-cu12==12.9.79 nvidia-cudnn-cu12==9.28.0.42
  nvidia-nccl-cu12==2.32.3 nvidia-cuda-nvrtc-cu12==12.9.86 nvidia-cuda-nvcc-cu12==12.9.86
  nvidia-cuda-cccl-cu12==12.9.27 nvidia-curand-cu12 nvidia-nvtx-cu12)
# cudnn-frontend for its headers only (its dependencies, the CuTe DSL among them, are ~500 MB TE's build never uses)
HEADER_ONLY=("nvidia-cudnn-frontend>=1.25.0")
BUILD_TOOLS=("pybind11[global]" setuptools wheel)

[ -x "$BASE/bin/python" ] || { echo "error: $BASE is missing; run scripts/setup.sh first" >&2; exit 1; }
stamp="$VENV/.built"
want=$(cat scripts/setup_targets.sh pyproject.toml | sha256sum | cut -c1-16)
if [ "$(cat "$stamp" 2>/dev/null)" = "$want" ]; then
  echo "[targets] up to date ($VENV)"
  exit 0
fi
t0=$SECONDS
PY=$(bash scripts/find_python.sh)
rm -rf "$VENV"
"$PY" -m venv "$VENV"
site=$("$VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
base_site=$("$BASE/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
# addsitedir (not a bare path line) so that .venv's own .pth files -- the editable install's finder -- apply too.
echo "import site; site.addsitedir('$(cd "$base_site" && pwd)')" > "$site/_maxtext_nvfp4_base.pth"
PIP=("$VENV/bin/python" -m pip install -q --no-compile --disable-pip-version-check)
"${PIP[@]}" "jax-cuda12-plugin==$JAX_VERSION" "jax-cuda12-pjrt==$JAX_VERSION" "libtpu==0.0.50.*" \
  "${CUDA_WHEELS[@]}" "${BUILD_TOOLS[@]}"
"${PIP[@]}" --no-deps "${HEADER_ONLY[@]}"
# TE's core wheel and Python package without their dependency resolution (it would pull torch-free extras and
# re-resolve jax); the JAX extension from the cache or built from the sdist.
"${PIP[@]}" --no-deps "transformer-engine==$TE_VERSION" "transformer-engine-cu12==$TE_VERSION"
pyver=$("$VENV/bin/python" -c 'import sys; print(f"cp{sys.version_info[0]}{sys.version_info[1]}")')
wheels="$CACHE/wheels/te-$TE_VERSION-$pyver-jax$JAX_VERSION-O0"
if ! ls "$wheels"/transformer_engine_jax-*.whl >/dev/null 2>&1; then
  echo "[targets] building transformer-engine-jax $TE_VERSION from its sdist (g++ -O0, a few CPU-minutes)"
  tmp="$wheels.tmp.$$"
  rm -rf "$tmp"; mkdir -p "$tmp"
  # Compiled at -O0 rather than TE's -O3 (two thirds of the build's CPU; benchmarks/RESULTS.md): on these machines the
  # extension's C++ only runs while a program is traced (its FFI handlers and workspace queries, never a kernel), so
  # its speed does not matter. g++ takes the last -O it is given; TE's own flags come before the wrapper's.
  printf '#!/bin/sh\nexec %s "$@" -O0\n' "${CXX:-g++}" > "$tmp/cxx-O0"; chmod +x "$tmp/cxx-O0"
  NVTE_BUILD_USE_NVIDIA_WHEELS=1 NVTE_FRAMEWORK=jax MAX_JOBS=$(nproc) CC="$tmp/cxx-O0" CXX="$tmp/cxx-O0" \
    "$VENV/bin/python" -m pip wheel -q --no-deps --no-build-isolation --disable-pip-version-check --no-cache-dir \
    "transformer-engine-jax==$TE_VERSION" -w "$tmp"  # no pip cache: it may hold a wheel built at other flags
  rm -f "$tmp/cxx-O0"
  rm -rf "$wheels"; mv "$tmp" "$wheels"  # whole or not at all: a killed build leaves no wheel behind
fi
"${PIP[@]}" --no-deps "$wheels"/transformer_engine_jax-*.whl
bash tests/te/libcuda_standin.sh "$VENV" "$VENV/libcuda_standin" > /dev/null
echo "$want" > "$stamp"
echo "[targets] ok: $VENV in $((SECONDS - t0)) s ($(du -sh "$VENV" | cut -f1)); TE extension from $wheels"
