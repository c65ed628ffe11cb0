"""MaxText RoutedMoE's grouped-GEMM path (``sparse_matmul=true``) with each expert's GEMM in its planned precision.

What MaxText does there (as read in its source; the call order is the adapter's ``gmm_call_order``;
``layers/moe.py``, ``RoutedMoE.sparse_matmul``): inside one ``jax.shard_map`` over the run's mesh it sorts
the routed (token, k) copies by expert (``permute``: a stable argsort, so an expert's rows keep token order) and runs the expert linears through a local closure ``gmm(inputs, kernel,
...)`` (moe.py:2236) that pads the rows to the tile and calls ``maxtext.kernels.megablox.gmm`` when
``megablox`` or ``use_tokamax_gmm`` is set (with a quantization set, tokamax's direct unquantized
``ragged_dot`` is never taken: moe.py:2296-2303), else ``jax.lax.ragged_dot`` (moe.py:2195). In one call
(``_moe_body``) the gmm calls come in the order

    wi_0, wi_1, wo                     (gmm_up's two up-projections, then the down projection)
    [wi_0 | wi_1], wo                  (prefuse_moe_weights: one gmm of the concatenated kernels)

each ``gmm(lhs (M, K), rhs (E, K, N), group_sizes (E,))``: rows ``[s_e, s_e + m_e)`` of ``lhs``
(``s_e = m_0 + ... + m_{e-1}``) are expert ``e``'s tokens, rows past ``sum(m_e)`` are padding whose output
is zero. The quantization object is never asked for the GEMM (only for megablox's int8/fp8 dtypes,
``get_quantization_dtypes``, moe.py:2224), so MaxText alone would run the experts unquantized.

The interception (two wraps, listed in the MaxText adapter's ``touches``):

* ``RoutedMoE.sparse_matmul``: when the layer's ``quant`` is ours, it asks it for the layer's three expert
  GEMMs (``expert_gemms()``: layer, role and recipes located exactly as the einsum path's
  ``quant.einsum`` calls are, one per expert linear per traced forward) and publishes them in a context
  variable while MaxText traces the call;
* ``maxtext.kernels.megablox.gmm``: inside such a call, the next expert linear of that order runs as
  :func:`maxtext_nvfp4.core.grouped_gemm.ragged_dot` (TE's GEMM recipe once per expert: own amax per
  expert weight and per expert token group, 1x16 / 16x16 blocks, RHT16 and SR on the wgrad/dgrad copies
  along the expert's tokens, groups zero-padded to 16) with the SR key of (seed, step, layer, role);
  a fused ``[wi_0 | wi_1]`` kernel is split back into its two experts' weights, each its own NVFP4 tensor.
  A linear whose every pass is plain bf16 (a kept layer, an untargeted role) and every call outside
  such a ``sparse_matmul`` run MaxText's own gmm, unchanged.

Routing, dispatch (permute) and combine (unpermute) stay MaxText's, in high precision.

Where the grouped GEMM runs: inside MaxText's shard_map, on each device's own tokens and expert-weight
shards (the experts' hidden dim split over the tensor axis, the weights gathered over fsdp). Each
expert's amax is therefore per device for x and dy and per tensor-parallel shard for W: TE's scope
(``nvfp4_amax_scope: te``). ``global`` on more than one device is refused at start-up
(:func:`maxtext_nvfp4.integration.moe_refusals.refusal`).
On several devices each device folds its linear mesh index into the SR key (TE's devices draw their own
bits; without it every data-parallel replica would reuse the same bits).

What cannot be intercepted, or never ran here, is refused at start-up with one line
(:func:`maxtext_nvfp4.integration.moe_refusals.refusal`): the
``ragged_dot`` path (``megablox=false`` with ``use_tokamax_gmm=false``: MaxText calls ``jax.lax.ragged_dot``
itself), ring of experts (gmm calls per token chunk, group offsets), expert parallelism (traced, but XLA:CPU
cannot run MaxText's ragged all-to-all, so never run), and the amax scope above.
"""

from __future__ import annotations

import collections
import contextlib
import contextvars
import dataclasses
import inspect
import itertools
from typing import Any

