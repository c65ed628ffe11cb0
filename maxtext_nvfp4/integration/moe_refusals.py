"""The MoE configurations ``quantization=nvfp4`` refuses, each in one line naming the key and the fix.

Refused: MoE paths whose expert GEMMs would silently skip the plan (TE's own MoE block, the batch-split
DeepSeek schedule, the sparse path's ``ragged_dot`` branch, ring of experts), what never ran here (expert
parallelism on the sparse path), the sparse path with a global amax on several devices (its grouped GEMM
runs per device), and the TE backend's expert GEMMs (TE JAX has no NVFP4 grouped GEMM).
"""

from __future__ import annotations

from maxtext_nvfp4.core import implementations
from maxtext_nvfp4.core import layout as layout_lib
from maxtext_nvfp4.core import plan as plan_lib
from maxtext_nvfp4.core import settings as settings_lib
from maxtext_nvfp4.integration import model_layout


def check_model(config, s: settings_lib.Nvfp4Settings, backend: str, num_devices: int | None = 1,
                layout: layout_lib.ModelLayout | None = None) -> None:
  """Refuse (one line) MoE configurations whose expert GEMMs would silently skip the plan.

  Run at config time (``num_devices=None``: the checks that need the device count are skipped) and again
  when MaxText builds the quantization object (``num_devices``: the devices of the run's mesh, on which the
  sparse path's amax scope depends). ``backend``: the requested ``nvfp4_backend``; ``layout``: the config's
  decoder (read here when not given).
  """
  _check_decoder(config, s, backend, layout or model_layout.layout_of(config), num_devices)


def check_parsed(run, num_devices: int | None) -> None:
  """:func:`check_model` of a config already read (a :class:`~maxtext_nvfp4.integration.parsed_config.ParsedConfig`)."""
  _check_decoder(run.config, run.settings, run.settings.backend, run.layout, num_devices)


def _check_decoder(config, s: settings_lib.Nvfp4Settings, backend: str, layout: layout_lib.ModelLayout,
                   num_devices: int | None) -> None:
  if not layout.moe_layers:
    return
  experts_planned = plan_lib.is_targeted("expert_wi_0", s.targets) or s.fallback != "bf16"
  if not experts_planned:
    return
  if bool(getattr(config, "te_moe_block", False)):
    raise settings_lib.SettingsError(
        "quantization=nvfp4 with te_moe_block=true: Transformer Engine's own MoE block runs the experts without"
        " the plugin's per-expert NVFP4 GEMMs; set te_moe_block=false")
  if bool(getattr(config, "use_batch_split_schedule", False)):
    raise settings_lib.SettingsError(
        "quantization=nvfp4 with use_batch_split_schedule=true: the batch-split DeepSeek schedule calls the grouped"
        " GEMM kernels directly, so its experts would run unquantized; set use_batch_split_schedule=false")
  why = refusal(config, s, num_devices)
  if why:
    raise settings_lib.SettingsError(why)
  insisted = implementations.insisted(backend)
  if insisted is not None and not insisted.expert_gemms:
    raise settings_lib.SettingsError(
        f"nvfp4_backend={insisted.name} cannot run the MoE expert GEMMs (TE JAX has no NVFP4 grouped GEMM); set"
        " nvfp4_backend=emulate, or nvfp4_targets=attention|mlp with nvfp4_fallback=bf16")


def refusal(config, s: settings_lib.Nvfp4Settings, num_devices: int | None) -> str | None:
  """Why the expert GEMMs of ``config``'s sparse path (``sparse_matmul=true``) cannot run as planned, or None.

  One line naming the key and the fix. Only asked when some expert linear is off plain bf16.
  ``num_devices`` None: unknown yet (config time), the amax-scope check is skipped.
  """
  if not bool(config.sparse_matmul):
    return None
  head = "quantization=nvfp4 with sparse_matmul=true and"
  if not bool(config.megablox) and not bool(getattr(config, "use_tokamax_gmm", False)):
    return (f"{head} megablox=false (and use_tokamax_gmm=false): MaxText then calls jax.lax.ragged_dot itself,"
            " which the plugin cannot intercept, so the experts would run unquantized; set megablox=true (MaxText's"
            " default: the emulated per-expert GEMM replaces the kernel) or sparse_matmul=false")
  if bool(getattr(config, "use_ring_of_experts", False)):
    return (f"{head} use_ring_of_experts=true: ring of experts splits the expert GEMMs into token chunks and"
            " group offsets the plugin does not emulate; set use_ring_of_experts=false or sparse_matmul=false")
  ep = {k: int(getattr(config, k, 1)) for k in ("ici_expert_parallelism", "dcn_expert_parallelism")}
  if any(v > 1 for v in ep.values()):
    return expert_parallel_refusal(", ".join(f"{k}={v}" for k, v in ep.items()))
  if s.amax_scope == "global" and (num_devices or 1) > 1:
    return (f"{head} nvfp4_amax_scope=global on {num_devices} devices: MaxText's grouped GEMM runs per device"
            " inside a shard_map, so each expert's amax can only be per device (TE's scope); set"
            " nvfp4_amax_scope=te or sparse_matmul=false")
  return None


def expert_parallel_refusal(what: str) -> str:
  """The one line for an expert-parallel mesh (``what``: the keys or the mesh axis that make it so)."""
  return ("quantization=nvfp4 with sparse_matmul=true and expert parallelism"
          f" ({what}): not verified (XLA:CPU cannot run MaxText's ragged all-to-all, so the expert-parallel grouped"
          " GEMM never ran here); set ici_expert_parallelism=1 and dcn_expert_parallelism=1 (data, fsdp and tensor"
          " parallelism are supported) or sparse_matmul=false")
