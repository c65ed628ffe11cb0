"""MaxText 0.2.5 integration: the ONLY module that touches MaxText internals (one file to review on upgrade).

What :func:`register` changes (idempotent; each patch is applied when its MaxText module is first
imported, or immediately if it already is, so ``import maxtext_nvfp4`` stays cheap):

* ``maxtext.configs.types``: ``QuantizationType`` gains the member ``NVFP4 = "nvfp4"`` (in place, so every
  entry point accepts ``quantization: nvfp4``); ``MaxTextConfig`` schema rebuilt.
* ``maxtext.configs.pyconfig._initialize_pydantic`` (used by ``initialize`` and ``initialize_pydantic``):
  validates with :data:`Nvfp4MaxTextConfig` (``MaxTextConfig`` + every ``nvfp4_*`` key of
  :mod:`maxtext_nvfp4.settings`, choices as ``Literal`` so the error lists them), turns pydantic errors on
  our keys into one line, then runs :func:`settings.validate` (num_layers, steps, scan_layers) and the
  backend choice, all before any compilation. Errors flow through MaxText's ``_handle_config_exception``
  ("MAXTEXT CONFIG ERROR: ...", exit code 2; re-raised under pytest).
* ``maxtext.layers.quantizations.configure_quantization``: returns our Quantization object for
  ``quantization=nvfp4`` and delegates every other value to MaxText unchanged.
* ``maxtext.trainers.pre_train.train.train_step`` / ``eval_step``: wrapped to publish the traced training
  step (``state.optimizer.step``, the step being computed) in a context variable read at trace time by
  the NVFP4 dot_general (stochastic-rounding key and late precision switch); ``train_step`` also marks
  the trace as a training step (the only place diagnostics are taken).
* ``maxtext.common.metric_logger.MetricLogger`` (class methods, in place):
  - ``write_metrics``: for ``train`` records, merges the ``nvfp4/*`` diagnostics reported for that step
    (``nvfp4_diagnostics``, see :mod:`maxtext_nvfp4.diagnostics` and docs/diagnostics.md) into
    ``metrics["scalar"]`` before MaxText logs/writes them (metrics file, TensorBoard, GCS, wandb);
  - ``write_metrics_locally``: MaxText truncates ``metrics_file`` at every record with step 0, including
    eval records (every eval's first running-eval snapshot, the eval after train step 0), deleting the
    training records written so far. Now a logger truncates once, at its first record if that has step
    0 and the run starts at step 0 (a fresh run); every other record is appended.

Per-GEMM identity. MaxText builds each decoder layer's DenseGenerals in order (layers_0..N-1 when
``scan_layers=false``; Attention query, key, value, out, then MLP wi_0, wi_1, wo) and calls
``quant.dot_general_cls(mesh_axes=kernel_axes)`` once per projection. The kernel axes name the
projection up to repeats inside a layer (key/value and wi_0/wi_1 share axes), so the k-th call with a
given axes signature is role ``roles[k % m]`` of layer ``(k // m) % num_layers`` (``m`` = projections
per layer with that signature). ``configure_quantization`` runs several times per run; every call gives a
fresh object with fresh counts. With ``scan_layers=true`` one module stands for all layers: layer is None.

Stochastic-rounding key: ``fold_in(fold_in(fold_in(key(nvfp4_seed), step), layer), ROLE_IDS[role])``
(threefry; the layer fold is skipped for scanned layers, so SR then varies by step and role only). It
depends on nothing but the step in the (restored) train state, so a resumed run draws the same bits.
"""

from __future__ import annotations

import collections
import contextlib
import contextvars
import dataclasses
import functools
import importlib.abc
import inspect
import logging
import sys
import threading
from typing import Any, Literal

from maxtext_nvfp4 import plan as plan_lib
from maxtext_nvfp4 import settings as settings_lib

_log = logging.getLogger("maxtext_nvfp4")

QUANTIZATION = "nvfp4"