from maxtext_nvfp4.core import settings as settings_lib
from maxtext_nvfp4.integration import moe_refusals
from maxtext_nvfp4.integration import step as step_lib
from maxtext_nvfp4.integration import touchpoints
from maxtext_nvfp4.integration import traced


@dataclasses.dataclass(frozen=True, kw_only=True)
class ExpertGemm:
  """One expert linear of one MoE layer, as the plan has it."""

  # decoder layer index (None: scanned layers)
  layer: int | None
  # expert_wi_0 | expert_wi_1 | expert_wo
  role: str
  # GemmRecipe before the switch, or None: every pass plain bf16 (MaxText's own gmm runs)
  recipe: Any = None
  # GemmRecipe from switch_step on, or None (switch off)
  switched: Any = None
  # first step that uses `switched`
  switch_step: int | None = None
  # nvfp4_seed
  seed: int = 0
  # diagnostics group (core.diagnostics.group_name), or None: no diagnostics
  diag_group: str | None = None
  # nvfp4_diagnostics_interval
  diag_interval: int = 1


@dataclasses.dataclass(frozen=True, kw_only=True)
class _Call:
  """One traced ``RoutedMoE.sparse_matmul`` with at least one expert linear off plain bf16."""

  # expert_wi_0, expert_wi_1, expert_wo
  gemms: dict
  # the expert role(s) of successive gmm calls, cycled (the MaxText adapter's gmm_call_order[_fused])
  cycle: tuple
  # gmm calls so far in this call (the k-th is entry k of the cycle)
  calls: Any = dataclasses.field(default_factory=itertools.count)

  def next_linears(self) -> tuple[str, ...]:
    """The expert role(s) of the next gmm call (two for a fused up-projection)."""
    return self.cycle[next(self.calls) % len(self.cycle)]


_ACTIVE: contextvars.ContextVar[_Call | None] = contextvars.ContextVar("maxtext_nvfp4_sparse_moe", default=None)

# Trace-time counts of gmm calls: "emulated" (our per-expert GEMM) and "maxtext" (MaxText's own kernel).
_gmm_calls = traced.TraceCounter()


def gmm_calls(reset: bool = False) -> collections.Counter:
  """``{"emulated": n, "maxtext": m}``: grouped-GEMM calls traced since the last reset (a trace-time count)."""
  return _gmm_calls.read(reset)


def _count(kind: str, n: int = 1) -> None:
  _gmm_calls.add(kind, n)


@contextlib.contextmanager
def _active(call: _Call):
  token = _ACTIVE.set(call)
  try:
    yield
  finally:
    _ACTIVE.reset(token)


# ---------------------------------------------------------------------------------------------------
# The two wraps
# ---------------------------------------------------------------------------------------------------


def patch_moe(moe) -> None:
  """Wrap ``moe.RoutedMoE.sparse_matmul`` (see the module docstring)."""
  def make(orig):
    def sparse_matmul(self, *args, **kwargs):
      expert_gemms = getattr(self.quant, "expert_gemms", None)
      if expert_gemms is None:  # not ours (MaxText's own quantization, or none)
        return orig(self, *args, **kwargs)
      gemms = expert_gemms()  # always located: keeps the per-trace count aligned (plan.GemmLocator)
      if all(g.recipe is None for g in gemms) or step_lib.in_reference_pass():  # the fidelity's reference: plain
        return orig(self, *args, **kwargs)
      ep = int(self.get_expert_parallelism_size())
      if ep > 1:  # e.g. ici_expert_parallelism=-1 resolved on the mesh (the config-time check saw -1)
        raise settings_lib.SettingsError(moe_refusals.expert_parallel_refusal(f"{ep} expert shards on the mesh"))
      facts = touchpoints.adapter()
      fused = bool(self.config.prefuse_moe_weights)
      call = _Call(gemms={g.role: g for g in gemms},
                   cycle=facts.gmm_call_order_fused if fused else facts.gmm_call_order)
      with _active(call):
        return orig(self, *args, **kwargs)
    return sparse_matmul

  cls = moe.RoutedMoE
  cls.sparse_matmul = touchpoints.wrap_once(cls.sparse_matmul, make)


