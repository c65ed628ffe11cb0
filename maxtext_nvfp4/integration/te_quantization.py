"""``nvfp4_backend=te`` inside MaxText: a subclass of MaxText's ``TransformerEngineQuantization``.

MaxText's ``quantizations.TransformerEngineQuantization`` already wraps
``transformer_engine.jax.dense.dense`` in a Linen module, routes quantizer state through
``_overwrite_with_gradient`` (checkpoint name ``"quantization"``) and picks TE's collective-GEMM ops from
the kernel's mesh axes. The subclass here reuses all of that and changes what
:mod:`maxtext_nvfp4.backends.te` describes: the recipe toggles, the per-GEMM precision plan and the
seeded ``sr_rng`` stream. MaxText internals it relies on (its ``__init__`` is not called; the recipe and
overlap-policy attributes and ``_wrap`` are MaxText's private names) are the MaxText adapter's
(``te_recipe_attr``, ``te_overlap_attr``, ``te_sr_source_stream``, ``touches``). ``base_cls`` is passed in,
so tests can use a fake.
"""

from __future__ import annotations

import copy
from typing import Any, Callable

from maxtext_nvfp4.backends.te import PRECISIONS, TE_SR_RNG_STREAM, check_te_settings, rng_streams_needed, te_recipe
from maxtext_nvfp4.integration import step as step_lib
from maxtext_nvfp4.integration import touchpoints

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


def _te_dense_operands(dims, overlap, generate_collective_op_set, mesh_axes):
  """``dims = (contracting_dims, ((), ()))  ->  (contracting_dims, collective_op_set)`` for TE's ``dense``.

  As MaxText's ``TransformerEngineQuantization.dot_general_cls`` (its ``te_dot_general``) derives them, so that our
  NVFP4 projections take the same path into TE: TE's ``dense`` has no batch dimensions (asserted), and the
  collective-GEMM ops are ``generate_collective_op_set(mesh_axes)`` when ``te_comm_gemm_overlap`` (``overlap``) is
  on, TE's ``noop_collective_op_set`` (plain GEMMs, XLA's own collectives) when it is ``"disabled"``.
  """
  import transformer_engine.jax.cpp_extensions as tex  # pylint: disable=import-outside-toplevel # pytype: disable=import-error

  contracting_dims, batch_dims = dims
  assert batch_dims == ((), ()), "Batch dimensions must be empty for TransformerEngine dot."
  return contracting_dims, (generate_collective_op_set(mesh_axes) if overlap != "disabled"
                            else tex.noop_collective_op_set)


