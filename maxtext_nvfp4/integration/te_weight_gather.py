"""``nvfp4_backend=te`` under FSDP: what Transformer Engine all-gathers, said once at start-up (:func:`announce`).

Per NVFP4 kernel W (K x N) and step, with F devices on the weight-sharding axes (fsdp x fsdp_transpose x expert:
the mesh axes MaxText shards both kernels' ``embed`` dim and the tokens over)::

    gathered bytes = 2 copies x K*N x (1/2 + 1/16)  = 1.125 B/weight    (bf16: 2 B/weight per gather)

as read in TE JAX 2.20.2's source and seen in its program compiled for compile-only B200s (tests/te/
test_te_weight_gather.py):

* ``dense._dense_fwd_rule`` quantizes the kernel where its shards live (``tex.quantize(kernel, ...,
  amax_scope=AmaxScope.FSDP)``: one amax per kernel, ``pmax`` over MaxText's ``fsdp`` axis only,
  ``cpp_extensions/amax.py: AmaxScope.all_reduce_amax_along_TPSP_and_FSDP``), both copies at once
  (row-wise and column-wise); the GEMM reads the column-wise copy (``TensorUsage.RHS``, ``scaling_modes.py:
  get_quantize_layout``), and the row-wise one (``RHS_TRANS``) is the residual the dgrad reads.
* ``cpp_extensions/gemm.py: GemmPrimitive._parse_operand_output_specs`` asks for the RHS's contracting dims
  unsharded unless the LHS's are sharded on the same axes, and for its non-contracting dims unsharded on the
  ``fsdp`` axis: XLA all-gathers the operand it is given, which is already quantized -- packed E2M1 (two per
  byte; ``s8`` in the optimized HLO) and the E4M3 scales (one per 16 elements, in TE's GEMM layout). The
  column-wise copy is gathered for the fprop and the row-wise copy for the dgrad; no bf16 copy of W is gathered.
* The wgrad's partial sums are ``psum``-ed in the GEMM's output dtype (``GemmPrimitive.partition``); XLA turns
  that into a bf16 reduce-scatter in MaxText's step (the gradient is sharded as the weight).

``nvfp4_fp4_weight_gather`` is the emulation's key: TE has no switch to gather W in bf16, so ``off`` is refused
with ``nvfp4_backend=te`` (``backends/te.py: check_te_settings``) and only explained when ``auto`` picked TE
(where the MoE experts, emulated, still follow it).
"""

from __future__ import annotations

import math

from maxtext_nvfp4.integration.log_once import log_once

KEY = "nvfp4_fp4_weight_gather"
# Bytes per weight of one gathered NVFP4 copy: E2M1 codes (4 bits) + one E4M3 scale per 16 elements.
BYTES_PER_WEIGHT_PER_COPY = 0.5 + 1 / 16
# Copies of each NVFP4 kernel TE gathers per step: the column-wise (fprop) and the row-wise (dgrad).
COPIES = 2


def _resolved(parallelism, total: int) -> list[int]:
  """MaxText's ``fill_unspecified_mesh_axes`` without its asserts (a mismatch is MaxText's own error later)."""
  vals = [int(v) for v in parallelism]
  if -1 in vals:
    rest = math.prod(v for v in vals if v != -1)
    vals[vals.index(-1)] = total // rest if rest and total % rest == 0 else 1
  return vals


def weight_gather_axes(config, num_devices: int) -> dict[str, int]:
  """``{mesh axis: size}`` (size > 1) of the axes that shard both the kernels' ``embed`` dim and the tokens
  (``activation_batch``) under the config's ``logical_axis_rules``: the axes each kernel is all-gathered over."""
  slices = max(1, int(getattr(config, "num_slices", 1) or 1))
  axes = list(config.mesh_axes)
  ici = _resolved(config.ici_parallelism, max(1, num_devices // slices))
  dcn = _resolved(getattr(config, "dcn_parallelism", [1] * len(axes)), slices)
  sizes = {a: i * d for a, i, d in zip(axes, ici, dcn)}
  rules = {}
  for name, mesh_axes in config.logical_axis_rules:
    rules.setdefault(name, (mesh_axes,) if isinstance(mesh_axes, str) else tuple(mesh_axes or ()))
  both = [a for a in rules.get("embed", ()) if a in rules.get("activation_batch", ())]
  return {a: sizes[a] for a in both if sizes.get(a, 1) > 1}


def statement(axes: dict[str, int], fp4_weight_gather: str = "auto", moe: bool = False) -> str | None:
  """The start-up line of the TE backend on a mesh whose weight-sharding axes are ``axes``; None without any."""
  size = math.prod(axes.values())
  if size <= 1:
    return None
  where = " x ".join(f"{a}={n}" for a, n in axes.items())
  tail = ""
  if fp4_weight_gather == "off":
    tail = (f"; {KEY}=off does not apply to TE (it has no bf16 weight gather)"
            + (", only to the emulated MoE experts" if moe else ""))
  return (f"maxtext-nvfp4: TE backend, weights sharded over {where}: TE all-gathers each NVFP4 kernel already"
          f" quantized (E2M1 codes + one E4M3 scale per 16 weights, {BYTES_PER_WEIGHT_PER_COPY:.4g} B/weight per"
          f" gather instead of bf16's 2): its column-wise copy for the fprop, its row-wise copy for the dgrad{tail}")


def announce(config, settings, num_devices: int, moe: bool = False) -> None:
  """Log :func:`statement` once per run (nothing without a weight-sharding axis of more than one device)."""
  line = statement(weight_gather_axes(config, num_devices), settings.fp4_weight_gather, moe)
  if line:
    log_once(line)
