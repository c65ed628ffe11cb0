"""The Quantization objects MaxText builds for ``quantization=nvfp4``: emulated, or on Transformer Engine.

:func:`make_quantization` is what MaxText's ``configure_quantization`` returns for ``nvfp4`` (through the
plugin, or the patch series' hook :mod:`maxtext_nvfp4.maxtext_plugin`). It logs the backend choice and
the precision table once per process, then builds

* ``Nvfp4Quantization`` (emulate): a ``maxtext.layers.quantizations.Quantization`` whose
  ``dot_general_cls(mesh_axes)`` names the projection being built (:class:`plan.GemmLocator`), looks up
  its GEMM recipes (:func:`plan.gemm_recipes`) and returns a Linen module running
  :func:`maxtext_nvfp4.core.gemm.dot_general` with the stochastic-rounding key of (seed, step, layer,
  role); or
* the TE adapter of :mod:`maxtext_nvfp4.integration.te_quantization` (``nvfp4_backend=te``).

MaxText symbols used here are listed in :data:`maxtext_nvfp4.integration.touchpoints.TOUCHES`.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import logging
import threading
from typing import Any

from maxtext_nvfp4.backends import capability
from maxtext_nvfp4.backends import te as te_backend
from maxtext_nvfp4.core import plan as plan_lib
from maxtext_nvfp4.core import settings as settings_lib
from maxtext_nvfp4.core import te_limits
from maxtext_nvfp4.integration import step as step_lib

_log = logging.getLogger("maxtext_nvfp4")
# Guards the log-once set and the traced-GEMM counter.
_log_lock = threading.Lock()

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
    # the kernel's logical axes (DenseGeneral's kernel_axes): with amax_scope te, W's sharding
    kernel_axes: tuple = ()
    # nvfp4_amax_scope: te (TE's per-device / per-shard amaxes on the run's mesh) or global
    amax_scope: str = "global"

    @nn.compact
    def __call__(self, lhs, rhs, dimension_numbers, precision=None, preferred_element_type=None, **kwargs):
      del kwargs  # e.g. MaxText's mutable=["aqt"] is consumed by Linen apply, nothing else is expected
      # recipe None: plain BF16. Initializing: DenseGeneral's dummy lazy_init call, whose output is
      # discarded (no variables to create), so skip the emulation's cost (same shape and dtype).
      if self.recipe is None or self.is_initializing():
        return jax.lax.dot_general(lhs, rhs, dimension_numbers, precision=precision,
                                   preferred_element_type=preferred_element_type)
      from maxtext_nvfp4.core import gemm  # pylint: disable=import-outside-toplevel

      training, step, use_switched, key = _step_inputs(self.layer, self.role, self.seed, self.recipe,
                                                       self.switched, self.switch_step)
      groups = None
      if self.amax_scope == "te":
        from maxtext_nvfp4.integration import mesh_scope  # pylint: disable=import-outside-toplevel

        groups = mesh_scope.te_amax_groups(lhs.shape, rhs.shape, dimension_numbers, self.kernel_axes, self.role)
      out = gemm.dot_general(lhs, rhs, dimension_numbers, recipe=self.recipe, switched=self.switched,
                             use_switched=use_switched, key=key, preferred_element_type=preferred_element_type,
                             amax_groups=groups)
      if self.diag_group is None or not training:
        return out  # trace-time decision: without diagnostics the traced GEMM is exactly the one above
      from maxtext_nvfp4.core import diagnostics  # pylint: disable=import-outside-toplevel

      return diagnostics.instrument(lhs, rhs, dimension_numbers, out, step=step, interval=self.diag_interval,
                                    group=self.diag_group, two_d_weights=self.recipe.two_d_weights,
                                    stochastic=self.recipe.stochastic_rounding, key=key)

  return Nvfp4DotGeneral


def _step_inputs(layer, role, seed, recipe, switched, switch_step):
  """``(training, step, use_switched, SR key)`` of an emulated GEMM being traced (and counts the GEMM).

  Outside MaxText's train/eval step (DenseGeneral's dummy call at model build, plain model applies) the
  step is 0. Not warned about: every model build makes such a call.
  """
  import jax.numpy as jnp  # pylint: disable=import-outside-toplevel

  step = step_lib.current_step()
  if step is not None:
    _note_traced(layer, role, recipe, switched)
  training = step is not None and step_lib.in_train_step()
  step = jnp.zeros((), jnp.int32) if step is None else jnp.asarray(step, jnp.int32)
  use_switched = None if switched is None else step >= switch_step
  return training, step, use_switched, plan_lib.sr_key(seed, step, layer, role)


def _expert_einsum(recipe, switched, switch_step, layer, role, seed):
  """MaxText RoutedMoE's expert einsum ``(eqn, tokens, kernel)``: one emulated GEMM per expert
  (:func:`maxtext_nvfp4.core.grouped_gemm.einsum`), or the plain einsum when every pass is BF16."""
  import jax.numpy as jnp  # pylint: disable=import-outside-toplevel

  def expert_einsum(eqn, lhs, rhs, *args, **kwargs):
    del args, kwargs  # MaxText drops einsum kwargs (precision) on its quantized path too
    if recipe is None:
      return jnp.einsum(eqn, lhs, rhs)
    from maxtext_nvfp4.core import grouped_gemm  # pylint: disable=import-outside-toplevel

    _, _, use_switched, key = _step_inputs(layer, role, seed, recipe, switched, switch_step)
    return grouped_gemm.einsum(eqn, lhs, rhs, recipe=recipe, switched=switched, use_switched=use_switched,
                               key=key)

  return expert_einsum


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
    # names each projection from the order of dot_general_cls calls (a fresh one per object)
    locator: plan_lib.GemmLocator = dataclasses.field(default_factory=lambda: plan_lib.GemmLocator(num_layers=1))
    # the first step of the late switch (None: off)
    switch_step: int | None = None
    # nvfp4_diagnostics_interval when nvfp4_diagnostics is on, else 0 (no diagnostics code traced)
    diagnostics_interval: int = 0

    def _located_recipes(self, mesh_axes):
      """(layer, role, recipe, switched) of the next projection built with ``mesh_axes`` (None: plain BF16)."""
      layer, role = self.locator.locate(mesh_axes)
      recipe, switched = plan_lib.gemm_recipes(self.settings, layer=layer, role=role, num_layers=self.num_layers)
      if _plain_bf16(recipe) and _plain_bf16(switched):
        recipe = switched = None
      return layer, role, recipe, switched

    def dot_general_cls(self, mesh_axes=()):
      layer, role, recipe, switched = self._located_recipes(mesh_axes)
      group = self.diagnostics_group(layer, role, recipe)
      extra = {} if group is None else {"diag_group": group, "diag_interval": int(self.diagnostics_interval)}
      return functools.partial(_linen_module_class(), recipe=recipe, switched=switched,
                               switch_step=self.switch_step if switched is not None else None,
                               layer=layer, role=role, seed=int(self.settings.seed),
                               kernel_axes=tuple(mesh_axes), amax_scope=self.settings.amax_scope, **extra)

    def diagnostics_group(self, layer: int | None, role: str, recipe) -> str | None:
      """Aggregation group of a GEMM with diagnostics on and an NVFP4 pass before the switch, else None.

      First/last: the first/last layer that runs NVFP4 (``keep_first_layers``,
      ``num_layers - 1 - keep_last_layers``).
      """
      if not self.diagnostics_interval or recipe is None or "nvfp4" not in _passes(recipe):
        return None
      from maxtext_nvfp4.core import diagnostics  # pylint: disable=import-outside-toplevel

      first = int(self.settings.keep_first_layers)
      last = self.num_layers - 1 - int(self.settings.keep_last_layers)
      return diagnostics.group_name(plan_lib.role_group(role), layer, first=first, last=last)

    def einsum(self, mesh_axes=(), dtype=None):
      """RoutedMoE's einsum for kernel axes ``mesh_axes`` (asked for at call time, sparse_matmul=false).

      Dispatch/combine (routing masks, ``activation_*`` axes) stay plain high-precision einsums; the
      expert linears run one emulated GEMM per expert in their planned precision.
      """
      del dtype
      if mesh_axes and str(mesh_axes[0]).startswith("activation_"):
        import jax.numpy as jnp  # pylint: disable=import-outside-toplevel

        return jnp.einsum
      layer, role, recipe, switched = self._located_recipes(mesh_axes)
      return _expert_einsum(recipe, switched, self.switch_step if switched is not None else None, layer, role,
                            int(self.settings.seed))

    def expert_gemms(self):
      """RoutedMoE.sparse_matmul's three expert linears (wi_0, wi_1, wo), asked for at call time
      (sparse_matmul=true; :mod:`maxtext_nvfp4.integration.sparse_moe`), located as the einsum path's are."""
      from maxtext_nvfp4.integration import sparse_moe  # pylint: disable=import-outside-toplevel

      out = []
      for axes in (sparse_moe.WI_AXES, sparse_moe.WI_AXES, sparse_moe.WO_AXES):
        layer, role, recipe, switched = self._located_recipes(axes)
        out.append(sparse_moe.ExpertGemm(layer=layer, role=role, recipe=recipe, switched=switched,
                                         switch_step=self.switch_step if switched is not None else None,
                                         seed=int(self.settings.seed)))
      return tuple(out)

    def get_block_size(self) -> int:
      # DenseGeneral's dummy init batch: one full NVFP4 block of tokens.
      return 16

  return Nvfp4Quantization


