"""``nvfp4_backend=te`` inside MaxText: a subclass of MaxText's ``TransformerEngineQuantization``.

MaxText 0.2.5's ``quantizations.TransformerEngineQuantization`` already wraps
``transformer_engine.jax.dense.dense`` in a Linen module, routes quantizer state through
``_overwrite_with_gradient`` (checkpoint name ``"quantization"``) and picks TE's collective-GEMM ops from
the kernel's mesh axes. The subclass here reuses all of that and changes what
:mod:`maxtext_nvfp4.backends.te` describes: the recipe toggles, the per-GEMM precision plan and the
seeded ``sr_rng`` stream. MaxText internals it relies on (its ``__init__`` is not called; ``_recipe``,
``_te_comm_gemm_overlap_policy`` and ``_wrap`` are MaxText's private names) are listed in
:data:`maxtext_nvfp4.integration.touchpoints.TOUCHES`. ``base_cls`` is passed in, so tests can use a fake.
"""

from __future__ import annotations

import copy
from typing import Any, Callable

from maxtext_nvfp4.backends.te import (PRECISIONS, SR_RNG_SOURCE_STREAM, TE_SR_RNG_STREAM, check_te_settings,
                                       rng_streams_needed, te_recipe)

_PLAIN_CLS: list[Any] = []


def plain_dot_general_cls():
  """A Linen module computing ``lax.dot_general`` unchanged: the ``bf16`` GEMMs (no TE involved).

  Called like every MaxText quantized dot_general: ``module(lhs, rhs, dimension_numbers,
  precision=None, preferred_element_type=None)``.
  """
  if not _PLAIN_CLS:
    import flax.linen as nn  # pylint: disable=import-outside-toplevel
    import jax  # pylint: disable=import-outside-toplevel

    class PlainDotGeneral(nn.Module):
      """Unquantized GEMM for projections the plan keeps in high precision."""

      @nn.compact
      def __call__(self, lhs, rhs, dimension_numbers, precision=None, preferred_element_type=None, **kwargs):
        del kwargs  # MaxText may pass extra keywords (e.g. for AQT); none apply here
        return jax.lax.dot_general(
            lhs, rhs, dimension_numbers, precision=precision, preferred_element_type=preferred_element_type
        )

    _PLAIN_CLS.append(PlainDotGeneral)
  return _PLAIN_CLS[0]


_SUBCLASSES: dict[type, type] = {}


def _subclass_of(base_cls: type) -> type:
  """One adapter class per MaxText base class (stable identity: MaxText compares quant objects)."""
  if base_cls in _SUBCLASSES:
    return _SUBCLASSES[base_cls]

  class Nvfp4TransformerEngineQuantization(base_cls):  # type: ignore[misc, valid-type]
    """MaxText's TE quantization with our NVFP4 toggles, per-GEMM plan and seeded ``sr_rng``."""

    # pylint: disable=super-init-not-called
    def __init__(self, config, settings, plan: Callable[[tuple], str]):
      # Not calling base_cls.__init__: it insists on config.quantization == "te_*" and a named recipe.
      self.quant_mode = "train"
      self._settings = settings
      self._plan = plan
      self._recipe = te_recipe("nvfp4", settings)
      # MaxText's TeCommGemmOverlapPolicy is a str enum; "disabled" compares equal to DISABLED.
      self._te_comm_gemm_overlap_policy = getattr(config, "te_comm_gemm_overlap", "disabled")

    def __hash__(self):
      return hash((type(self).__name__, self.quant_mode, self._settings, self._plan))

    def __eq__(self, other):
      return (
          type(other) is type(self)
          and (self.quant_mode, self._settings, self._plan) == (other.quant_mode, other._settings, other._plan)
      )

    @property
    def needs_apply_rngs(self) -> bool:
      return bool(rng_streams_needed(self._settings))

    @property
    def settings(self):
      return self._settings

    def precision_for(self, mesh_axes=()) -> str:
      p = self._plan(tuple(mesh_axes))
      if p not in PRECISIONS:
        raise ValueError(f"plan({tuple(mesh_axes)!r}) returned {p!r}; expected one of {', '.join(PRECISIONS)}")
      return p

    def _wrap(self, f, name=None):
      wrapper = super()._wrap(f, name)
      seed = int(self._settings.seed)

      class SeededSrRngWrapper(wrapper):  # type: ignore[misc, valid-type]
        """Serves TE's ``sr_rng`` from MaxText's ``aqt`` stream, folded with ``nvfp4_seed``."""

        def make_rng(self, name: str = "params"):
          if name == TE_SR_RNG_STREAM:
            import jax  # pylint: disable=import-outside-toplevel

            return jax.random.fold_in(super().make_rng(SR_RNG_SOURCE_STREAM), seed)
          return super().make_rng(name)

      SeededSrRngWrapper.__name__ = wrapper.__name__
      SeededSrRngWrapper.__qualname__ = wrapper.__qualname__
      return SeededSrRngWrapper

    def dot_general_cls(self, mesh_axes=()):
      precision = self.precision_for(mesh_axes)
      if precision == "bf16":
        return plain_dot_general_cls()
      routed = self
      if precision != "nvfp4":
        routed = copy.copy(self)
        routed._recipe = te_recipe(precision, self._settings)  # pylint: disable=protected-access
      # MaxText's implementation: TEWrapper(dense(x, kernel, contracting_dims, quantizer_set, ...)).
      return base_cls.dot_general_cls(routed, mesh_axes)

  Nvfp4TransformerEngineQuantization.__qualname__ = f"Nvfp4TransformerEngineQuantization[{base_cls.__name__}]"
  _SUBCLASSES[base_cls] = Nvfp4TransformerEngineQuantization
  return Nvfp4TransformerEngineQuantization


def make_te_quantization(base_cls: type, config: Any, settings, plan: Callable[[tuple], str]):
  """An instance of a subclass of ``base_cls`` running our recipe through TE (see module docstring).

  Args:
    base_cls: MaxText's ``maxtext.layers.quantizations.TransformerEngineQuantization``.
    config: the MaxText config (only ``te_comm_gemm_overlap`` is read).
    settings: :class:`maxtext_nvfp4.core.settings.Nvfp4Settings`.
    plan: ``plan(mesh_axes) -> "nvfp4" | "bf16" | "fp8"`` for the projection being built. It is part
      of the object's equality/hash (MaxText builds the quantization object several times per run),
      so pass something that compares equal across calls (e.g. a frozen dataclass with ``__call__``).

  Raises:
    BackendError: settings the TE backend does not map (see :func:`check_te_settings`).
  """
  check_te_settings(settings)
  return _subclass_of(base_cls)(config, settings, plan)
