"""Gradient fidelity and stability telemetry inside MaxText's training step (``nvfp4_diagnostics``).

The math and the metric keys are :mod:`maxtext_nvfp4.core.stability`'s; this module hooks them into MaxText:

* ``train.loss_fn`` (wrapped, training steps only): with ``nvfp4_diagnostics_grad``, the model's parameters
  pass through an identity ``custom_vjp`` (:func:`_fidelity_tap`) whose backward receives the gradient the
  step trains with. On steps ``step % nvfp4_diagnostics_interval == 0`` (a ``lax.cond`` on the traced step:
  other steps evaluate the predicate only) it computes the high-precision gradient of the same loss, batch and
  parameters -- MaxText's ``loss_fn`` again, traced under :func:`step.reference_pass`, where every emulated
  GEMM is MaxText's plain one -- and reports the per-unit sums. Cost: one more forward and backward pass of the
  model on diagnostic steps only, after the step's own backward (nothing is held across the step). With
  ``gradient_accumulation_steps > 1`` each microbatch is compared with its own reference and the sums pooled.
* ``normalizations.RMSNorm.__call__``: the sum of squares of every input over the model width
  (``emb_dim``), on diagnostic steps.
* ``moe.RoutedMoE.get_topk``: the tokens per expert of every MoE layer, numbered in forward order per trace.

Telemetry is on with ``nvfp4_diagnostics`` for any ``quantization`` (a BF16 or FP8 baseline too, when the
plugin is registered, e.g. ``python -m maxtext_nvfp4.train``); the gradient fidelity needs the emulation
backend (on TE the reference would still run TE's GEMMs: refused with a warning). Nothing is traced when
``nvfp4_diagnostics`` is off. Eval steps and the reference pass itself take no statistic.
"""

from __future__ import annotations

import contextvars
import dataclasses
import functools
import inspect

from maxtext_nvfp4.integration import step as step_lib
from maxtext_nvfp4.integration import touchpoints
from maxtext_nvfp4.integration.log_once import log_once


@dataclasses.dataclass(frozen=True, kw_only=True)
class Telemetry:
  """What the hooks do in the current process (set from the config at each model build)."""

  # nvfp4_diagnostics_interval when nvfp4_diagnostics is on, else 0 (nothing traced)
  interval: int = 0
  # nvfp4_diagnostics_grad (emulation backend only)
  grad: bool = False
  # the model width: RMSNorm inputs of this width are the residual stream
  emb_dim: int = 0
  # MaxText's param_scan_axis (the layer axis of scanned parameters)
  scan_axis: int = 1
  # first / last decoder layer with NVFP4 GEMMs (the groups' _first / _last), as the quantization statistics
  first: int | None = None
  last: int | None = None


_SETTINGS = Telemetry()
# Per trace of a training loss: the MoE layers seen so far ([count]); None outside it.
_MOE_INDEX: contextvars.ContextVar[list | None] = contextvars.ContextVar("maxtext_nvfp4_moe_index", default=None)


def settings() -> Telemetry:
  return _SETTINGS


def configure(config, *, grad_supported: bool) -> Telemetry:
  """Set the hooks' settings from a MaxText ``config`` (its ``nvfp4_diagnostics*`` keys); returns them.

  ``grad_supported``: the GEMMs can run MaxText's plain path in the reference pass (the emulation backend).
  """
  from maxtext_nvfp4.core import settings as settings_lib  # pylint: disable=import-outside-toplevel

  return configure_settings(config, settings_lib.from_config(config), grad_supported=grad_supported)


def configure_settings(config, s, *, grad_supported: bool) -> Telemetry:
  """:func:`configure` with the config's ``nvfp4_*`` settings ``s`` already read (``quantization=nvfp4``)."""
  from maxtext_nvfp4.core import stability as core  # pylint: disable=import-outside-toplevel

  global _SETTINGS
  if not s.diagnostics:
    _SETTINGS = Telemetry()
    return _SETTINGS
  grad = bool(s.diagnostics_grad)
  if grad and not grad_supported:
    log_once("maxtext-nvfp4: nvfp4_diagnostics_grad needs the emulation backend (the reference pass runs"
             " MaxText's plain GEMMs there); no nvfp4/*/dw_* metrics in this run", warn=True)
    grad = False
  num_layers = int(getattr(config, "num_decoder_layers", 1) or 1)
  first, last = int(s.keep_first_layers), num_layers - 1 - int(s.keep_last_layers)
  _SETTINGS = Telemetry(interval=int(s.diagnostics_interval), grad=grad, emb_dim=int(getattr(config, "emb_dim", 0)),
                        scan_axis=int(getattr(config, "param_scan_axis", 1)), first=first, last=last)
  from maxtext_nvfp4.core import diagnostics  # pylint: disable=import-outside-toplevel

  core.STORE.group_of = functools.partial(_group_of, first=first, last=last)
  diagnostics.AGGREGATOR.armed = True  # the metrics writer waits for the step and merges nvfp4/* keys
  what = "residual RMS and MoE load" + (", gradient fidelity (one extra forward+backward)" if grad else "")
  log_once(f"maxtext-nvfp4: stability telemetry on: {what} every {s.diagnostics_interval} steps")
  return _SETTINGS