_logged: set[str] = set()


def _log_once(text: str, warn: bool = False) -> None:
  """Show ``text`` once per process (MaxText builds the quantization object several times): printed to
  stdout (where the step lines are parsed), or logged as a warning when ``warn``. The printed text goes
  to ``logging`` at DEBUG only: under MaxText's absl handler an INFO record reaches the console too, so
  every line was shown twice."""
  with _log_lock:
    if text in _logged:
      return
    _logged.add(text)
  if warn:
    _log.warning(text)
    return
  print(text, flush=True)
  _log.debug(text)


def precision_table_text(config) -> str:
  """The precision table of ``config`` (every decoder GEMM, fprop/dgrad/wgrad, before/after the switch)."""
  s = settings_lib.from_config(config)
  rows = plan_lib.precision_table(s, num_layers=config.num_decoder_layers, roles=_roles_of(config),
                                  scan_layers=config.scan_layers)
  switch = s.switch_step(config.steps)
  head = (f"maxtext-nvfp4: decoder GEMM precisions (targets={s.targets}, keep_first={s.keep_first_layers},"
          f" keep_last={s.keep_last_layers}, fallback={s.fallback}"
          + (f", switch at step {switch} to {s.switch_to} scope={s.switch_scope})" if switch is not None else ")"))
  path = ("sparse_matmul=true: the grouped GEMM, per device" if bool(getattr(config, "sparse_matmul", False))
          else "sparse_matmul=false: the expert einsums")
  moe = ("\nMoE: router = gate logits, always bf16; dispatch/combine (routing) = MaxText's, in high"
         " precision; expert_* = one GEMM per expert (own amax per expert weight and per expert token group;"
         f" {path})" if moe_layers(config) else "")
  return head + "\n" + plan_lib.format_precision_table(rows, switch_step=switch) + moe