_TYPES = "maxtext.configs.types"
_PYCONFIG = "maxtext.configs.pyconfig"
_QUANTIZATIONS = "maxtext.layers.quantizations"
_TRAIN = "maxtext.trainers.pre_train.train"
_METRIC_LOGGER = "maxtext.common.metric_logger"

# ---------------------------------------------------------------------------------------------------
# Step context
# ---------------------------------------------------------------------------------------------------

# Guards the log-once set and the traced-GEMM counter.
_log_lock = threading.Lock()
# The training step being traced (a traced int scalar inside train_step/eval_step), else None.
_STEP: contextvars.ContextVar[Any] = contextvars.ContextVar("maxtext_nvfp4_step", default=None)
# True while a (wrapped) train_step is traced: NVFP4 diagnostics are taken there only (not in eval_step).
_TRAINING: contextvars.ContextVar[bool] = contextvars.ContextVar("maxtext_nvfp4_training", default=False)


def current_step() -> Any:
  """The step published by the wrapped ``train_step``/``eval_step`` being traced, or None outside them."""
  return _STEP.get()


def in_train_step() -> bool:
  """Whether the code being traced is inside a wrapped ``train_step`` (see :func:`step_context`)."""
  return _TRAINING.get()


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


def _with_step(fn, training: bool = False):
  """Wrap a MaxText ``train_step``/``eval_step`` so the step of its ``state`` argument is published."""
  if getattr(fn, "_maxtext_nvfp4_wrapped", None) is not None:
    return fn
  sig = inspect.signature(fn)

  @functools.wraps(fn)
  def wrapped(*args, **kwargs):
    try:
      state = sig.bind_partial(*args, **kwargs).arguments.get("state")
    except TypeError:
      state = None
    with step_context(None if state is None else _state_step(state), training=training):
      return fn(*args, **kwargs)

  wrapped._maxtext_nvfp4_wrapped = fn  # pylint: disable=protected-access
  return wrapped


# ---------------------------------------------------------------------------------------------------
# Config schema
# ---------------------------------------------------------------------------------------------------

_PY_TYPES = {"bool": bool, "int": int, "float": float, "str": str}
Nvfp4MaxTextConfig: Any = None  # built on registration: MaxTextConfig + the nvfp4_* keys


def _field_annotations() -> dict[str, Any]:
  """``{config key: annotation}``: ``Literal[choices]`` for enumerated keys, else the settings type."""
  out = {}
  for f in dataclasses.fields(settings_lib.Nvfp4Settings):
    choices = settings_lib.CHOICES.get(f.name)
    typ = f.type if isinstance(f.type, type) else _PY_TYPES[str(f.type)]
    out[settings_lib.config_key(f.name)] = Literal[choices] if choices else typ
  return out


def _patch_types(types) -> None:
  qt = types.QuantizationType
  if QUANTIZATION not in qt._value2member_map_:  # pylint: disable=protected-access
    # Extend the str-Enum in place (a subclass/replacement would break `is`/== checks elsewhere).
    member = str.__new__(qt, QUANTIZATION)
    member._name_ = "NVFP4"  # pylint: disable=protected-access
    member._value_ = QUANTIZATION  # pylint: disable=protected-access
    member._sort_order_ = len(qt._member_names_)  # pylint: disable=protected-access
    member.__objclass__ = qt
    qt._member_map_["NVFP4"] = member  # pylint: disable=protected-access
    qt._value2member_map_[QUANTIZATION] = member  # pylint: disable=protected-access
    qt._member_names_.append("NVFP4")  # pylint: disable=protected-access
    type.__setattr__(qt, "NVFP4", member)
    types.MaxTextConfig.model_rebuild(force=True)

  global Nvfp4MaxTextConfig
  if Nvfp4MaxTextConfig is None:
    import pydantic  # pylint: disable=import-outside-toplevel

    defaults = settings_lib.config_keys()
    fields = {
        key: (ann, pydantic.Field(defaults[key], description=settings_lib.KEY_HELP[settings_lib.field_of_key(key)]))
        for key, ann in _field_annotations().items()
    }
    Nvfp4MaxTextConfig = pydantic.create_model("Nvfp4MaxTextConfig", __base__=types.MaxTextConfig, **fields)


