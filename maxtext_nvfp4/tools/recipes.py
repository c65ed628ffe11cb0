"""Recipes: find them, read their YAML chain without MaxText, and refuse hardware they cannot use.

Pure Python (PyYAML only; no JAX/MaxText import), so the train entry point can check a recipe *before*
anything heavy runs. The authoritative config is still MaxText's ``pyconfig.initialize``; this module
reproduces only what the hardware check needs: the ``base_config`` chain (looked up next to the YAML,
like MaxText; MaxText's own ``base.yml`` ends the chain) with child keys over parent keys, then
``key=value`` overrides (YAML-typed, like OmegaConf's dotlist).

Hardware rule (:func:`check_hardware`): a config needs Transformer Engine and a GPU of compute capability
at least ``c`` when it uses

* ``quantization=te_fp8_delayedscaling`` / ``te_fp8_currentscaling`` (c = 8.9, FP8 tensor cores),
* ``quantization=te_mxfp8`` / ``te_nvfp4`` / ``te_nvfp4_no_rht`` (c = 10.0, Blackwell),
* ``quantization=nvfp4`` with ``nvfp4_backend=te`` (c = 10.0),
* ``attention=cudnn_flash_te`` or ``quantization=te_no_quant`` (c = 8.0, TE's fused attention).

The requirement of a config is the maximum over the rules it triggers.
"""

from __future__ import annotations

import os
from typing import Any, Mapping, Sequence

import yaml

# Where the shipped recipes live: the repository's recipes/ (editable install / checkout), or a copy
# bundled inside the package (maxtext_nvfp4/recipes/) for wheel installs.
_PKG_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # maxtext_nvfp4/
RECIPE_DIRS = (os.path.join(os.path.dirname(_PKG_DIR), "recipes"), os.path.join(_PKG_DIR, "recipes"))

# quantization value -> minimum compute capability (all need Transformer Engine)
_TE_QUANT_CC = {
    "te_no_quant": 8.0,
    "te_fp8_delayedscaling": 8.9,
    "te_fp8_currentscaling": 8.9,
    "te_mxfp8": 10.0,
    "te_nvfp4": 10.0,
    "te_nvfp4_no_rht": 10.0,
}
_CUDNN_FLASH_TE_CC = 8.0
_NVFP4_TE_CC = 10.0


class RecipeError(ValueError):
  """A recipe that cannot be found or read; one-line message."""


def recipes_dir() -> str | None:
  """The first existing recipes directory (see ``RECIPE_DIRS``), or None."""
  return next((d for d in RECIPE_DIRS if os.path.isdir(d)), None)


def list_recipes() -> list[str]:
  """Paths of the shipped recipes (``*.yml``), sorted; shared ``*_base.yml`` files included."""
  d = recipes_dir()
  return sorted(os.path.join(d, f) for f in os.listdir(d) if f.endswith(".yml")) if d else []


def find_recipe(name: str) -> str:
  """``name`` if it is an existing file, else ``<recipes dir>/<name>[.yml]``; raises :class:`RecipeError`."""
  if os.path.isfile(name):
    return name
  base = os.path.basename(name)
  for d in RECIPE_DIRS:
    for cand in (base, base + ".yml"):
      if os.path.isfile(os.path.join(d, cand)):
        return os.path.join(d, cand)
  raise RecipeError(f"recipe {name!r} not found (looked in the working dir and {', '.join(RECIPE_DIRS)})")


def load_recipe(path: str) -> dict[str, Any]:
  """Merged keys of ``path`` and its local ``base_config`` chain (child over parent). A ``base_config``
  that is not a file next to its YAML (e.g. MaxText's ``base.yml``) ends the chain; its name is kept in
  ``"base_config"``."""
  chain, seen = [], set()
  cur = os.path.abspath(path)
  while True:
    if cur in seen:
      raise RecipeError(f"{path}: base_config cycle through {cur}")
    seen.add(cur)
    try:
      with open(cur, encoding="utf-8") as f:
        data = yaml.safe_load(f) or {}
    except OSError as e:
      raise RecipeError(f"cannot read recipe {cur}: {e.strerror}") from None
    except yaml.YAMLError as e:
      raise RecipeError(f"{cur}: invalid YAML ({str(e).splitlines()[0]})") from None
    if not isinstance(data, dict):
      raise RecipeError(f"{cur}: a recipe must be a YAML mapping")
    chain.append(data)
    parent = data.get("base_config")
    if not parent:
      break
    nxt = parent if os.path.isabs(parent) else os.path.join(os.path.dirname(cur), parent)
    if not os.path.isfile(nxt) or os.path.basename(nxt) == "base.yml":
      break
    cur = nxt
  merged: dict[str, Any] = {}
  for data in reversed(chain):
    merged.update(data)
  merged["base_config"] = chain[-1].get("base_config")  # where the chain leaves the recipes (MaxText's base.yml)
  return merged


def apply_overrides(config: Mapping[str, Any], overrides: Sequence[str]) -> dict[str, Any]:
  """``config`` with ``key=value`` tokens applied (values parsed as YAML scalars, like MaxText's CLI)."""
  out = dict(config)
  for tok in overrides:
    if "=" not in tok:
      continue
    k, v = tok.split("=", 1)
    try:
      out[k.strip()] = yaml.safe_load(v) if v != "" else ""
    except yaml.YAMLError:
      out[k.strip()] = v
  return out


def _get(config: Any, key: str, default: Any = None) -> Any:
  v = config.get(key, default) if isinstance(config, Mapping) else getattr(config, key, default)
  v = getattr(v, "value", v)  # MaxText enums (QuantizationType) -> plain strings
  return default if v is None else v