def _value(x) -> str:
  """A config value as a plain string (MaxText keeps some as enums)."""
  return str(getattr(x, "value", x))


def moe_layers(config) -> tuple[int, ...]:
  """The decoder layers with routed experts (MaxText 0.2.5 ``models/deepseek.py``: from
  ``first_num_dense_layers`` on; ``models/llama4.py``: every ``interleave_moe_layer_step``-th; other MoE
  blocks: all), or () for a dense model."""
  n = int(config.num_decoder_layers)
  if int(getattr(config, "num_experts", 1)) <= 1:
    return ()
  block = _value(config.decoder_block)
  if block == "deepseek":
    return tuple(range(int(config.first_num_dense_layers), n))
  if block == "llama4":
    step = int(config.interleave_moe_layer_step)
    return tuple(l for l in range(n) if step > 0 and (l + 1) % step == 0)
  return tuple(range(n))


def _roles_of(config):
  """``roles(layer)``: the projection roles of decoder layer ``layer`` (None: scanned, the MoE layers')."""
  moe = set(moe_layers(config))
  mla = _value(getattr(config, "attention_type", "")) == "mla"
  shared = int(getattr(config, "shared_experts", 0) or 0) > 0

  def roles(layer):
    is_moe = bool(moe) and (layer is None or layer in moe)
    return plan_lib.decoder_roles(num_activations=len(config.mlp_activations), fused_mlp=bool(config.fused_mlp),
                                  fused_qkv=bool(config.fused_qkv), mla=mla, q_lora=int(getattr(config, "q_lora_rank", 0) or 0) > 0,
                                  dense_mlp=not is_moe or shared, moe=is_moe)
  return roles


