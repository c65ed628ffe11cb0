"""Load the real peers from ./.peers/ in the peer python (torch on CPU); imported by the peer-side scripts.

TE: the 2.20.2 wheel is only unzipped. Its package ``__init__``s load the C extension
(``transformer_engine_torch``), so the packages are registered here as bare namespace packages pointing at
the unzipped folders, and the two modules on the reference's import path that need the extension at import
time get stand-ins: ``pytorch/constants.py`` (builds an enum from ``tex.DType``; the reference needs only
``dist_group_type``) and ``pytorch/tensor/utils.py`` (imports every tensor class; ``custom_recipes/gemm.py``
needs only ``is_custom``, whose body is copied in meaning: a Quantizer/Storage with ``custom`` set).
``transformer_engine_torch`` itself is a module whose every attribute access raises, so any use of the
extension fails loudly instead of being faked.

vLLM: ``nvfp4_emulation_utils.py`` is loaded by file path; the four vLLM modules it imports for its GPU
paths get stand-ins (platform: not CUDA; scalar types: float4_e2m1f.max() = 6.0; Triton: ``jit`` returns
the function unchanged, so the kernels are defined and never launched; custom-op registration: a no-op).
Its CPU decode (``break_fp4_bytes``, ``dequantize_to_dtype``) runs unchanged. vLLM's config parsing runs the
real package from ``.peers/vllm_site`` in a process of its own (:func:`vllm_env`).
"""

import importlib.util
import os
import pathlib
import sys
import types

PEERS = pathlib.Path(os.environ.get("MAXTEXT_NVFP4_PEERS", pathlib.Path(__file__).resolve().parents[3] / ".peers"))


class _NoExtension(types.ModuleType):
  def __getattr__(self, name):
    raise RuntimeError(f"transformer_engine_torch.{name}: the TE C extension is not available in the peer env")


def _package(name, path):
  mod = types.ModuleType(name)
  mod.__path__ = [str(path)]
  sys.modules[name] = mod
  return mod


def load_te():
  """Import TE's ``reference_nvfp4`` from the unzipped wheel; returns the module."""
  if "transformer_engine.pytorch.custom_recipes.reference_nvfp4" in sys.modules:
    return sys.modules["transformer_engine.pytorch.custom_recipes.reference_nvfp4"]
  import torch  # pylint: disable=import-outside-toplevel
  root = PEERS / "te" / "transformer_engine"
  if not (root / "pytorch" / "custom_recipes" / "reference_nvfp4.py").is_file():
    raise FileNotFoundError(f"{root}: TE wheel not unzipped; run scripts/setup_peers.sh")
  sys.modules["transformer_engine_torch"] = _NoExtension("transformer_engine_torch")
  _package("transformer_engine", root)
  _package("transformer_engine.common", root / "common")  # its __init__ checks the pip install and loads libtransformer_engine
  _package("transformer_engine.pytorch", root / "pytorch")
  _package("transformer_engine.pytorch.tensor", root / "pytorch" / "tensor")
  constants = types.ModuleType("transformer_engine.pytorch.constants")
  constants.dist_group_type = torch.distributed.ProcessGroup
  sys.modules[constants.__name__] = constants
  tensor_utils = types.ModuleType("transformer_engine.pytorch.tensor.utils")

  def is_custom(x=None):
    from transformer_engine.pytorch.quantized_tensor import QuantizedTensorStorage, Quantizer  # pylint: disable=import-outside-toplevel
    if x is None or isinstance(x, torch.Tensor):
      return False
    assert isinstance(x, (Quantizer, QuantizedTensorStorage)), "Object must be a Quantizer or QuantizedTensorStorage"
    return bool(getattr(x, "custom", False))

  tensor_utils.is_custom = is_custom
  sys.modules[tensor_utils.__name__] = tensor_utils
  import transformer_engine.pytorch.custom_recipes.reference_nvfp4 as ref  # pylint: disable=import-outside-toplevel
  return ref


def te_version():
  return (PEERS / "te" / "VERSION").read_text().strip()


def load_vllm_nvfp4():
  """Load vLLM's ``nvfp4_emulation_utils.py`` by path with stand-ins for its four GPU-path imports."""
  name = "vllm_nvfp4_emulation_utils"
  if name in sys.modules:
    return sys.modules[name]
  path = PEERS / "vllm" / "nvfp4_emulation_utils.py"
  if not path.is_file():
    raise FileNotFoundError(f"{path}: missing; run scripts/setup_peers.sh")
  platforms = types.ModuleType("vllm.platforms")
  platforms.current_platform = types.SimpleNamespace(is_cuda_alike=lambda: False, is_cuda=lambda: False)
  scalar_type = types.ModuleType("vllm.scalar_type")
  scalar_type.scalar_types = types.SimpleNamespace(float4_e2m1f=types.SimpleNamespace(max=lambda: 6.0))
  triton_utils = types.ModuleType("vllm.triton_utils")
  triton_utils.triton = types.SimpleNamespace(jit=lambda f=None, **kw: f if f is not None else (lambda g: g),
                                              next_power_of_2=lambda n: 1 << max(int(n) - 1, 0).bit_length())
  triton_utils.tl = types.SimpleNamespace(constexpr=int)
  torch_utils = types.ModuleType("vllm.utils.torch_utils")
  torch_utils.direct_register_custom_op = lambda *a, **kw: None
  for mod in ("vllm", "vllm.utils"):
    sys.modules.setdefault(mod, types.ModuleType(mod))
  for mod in (platforms, scalar_type, triton_utils, torch_utils):
    sys.modules[mod.__name__] = mod
  spec = importlib.util.spec_from_file_location(name, path)
  module = importlib.util.module_from_spec(spec)
  sys.modules[name] = module
  spec.loader.exec_module(module)
  return module


def vllm_env() -> dict:
  """The environment of vLLM's config parsing (peer_side/vllm_config_run.py): ``.peers/vllm_site`` first on
  PYTHONPATH (vLLM's sources, transformers 5.20.2 and compressed-tensors 0.17.0 at vLLM's pins, before the venv's
  5.24.0 / 0.20.1), the CPU platform (``VLLM_TARGET_DEVICE=cpu``: ``platforms/__init__.py`` then skips the CUDA
  probe), vLLM's cache (the registry's architecture inspections) inside ``.peers``, nothing online."""
  site = PEERS / "vllm_site"
  if not (site / "vllm" / "config" / "model.py").is_file():
    raise FileNotFoundError(f"{site}: vLLM's sources missing; run scripts/setup_peers.sh")
  return {"PYTHONPATH": str(site), "VLLM_TARGET_DEVICE": "cpu", "VLLM_CACHE_ROOT": str(PEERS / "vllm_cache"),
          "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
          "PYTHONWARNINGS": "ignore"}