def _group_of(kind: str, layer, *, first, last) -> str:
  from maxtext_nvfp4.core import diagnostics  # pylint: disable=import-outside-toplevel

  return diagnostics.group_name(kind, layer, first=first, last=last)


def _active() -> bool:
  """Statistics are taken in this trace: telemetry on, a training step, not the reference pass."""
  return (_SETTINGS.interval > 0 and step_lib.current_step() is not None and step_lib.in_train_step()
          and not step_lib.in_reference_pass())


def _when_due(fn, *operands) -> None:
  """``fn(step, *operands)`` on diagnostic steps only (``lax.cond`` on the traced step)."""
  import jax.numpy as jnp  # pylint: disable=import-outside-toplevel
  from jax import lax  # pylint: disable=import-outside-toplevel

  step = jnp.asarray(step_lib.current_step(), jnp.int32)
  lax.cond(step % jnp.int32(_SETTINGS.interval) == 0, fn, lambda *_: None, step, *operands)


# ------------------------------------------------------------------------------------------ telemetry hooks


def patch_rms_norm(normalizations) -> None:
  """Wrap ``RMSNorm.__call__``: report ``sum(x**2)`` of inputs over the model width on diagnostic steps."""
  def make(orig):
    def __call__(self, x, *args, **kwargs):
      if _active() and _SETTINGS.emb_dim and x.shape[-1] == _SETTINGS.emb_dim:
        import jax  # pylint: disable=import-outside-toplevel
        import jax.numpy as jnp  # pylint: disable=import-outside-toplevel
        from maxtext_nvfp4.core import stability as core  # pylint: disable=import-outside-toplevel

        def report(step, xs):
          xf = xs.astype(jnp.float32)
          jax.debug.callback(functools.partial(core.STORE.report_rms, count=xf.size), step, jnp.sum(xf * xf))
        _when_due(report, jax.lax.stop_gradient(x))
      return orig(self, x, *args, **kwargs)
    return __call__

  cls = normalizations.RMSNorm
  cls.__call__ = touchpoints.wrap_once(cls.__call__, make)


def patch_topk(moe) -> None:
  """Wrap ``RoutedMoE.get_topk``: report the tokens per expert of its choices on diagnostic steps."""
  def make(orig):
    def get_topk(self, *args, **kwargs):
      out = orig(self, *args, **kwargs)
      index = _MOE_INDEX.get()
      if index is None or not _active():
        return out
      import jax  # pylint: disable=import-outside-toplevel
      import jax.numpy as jnp  # pylint: disable=import-outside-toplevel
      from maxtext_nvfp4.core import stability as core  # pylint: disable=import-outside-toplevel

      k = index[0]
      index[0] += 1
      n = int(self.num_experts)

      def report(step, chosen):
        # an id outside [0, n) is an unused slot (forced routing's -1): dropped
        counts = jnp.zeros((n,), jnp.int32).at[chosen.ravel()].add(1, mode="drop")
        jax.debug.callback(functools.partial(core.STORE.report_load, index=k), step, counts)
      _when_due(report, jax.lax.stop_gradient(out[1]))
      return out
    return get_topk

  cls = moe.RoutedMoE
  cls.get_topk = touchpoints.wrap_once(cls.get_topk, make)


# ------------------------------------------------------------------------------------------ gradient fidelity


def patch_loss_fn(train) -> None:
  """Wrap ``train.loss_fn`` (MaxText's train_step looks it up at call time): numbers the MoE layers of the
  trace and, with ``nvfp4_diagnostics_grad``, taps the parameters' gradient (module doc)."""
  def make(orig):
    sig = inspect.signature(orig)

    def loss_fn(*args, **kwargs):
      if not _active():
        return orig(*args, **kwargs)
      try:
        a = sig.bind(*args, **kwargs)
      except TypeError:
        return orig(*args, **kwargs)
      a.apply_defaults()
      if not a.arguments.get("is_train", True):
        return orig(*args, **kwargs)
      token = _MOE_INDEX.set([0])
      try:
        if _SETTINGS.grad:
          _fidelity_tap(a.arguments["model"], orig, a.arguments["config"], a.arguments["data"])
        return orig(*a.args, **a.kwargs)
      finally:
        _MOE_INDEX.reset(token)
    return loss_fn

  if hasattr(train, "loss_fn"):  # a __main__ copy still executing may not define it yet (plugin.register)
    train.loss_fn = touchpoints.wrap_once(train.loss_fn, make)


