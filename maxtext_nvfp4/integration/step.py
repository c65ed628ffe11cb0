"""The training step being traced, published to the NVFP4 GEMMs (stochastic-rounding key, late switch).

MaxText's ``train_step`` / ``eval_step`` are wrapped (:func:`with_step`, installed by
:mod:`maxtext_nvfp4.integration.plugin`) to publish ``state.optimizer.step`` -- the step being computed,
a traced int scalar -- in a context variable that the emulated dot_general reads at trace time.
``train_step`` also marks the trace as a training step, the only place diagnostics are taken.

:func:`reference_pass` marks the high-precision pass of the gradient-fidelity diagnostic
(:mod:`maxtext_nvfp4.integration.stability`): inside it every emulated GEMM runs as MaxText's plain GEMM and
no statistic is taken.
"""

from __future__ import annotations

import contextlib
import contextvars
import inspect
from typing import Any

from maxtext_nvfp4.integration import touchpoints

# The training step being traced (a traced int scalar inside train_step/eval_step), else None.
_STEP: contextvars.ContextVar[Any] = contextvars.ContextVar("maxtext_nvfp4_step", default=None)
# True while a (wrapped) train_step is traced: NVFP4 diagnostics are taken there only (not in eval_step).
_TRAINING: contextvars.ContextVar[bool] = contextvars.ContextVar("maxtext_nvfp4_training", default=False)
# True while the gradient-fidelity diagnostic traces its high-precision reference pass.
_REFERENCE: contextvars.ContextVar[bool] = contextvars.ContextVar("maxtext_nvfp4_reference", default=False)


def current_step() -> Any:
  """The step published by the wrapped ``train_step``/``eval_step`` being traced, or None outside them."""
  return _STEP.get()


def in_train_step() -> bool:
  """Whether the code being traced is inside a wrapped ``train_step`` (see :func:`step_context`)."""
  return _TRAINING.get()


def in_reference_pass() -> bool:
  """Whether the code being traced is the gradient-fidelity diagnostic's high-precision pass: every
  emulated GEMM is then MaxText's plain one (the path of ``recipe is None``) and no statistic is taken."""
  return _REFERENCE.get()


@contextlib.contextmanager
def reference_pass():
  """Trace the block as the high-precision reference pass (see :func:`in_reference_pass`)."""
  token = _REFERENCE.set(True)
  try:
    yield
  finally:
    _REFERENCE.reset(token)


@contextlib.contextmanager
def step_context(step, training: bool = False):
  """Publish ``step`` (int or traced int scalar) to the NVFP4 dot_generals traced inside the block.

  ``training``: the block is a training step (diagnostics, when enabled, are taken only there).
  """
  token = _STEP.set(step)
  token_t = _TRAINING.set(bool(training))
  try:
    yield
  finally:
    _TRAINING.reset(token_t)
    _STEP.reset(token)


def _state_step(state) -> Any:
  """``state.optimizer.step`` of MaxText's NNX train state (pure ``nnx.State``), or None."""
  for path in (("optimizer", "step"), ("step",)):  # TrainStateNNX; DiLoCo's outer state
    node = state
    try:
      for k in path:
        node = node[k]
    except (KeyError, TypeError, AttributeError):
      continue
    if hasattr(node, "get_value"):
      node = node.get_value()
    return getattr(node, "value", node)
  return None


def with_step(fn, training: bool = False):
  """Wrap a MaxText ``train_step``/``eval_step`` so the step of its ``state`` argument is published."""
  sig = inspect.signature(fn)

  def make(orig):
    def wrapped(*args, **kwargs):
      try:
        state = sig.bind_partial(*args, **kwargs).arguments.get("state")
      except TypeError:
        state = None
      with step_context(None if state is None else _state_step(state), training=training):
        return orig(*args, **kwargs)
    return wrapped

  return touchpoints.wrap_once(fn, make)