def _cc_float(gpu_cc: Any) -> float | None:
  if gpu_cc is None:
    return None
  if isinstance(gpu_cc, (tuple, list)):
    return float(f"{int(gpu_cc[0])}.{int(gpu_cc[1])}")
  return float(gpu_cc)


def requirements(config: Any) -> list[tuple[str, float]]:
  """``[(what needs TE, min compute capability), ...]`` for a config (mapping or MaxText config object)."""
  need = []
  quant = str(_get(config, "quantization", "") or "")
  if quant in _TE_QUANT_CC:
    need.append((f"quantization={quant}", _TE_QUANT_CC[quant]))
  if quant == "nvfp4" and str(_get(config, "nvfp4_backend", "auto")) == "te":
    need.append(("quantization=nvfp4 with nvfp4_backend=te", _NVFP4_TE_CC))
  if str(_get(config, "attention", "")) == "cudnn_flash_te":
    need.append(("attention=cudnn_flash_te", _CUDNN_FLASH_TE_CC))
  return need


def _suggestion(config: Any, on_gpu: bool) -> str:
  """The proxy / emulated recipe matching a config's precision."""
  quant = str(_get(config, "quantization", "") or "")
  if quant == "nvfp4" or "nvfp4" in quant or quant == "te_mxfp8":
    alt = ("nvfp4_backend=emulate (exact, no FP4 speed-up), or recipes/proxy_1gpu_nvfp4.yml on one GPU"
           if on_gpu else "recipes/demo_nvfp4.yml on CPU (exact emulation)")
  elif quant.startswith("te_fp8"):
    alt = ("recipes/proxy_1gpu_fp8.yml (XLA FP8, no Transformer Engine)" if on_gpu
           else "recipes/demo_bf16.yml on CPU")
  else:
    alt = "attention=dot_product" + (", or recipes/proxy_1gpu_nvfp4.yml" if on_gpu else ", or recipes/demo_bf16.yml on CPU")
  if str(_get(config, "attention", "")) == "cudnn_flash_te" and "attention=dot_product" not in alt and on_gpu:
    alt += " (with attention=dot_product if TE is missing)"
  return alt


def check_hardware(config: Any, *, te_available: bool, gpu_cc: float | tuple[int, int] | None) -> str | None:
  """None when this machine can run ``config``; else a one-line message saying what is missing and which
  proxy/emulated recipe to use instead.

  ``config``: a mapping of config keys (e.g. :func:`load_recipe` + :func:`apply_overrides`) or MaxText's
  config object. ``te_available``: ``transformer_engine.jax`` imports. ``gpu_cc``: the smallest compute
  capability over the GPUs in use (``10.0`` or ``(10, 0)``), None when there is no NVIDIA GPU.
  """
  need = requirements(config)
  if not need:
    return None
  cc = _cc_float(gpu_cc)
  what, min_cc = max(need, key=lambda n: n[1])
  problems = []
  if not te_available:
    problems.append("Transformer Engine (JAX) is not installed/importable")
  if cc is None:
    problems.append("there is no NVIDIA GPU")
  elif cc < min_cc:
    problems.append(f"the GPU has compute capability {cc:.1f} < {min_cc:.1f}")
  if not problems:
    return None
  needs = ", ".join(w for w, _ in need)
  return (f"this recipe needs Transformer Engine on a GPU with compute capability >= {min_cc:.1f} ({needs}), but"
          f" {' and '.join(problems)}; use {_suggestion(config, cc is not None)} instead")


def detect_hardware() -> tuple[bool, float | None]:
  """``(te_available, min GPU compute capability or None)`` without initializing any JAX backend.

  Safe before ``jax.distributed.initialize`` (which must run before the first ``jax.devices()`` of a
  multi-process job): the compute capability comes from ``nvidia-smi --query-gpu=compute_cap`` (GPUs in
  ``CUDA_VISIBLE_DEVICES`` only, as nvidia-smi reports them), TE availability from the installed package
  (``transformer_engine`` importable spec; its CUDA extension is not loaded). No nvidia-smi: no GPU.
  """
  import importlib.util  # pylint: disable=import-outside-toplevel
  import shutil  # pylint: disable=import-outside-toplevel
  import subprocess  # pylint: disable=import-outside-toplevel

  te_available = importlib.util.find_spec("transformer_engine") is not None
  smi = shutil.which("nvidia-smi")
  if smi is None:
    return te_available, None
  try:
    out = subprocess.run([smi, "--query-gpu=compute_cap", "--format=csv,noheader"], capture_output=True, text=True,
                         timeout=30, check=True).stdout
    ccs = [float(line.strip()) for line in out.splitlines() if line.strip()]
  except (OSError, subprocess.SubprocessError, ValueError):
    return te_available, None
  return te_available, (min(ccs) if ccs else None)


def effective_config(args: Sequence[str]) -> dict[str, Any]:
  """Keys of a trainer command line ``[RECIPE.yml] key=value ...``: the recipe's local ``base_config``
  chain (:func:`load_recipe`) with the overrides applied; without a leading ``.yml``, the overrides only."""
  args = [a for a in args if a is not None]
  config: dict[str, Any] = {}
  if args and str(args[0]).endswith(".yml"):
    config = load_recipe(find_recipe(args[0]))
    args = args[1:]
  return apply_overrides(config, args)


def check_argv(argv: Sequence[str], *, te_available: bool, gpu_cc: float | tuple[int, int] | None) -> str | None:
  """:func:`check_hardware` for a trainer command line ``[prog, RECIPE.yml, key=value, ...]`` (argv[0]
  ignored; no ``.yml`` means MaxText's base.yml, which needs nothing)."""
  return check_hardware(effective_config(list(argv)[1:]), te_available=te_available, gpu_cc=gpu_cc)
