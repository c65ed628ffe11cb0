"""The shape of a MaxText adapter: :class:`MaxTextVersion` (every fact about one release) and :class:`Touch`."""

from __future__ import annotations

import dataclasses
from typing import Mapping


class MaxTextVersionError(ImportError):
  """The installed MaxText is not one this plugin supports, or lacks a symbol it needs (one line)."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class Touch:
  """One MaxText name we read, wrap, replace or subclass."""

  # dotted module path
  module: str
  # attribute path inside the module ("Class.method" allowed)
  symbol: str
  # what we do with it, and where
  use: str


@dataclasses.dataclass(frozen=True, kw_only=True)
class HfConversion:
  """MaxText's own MaxText -> Hugging Face conversion of one decoder block (checkpoint_conversion's
  ``param_mapping``: the functions ``to_huggingface.py`` calls), as the NVFP4 export uses it."""

  # the names function (MaxText key -> HF name(s)) and the hook-functions function, in param_mapping
  names_fn: str
  hooks_fn: str
  # the hook functions (by __name__) its chains may hold, and those the export drops (with its reason)
  hooks: frozenset[str]
  dropped: frozenset[str] = frozenset()
  # why a hook is dropped (one line; docs/export.md has the proof)
  dropped_reason: str = ""
  # the functions read a multimodal HF config (``{"text_config": <the text model's>, "vision_config": ...}``;
  # the export passes a vision tower of 0 layers) and name the text model's tensors under ``hf_prefix[0]``,
  # which the text-only architecture names ``hf_prefix[1]``
  multimodal_config: bool = False
  hf_prefix: tuple[str, str] = ("", "")
  # (checkpoint key prefix, the prefix the mapping names it under): a variable whose Flax collection moved
  # after the mapping was written (MaxText's own restore aliases it the same way)
  aliases: tuple[tuple[str, str], ...] = ()
  # (checkpoint key part, the part the mapping names it with): a block whose modules are named otherwise
  # than those of the block the mapping was written for (gemma: pre_ffw_norm where llama has
  # post_self_attention_layer_norm); each is replaced wherever it occurs in a key
  renames: tuple[tuple[str, str], ...] = ()
  # a second hooks function of param_mapping whose hooks (at ``borrowed_hooks``' second key) are appended to
  # the chain of every mapping key ending with the first (gemma: gemma2's norm - 1 and embedding / sqrt(d))
  borrowed_hooks_fn: str = ""
  borrowed_hooks: tuple[tuple[str, str], ...] = ()
  # the module holding names_fn / hooks_fn when MaxText's param_mapping has none for the block: the adapter's
  # own functions, written from MaxText's facts and citing them ("": MaxText's param_mapping)
  module: str = ""
  # values the MaxText block hard-codes that the HF config must state, as (name, value) pairs
  constants: tuple[tuple[str, float], ...] = ()


@dataclasses.dataclass(frozen=True, kw_only=True)
class LogNoise:
  """A message MaxText or a library it imports shows on every run that misleads an nvfp4 user (hidden by
  ``integration/log_filter.py``, which says so once; ``MAXTEXT_NVFP4_VERBOSE=1`` shows it)."""

  # "logger": the records of the logging.Logger named ``source`` (the logger that creates them);
  # "print": the ``print`` calls of the module named ``source``
  kind: str
  source: str
  # the message contains this text
  text: str
  # a few words for the one-line notice
  label: str
  # why it is harmless (docs/failure_behaviour.md)
  why: str
  # hidden for quantization=nvfp4 only (held while the config is validated, shown for any other value)
  nvfp4_only: bool = False


@dataclasses.dataclass(frozen=True, kw_only=True)
class MaxTextVersion:
  """Every fact about one MaxText release that the plugin relies on (data only: no MaxText import)."""

  # the release, as its wheel's metadata spells it ("0.2.5")
  version: str
  # every MaxText symbol touched; checked when the module holding it is patched
  touches: tuple[Touch, ...]
  # module the plugin patches -> the patch job that handles it (integration/patches.py's table keys)
  patched_modules: Mapping[str, str]
  # MaxText's pre-training module (its `main(argv)` is what `python -m maxtext_nvfp4.train` runs)
  train_module: str
  # the module whose main(argv) is MaxText's ahead-of-time compile of the train step (train_compile)
  train_compile_module: str
  # kernel axes of a decoder projection -> the roles sharing them inside one layer, in build order
  kernel_signatures: Mapping[tuple, tuple[str, ...]]
  # kernel axes of the dense up-projection(s): wi_0..wi_{n-1}, or wi with one activation (resolved per config)
  up_projection_axes: tuple
  # a decoder projection's kernel input axis -> MaxText's activation axis of the matching lhs dim
  activation_of_kernel_axis: Mapping[str, str]
  # the two leading logical axes of every activation (tokens): batch, length
  activation_row_axes: tuple[str, str]
  # prefix of RoutedMoE.einsum's dispatch/combine axes (routing einsums, never quantized)
  routing_axis_prefix: str
  # decoder_block -> (rule, config key) of its MoE layers: ("from", k): layers k.. ; ("every", k): (l+1) % k == 0;
  # a block not listed with num_experts > 1 has routed experts in every layer
  moe_layer_rules: Mapping[str, tuple[str, str]]
  # RoutedMoE's expert kernel axes under which the locator counts the sparse path's linears: (wi, wo)
  expert_kernel_axes: tuple[tuple, tuple]
  # the expert roles of successive megablox gmm calls inside one sparse_matmul (cycled), unfused / prefused
  gmm_call_order: tuple[tuple[str, ...], ...]
  gmm_call_order_fused: tuple[tuple[str, ...], ...]
  # pyconfig's unknown-key ValueError (a regex whose group 1 is the key)
  unknown_key_pattern: str
  # keys pyconfig (or a "before" validator) rewrites before pydantic sees them: only MaxText judges them
  rewritten_keys: frozenset[str]
  # MaxText's nnx.Rngs stream that TE's sr_rng is drawn from (DenseGeneral's quantization randomness)
  te_sr_source_stream: str
  # TransformerEngineQuantization's private attributes the TE adapter sets: the recipe, the overlap policy
  te_recipe_attr: str
  te_overlap_attr: str
  # MaxText's checkpoint-conversion module (param_mapping) and its conversion of each exported decoder block
  hf_param_mapping_module: str
  hf_conversions: Mapping[str, HfConversion]
  # where a scanned MoE checkpoint stacks (experts, layers) in an expert weight (tensor_handling.stacked_axes)
  scanned_expert_axes: tuple[int, int]
  # config files: the folder inside the maxtext package, its base file, the model YAMLs' subfolder
  configs_dir: str
  base_config: str
  models_dir: str
  # the environment prefix pyconfig reads overrides from (M_STEPS=10)
  env_prefix: str
  # the patch series' anchors in the pristine files (scripts/make_patch_series.py): the QuantizationType
  # member after which NVFP4 is added (types.py), and base.yml's quantization comment line it extends
  patch_anchors: Mapping[str, str]
  # RoutedMoE.sparse_matmul reads ``quant.quant_dg`` unconditionally (get_quantization_dtypes): our emulated
  # Quantization then carries a stand-in whose dtypes are None (the gmm wrapper ignores them)
  sparse_matmul_reads_quant_dg: bool = False
  # MaxText's and its libraries' misleading start-up messages (log_filter.py hides them)
  log_noise: tuple[LogNoise, ...] = ()
  # how many times one ``train.main`` run traces the train step: 0.2.5 lowers and compiles it once and runs that
  # executable; 0.2.4 compiles a lowering for its memory statistics only, and its loop's first call traces again
  # (per-trace counts -- traced GEMMs, gmm calls -- are this many times the per-step ones)
  train_step_traces_per_run: int = 1
  # MaxText's post-training trainers the plugin runs (python -m maxtext_nvfp4.sft / .distill): trainer ->
  # module whose ``main(argv)`` runs it ("sft": the pre-training loop with use_sft; "distill": the Tunix
  # distillation trainer). Empty: no post-training entry point was verified on this version.
  posttrain_modules: Mapping[str, str] = dataclasses.field(default_factory=dict)
  # the pip pins the distillation trainer's Tunix is installed with (``pip install --no-deps``: google-tunix's own
  # dependency list would downgrade transformers; scripts/setup.sh installs the same set)
  tunix_pins: tuple[str, ...] = ()
  # what the distillation trainer's MaxTextCheckpointManager calls on Tunix's CheckpointManager that the pinned
  # google-tunix lacks (integration/posttrain.py bridges them from that release's own Orbax manager)
  tunix_checkpoint_api: tuple[str, ...] = ()
  # MoE flags that work only with expert parallelism: flag -> the value they must keep when its rank is 1, unless
  # override_logical_axis_rules is set (types.py: "When EP rank is 1, <flag> must be <value>"); the train CLI says
  # so in one line before MaxText starts
  ep_only_flags: Mapping[str, object] = dataclasses.field(default_factory=dict)
  # the XLA_FLAGS MaxText's config validation sets whenever XLA_FLAGS is unset (or empty) and
  # ``dump_hlo_xla_flags`` is empty -- even with ``dump_hlo=false`` (types.py, validate_and_set_hlo_dump_defaults,
  # called unconditionally): a format over config keys, then the module filter appended when that key is
  # non-empty. Every such run would write HLO dumps; the plugin restores XLA_FLAGS when dump_hlo is false.
  # Empty: this version sets no XLA_FLAGS of its own.
  hlo_dump_injected_flags: str = ""
  hlo_dump_injected_module_flag: str = ""  # appended when ``dump_hlo_local_module_name`` is set