def check_model(config, s: settings_lib.Nvfp4Settings, backend: str, num_devices: int | None = 1) -> None:
  """Refuse (one line) MoE configurations whose expert GEMMs would silently skip the plan.

  Run at config time (``num_devices=None``: the checks that need the device count are skipped) and again
  when MaxText builds the quantization object (``num_devices``: the devices of the run's mesh, on which the
  sparse path's amax scope depends).
  """
  if not moe_layers(config):
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
  from maxtext_nvfp4.integration import sparse_moe  # pylint: disable=import-outside-toplevel

  why = sparse_moe.refusal(config, s, num_devices)
  if why:
    raise settings_lib.SettingsError(why)
  if backend == "te":
    raise settings_lib.SettingsError(
        "nvfp4_backend=te cannot run the MoE expert GEMMs (TE JAX has no NVFP4 grouped GEMM); set"
        " nvfp4_backend=emulate, or nvfp4_targets=attention|mlp with nvfp4_fallback=bf16")


def make_quantization(config, quant_mode_str: str = "train"):
  """Our Quantization object for a ``quantization=nvfp4`` config (the patch series' hook calls it too).

  Logs the backend choice and the precision table once per process. On the TE backend the object comes
  from :func:`maxtext_nvfp4.integration.te_quantization.make_te_quantization`.
  """
  del quant_mode_str  # emulated NVFP4 is the same computation in train/serve/convert
  from maxtext_nvfp4.integration import plugin  # pylint: disable=import-outside-toplevel

  plugin.register()  # the patch series calls us without importing the package first: wire the step
  s = settings_lib.from_config(config)
  choice = capability.choose_backend(s.backend)
  capability.announce(choice, log=_log_once)
  _log_once(precision_table_text(config))
  if choice.name == "te":
    te_backend.check_te_shapes(config, s)  # nvfp4_backend=te was checked at config time; auto is checked here
  else:  # the emulation zero-pads what TE refuses: say so once, so the recipe is not taken to Blackwell as is
    refused = te_limits.summary(te_limits.check(config, s))
    if refused:
      _log_once(refused)
  import jax  # pylint: disable=import-outside-toplevel

  check_model(config, s, s.backend, num_devices=jax.device_count())
  locator = plan_lib.GemmLocator(num_layers=int(config.num_decoder_layers),
                                 num_activations=len(config.mlp_activations), scan_layers=bool(config.scan_layers),
                                 moe_layers=moe_layers(config) or None)
  if choice.name == "te":
    if s.diagnostics:
      _log_once("maxtext-nvfp4: nvfp4_diagnostics is available with the emulation backend only; no nvfp4/*"
                " metrics on the TE backend", warn=True)
    from maxtext.layers import quantizations  # pylint: disable=import-outside-toplevel
    from maxtext_nvfp4.integration import te_quantization  # pylint: disable=import-outside-toplevel

    te_quant = te_quantization.make_te_quantization(quantizations.TransformerEngineQuantization, config, s,
                                                    plan_lib.FpropPlan(settings=s, locator=locator))
    if moe_layers(config):  # nvfp4_backend=auto (te was refused by check_model): experts emulated
      _log_once("maxtext-nvfp4: MoE expert GEMMs run emulated (TE JAX has no NVFP4 grouped GEMM); attention"
                " and dense projections on TE")
      experts = _quantization_class()(settings=s, num_layers=int(config.num_decoder_layers),
                                      locator=dataclasses.replace(locator, counts={}),
                                      switch_step=s.switch_step(config.steps))
      object.__setattr__(te_quant, "einsum", experts.einsum)
      object.__setattr__(te_quant, "expert_gemms", experts.expert_gemms)
    return te_quant
  diag_interval = 0
  if s.diagnostics:
    from maxtext_nvfp4.core import diagnostics  # pylint: disable=import-outside-toplevel

    diag_interval = int(s.diagnostics_interval)
    diagnostics.AGGREGATOR.armed = True  # the metrics writer now waits for and merges nvfp4/* reports
    _log_once(f"maxtext-nvfp4: diagnostics on: nvfp4/* metrics every {diag_interval} steps")
  return _quantization_class()(settings=s, num_layers=int(config.num_decoder_layers), locator=locator,
                               switch_step=s.switch_step(config.steps), diagnostics_interval=diag_interval)
