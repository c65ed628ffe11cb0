"""Accelerators a program can be compiled for without being on one: names, XLA target specs, compile-only devices.

A *target* is a kind of accelerator chip. ``devices(target, n)`` gives ``n`` compile-only devices of it on any
host (no accelerator, no driver): XLA:GPU's compiler from its target spec
(``jax.experimental.topologies.get_topology_desc(platform="cuda", target_config=<spec text>, topology="1x1xN")``,
with jax-cuda12-plugin / jax-cuda12-pjrt at jaxlib's version) or libtpu's compile-only TPU topology
(``get_topology_desc(platform="tpu", topology_name=...)``, libtpu at jax's own pin). The GPU specs are XLA's own
files (``target_specs/``, each headed by its openxla/xla commit), vendored unchanged.

A *compile topology* names a target and a device count, as MaxText's ``compile_topology`` does
(``b200-4``: four B200s); :func:`parse_topology` reads the GPU names this package adds. TPU topologies are
MaxText's own (``v5e-4``, ...).
"""

from __future__ import annotations

import dataclasses
import functools
import os
import re

from maxtext_nvfp4.core import compilers

SPECS_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "target_specs")


@dataclasses.dataclass(frozen=True, kw_only=True)
class Target:
  """One kind of accelerator chip to compile for."""

  # the name users type: "b200", "tpu-v5e"
  name: str
  # JAX's platform of its devices: "gpu" or "tpu"
  platform: str
  # GPU: the vendored XLA GpuTargetConfigProto file in target_specs/ (None for TPUs)
  spec_file: str | None = None
  # TPU: libtpu's chip name in a topology string ("v5e" -> "v5e:2x2"); None for GPUs
  tpu_chip: str | None = None


TARGETS: dict[str, Target] = {t.name: t for t in (
    Target(name="a100", platform="gpu", spec_file="a100_sxm_80.txtpb"),
    Target(name="h100", platform="gpu", spec_file="h100_sxm.txtpb"),
    Target(name="h200", platform="gpu", spec_file="h200.txtpb"),
    Target(name="b200", platform="gpu", spec_file="b200.txtpb"),
    Target(name="gb200", platform="gpu", spec_file="gb200.txtpb"),
    Target(name="tpu-v5e", platform="tpu", tpu_chip="v5e"),
    Target(name="tpu-v6e", platform="tpu", tpu_chip="v6e"),
    Target(name="tpu-v5p", platform="tpu", tpu_chip="v5p"),
)}
GPU_TARGETS = tuple(n for n, t in TARGETS.items() if t.platform == "gpu")


class TargetError(ValueError):
  """A target or compile topology that cannot be used here; the message is one line with the fix."""


def target(name: str) -> Target:
  """The :class:`Target` called ``name`` (one-line :class:`TargetError` listing the names otherwise)."""
  if name not in TARGETS:
    raise TargetError(f"unknown compile target {name!r}; choose one of: {', '.join(TARGETS)}")
  return TARGETS[name]


def spec_text(name: str) -> str:
  """The XLA GpuTargetConfigProto text of GPU target ``name``."""
  t = target(name)
  if t.spec_file is None:
    raise TargetError(f"compile target {name!r} is a {t.platform.upper()}, which has no XLA:GPU target spec")
  with open(os.path.join(SPECS_DIR, t.spec_file), encoding="utf-8") as fh:
    return fh.read()


def spec_field(text: str, field: str) -> str | None:
  """The first scalar ``field: value`` of a target spec's text (quotes stripped), or None."""
  m = re.search(rf"^\s*{re.escape(field)}:\s*(.+?)\s*$", text, flags=re.M)
  return None if m is None else m.group(1).strip('"')


def compute_capability(name: str) -> float:
  """GPU target ``name``'s CUDA compute capability from its spec (``cuda_compute_capability { major minor }``)."""
  text = spec_text(name)
  block = re.search(r"cuda_compute_capability\s*{([^}]*)}", text)
  if block is None:
    raise TargetError(f"the spec of compile target {name!r} names no cuda_compute_capability")
  major = spec_field(block.group(1), "major")
  minor = spec_field(block.group(1), "minor")
  return float(f"{int(major or 0)}.{int(minor or 0)}")


def memory_bytes(name: str) -> int | None:
  """Device memory of GPU target ``name`` from its spec (``device_memory_size``), or None."""
  value = spec_field(spec_text(name), "device_memory_size")
  return None if value is None else int(value)


def unavailable_reason(name: str) -> str | None:
  """None when compile-only devices of target ``name`` can be made here; else why, with the fix (one line)."""
  t = target(name)
  if t.platform == "gpu":
    if "cuda" not in compilers.installed():
      import jax  # pylint: disable=import-outside-toplevel

      return (f"compiling for {name} needs XLA:GPU's compiler: pip install jax-cuda12-plugin=={jax.__version__}"
              f" jax-cuda12-pjrt=={jax.__version__} (scripts/setup_targets.sh builds .venv-targets with them)")
    return None
  if "tpu" not in compilers.installed():
    return (f"compiling for {name} needs libtpu at jax's own pin (jax 0.12.0.1: pip install 'libtpu==0.0.50.*';"
            " scripts/setup_targets.sh builds .venv-targets with it)")
  return None


def tpu_topology(name: str, count: int) -> str:
  """libtpu's topology string for ``count`` chips of TPU target ``name`` ("v5e", 4 -> "v5e:2x2")."""
  t = target(name)
  if t.tpu_chip is None:
    raise TargetError(f"compile target {name!r} is not a TPU")
  shapes = {1: "1x1", 2: "1x2", 4: "2x2", 8: "2x4", 16: "4x4", 32: "4x8", 64: "8x8", 128: "8x16", 256: "16x16"}
  if count not in shapes:
    raise TargetError(f"{count} {name} chips: choose one of {', '.join(map(str, shapes))}")
  dims = shapes[count]
  if t.tpu_chip == "v5p":  # 3D torus: chips x chips x 1
    dims += "x1"
  return f"{t.tpu_chip}:{dims}"


@functools.lru_cache(maxsize=None)
def devices(name: str, count: int = 1) -> tuple:
  """``count`` compile-only devices of target ``name`` (one-line :class:`TargetError` when it cannot be done here)."""
  if count < 1:
    raise TargetError(f"{count} devices: a compile target needs at least 1")
  reason = unavailable_reason(name)
  if reason:
    raise TargetError(reason)
  from jax.experimental import topologies  # pylint: disable=import-outside-toplevel

  t = target(name)
  if t.platform == "gpu":
    desc = topologies.get_topology_desc(platform="cuda", target_config=spec_text(name), topology=f"1x1x{count}")
  else:
    desc = topologies.get_topology_desc(platform="tpu", topology_name=tpu_topology(name, count))
  return tuple(desc.devices)


_TOPOLOGY = re.compile(r"^([a-z0-9]+)-(\d+)$")


def parse_topology(compile_topology: str) -> tuple[str, int] | None:
  """``"b200-4"`` -> ``("b200", 4)`` for the GPU targets this package names; None for anything else."""
  m = _TOPOLOGY.match(str(compile_topology or ""))
  if m is None or m.group(1) not in GPU_TARGETS:
    return None
  return m.group(1), int(m.group(2))
