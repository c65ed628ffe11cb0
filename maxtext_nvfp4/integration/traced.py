"""What an emulated GEMM reads while MaxText traces it: the step, the late switch, its SR key (and a count).

:func:`step_inputs` is shared by every emulated GEMM path (the Linen dot_general, RoutedMoE's expert
einsums, the sparse path's grouped GEMM). :func:`traced_gemms` counts, at trace time only (no runtime
cost), which decoder GEMMs really took the NVFP4/FP8 path inside train/eval steps, and that the step is
traced once, not once per step.
"""

from __future__ import annotations

import collections
import threading

from maxtext_nvfp4.core import plan as plan_lib
from maxtext_nvfp4.integration import step as step_lib



class TraceCounter:
  """A thread-safe ``collections.Counter`` of trace-time events, read (and optionally reset) as a copy."""

  def __init__(self):
    self._lock = threading.Lock()
    self._counts: collections.Counter = collections.Counter()

  def add(self, key, n: int = 1) -> None:
    with self._lock:
      self._counts[key] += n

  def read(self, reset: bool = False) -> collections.Counter:
    with self._lock:
      out = collections.Counter(self._counts)
      if reset:
        self._counts.clear()
    return out


# (layer, role, before-switch passes, after-switch passes or None) -> traces inside a train/eval step
_traced = TraceCounter()


def passes(recipe):
  """``(fprop, dgrad, wgrad)`` of a GemmRecipe, or None."""
  return None if recipe is None else (recipe.fprop, recipe.dgrad, recipe.wgrad)


def traced_gemms(reset: bool = False) -> collections.Counter:
  """Emulated decoder GEMMs traced inside train/eval steps since the last reset (see ``_traced``)."""
  return _traced.read(reset)


def step_inputs(layer, role, seed, recipe, switched, switch_step):
  """``(training, step, use_switched, SR key)`` of an emulated GEMM being traced (and counts the GEMM).

  Outside MaxText's train/eval step (DenseGeneral's dummy call at model build, plain model applies) the
  step is 0. Not warned about: every model build makes such a call.
  """
  import jax.numpy as jnp  # pylint: disable=import-outside-toplevel

  step = step_lib.current_step()
  if step is not None:
    _traced.add((layer, role, passes(recipe), passes(switched)))
  training = step is not None and step_lib.in_train_step()
  step = jnp.zeros((), jnp.int32) if step is None else jnp.asarray(step, jnp.int32)
  use_switched = None if switched is None else step >= switch_step
  return training, step, use_switched, plan_lib.sr_key(seed, step, layer, role)


def diagnostics_observer(recipe, *, group: str, interval: int, step, key):
  """``observe(lhs, rhs, dimension_numbers, y) -> y``: :func:`maxtext_nvfp4.core.diagnostics.instrument` of one
  traced GEMM (dense, or the experts' batched one) with its recipe's operand settings, reporting to ``group``."""
  from maxtext_nvfp4.core import diagnostics  # pylint: disable=import-outside-toplevel

  def observe(lhs, rhs, dimension_numbers, y):
    return diagnostics.instrument(lhs, rhs, dimension_numbers, y, step=step, interval=interval, group=group,
                                  two_d_weights=recipe.two_d_weights, stochastic=recipe.stochastic_rounding,
                                  key=key, x_rule=recipe.scale_rule("activation"),
                                  w_rule=recipe.scale_rule("weight"))
  return observe
