"""The devices a MaxText config is compiled for, when they are not the host's: ``compile_topology``.

MaxText compiles ahead of time for ``compile_topology`` (its own TPU names, ``v5e-4``, ..., and ``a3``); this package
adds the GPU targets of :mod:`maxtext_nvfp4.backends.targets` as ``<target>-<devices per slice>`` (``b200-4``,
``gb200-8``, ``h200-1``). The NVFP4 backend is chosen for those devices, not for the host that compiles
(``nvfp4_backend=auto`` compiling for four B200s on a CPU host picks Transformer Engine when it imports).
"""

from __future__ import annotations

import types
from typing import Any

from maxtext_nvfp4.backends import capability
from maxtext_nvfp4.backends import targets


def parse(config) -> tuple[str, int] | None:
  """``(GPU target, device count)`` of the config's ``compile_topology`` when it names one of ours (slices included)."""
  parsed = targets.parse_topology(getattr(config, "compile_topology", ""))
  if parsed is None:
    return None
  name, per_slice = parsed
  return name, per_slice * max(1, int(getattr(config, "compile_topology_num_slices", 1) or 1))


def target_of(config) -> tuple[str, tuple] | None:
  """``(label, devices)`` the config compiles for, or None when it runs on the host's devices.

  Our GPU names give compile-only devices (:func:`targets.devices`: a one-line :class:`targets.TargetError` when
  XLA:GPU's compiler is missing); MaxText's own names (TPU slices, ``a3``) give one stand-in device of their
  platform, which is all the backend choice reads.
  """
  topology = str(getattr(config, "compile_topology", "") or "")
  if not topology:
    return None
  ours = parse(config)
  if ours is not None:
    return topology, targets.devices(*ours)
  platform = maxtext_platform(topology)
  if platform == "gpu":  # MaxText's a3: its train_compile compiles for the host's own (mocked) GPUs
    return None
  return topology, (types.SimpleNamespace(platform=platform, device_kind=topology, id=0),)


def maxtext_platform(topology: str) -> str:
  """The platform ("tpu", "gpu") of one of MaxText's compile topologies; MaxText's one-line ValueError otherwise."""
  from maxtext.utils import accelerator_to_spec_map  # pylint: disable=import-outside-toplevel

  return accelerator_to_spec_map.get_system_characteristics(topology).platform


def choose_backend(config, s) -> capability.BackendChoice:
  """:func:`capability.choose_backend` for ``s.backend``, judging the compile target's devices when there is one."""
  if capability.current_target() is not None:
    return capability.choose_backend(s.backend, settings=s)
  target = target_of(config)
  if target is None:
    return capability.choose_backend(s.backend, settings=s)
  with capability.compile_target(*target):
    return capability.choose_backend(s.backend, settings=s)


def device_count(config) -> int:
  """Devices the config's program runs on: the compile target's, else the host's (``jax.device_count()``)."""
  current = capability.current_target()
  if current is not None:
    return len(current[1])
  ours = parse(config)
  if ours is not None:
    return ours[1]
  import jax  # pylint: disable=import-outside-toplevel

  return jax.device_count()


def system_characteristics(name: str, original) -> Any:
  """MaxText's ``get_system_characteristics(name)`` that also knows our GPU names (``b200-4``: 4 devices per slice)."""
  parsed = targets.parse_topology(name)
  if parsed is None:
    return original(name)
  from maxtext.utils import accelerator_to_spec_map  # pylint: disable=import-outside-toplevel

  return accelerator_to_spec_map.SystemCharacteristics("gpu", None, None, None, parsed[1], None)
