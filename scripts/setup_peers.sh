#!/usr/bin/env bash
# Build and cache ./.peers/: the real peer implementations our tests use as oracles (docs/peers.md).
#
#   .peers/venv/   Python 3.11 venv: torch on CPU, transformers, nvidia-modelopt (+ requests, which it
#                  imports without declaring it), compressed-tensors, safetensors, numpy
#   .peers/te/     the transformer-engine 2.20.2 pure-Python wheel, unzipped only (never pip-installed:
#                  its C extension is never imported; tests/peers/peer_side/ has the two stand-ins)
#   .peers/vllm/   vLLM's nvfp4_emulation_utils.py, the one file kept from the vLLM wheel (loaded by path)
#   .peers/vllm_site/  vLLM's config parsing on CPU (tests/peers/peer_side/vllm_config_run.py puts it first on
#                  PYTHONPATH): the wheel's Python sources (vllm/**/*.py; no compiled extension), transformers and
#                  compressed-tensors at vLLM 0.33.0's own pins, and the packages its import chain needs
#                  (pip --no-deps --target: the venv itself is unchanged)
#
# Idempotent: a stamp (hash of this script) skips a finished build; a half-built .peers/ is rebuilt.
# torch: `pip install torch==2.13.0` takes this machine's CPU-only wheel (a file on disk) where pip has one;
# elsewhere PyPI's Linux build (CUDA, ~2.9 GB; it runs on CPU). PEERS_TORCH overrides the requirement.
# The main package never imports any of this: the tests talk to .peers/venv/bin/python through files.
set -euo pipefail
SELF="$(cd "$(dirname "$0")" && pwd)/$(basename "$0")"
cd "$(dirname "$0")/.."
PEERS=${PEERS:-.peers}
TORCH_REQ=${PEERS_TORCH:-torch==2.13.0}
TE_VERSION=2.20.2
VLLM_VERSION=0.33.0
VLLM_FILE=vllm/model_executor/layers/quantization/utils/nvfp4_emulation_utils.py
REQS=(transformers==5.24.0 nvidia-modelopt==0.47.0 requests compressed-tensors==0.20.1 safetensors numpy)
# vllm_site: vLLM 0.33.0 pins transformers<5.21.0,>=5.16.1 (the newest, 5.20.2) and compressed-tensors==0.17.0,
# which its config parsing imports; then what `import vllm.config` and its model registry's inspection of our
# architectures import (found by running them; within vLLM's METADATA ranges where it names the package).
VLLM_SITE_REQS=(transformers==5.20.2 compressed-tensors==0.17.0
  cbor2==6.3.0 pyzmq==27.3.0 aiohttp==3.14.5 aiosignal==1.4.0 aiohappyeyeballs==2.7.1 attrs==26.1.0 frozenlist==1.8.0
  multidict==7.2.1 yarl==1.25.1 propcache==0.5.4 openai==3.57.0 sniffio==1.3.1 oss-harmony==0.0.11 cloudpickle==3.1.3
  pillow==13.0.0 pybase64==1.5.1 cachetools==8.0.2 msgspec==0.23.0 uvloop==0.23.0 py-cpuinfo==9.0.0
  prometheus_client==0.26.0 xgrammar==0.2.8 apache-tvm-ffi==0.1.11 fastapi==0.136.3 starlette==1.10.0
  partial-json-parser==0.2.1.1.post7 llguidance==1.7.6 einops==0.8.2)

stamp="$PEERS/.built"
want=$( (cat "$SELF"; echo "$TORCH_REQ") | sha256sum | cut -c1-16)
if [ "$(cat "$stamp" 2>/dev/null)" = "$want" ]; then
  echo "[peers] up to date ($PEERS, $(du -sh "$PEERS" | cut -f1)); delete $PEERS to rebuild"
  exit 0
fi

find_py311() {
  for c in "${PEERS_PYTHON:-}" python3.11 python3; do
    [ -n "$c" ] || continue
    p=$(command -v "$c" 2>/dev/null) || continue
    if "$p" -c 'import sys; sys.exit(0 if sys.version_info[:2] == (3, 11) else 1)' 2>/dev/null; then echo "$p"; return 0; fi
  done
  for d in "$(pyenv root 2>/dev/null || echo /root/.pyenv)"/versions/3.11*; do
    if [ -x "$d/bin/python" ]; then echo "$d/bin/python"; return 0; fi
  done
  echo "error: no Python 3.11 for the peer env; install one (pyenv install 3.11) or set PEERS_PYTHON=/path/to/python3.11" >&2
  return 1
}