def patch_megablox(megablox) -> None:
  """Wrap ``maxtext.kernels.megablox.gmm`` (the name ``layers/moe.py`` calls as ``mblx.gmm``)."""
  def make(orig):
    sig = inspect.signature(orig)

    def gmm(*args, **kwargs):
      call = _ACTIVE.get()
      if call is None:
        _count("maxtext")
        return orig(*args, **kwargs)
      a = sig.bind(*args, **kwargs)
      a.apply_defaults()
      roles = call.next_linears()
      gemms = [call.gemms[r] for r in roles]
      if all(g.recipe is None for g in gemms):  # a plain-bf16 linear: MaxText's kernel, bit for bit
        _count("maxtext")
        return orig(*args, **kwargs)
      _check_call(a.arguments)
      _count("emulated", len(gemms))
      args_ = a.arguments
      return _emulated(gemms, args_["lhs"], args_["rhs"], args_["group_sizes"], args_["preferred_element_type"])
    return gmm

  megablox.gmm = touchpoints.wrap_once(megablox.gmm, make)


def _check_call(a: dict) -> None:
  """One line for a gmm call the emulation does not model (the start-up refusals keep these out)."""
  import jax  # pylint: disable=import-outside-toplevel

  bad = [k for k in ("existing_out", "partial_sum") if a.get(k) is not None]
  bad += [k for k in ("transpose_rhs", "weight_gather_axes", "use_qwix_quantization") if a.get(k)]
  if not all(isinstance(a[k], jax.Array) for k in ("lhs", "rhs")):
    bad.append("pre-quantized operands")
  if a["lhs"].ndim != 2 or a["rhs"].ndim != 3 or a["group_sizes"].shape != (a["rhs"].shape[0],):
    bad.append(f"group_sizes {tuple(a['group_sizes'].shape)} for {a['rhs'].shape[0]} local experts (group offsets)")
  offset = a.get("group_offset")
  if isinstance(offset, int) and offset != 0:
    bad.append(f"group_offset={offset}")
  if bad:
    raise settings_lib.SettingsError(
        f"quantization=nvfp4 with sparse_matmul=true: MaxText's grouped GEMM was called with {', '.join(bad)},"
        " which the emulated per-expert GEMM does not model; set sparse_matmul=false (the MoE einsum path)")


def _device_index():
  """This device's linear index on the manual (shard_map) mesh axes of size > 1, or None on one device."""
  import jax  # pylint: disable=import-outside-toplevel

  mesh = jax.sharding.get_abstract_mesh()
  if mesh.empty:
    return None
  manual = set(getattr(mesh, "manual_axes", ()))
  index = None
  for name in mesh.axis_names:
    size = int(mesh.shape[name])
    if size > 1 and name in manual:
      i = jax.lax.axis_index(name)
      index = i if index is None else index * size + i
  return index


def _emulated(gemms, lhs, rhs, group_sizes, out_dtype):
  """``gmm(lhs, rhs, group_sizes)`` with each expert's GEMM in its planned precision (``gemms``: one per
  column block of ``rhs``: two for a fused ``[wi_0 | wi_1]`` kernel, split evenly as MaxText does)."""
  import jax  # pylint: disable=import-outside-toplevel
  import jax.numpy as jnp  # pylint: disable=import-outside-toplevel

  from maxtext_nvfp4.core import grouped_gemm  # pylint: disable=import-outside-toplevel
  from maxtext_nvfp4.core import prng  # pylint: disable=import-outside-toplevel

  device = _device_index()
  n = rhs.shape[2] // len(gemms)
  outs = []
  for i, g in enumerate(gemms):  # wi_0 and wi_1 of one layer share their plan: both have a recipe
    w = rhs[:, :, i * n:(i + 1) * n] if len(gemms) > 1 else rhs
    training, step, use_switched, key = traced.step_inputs(g.layer, g.role, g.seed, g.recipe, g.switched,
                                                           g.switch_step)
    if device is not None:
      key = prng.fold_in(key, device)
    outs.append(grouped_gemm.ragged_dot(lhs, w, group_sizes, recipe=g.recipe, switched=g.switched,
                                        use_switched=use_switched, key=key, preferred_element_type=out_dtype,
                                        observe=traced.diagnostics_observer(g.recipe, group=g.diag_group,
                                                                            interval=g.diag_interval, step=step,
                                                                            key=key)
                                        if g.diag_group and training else None))
  return outs[0] if len(outs) == 1 else jnp.concatenate(outs, axis=-1)