def _path_names(path) -> tuple[str, ...]:
  out = []
  for k in path:
    name = getattr(k, "key", getattr(k, "name", getattr(k, "idx", k)))
    if str(name) != "value":  # a Variable's value leaf
      out.append(str(name))
  return tuple(out)


def zero_cotangent(x):
  """The zero cotangent of a ``custom_vjp`` operand: zeros of a float array, ``float0`` of an integer or key one."""
  import jax  # pylint: disable=import-outside-toplevel
  import jax.numpy as jnp  # pylint: disable=import-outside-toplevel
  import numpy as np  # pylint: disable=import-outside-toplevel

  dtype = getattr(x, "dtype", None)
  if dtype is not None and jnp.issubdtype(dtype, jnp.inexact):
    return jnp.zeros_like(x)
  return np.zeros(np.shape(x), dtype=jax.dtypes.float0)


def fidelity_units(params, scan_axis: int = 1):
  """``(metas, keeps)`` of a parameter pytree's leaves, in ``tree_leaves`` order (core.stability's units)."""
  import jax  # pylint: disable=import-outside-toplevel
  from maxtext_nvfp4.core import stability as core  # pylint: disable=import-outside-toplevel

  metas, keeps = [], []
  for path, leaf in jax.tree_util.tree_flatten_with_path(params)[0]:
    names = _path_names(path)
    role = core.param_role(names, leaf.ndim, scan_axis=scan_axis)
    keep = core.unit_axes(role)
    axes = tuple("layer" if a == role.layer_axis else "expert" for a in keep)
    metas.append(core.UnitMeta(name="/".join(names), kind=role.kind, axes=axes, layer=role.layer))
    keeps.append(keep)
  return tuple(metas), tuple(keeps)


def tapped(params, aux, *, reference_grads, metas, keeps, interval: int):
  """``params`` through an identity whose backward reports, on steps ``aux[-1] % interval == 0``, the fidelity
  sums of the incoming gradient against ``reference_grads(params, *aux[:-1])`` (same pytree) to
  :data:`maxtext_nvfp4.core.stability.STORE`. ``aux``: further operands of the reference (arrays), the traced
  step last. The reference is computed in the backward pass, so nothing is kept alive across the step."""
  import jax  # pylint: disable=import-outside-toplevel
  import jax.numpy as jnp  # pylint: disable=import-outside-toplevel
  from jax import lax  # pylint: disable=import-outside-toplevel
  from maxtext_nvfp4.core import stability as core  # pylint: disable=import-outside-toplevel

  @jax.custom_vjp
  def tap(p, aux_):
    del aux_
    return p

  def fwd(p, aux_):
    return p, (p, aux_)

  def bwd(res, g):
    p, aux_ = res
    step = aux_[-1]

    def report(step, g, p, rest):
      r = reference_grads(p, *rest)
      gl, rl = jax.tree_util.tree_leaves(g), jax.tree_util.tree_leaves(r)
      sums = [core.grad_sums(a, b, keep) for a, b, keep in zip(gl, rl, keeps)]
      jax.debug.callback(functools.partial(core.STORE.report_grads, metas=metas), step, sums)

    lax.cond(jnp.asarray(step, jnp.int32) % jnp.int32(interval) == 0, report, lambda *_: None,
             step, lax.stop_gradient(g), p, aux_[:-1])
    return g, jax.tree_util.tree_map(zero_cotangent, aux_)

  tap.defvjp(fwd, bwd)
  return tap(params, aux)


def _fidelity_tap(model, orig_loss_fn, config, data) -> None:
  """Route ``model``'s parameters through :func:`tapped` (in place: the caller's local copy of the model)."""
  import jax  # pylint: disable=import-outside-toplevel
  import jax.numpy as jnp  # pylint: disable=import-outside-toplevel
  from flax import nnx  # pylint: disable=import-outside-toplevel

  if not isinstance(model, nnx.Module):
    log_once("maxtext-nvfp4: nvfp4_diagnostics_grad needs MaxText's NNX model in loss_fn; no gradient fidelity",
             warn=True)
    return
  graphdef, params, rest = nnx.split(model, nnx.Param, ...)
  metas, keeps = fidelity_units(params, _SETTINGS.scan_axis)

  def reference_grads(p, rest_, data_):
    def loss(pp):
      with step_lib.reference_pass():
        local = nnx.merge(graphdef, pp, rest_, copy=True)
        value, _ = orig_loss_fn(local, config, data_, None, None, is_train=True)
      return value
    return jax.grad(loss)(p)

  step = jnp.asarray(step_lib.current_step(), jnp.int32)
  out = tapped(params, (rest, data, step), reference_grads=reference_grads, metas=metas, keeps=keeps,
               interval=_SETTINGS.interval)
  nnx.update(model, out)