class TeQuantizationMixin:
  """MaxText's TE quantization with our NVFP4 toggles, per-GEMM plan and seeded ``sr_rng``: mixed in before
  MaxText's ``TransformerEngineQuantization`` (``_base_cls``) by :func:`_subclass_of`."""

  # Set on each class _subclass_of composes: MaxText's base class, its private attributes for the recipe and
  # the overlap policy (the adapter's te_recipe_attr / te_overlap_attr), and MaxText's rng stream sr_rng is
  # drawn from (the adapter's te_sr_source_stream).
  _base_cls: type = object
  _recipe_attr: str = ""
  _overlap_attr: str = ""
  _sr_source_stream: str = ""

  # pylint: disable=super-init-not-called
  def __init__(self, config, settings, plan: Callable[[tuple], str]):
    # Not calling MaxText's __init__: it insists on config.quantization == "te_*" and a named recipe.
    self.quant_mode = "train"
    self._settings = settings
    self._plan = plan
    setattr(self, self._recipe_attr, te_recipe("nvfp4", settings))
    # MaxText's TeCommGemmOverlapPolicy is a str enum; "disabled" compares equal to DISABLED.
    setattr(self, self._overlap_attr, getattr(config, "te_comm_gemm_overlap", "disabled"))
    # first step of the late precision switch (None: off)
    self._switch_step = settings.switch_step(getattr(config, "steps", None))

  def _key(self):
    return (self.quant_mode, self._settings, self._plan, self._switch_step)

  def __hash__(self):
    return hash((type(self).__name__,) + self._key())

  def __eq__(self, other):
    return type(other) is type(self) and self._key() == other._key()

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
    seed, stream = int(self._settings.seed), self._sr_source_stream

    class SeededSrRngWrapper(wrapper):  # type: ignore[misc, valid-type]
      """Serves TE's ``sr_rng`` from MaxText's ``aqt`` stream, folded with ``nvfp4_seed``."""

      def make_rng(self, name: str = "params"):
        if name == TE_SR_RNG_STREAM:
          import jax  # pylint: disable=import-outside-toplevel

          return jax.random.fold_in(super().make_rng(stream), seed)
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
      setattr(routed, self._recipe_attr, te_recipe(precision, self._settings))
    elif self._switch_step is not None:
      return self._switched_dot_general_cls(mesh_axes)
    else:
      return self._shared_x_dot_general_cls(mesh_axes)
    # MaxText's implementation: TEWrapper(dense(x, kernel, contracting_dims, quantizer_set, ...)).
    return self._base_cls.dot_general_cls(routed, mesh_axes)

  def _shared_x_dot_general_cls(self, mesh_axes):
    """An NVFP4 projection as MaxText's ``te_dot_general`` builds it, through
    :func:`maxtext_nvfp4.backends.te_shared_dense.dense`: TE's dense whose activation quantization is shared with
    the other projections reading the same input (q/k/v, wi_0/wi_1), identical GEMM operands."""
    overlap = getattr(self, self._overlap_attr)

    def te_dot_general(generate_quantizer_set, generate_collective_op_set, x, kernel, dims, **kwargs):
      del kwargs  # as MaxText's te_dot_general: TE's dense takes no precision arguments
      from maxtext_nvfp4.backends import te_shared_dense  # pylint: disable=import-outside-toplevel

      contracting_dims, collective = _te_dense_operands(dims, overlap, generate_collective_op_set, mesh_axes)
      return te_shared_dense.dense(x, kernel, contracting_dims, generate_quantizer_set(), collective)

    return self._wrap(te_dot_general, "dot_general")

  def _switched_dot_general_cls(self, mesh_axes):
    """An NVFP4 projection with the late switch: ``lax.cond(step >= S, switched, nvfp4)``, both compiled once.

    ``nvfp4``: TE's NVFP4 ``dense``. ``switched``: with ``nvfp4_switch_scope=all`` the whole GEMM in
    ``nvfp4_switch_to`` (TE's ``Float8CurrentScaling`` ``dense``, or the plain ``lax.dot_general`` for
    bf16); with ``forward`` (the paper's recipe) the forward value of that GEMM and the gradients of the
    NVFP4 one, ``y = y_nvfp4 + stop_gradient(y_hp - y_nvfp4)`` in fp32 (exactly ``y_hp`` after the cast:
    the fp32 error is far below half a bf16 ulp). TE's ``dense`` runs one recipe for all three GEMMs, so
    after the switch the forward-only variant also computes the NVFP4 forward, whose residuals feed the
    NVFP4 backward. Both quantizer sets are created outside the cond (module variables and rngs).
    """
    s = self._settings
    after_recipe = None if s.switch_to == "bf16" else te_recipe(s.switch_to, s)
    forward_only = s.switch_scope == "forward"
    switch_step = int(self._switch_step)
    overlap = getattr(self, self._overlap_attr)

    def te_switched_dot_general(generate_quantizer_set, generate_collective_op_set, x, kernel, dims, **kwargs):
      del kwargs  # as MaxText's te_dot_general: TE's dense takes no precision arguments
      import jax  # pylint: disable=import-outside-toplevel
      import jax.numpy as jnp  # pylint: disable=import-outside-toplevel
      import transformer_engine.jax  # pylint: disable=import-outside-toplevel # pytype: disable=import-error

      contracting_dims, collective = _te_dense_operands(dims, overlap, generate_collective_op_set, mesh_axes)
      out_dtype = jnp.result_type(x)

      def dense(quantizer_set):
        return transformer_engine.jax.dense.dense(x, kernel, contracting_dims=contracting_dims,
                                                  quantizer_set=quantizer_set,
                                                  collective_op_set=collective).astype(out_dtype)

      nvfp4_set = generate_quantizer_set()
      if after_recipe is None:
        high = lambda: jax.lax.dot_general(x, kernel, dims).astype(out_dtype)  # noqa: E731
      else:
        after_set = generate_quantizer_set(postfix="_switched", fp8_recipe=after_recipe)
        high = lambda: dense(after_set)  # noqa: E731

      def switched():
        if not forward_only:
          return high()
        y_nv, y_hp = dense(nvfp4_set).astype(jnp.float32), high().astype(jnp.float32)
        return (y_nv + jax.lax.stop_gradient(y_hp - y_nv)).astype(out_dtype)

      step = step_lib.current_step()
      step = jnp.zeros((), jnp.int32) if step is None else jnp.asarray(step, jnp.int32)
      return jax.lax.cond(step >= switch_step, switched, lambda: dense(nvfp4_set))

    return self._wrap(te_switched_dot_general, "dot_general_switched")


_SUBCLASSES: dict[tuple[type, str], type] = {}


def _subclass_of(base_cls: type, sr_source_stream: str) -> type:
  """:class:`TeQuantizationMixin` over ``base_cls``: one class per MaxText base class and stream (stable identity:
  MaxText compares quant objects)."""
  if (base_cls, sr_source_stream) not in _SUBCLASSES:
    facts = touchpoints.adapter()
    _SUBCLASSES[(base_cls, sr_source_stream)] = type(
        "Nvfp4TransformerEngineQuantization", (TeQuantizationMixin, base_cls),
        {"__module__": __name__, "__qualname__": f"Nvfp4TransformerEngineQuantization[{base_cls.__name__}]",
         "_base_cls": base_cls, "_recipe_attr": facts.te_recipe_attr, "_overlap_attr": facts.te_overlap_attr,
         "_sr_source_stream": sr_source_stream})
  return _SUBCLASSES[(base_cls, sr_source_stream)]


def make_te_quantization(base_cls: type, config: Any, settings, plan: Callable[[tuple], str], *,
                         sr_source_stream: str | None = None):
  """An instance of a subclass of ``base_cls`` running our recipe through TE (see module docstring).

  Args:
    base_cls: MaxText's ``maxtext.layers.quantizations.TransformerEngineQuantization``.
    config: the MaxText config (only ``te_comm_gemm_overlap`` is read).
    settings: :class:`maxtext_nvfp4.core.settings.Nvfp4Settings`.
    plan: ``plan(mesh_axes) -> "nvfp4" | "bf16" | "fp8"`` for the projection being built. It is part
      of the object's equality/hash (MaxText builds the quantization object several times per run),
      so pass something that compares equal across calls (e.g. a frozen dataclass with ``__call__``).
    sr_source_stream: MaxText's rng stream TE's ``sr_rng`` is drawn from (default: the installed
      MaxText adapter's ``te_sr_source_stream``).

  Raises:
    BackendError: settings the TE backend does not map (see :func:`check_te_settings`).
  """
  check_te_settings(settings)
  stream = sr_source_stream or touchpoints.adapter().te_sr_source_stream
  return _subclass_of(base_cls, stream)(config, settings, plan)
