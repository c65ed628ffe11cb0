"""MaxText's train step compiled ahead of time for a GPU target this host does not have (``compile_topology=b200-4``).

The step is built exactly as MaxText's own ahead-of-time compiler builds it (``trainers/pre_train/train_compile.py``:
``get_shaped_inputs`` for the abstract state and batch, ``maxtext_utils.get_functional_train_with_signature`` for
the step and its shardings); only the devices differ: train_compile's GPU branch takes the host's ``jax.devices()``,
here they are compile-only devices of the target (:mod:`maxtext_nvfp4.backends.targets`). Lowering and compiling
both run inside ``jax.set_mesh`` and MaxText's Transformer Engine context (TE's custom partitioner reads its mesh
resources then, and asserts without them), with the target as :func:`capability.compile_target` (so the NVFP4
backend is chosen for it) and, on the TE backend, TE's trace-time device queries answered for the target
(:mod:`maxtext_nvfp4.backends.te_compile_only`).

Nothing runs: what comes out is XLA's compiled program for the target -- its memory analysis and optimized HLO
(compile-derived figures, not measurements).
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any, Sequence

from maxtext_nvfp4.backends import capability
from maxtext_nvfp4.backends import targets
from maxtext_nvfp4.integration import compile_target


@dataclasses.dataclass(frozen=True, kw_only=True)
class CompiledStep:
  """One train step compiled for a target."""

  # the compile topology, e.g. "b200-4"
  topology: str
  # the backend the NVFP4 GEMMs were built for ("emulate" | "te"; "" when the config is not nvfp4)
  backend: str
  # XLA's compiled executable (memory_analysis(), as_text(), cost_analysis()); None when only lowered
  compiled: Any
  # the lowered program (as_text(): StableHLO before XLA's passes)
  lowered: Any
  # seconds to trace and lower, and to compile, on this host
  lower_s: float
  compile_s: float
  # the mesh, axis -> size
  mesh: dict[str, int]
  # MaxText's config of the step (pyconfig.HyperParameters)
  config: Any


def _config_backend(config) -> str:
  if str(getattr(config, "quantization", "")) not in ("nvfp4", "QuantizationType.NVFP4"):
    return ""
  from maxtext_nvfp4.core import settings as settings_lib  # pylint: disable=import-outside-toplevel

  return compile_target.choose_backend(config, settings_lib.from_config(config)).name


def _te_loads() -> bool:
  return capability.te_version() is not None and capability.te_unavailable_reason() is None


def compile_train_step(argv: Sequence[str], *, compile: bool = True) -> CompiledStep:  # pylint: disable=redefined-builtin
  """Compile MaxText's train step of ``argv`` (``[None, recipe.yml, key=value, ...]``, as ``pyconfig.initialize``
  takes it) for the GPU target its ``compile_topology`` names (``b200-4``); registers the plugin. ``compile=False``
  stops after lowering (the program as traced, before XLA's passes and partitioning).

  Raises:
    targets.TargetError: ``compile_topology`` names no GPU target of ours, or XLA:GPU's compiler is missing.
  """
  import maxtext_nvfp4  # pylint: disable=import-outside-toplevel

  maxtext_nvfp4.register()
  import jax  # pylint: disable=import-outside-toplevel
  from flax.core.spmd import logical_axis_rules  # pylint: disable=import-outside-toplevel
  from jax.sharding import AxisType, Mesh  # pylint: disable=import-outside-toplevel
  from maxtext.configs import pyconfig  # pylint: disable=import-outside-toplevel
  from maxtext.trainers.pre_train import train, train_compile  # pylint: disable=import-outside-toplevel
  from maxtext.utils import max_utils, maxtext_utils, sharding  # pylint: disable=import-outside-toplevel

  topology = next((a.split("=", 1)[1] for a in reversed(list(argv)) if isinstance(a, str)
                   and a.startswith("compile_topology=")), "")
  t0 = time.perf_counter()
  probe = type("Probe", (), {"compile_topology": topology, "compile_topology_num_slices": next(
      (int(a.split("=", 1)[1]) for a in reversed(list(argv)) if isinstance(a, str)
       and a.startswith("compile_topology_num_slices=")), 1)})
  parsed = compile_target.parse(probe)
  if parsed is None:
    raise targets.TargetError(f"compile_topology={topology!r} names no GPU target; use <target>-<devices> with a"
                              f" target among {', '.join(targets.GPU_TARGETS)} (e.g. b200-4)")
  devices = targets.devices(*parsed)
  with capability.compile_target(topology, devices):
    config = pyconfig.initialize(list(argv))
    backend = _config_backend(config)
    if _te_loads():  # TE traces for the target: the NVFP4 backend, MaxText's te_* recipes, cudnn_flash_te attention
      from maxtext_nvfp4.backends import te_compile_only  # pylint: disable=import-outside-toplevel

      te_compile_only.answer_device_queries(targets.compute_capability(parsed[0]),
                                            answer_fused_attention=str(config.attention) == "cudnn_flash_te")
    mesh = Mesh(maxtext_utils.create_device_mesh(config, list(devices)), config.mesh_axes,
                axis_types=(AxisType.Auto,) * len(config.mesh_axes))
    with jax.set_mesh(mesh):
      args, kwargs, state_shardings, _, model = train_compile.get_shaped_inputs(mesh, config)
    params_shardings, state_shardings = sharding.maybe_update_params_sharding_with_opt(config, state_shardings)
    in_state = sharding.build_zero1_input_state_mesh_shardings(config, state_shardings, params_shardings)
    data_sharding = sharding.get_input_data_sharding(config, mesh)
    fn, in_sh, out_sh, static, donate = maxtext_utils.get_functional_train_with_signature(
        train.train_step, data_sharding, in_state, model, config, params_shardings)
    te_context = max_utils.maybe_get_transformer_engine_context(config)
    # The default device is the target's: Pallas's Triton lowering (the emulation's kernels) targets it.
    with jax.default_device(devices[0]), jax.set_mesh(mesh), te_context:
      with logical_axis_rules(config.logical_axis_rules):
        lowered = jax.jit(fn, in_shardings=in_sh, out_shardings=out_sh, static_argnums=static,
                          donate_argnums=donate).lower(*args, **kwargs)
      t1 = time.perf_counter()
      compiled = lowered.compile() if compile else None
    t2 = time.perf_counter()
  return CompiledStep(topology=topology, backend=backend, compiled=compiled, lowered=lowered, lower_s=round(t1 - t0, 1),
                      compile_s=round(t2 - t1, 1), mesh=dict(mesh.shape), config=config)
