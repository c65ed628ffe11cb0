# Source this to run Transformer Engine JAX from .venv-targets on a machine without a GPU driver
# (compile-only; scripts/setup_targets.sh builds the env):  source scripts/te_env.sh; .venv-targets/bin/python ...
#   CUDA_HOME        the pip CUDA wheels' folder: TE looks there for cuDNN, NVRTC and cuRAND before /usr/local/cuda
#                    (which may hold another CUDA major version)
#   LD_LIBRARY_PATH  the stand-in libcuda.so.1 (tests/te/libcuda_standin.sh), then every pip CUDA library folder:
#                    libtransformer_engine.so's cuBLAS, CUDA runtime and NCCL are found by the dynamic linker
#   JAX_PLATFORMS    cpu: no accelerator here; compile-only devices come from backends/targets.py
_te_venv=${VENV_TARGETS:-$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)/.venv-targets}
_te_site=$("$_te_venv/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
export CUDA_HOME="$_te_site/nvidia"
export LD_LIBRARY_PATH="$_te_venv/libcuda_standin$(for d in "$_te_site"/nvidia/*/lib; do printf ':%s' "$d"; done)${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
export JAX_PLATFORMS=cpu
unset _te_venv _te_site