def _is_nvfp4(config) -> bool:
  q = getattr(config, "quantization", "")
  return str(getattr(q, "value", q)) == QUANTIZATION


def _one_line_error(e) -> Exception | None:
  """A pydantic ValidationError on ``quantization``/``nvfp4_*`` as one line (key=value: allowed), or None."""
  ours = [err for err in e.errors() if err.get("loc") and str(err["loc"][0]).startswith(("nvfp4_", "quantization"))]
  if not ours:
    return None
  parts = [f"{err['loc'][0]}={err.get('input')!r}: {err['msg']}" for err in ours]
  return settings_lib.SettingsError("; ".join(parts))


def settings_of(config) -> settings_lib.Nvfp4Settings:
  """The :class:`Nvfp4Settings` of a MaxText config (HyperParameters or pydantic config)."""
  return settings_lib.from_config(config)


def _backend_choice(s: settings_lib.Nvfp4Settings):
  """``capability.choose_backend(nvfp4_backend)``; without the capability module: emulate."""
  try:
    from maxtext_nvfp4 import capability  # pylint: disable=import-outside-toplevel
  except ImportError:
    if s.backend == "te":
      raise settings_lib.SettingsError("nvfp4_backend=te is not available in this build; use emulate or auto") from None
    return None
  return capability.choose_backend(s.backend)


def validate_config(config) -> None:
  """Cross-key checks for ``quantization=nvfp4`` (one-line :class:`SettingsError`/``BackendError``)."""
  if not _is_nvfp4(config):
    return
  s = settings_of(config)
  settings_lib.validate(s, num_layers=config.num_decoder_layers, steps=config.steps, scan_layers=config.scan_layers)
  if config.use_qwix_quantization:
    raise settings_lib.SettingsError(
        "quantization=nvfp4 with use_qwix_quantization=true: the NVFP4 plugin does not use qwix; set"
        " use_qwix_quantization=false")
  _backend_choice(s)


def _patch_pyconfig(pyconfig) -> None:
  from maxtext.configs import types  # pylint: disable=import-outside-toplevel

  _patch_types(types)
  orig = pyconfig._initialize_pydantic  # pylint: disable=protected-access
  if getattr(orig, "_maxtext_nvfp4_wrapped", None) is not None:
    return
  import pydantic  # pylint: disable=import-outside-toplevel

  @functools.wraps(orig)
  def _initialize_pydantic(argv=None, config_class=types.MaxTextConfig, **kwargs):
    if config_class is types.MaxTextConfig:
      config_class = Nvfp4MaxTextConfig
    try:
      config = orig(argv, config_class=config_class, **kwargs)
    except pydantic.ValidationError as e:
      short = _one_line_error(e)
      if short is None:
        raise
      raise short from None
    validate_config(config)
    return config

  _initialize_pydantic._maxtext_nvfp4_wrapped = orig  # pylint: disable=protected-access
  pyconfig._initialize_pydantic = _initialize_pydantic  # pylint: disable=protected-access


# ---------------------------------------------------------------------------------------------------
# Quantization object and its Linen dot_general
# ---------------------------------------------------------------------------------------------------

# kernel axes of a decoder projection -> the roles sharing that signature inside one layer, in
# construction order (maxtext_internals.md §1.4; filled per config for the MLP up-projections).
_SIGNATURES = {
    ("embed_attn", "q_heads", "kv"): ("query",),
    ("embed_attn", "kv_heads", "kv_head_dim"): ("key", "value"),
    ("embed_attn", "heads", "kv"): ("qkv_proj",),
    ("heads", "kv", "embed_attn"): ("out",),
    ("embed", "num_activations", "mlp"): ("wi",),
    ("mlp", "embed"): ("wo",),
}


def _signature_roles(mesh_axes, num_activations: int) -> tuple[str, ...]:
  axes = tuple(mesh_axes)
  if axes == ("embed", "mlp"):
    return ("wi",) if num_activations == 1 else tuple(f"wi_{i}" for i in range(num_activations))
  if axes in _SIGNATURES:
    return _SIGNATURES[axes]
  raise settings_lib.SettingsError(
      f"quantization=nvfp4 cannot identify the decoder projection with kernel axes {axes!r} (supported: the"
      " llama2/default decoder blocks' query/key/value/out/wi/wo; ici_context_autoregressive_parallelism=1)")