t0=$(date +%s)
PY=$(find_py311)
echo "[peers] building $PEERS with $PY (torch: $TORCH_REQ)"
rm -rf "$PEERS"
mkdir -p "$PEERS/dl"
"$PY" -m venv "$PEERS/venv"
PIP=("$PEERS/venv/bin/python" -m pip install -q --no-compile --disable-pip-version-check)
"${PIP[@]}" "$TORCH_REQ"
"${PIP[@]}" "${REQS[@]}"
t1=$(date +%s)

# TE: unzip the pure-Python wheel (a wheel is a zip; no pip, so no extension build or import).
"$PEERS/venv/bin/python" -m pip download -q --no-deps --disable-pip-version-check \
  "transformer-engine==$TE_VERSION" -d "$PEERS/dl"
"$PEERS/venv/bin/python" -m zipfile -e "$PEERS"/dl/transformer_engine-"$TE_VERSION"-*.whl "$PEERS/te"
test -f "$PEERS/te/transformer_engine/pytorch/custom_recipes/reference_nvfp4.py"
test -d "$PEERS/te/transformer_engine/jax"
echo "$TE_VERSION" > "$PEERS/te/VERSION"

# vLLM: keep one file of its wheel.
"$PEERS/venv/bin/python" -m pip download -q --no-deps --disable-pip-version-check \
  "vllm==$VLLM_VERSION" -d "$PEERS/dl"
mkdir -p "$PEERS/vllm" "$PEERS/vllm_site"
"$PEERS/venv/bin/python" - "$PEERS"/dl/vllm-"$VLLM_VERSION"-*.whl "$VLLM_FILE" "$PEERS/vllm" "$PEERS/vllm_site" <<'EOF'
import pathlib, sys, zipfile
wheel, member, out, site = sys.argv[1:]
with zipfile.ZipFile(wheel) as z:
  (pathlib.Path(out) / pathlib.Path(member).name).write_bytes(z.read(member))
  # the Python sources and metadata only: the compiled extensions (~780 MB) are never imported on CPU
  z.extractall(site, [n for n in z.namelist() if (n.startswith("vllm/") and n.endswith(".py")) or ".dist-info/" in n])
EOF
echo "$VLLM_VERSION $VLLM_FILE" > "$PEERS/vllm/VERSION"
rm -rf "$PEERS/dl"
t2=$(date +%s)
"${PIP[@]}" --no-deps --target "$PEERS/vllm_site" "${VLLM_SITE_REQS[@]}"
t2b=$(date +%s)

# First import of everything the oracles load (this also writes the .pyc files --no-compile skipped).
MAXTEXT_NVFP4_PEERS="$PEERS" "$PEERS/venv/bin/python" - <<'EOF'
import sys
sys.path.insert(0, "tests/peers/peer_side")
import compressed_tensors, modelopt, safetensors, torch, transformers
import modelopt.torch.quantization.qtensor.nvfp4_tensor
import peers_env
peers_env.load_te(), peers_env.load_vllm_nvfp4()
print("[peers] ok: torch", torch.__version__, "transformers", transformers.__version__, "modelopt", modelopt.__version__,
      "compressed-tensors", compressed_tensors.__version__, "TE", peers_env.te_version())
EOF
# vLLM's config parsing: its first import (writes the .pyc files) and its model registry's inspection of every
# architecture we export (cached in vllm_site/.cache, so the tests do not repeat it)
t3a=$(date +%s)
MAXTEXT_NVFP4_PEERS="$PEERS" "$PEERS/venv/bin/python" tests/peers/peer_side/vllm_config_run.py --warm
t3=$(date +%s)
size=$(du -sh "$PEERS" | cut -f1)
echo "pip install: $((t1 - t0)) s; TE + vLLM files: $((t2 - t1)) s; vllm_site pip: $((t2b - t2)) s; first import: $((t3a - t2b)) s; vLLM warm-up: $((t3 - t3a)) s; total $((t3 - t0)) s; size $size" > "$PEERS/BUILD.txt"
echo "$want" > "$stamp"
echo "[peers] built in $((t3 - t0)) s (pip $((t1 - t0)) s, wheels $((t2 - t1)) s, vllm_site pip $((t2b - t2)) s, first import $((t3a - t2b)) s, vLLM warm-up $((t3 - t3a)) s), $size"
