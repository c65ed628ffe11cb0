"""Compile targets by name: the accelerators the deviceless tools compile for on a CPU host (no accelerator).

    name -> Target -> compile-only devices
    GPU: XLA's GpuTargetConfigProto (``maxtext_nvfp4/backends/target_specs/<spec>.txtpb``, vendored from openxla/xla;
         the package's ``train-compile`` reads the same files through ``maxtext_nvfp4.backends.targets``)
         -> ``get_topology_desc(platform="cuda", target_config=<text>, topology="1x<n>x1")``
    TPU: MaxText's ``compile_topology`` name (``utils/accelerator_to_spec_map.py``: topology, chip config,
         chips per host, wrap) -> ``get_topology_desc(platform="tpu", ...)``, as MaxText's ``train_compile`` does

GPU targets need ``jax-cuda12-plugin`` / ``jax-cuda12-pjrt`` at jax's version; TPU targets need ``libtpu`` at
jax's own pin (jax 0.12.0.1: ``libtpu==0.0.50.*``). Both run with ``JAX_PLATFORMS=cpu``. What a target
compiles to is compile-derived (no autotuning, no device): it says what XLA makes of a program for that chip,
not how fast it runs.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib.util
import os

import jax

TARGETS_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "maxtext_nvfp4", "backends",
                           "target_specs")
# jax's own pin of libtpu (``jax[tpu]``), by jax version: the TPU compiler the pinned counts are from.
LIBTPU_PINS = {"0.12.0.1": "0.0.50.*"}


@dataclasses.dataclass(frozen=True, kw_only=True)
class Target:
  """One compile target."""

  # the name the tools take (``--target``)
  name: str
  # jax platform of its compile-only devices: "cuda" or "tpu"
  platform: str
  # the chip, as a reader names it
  chip: str
  # the architecture XLA compiles for (GPU: the SM version of the spec; TPU: the generation)
  arch: str
  # GPU: the spec file in TARGETS_DIR (XLA's own GpuTargetConfigProto); None for TPU
  spec: str | None = None
  # TPU: MaxText's compile_topology of the smallest slice it names (accelerator_to_spec_map); None for GPU
  compile_topology: str | None = None


TARGETS = {t.name: t for t in (
    Target(name="a100", platform="cuda", chip="NVIDIA A100-SXM4-80GB", arch="sm_80", spec="a100_sxm_80"),
    Target(name="h100", platform="cuda", chip="NVIDIA H100 80GB HBM3 (SXM)", arch="sm_90a", spec="h100_sxm"),
    Target(name="h200", platform="cuda", chip="NVIDIA H200 141GB HBM3e", arch="sm_90a", spec="h200"),
    Target(name="b200", platform="cuda", chip="NVIDIA B200", arch="sm_100a", spec="b200"),
    Target(name="gb200", platform="cuda", chip="NVIDIA GB200", arch="sm_100a", spec="gb200"),
    Target(name="tpu-v5e", platform="tpu", chip="TPU v5e (v5 lite)", arch="v5e", compile_topology="v5e-1"),
    Target(name="tpu-v6e", platform="tpu", chip="TPU v6e (Trillium)", arch="v6e", compile_topology="v6e-1"),
    Target(name="tpu-v5p", platform="tpu", chip="TPU v5p (megacore)", arch="v5p", compile_topology="v5p-8"),
)}
# The spec files' own names (the older ``--spec`` spelling) for the same GPU targets.
_ALIASES = {t.spec: t.name for t in TARGETS.values() if t.spec}


class UnknownTarget(ValueError):
  """A target name that is neither a name in TARGETS nor a GpuTargetConfigProto file."""


def resolve(name: str) -> Target:
  """The Target called ``name`` (a TARGETS name, a spec file's stem, or a path to a GpuTargetConfigProto text file
  such as the ``gpu_target_config.pbtxt`` a GPU run writes with ``--xla_dump_to``)."""
  name = _ALIASES.get(name, name)
  if name in TARGETS:
    return TARGETS[name]
  if os.path.isfile(name):
    return Target(name=name, platform="cuda", chip=f"GPU of {os.path.basename(name)}", arch="from the file", spec=name)
  raise UnknownTarget(f"unknown compile target {name!r}: choose one of {', '.join(TARGETS)} or pass a "
                      f"GpuTargetConfigProto file")


def spec_path(target: Target) -> str:
  """The GpuTargetConfigProto file of a GPU target."""
  return target.spec if os.path.isfile(target.spec) else os.path.join(TARGETS_DIR, f"{target.spec}.txtpb")


def unavailable_reason(name: str = "h200") -> str | None:
  """None when this environment can compile for target ``name``; otherwise why not and the fix (one line)."""
  target = resolve(name)
  if target.platform == "cuda":
    if importlib.util.find_spec("jax_cuda12_plugin") is None or importlib.util.find_spec("jax_plugins") is None:
      return (f"jax-cuda12-plugin / jax-cuda12-pjrt=={jax.__version__} not installed"
              f" (bash scripts/setup_targets.sh builds .venv-targets with them)")
    return None
  if importlib.util.find_spec("libtpu") is None:
    pin = LIBTPU_PINS.get(jax.__version__, "at jax's own pin")
    return (f"libtpu not installed: TPU targets compile with jax[tpu]'s libtpu ({pin} for jax {jax.__version__});"
            f" bash scripts/setup_targets.sh builds .venv-targets with it")
  return None


@functools.lru_cache(maxsize=None)
def devices(name: str = "h200", n: int = 1) -> tuple:
  """Compile-only devices of target ``name``: GPU ``n`` GPUs of one host; TPU the chips of the target's
  MaxText slice (``n`` is ignored). Raises RuntimeError with the fix when the compiler is not installed."""
  target = resolve(name)
  reason = unavailable_reason(name)
  if reason:
    raise RuntimeError(f"deviceless compile for {target.name}: {reason}")
  from jax.experimental import topologies  # pylint: disable=import-outside-toplevel

  if target.platform == "cuda":
    with open(spec_path(target)) as fh:
      text = fh.read()
    return tuple(topologies.get_topology_desc(platform="cuda", target_config=text, topology=f"1x{n}x1").devices)
  _quiet_libtpu()
  sc = system_characteristics(target)
  return tuple(topologies.get_topology_desc(
      platform="tpu", topology_name=sc.topology_name, chip_config_name=sc.chip_config_name,
      chips_per_host_bounds=sc.chips_per_host_bounds, num_slices=1, wrap=sc.wrap).devices)


def system_characteristics(target: Target):
  """MaxText's SystemCharacteristics of a TPU target's compile_topology (the one source of its topology)."""
  from maxtext.utils import accelerator_to_spec_map  # pylint: disable=import-outside-toplevel

  return accelerator_to_spec_map.get_system_characteristics(target.compile_topology)


def _quiet_libtpu() -> None:
  # On a host without TPUs libtpu looks for the host's accelerator type and worker names in the environment and
  # logs a warning and an error (harmless for compile-only devices) when they are missing; the same optimized HLO
  # with and without these (checked for v6e). It also takes a lock file that a second process (a child compiling
  # MaxText's step) cannot get: compile-only clients share no device, so they may load it side by side, as jax's
  # own multi-process tests allow.
  os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
  os.environ.setdefault("TPU_SKIP_MDS_QUERY", "1")
  os.environ.setdefault("TPU_ACCELERATOR_TYPE", "v5litepod-1")
  os.environ.setdefault("TPU_WORKER_HOSTNAMES", "localhost")