def _locate(counts: dict, mesh_axes, *, num_activations: int, num_layers: int,
            scan_layers: bool) -> tuple[int | None, str]:
  """(layer, role) of the next projection with ``mesh_axes``; ``counts`` is the per-signature counter."""
  roles = _signature_roles(mesh_axes, num_activations)
  sig = tuple(mesh_axes)
  k = counts.get(sig, 0)
  counts[sig] = k + 1
  role = roles[k % len(roles)]
  layer = None if scan_layers else (k // len(roles)) % num_layers
  return layer, role


@dataclasses.dataclass(frozen=True, kw_only=True)
class TePlan:
  """``plan(mesh_axes) -> "nvfp4" | "bf16" | "fp8"`` for ``te_backend`` (same layer/role logic as emulate).

  Equal across MaxText's repeated ``configure_quantization`` calls (the counter is not compared).
  """

  # the run's NVFP4 settings
  settings: settings_lib.Nvfp4Settings
  # config.num_decoder_layers
  num_layers: int
  # len(config.mlp_activations)
  num_activations: int = 2
  # config.scan_layers
  scan_layers: bool = False
  # dot_general_cls calls per kernel-axes signature
  counts: dict = dataclasses.field(default_factory=dict, compare=False, hash=False, repr=False)

  def __call__(self, mesh_axes) -> str:
    layer, role = _locate(self.counts, mesh_axes, num_activations=self.num_activations,
                          num_layers=self.num_layers, scan_layers=self.scan_layers)
    before, _ = plan_lib.precisions(self.settings, layer=layer, role=role, num_layers=self.num_layers)
    return before.fprop


def sr_key(seed: int, step, layer: int | None, role: str):
  """``fold_in(fold_in(fold_in(key(seed), step), layer), ROLE_IDS[role])`` (threefry; no layer fold if None)."""
  import jax  # pylint: disable=import-outside-toplevel
  import jax.numpy as jnp  # pylint: disable=import-outside-toplevel

  key = jax.random.key(seed, impl="threefry2x32")
  key = jax.random.fold_in(key, jnp.asarray(step, jnp.uint32))
  if layer is not None:
    key = jax.random.fold_in(key, layer)
  return jax.random.fold_in(key, plan_lib.ROLE_IDS[role])


# (layer, role, before-switch passes, after-switch passes or None) -> how many times a train/eval step
# traced that GEMM through the emulation. Trace-time only (no runtime cost): it shows which decoder
# GEMMs really take the NVFP4/FP8 path and that the step is traced once, not once per step.
_traced: collections.Counter = collections.Counter()


def _passes(recipe):
  return None if recipe is None else (recipe.fprop, recipe.dgrad, recipe.wgrad)


def _note_traced(layer, role, recipe, switched) -> None:
  with _log_lock:
    _traced[(layer, role, _passes(recipe), _passes(switched))] += 1


def traced_gemms(reset: bool = False) -> collections.Counter:
  """Emulated decoder GEMMs traced inside train/eval steps since the last reset (see ``_traced``)."""
  with _log_lock:
    out = collections.Counter(_traced)
    if reset:
      _traced.clear()
  return out


@functools.cache
def _linen_module_class():
  """The Linen module MaxText's DenseGeneral wraps (built lazily: flax is imported only when used)."""
  import flax.linen as nn  # pylint: disable=import-outside-toplevel
  import jax  # pylint: disable=import-outside-toplevel
  import jax.numpy as jnp  # pylint: disable=import-outside-toplevel

  class Nvfp4DotGeneral(nn.Module):
    """``dot_general(lhs=activations, rhs=kernel)`` of one decoder projection, in its planned precision.

    ``recipe is None`` means every pass is BF16 before and after the switch: the plain
    ``lax.dot_general`` MaxText runs unquantized. Otherwise ``gemm.dot_general`` with the recipe, the
    switched recipe selected by ``step >= switch_step`` (traced: one compile for the whole run), and
    the SR key of (seed, step, layer, role). No variables: the checkpoint is unchanged.
    """

    # GemmRecipe before the switch, or None for plain BF16
    recipe: Any = None
    # GemmRecipe from switch_step on, or None (switch off)
    switched: Any = None
    # first step that uses `switched`
    switch_step: int | None = None
    # decoder layer index (None: scanned layers)
    layer: int | None = None
    # projection role (query, key, value, out, wi_0, wi_1, wo, ...)
    role: str = ""
    # nvfp4_seed
    seed: int = 0
    # diagnostics aggregation group (diagnostics.group_name), or None: no diagnostics (the normal path)
    diag_group: str | None = None
    # nvfp4_diagnostics_interval: statistics on steps with step % diag_interval == 0
    diag_interval: int = 1

    @nn.compact
    def __call__(self, lhs, rhs, dimension_numbers, precision=None, preferred_element_type=None, **kwargs):
      del kwargs  # e.g. MaxText's mutable=["aqt"] is consumed by Linen apply, nothing else is expected
      # recipe None: plain BF16. Initializing: DenseGeneral's dummy lazy_init call, whose output is
      # discarded (no variables to create), so skip the emulation's cost (same shape and dtype).
      if self.recipe is None or self.is_initializing():
        return jax.lax.dot_general(lhs, rhs, dimension_numbers, precision=precision,
                                   preferred_element_type=preferred_element_type)
      from maxtext_nvfp4 import gemm  # pylint: disable=import-outside-toplevel

      step = current_step()
      if step is not None:
        _note_traced(self.layer, self.role, self.recipe, self.switched)
      # else: outside MaxText's train/eval step (DenseGeneral's dummy call at model build, plain model
      # applies): step 0. Not warned about: every model build makes such a call.
      training = step is not None and in_train_step()
      step = jnp.zeros((), jnp.int32) if step is None else jnp.asarray(step, jnp.int32)
      use_switched = None if self.switched is None else step >= self.switch_step
      key = sr_key(self.seed, step, self.layer, self.role)
      out = gemm.dot_general(lhs, rhs, dimension_numbers, recipe=self.recipe, switched=self.switched,
                             use_switched=use_switched, key=key, preferred_element_type=preferred_element_type)
      if self.diag_group is None or not training:
        return out  # trace-time decision: without diagnostics the traced GEMM is exactly the one above
      from maxtext_nvfp4 import diagnostics  # pylint: disable=import-outside-toplevel

      return diagnostics.instrument(lhs, rhs, dimension_numbers, out, step=step, interval=self.diag_interval,
                                    group=self.diag_group, two_d_weights=self.recipe.two_d_weights,
                                    stochastic=self.recipe.stochastic_rounding, key=key)

  return Nvfp4DotGeneral


def _plain_bf16(recipe) -> bool:
  return recipe is None or (recipe.fprop, recipe.dgrad, recipe.wgrad) == ("bf16", "bf16", "bf16")


@functools.cache
def _quantization_class():
  from maxtext.layers import quantizations  # pylint: disable=import-outside-toplevel

  @dataclasses.dataclass
  class Nvfp4Quantization(quantizations.Quantization):
    """``quantization=nvfp4`` (emulated): every decoder projection's GEMM in its planned precision."""

    # SR keys come from (nvfp4_seed, step, layer, role), never from MaxText's rng streams.
    needs_apply_rngs = False
    # MaxText's in_serve_mode/in_convert_mode read it (AQT's modes); emulated NVFP4 is always "train".
    quant_mode = "train"

    # the run's NVFP4 settings
    settings: settings_lib.Nvfp4Settings = dataclasses.field(default_factory=settings_lib.Nvfp4Settings)
    # config.num_decoder_layers
    num_layers: int = 1
    # len(config.mlp_activations): how many up-projections (wi_0, wi_1, ...) share ("embed","mlp")
    num_activations: int = 2
    # config.scan_layers: one module for all layers, layer index unknown
    scan_layers: bool = False
    # the first step of the late switch (None: off)
    switch_step: int | None = None
    # dot_general_cls calls per kernel-axes signature (the layer counter; see the module docstring)
    counts: dict = dataclasses.field(default_factory=dict, compare=False, repr=False)
    # (layer, role) of every dot_general_cls call, in order (to check the ordering assumption)
    assigned: list = dataclasses.field(default_factory=list, compare=False, repr=False)
    # nvfp4_diagnostics_interval when nvfp4_diagnostics is on, else 0 (no diagnostics code traced)
    diagnostics_interval: int = 0

    def locate(self, mesh_axes) -> tuple[int | None, str]:
      """(layer, role) of the next projection built with ``mesh_axes`` (advances the counter)."""
      layer, role = _locate(self.counts, mesh_axes, num_activations=self.num_activations,
                            num_layers=self.num_layers, scan_layers=self.scan_layers)
      self.assigned.append((layer, role))
      return layer, role

    def dot_general_cls(self, mesh_axes=()):
      layer, role = self.locate(mesh_axes)
      recipe, switched = plan_lib.gemm_recipes(self.settings, layer=layer, role=role, num_layers=self.num_layers)
      if _plain_bf16(recipe) and _plain_bf16(switched):
        recipe = switched = None
      group = self.diagnostics_group(layer, role, recipe)
      extra = {} if group is None else {"diag_group": group, "diag_interval": int(self.diagnostics_interval)}
      return functools.partial(_linen_module_class(), recipe=recipe, switched=switched,
                               switch_step=self.switch_step if switched is not None else None,
                               layer=layer, role=role, seed=int(self.settings.seed), **extra)

    def diagnostics_group(self, layer: int | None, role: str, recipe) -> str | None:
      """Aggregation group of a GEMM with diagnostics on and an NVFP4 pass before the switch, else None.

      First/last: the first/last layer that runs NVFP4 (``keep_first_layers``,
      ``num_layers - 1 - keep_last_layers``).
      """
      if not self.diagnostics_interval or recipe is None or "nvfp4" not in _passes(recipe):
        return None
      from maxtext_nvfp4 import diagnostics  # pylint: disable=import-outside-toplevel

      first = int(self.settings.keep_first_layers)
      last = self.num_layers - 1 - int(self.settings.keep_last_layers)
      return diagnostics.group_name(plan_lib.role_group(role), layer, first=first, last=last)

    def einsum(self, dtype=None):
      raise NotImplementedError("quantization=nvfp4 quantizes DenseGeneral projections only (no einsum path)")

    def get_block_size(self) -> int:
      # DenseGeneral's dummy init batch: one full NVFP4 block of tokens.
      return 16

  return Nvfp4Quantization


_logged: set[str] = set()


def _log_once(text: str, warn: bool = False) -> None:
  """Print and log ``text`` once per process (MaxText builds the quantization object several times)."""
  with _log_lock:
    if text in _logged:
      return
    _logged.add(text)
  if warn:
    _log.warning(text)
    return
  print(text, flush=True)
  _log.info(text)


def precision_table_text(config) -> str:
  """The precision table of ``config`` (every decoder GEMM, fprop/dgrad/wgrad, before/after the switch)."""
  s = settings_of(config)
  rows = plan_lib.precision_table(s, num_layers=config.num_decoder_layers, roles=_roles_of(config),
                                  scan_layers=config.scan_layers)
  switch = s.switch_step(config.steps)
  head = (f"maxtext-nvfp4: decoder GEMM precisions (targets={s.targets}, keep_first={s.keep_first_layers},"
          f" keep_last={s.keep_last_layers}, fallback={s.fallback}"
          + (f", switch at step {switch} to {s.switch_to} scope={s.switch_scope})" if switch is not None else ")"))
  return head + "\n" + plan_lib.format_precision_table(rows, switch_step=switch)


def _roles_of(config) -> tuple[str, ...]:
  return plan_lib.decoder_roles(num_activations=len(config.mlp_activations), fused_mlp=bool(config.fused_mlp),
                                fused_qkv=bool(config.fused_qkv))


def make_quantization(config, quant_mode_str: str = "train"):
  """Our Quantization object for a ``quantization=nvfp4`` config (used by the patch set too).

  Logs the backend choice and the precision table once per process. On the TE backend the object comes
  from ``te_backend.make_te_quantization(TransformerEngineQuantization, config, settings, plan)``.
  """
  del quant_mode_str  # emulated NVFP4 is the same computation in train/serve/convert
  register()  # the patch set calls us without importing the package first: make sure the step is wired
  s = settings_of(config)
  choice = _backend_choice(s)
  if choice is not None:
    from maxtext_nvfp4 import capability  # pylint: disable=import-outside-toplevel

    capability.announce(choice, log=_log_once)
  _log_once(precision_table_text(config))
  if choice is not None and choice.name == "te":
    if s.diagnostics:
      _log_once("maxtext-nvfp4: nvfp4_diagnostics is available with the emulation backend only; no nvfp4/*"
                " metrics on the TE backend", warn=True)
    from maxtext.layers import quantizations  # pylint: disable=import-outside-toplevel
    from maxtext_nvfp4 import te_backend  # pylint: disable=import-outside-toplevel

    plan = TePlan(settings=s, num_layers=int(config.num_decoder_layers),
                  num_activations=len(config.mlp_activations), scan_layers=bool(config.scan_layers))
    return te_backend.make_te_quantization(quantizations.TransformerEngineQuantization, config, s, plan)
  diag_interval = 0
  if s.diagnostics:
    from maxtext_nvfp4 import diagnostics  # pylint: disable=import-outside-toplevel

    diag_interval = int(s.diagnostics_interval)
    diagnostics.AGGREGATOR.armed = True  # the metrics writer now waits for and merges nvfp4/* reports
    _log_once(f"maxtext-nvfp4: diagnostics on: nvfp4/* metrics every {diag_interval} steps")
  return _quantization_class()(settings=s, num_layers=int(config.num_decoder_layers),
                               num_activations=len(config.mlp_activations), scan_layers=bool(config.scan_layers),
                               switch_step=s.switch_step(config.steps), diagnostics_interval=diag_interval)


def _patch_quantizations(quantizations) -> None:
  orig = quantizations.configure_quantization
  if getattr(orig, "_maxtext_nvfp4_wrapped", None) is not None:
    return

  @functools.wraps(orig)
  def configure_quantization(config, quant_mode_str: str = "train"):
    if _is_nvfp4(config):
      return make_quantization(config, quant_mode_str=quant_mode_str)
    return orig(config, quant_mode_str=quant_mode_str)

  configure_quantization._maxtext_nvfp4_wrapped = orig  # pylint: disable=protected-access
  quantizations.configure_quantization = configure_quantization


def _patch_train(train) -> None:
  train.train_step = _with_step(train.train_step, training=True)
  train.eval_step = _with_step(train.eval_step)


def _merge_diagnostics(metrics, step) -> None:
  """Add the ``nvfp4/*`` statistics reported for training ``step`` to ``metrics["scalar"]`` (host side).

  MaxText writes step ``s`` after dispatching step ``s + 1``; waiting for step ``s``'s own outputs (already
  due: the writer converts them to floats next) guarantees its callbacks have run.
  """
  from maxtext_nvfp4 import diagnostics  # pylint: disable=import-outside-toplevel

  if not diagnostics.AGGREGATOR.armed or "scalar" not in metrics:
    return
  import jax  # pylint: disable=import-outside-toplevel

  jax.block_until_ready([v for v in metrics["scalar"].values() if isinstance(v, jax.Array)])
  metrics["scalar"].update(diagnostics.AGGREGATOR.pop(int(step)))


def _patch_metric_logger(metric_logger) -> None:
  cls = metric_logger.MetricLogger
  orig_write = cls.write_metrics
  if getattr(orig_write, "_maxtext_nvfp4_wrapped", None) is not None:
    return
  orig_local = cls.write_metrics_locally

  @functools.wraps(orig_write)
  def write_metrics(self, metrics, step, metric_type="train"):
    if metrics and metric_type == "train":
      _merge_diagnostics(metrics, step)
    return orig_write(self, metrics, step, metric_type)

  @functools.wraps(orig_local)
  def write_metrics_locally(self, metrics, step):
    # MaxText truncates at every step-0 record; eval records have step 0 too (the running-eval snapshots
    # count eval batches; the eval after train step 0), so it deleted the training records. Truncate once
    # per logger instead: at its first record, when that is step 0 of a run that starts at step 0 (a
    # fresh run; the first eval's snapshots may come before train step 0's record). Append otherwise.
    import json  # pylint: disable=import-outside-toplevel

    fresh = not getattr(self, "_maxtext_nvfp4_wrote", False) and step == 0 and getattr(self, "start_step", 0) == 0
    self._maxtext_nvfp4_wrote = True  # pylint: disable=protected-access
    record = metric_logger._prepare_metrics_for_json(metrics, step, self.config.run_name)  # pylint: disable=protected-access
    with open(self.config.metrics_file, "w" if fresh else "a", encoding="utf8") as f:
      f.write(json.dumps(record) + "\n")

  write_metrics._maxtext_nvfp4_wrapped = orig_write  # pylint: disable=protected-access
  write_metrics_locally._maxtext_nvfp4_wrapped = orig_local  # pylint: disable=protected-access
  cls.write_metrics = write_metrics
  cls.write_metrics_locally = write_metrics_locally


# ---------------------------------------------------------------------------------------------------
# Registration (lazy, via an import hook)
# ---------------------------------------------------------------------------------------------------

_PATCHERS = {
    _TYPES: _patch_types,
    _PYCONFIG: _patch_pyconfig,
    _QUANTIZATIONS: _patch_quantizations,
    _TRAIN: _patch_train,
    _METRIC_LOGGER: _patch_metric_logger,
}
_lock = threading.RLock()
_finder: Any = None


def _apply(name: str, module) -> None:
  with _lock:
    if getattr(module, "_maxtext_nvfp4_patched", False):
      return
    _PATCHERS[name](module)
    module._maxtext_nvfp4_patched = True  # pylint: disable=protected-access


class _PatchingLoader(importlib.abc.Loader):
  """Runs the real loader, then our patch for that module (before anyone can use it)."""

  def __init__(self, loader, name):
    self._loader = loader
    self._name = name

  def create_module(self, spec):
    return self._loader.create_module(spec)

  def exec_module(self, module):
    self._loader.exec_module(module)
    _apply(self._name, module)

  def __getattr__(self, attr):  # get_source, get_resource_reader, ... of the real loader
    return getattr(self._loader, attr)


class _PatchFinder(importlib.abc.MetaPathFinder):
  """Finds the MaxText modules we patch with the other finders and wraps their loader."""

  def find_spec(self, fullname, path, target=None):
    if fullname not in _PATCHERS:
      return None
    for finder in sys.meta_path:
      if finder is self or not hasattr(finder, "find_spec"):
        continue
      spec = finder.find_spec(fullname, path, target)
      if spec is not None:
        break
    else:
      return None
    if spec.loader is not None and hasattr(spec.loader, "exec_module"):
      spec.loader = _PatchingLoader(spec.loader, fullname)
    return spec


def register() -> None:
  """Make MaxText accept ``quantization=nvfp4`` and the ``nvfp4_*`` keys (idempotent, cheap)."""
  global _finder
  with _lock:
    if _finder is None:
      _finder = _PatchFinder()
      sys.meta_path.insert(0, _finder)
    for name in _PATCHERS:
      module = sys.modules.get(name)
      if module is not None:
        _apply(name, module)
    # `python -m maxtext.trainers.pre_train.train` (e.g. with the patch set) runs MaxText's train module as
    # __main__: its train_step is looked up there, so wrap that copy too.
    main = sys.modules.get("__main__")
    if getattr(getattr(main, "__spec__", None), "name", None) == _TRAIN and hasattr(main, "train_step"):
      _apply(_TRAIN, main)
