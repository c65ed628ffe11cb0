"""Recipes: every recipe validates in MaxText's config system with the plugin registered, the effective settings
are the published ones, and recipes needing hardware this machine lacks are refused with a suggestion."""

from __future__ import annotations

import os
import re

import pytest
import yaml

import maxtext_nvfp4
from maxtext_nvfp4.tools import data
from maxtext_nvfp4.tools import recipes
from maxtext_nvfp4.core import settings

maxtext_nvfp4.register()  # MaxText accepts quantization=nvfp4 (importing the package registers nothing)

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
RECIPES = os.path.join(REPO, "recipes")
MAXTEXT_MODELS = os.path.join(os.path.dirname(__import__("maxtext").__file__), "configs", "models")

RUNNABLE = [
    "demo_bf16", "demo_nvfp4", "demo_nvfp4_paper",
    "llama3_8b_bf16", "llama3_8b_fp8", "llama3_8b_nvfp4", "llama3_8b_fp8_c4", "llama3_8b_nvfp4_c4",
    "llama3.1_405b_fp8", "llama3.1_405b_nvfp4", "proxy_1gpu_fp8", "proxy_1gpu_nvfp4",
    "demo_moe_bf16", "demo_moe_nvfp4", "proxy_1gpu_moe_fp8", "proxy_1gpu_moe_nvfp4",
    "demo_qwen3_bf16", "demo_qwen3_nvfp4",
    "sft_demo_bf16", "sft_demo_nvfp4", "distill_demo_nvfp4",
    "sft_demo_moe_bf16", "sft_demo_moe_nvfp4", "distill_demo_moe_nvfp4",
]
ARCH_KEYS = ("base_emb_dim", "base_num_query_heads", "base_num_kv_heads", "base_num_decoder_layers", "base_mlp_dim",
             "head_dim", "vocab_size", "enable_dropout", "logits_via_embedding", "normalization_layer_epsilon",
             "rope_max_timescale", "decoder_block", "mlp_activations")
# TE's NVFP4BlockScaling defaults (RHT, SR, 2D weights) on every projection, as MaxText's te_nvfp4 does.
TE_NVFP4 = {"nvfp4_targets": "all", "nvfp4_rht": True, "nvfp4_stochastic_rounding": True, "nvfp4_2d_weights": True,
            "nvfp4_keep_first_layers": 0, "nvfp4_keep_last_layers": 0, "nvfp4_switch_at_step": -1}


def _value(v):
  v = getattr(v, "value", v)
  return list(v) if isinstance(v, tuple) else v


@pytest.fixture(scope="module")
def configs():
  """``{recipe name: {key: value}}`` from MaxText's pyconfig.initialize (the plugin registered).

  nvfp4_backend=te is checked by the plugin at config time against this machine's devices (a CPU here); the
  capability check is stubbed to "TE available" so that the rest of the recipe is validated as written.
  """
  from maxtext.configs import pyconfig  # pylint: disable=import-outside-toplevel

  from maxtext_nvfp4.backends import capability  # pylint: disable=import-outside-toplevel

  mp = pytest.MonkeyPatch()
  real = capability.choose_backend
  mp.setattr(capability, "choose_backend",
             lambda requested, *a, **k: capability.BackendChoice(name="te", reason="test stub")
             if requested == "te" else real(requested, *a, **k))
  out = {}
  try:
    for name in RUNNABLE:
      cfg = pyconfig.initialize([None, os.path.join(RECIPES, name + ".yml"), "skip_jax_distributed_system=true"])
      out[name] = {k: _value(v) for k, v in cfg.get_keys().items()}
  finally:
    mp.undo()
  return out


def _model_yml(name):
  with open(os.path.join(MAXTEXT_MODELS, name + ".yml"), encoding="utf-8") as f:
    return yaml.safe_load(f)


@pytest.fixture(scope="module")
def resolved():
  """``{yml name: recipes.resolve([it])}`` for every YAML in recipes/ (each resolve merges MaxText's base.yml:
  ~0.5 CPU-s, so once per file for the whole module)."""
  return {f[:-4]: recipes.resolve([os.path.join(RECIPES, f)]) for f in sorted(os.listdir(RECIPES))
          if f.endswith(".yml")}


def test_every_yml_is_a_recipe_or_a_used_base(resolved):
  ymls = sorted(resolved)
  bases = [y for y in ymls if y.endswith("_base")]
  assert sorted(set(ymls) - set(bases)) == sorted(RUNNABLE)
  maxtext_base = os.path.join(recipes.maxtext_configs_dir(), "base.yml")
  used = {resolved[f].chain[-1] for f in ymls}
  chained = set()
  for y in ymls:
    with open(os.path.join(RECIPES, y + ".yml"), encoding="utf-8") as f:
      chained.add(yaml.safe_load(f)["base_config"])
  assert all(b + ".yml" in chained for b in bases), (bases, chained)
  assert used == {maxtext_base}  # every chain ends at MaxText's base.yml
  for y in ymls:  # no model_name: a model YAML would silently override the recipe's keys
    assert dict(resolved[y].values)["model_name"] == "default"  # = recipes.load_recipe(path), one resolve


@pytest.mark.parametrize("name", RUNNABLE)
def test_header_says_what_hardware_and_published_number(name):
  with open(os.path.join(RECIPES, name + ".yml"), encoding="utf-8") as f:
    header = "".join(line for line in f if line.startswith("#"))
  assert re.search(r"hardware", header, re.I) and re.search(r"published", header, re.I), name


def test_llama3_8b_published_settings(configs):
  arch = _model_yml("llama3-8b")
  for name in ("llama3_8b_bf16", "llama3_8b_fp8", "llama3_8b_nvfp4", "llama3_8b_fp8_c4", "llama3_8b_nvfp4_c4"):
    c = configs[name]
    for k in ARCH_KEYS:
      assert c[k] == _value(arch[k]) or (k == "mlp_activations" and list(c[k]) == list(arch[k])), (name, k)
    assert (c["max_target_length"], c["per_device_batch_size"], c["ici_fsdp_parallelism"]) == (8192, 4, 4), name
    assert c["per_device_batch_size"] * c["ici_fsdp_parallelism"] == 16  # global batch 16 on 4 GPUs
    # MaxText's GPU policy for the model: the published one plans more than a GB200's memory (RESULTS.md)
    assert c["remat_policy"] == "minimal_with_context" and c["scan_layers"] is False, name
    assert c["attention"] == "cudnn_flash_te" and c["dtype"] == "bfloat16" and c["gradient_accumulation_steps"] == 1
    assert c["num_decoder_layers"] == 32 and c["emb_dim"] == 4096
  assert configs["llama3_8b_fp8"]["quantization"] == "te_fp8_delayedscaling"
  assert configs["llama3_8b_bf16"]["quantization"] in ("", None)
  for name in ("llama3_8b_bf16", "llama3_8b_fp8", "llama3_8b_nvfp4"):
    assert configs[name]["dataset_type"] == "synthetic"


def _nvfp4_keys(c):
  return {k: c[k] for k in TE_NVFP4}


def test_nvfp4_recipes_use_te_nvfp4_numerics(configs):
  for name in ("llama3_8b_nvfp4", "llama3_8b_nvfp4_c4", "llama3.1_405b_nvfp4"):
    c = configs[name]
    assert c["quantization"] == "nvfp4" and c["nvfp4_backend"] == "te", name
    assert _nvfp4_keys(c) == TE_NVFP4, name
  assert configs["proxy_1gpu_nvfp4"]["nvfp4_backend"] == "emulate"
  assert _nvfp4_keys(configs["proxy_1gpu_nvfp4"]) == TE_NVFP4
  assert configs["demo_nvfp4"]["nvfp4_backend"] == "auto" and _nvfp4_keys(configs["demo_nvfp4"]) == TE_NVFP4


def _diff(a, b):
  return {k for k in set(a) | set(b) if a.get(k) != b.get(k)}


QUANT_KEYS = {"quantization", "run_name", "metrics_file", *settings.config_keys()}


def _setting_diff(a, b):
  """Keys whose values differ, other than precision keys and what MaxText derives per run."""
  diff = _diff(a, b) - QUANT_KEYS - {"base_config"}
  # Output dirs that MaxText derives from the run name (runs/<run_name>/...) are not settings.
  diff = {k for k in diff if str(a.get(k)).replace(a["run_name"], b["run_name"]) != str(b.get(k))}
  # MaxText fills dump_hlo_xla_flags only in the first pyconfig.initialize of a process (global XLA_FLAGS state).
  return diff - {"dump_hlo_xla_flags"}


@pytest.mark.parametrize("pair", [("llama3_8b_fp8", "llama3_8b_nvfp4"), ("llama3_8b_bf16", "llama3_8b_nvfp4"),
                                  ("llama3_8b_fp8_c4", "llama3_8b_nvfp4_c4"), ("llama3.1_405b_fp8", "llama3.1_405b_nvfp4"),
                                  ("proxy_1gpu_fp8", "proxy_1gpu_nvfp4"), ("demo_bf16", "demo_nvfp4"),
                                  ("demo_qwen3_bf16", "demo_qwen3_nvfp4")])
def test_pairs_differ_only_in_precision(configs, pair):
  """A comparison is fair only if nothing but the precision keys differ (MaxText derives the rest)."""
  a, b = configs[pair[0]], configs[pair[1]]
  diff = _setting_diff(a, b)
  assert not diff, {k: (a.get(k), b.get(k)) for k in diff}


def test_c4_pair_is_the_10k_step_convergence_run(configs):
  for name in ("llama3_8b_fp8_c4", "llama3_8b_nvfp4_c4"):
    c = configs[name]
    assert c["steps"] == 10000 and c["dataset_type"] == "grain" and c["grain_file_type"] == "parquet"
    assert c["eval_interval"] > 0 and c["eval_steps"] > 0
    # What `prepare-data --input C4 --out data/c4 --tokenizer llama3` writes.
    assert c["grain_train_files"] == "data/c4/train-*.parquet" and c["grain_eval_files"] == "data/c4/eval-*.parquet"
    assert c["tokenizer_type"] == "tiktoken" and c["tokenizer_path"] == "data/c4/tokenizer_llama3.tiktoken"
    assert c["use_truncation"] is False


def test_llama31_405b_published_settings(configs):
  arch = _model_yml("llama3.1-405b")
  for name in ("llama3.1_405b_fp8", "llama3.1_405b_nvfp4"):
    c = configs[name]
    for k in ARCH_KEYS:
      assert c[k] == _value(arch[k]) or (k == "mlp_activations" and list(c[k]) == list(arch[k])), (name, k)
    assert c["per_device_batch_size"] == 1 and c["max_target_length"] == 8192
    assert c["ici_fsdp_parallelism"] == -1 and c["dcn_fsdp_parallelism"] == -1  # FSDP over every GPU (128)
    assert all(c[f"{p}_{a}_parallelism"] == 1 for p in ("ici", "dcn") for a in ("data", "tensor", "pipeline"))
    # MaxText's own GPU config for the model (the published policy plans 3x a GB200's memory: RESULTS.md)
    assert c["hardware"] == "gpu_multiprocess" and c["scan_layers"] is True
    assert c["remat_policy"] == "full" and c["attention"] == "cudnn_flash_te"
  assert configs["llama3.1_405b_fp8"]["quantization"] == "te_fp8_delayedscaling"


def _params(c):
  e, l, h, kv, hd, m, v = (c[k] for k in ("emb_dim", "num_decoder_layers", "num_query_heads", "num_kv_heads",
                                          "head_dim", "mlp_dim", "vocab_size"))
  return l * (e * hd * (2 * h + 2 * kv) + 3 * e * m) + 2 * v * e


def test_proxy_fits_one_gpu_and_needs_no_te(configs):
  for name in ("proxy_1gpu_fp8", "proxy_1gpu_nvfp4"):
    c = configs[name]
    assert 0.8e9 < _params(c) < 1.6e9, _params(c)
    # fp32 master weights + Adam moments (16 B/param) far below one H100's 80 GB.
    assert _params(c) * 16 < 40e9
    assert recipes.check_hardware(c, te_available=False, gpu_cc=9.0) is None, name
    assert c["attention"] != "cudnn_flash_te"
  assert configs["proxy_1gpu_fp8"]["quantization"] == "fp8"


def test_demo_recipes_read_prepare_data_defaults(configs):
  d = data.PrepareOptions()
  for name in ("demo_bf16", "demo_nvfp4", "demo_nvfp4_paper", "demo_qwen3_bf16", "demo_qwen3_nvfp4"):
    c = configs[name]
    assert c["grain_train_files"] == os.path.join(data.DEFAULT_OUT, "train-*.parquet")
    assert c["grain_eval_files"] == os.path.join(data.DEFAULT_OUT, "eval-*.parquet")
    assert c["tokenizer_path"] == os.path.join(data.DEFAULT_OUT, "tokenizer") and c["tokenizer_type"] == "huggingface"
    assert c["vocab_size"] == d.vocab_size and c["use_truncation"] is False and c["eval_interval"] > 0
    assert recipes.check_hardware(c, te_available=False, gpu_cc=None) is None
    assert _params(c) < 5e6  # tiny: trains on 2 CPU cores in minutes


def test_demo_qwen3_is_the_demo_with_the_qwen3_block(configs):
  """The accuracy study's second dense family: the llama2 demo's size, data and run; only the block differs."""
  q, d = configs["demo_qwen3_bf16"], configs["demo_bf16"]
  assert (q["decoder_block"], d["decoder_block"]) == ("qwen3", "llama2")
  assert q["use_qk_norm"] is True and d["use_qk_norm"] is False
  assert _setting_diff(d, q) == {"decoder_block", "use_qk_norm", "rope_max_timescale", "normalization_layer_epsilon"}
  assert _nvfp4_keys(configs["demo_qwen3_nvfp4"]) == TE_NVFP4 and configs["demo_qwen3_nvfp4"]["quantization"] == "nvfp4"


def test_demo_paper_settings(configs):
  c = configs["demo_nvfp4_paper"]
  s = settings.from_config(c)
  assert (s.keep_first_layers, s.keep_last_layers, s.switch_scope, s.switch_to) == (0, 1, "forward", "bf16")
  assert s.switch_step(c["steps"]) == round(0.8 * c["steps"])
  assert 0.1 <= s.keep_last_layers / c["num_decoder_layers"] <= 0.3  # the paper keeps ~15% at the end
  assert not _setting_diff(configs["demo_nvfp4"], c)


def _suggested(msg):
  return re.findall(r"[\w.]+\.yml", msg)


@pytest.mark.parametrize("name, te, cc, expect", [
    ("llama3_8b_nvfp4", False, None, "demo_nvfp4.yml"),
    ("llama3_8b_nvfp4", True, 9.0, "proxy_1gpu_nvfp4.yml"),
    ("llama3_8b_nvfp4", True, (10, 0), None),
    ("llama3_8b_fp8", False, 9.0, "proxy_1gpu_fp8.yml"),
    ("llama3_8b_fp8", True, 9.0, None),  # TE FP8 runs on Hopper
    ("llama3_8b_fp8", True, 8.0, "proxy_1gpu_fp8.yml"),
    ("llama3_8b_bf16", False, 9.0, "attention=dot_product"),
    ("llama3.1_405b_nvfp4", True, 9.0, "proxy_1gpu_nvfp4.yml"),
    ("llama3.1_405b_fp8", False, None, "demo_bf16.yml"),
    ("llama3_8b_nvfp4_c4", False, 10.0, "proxy_1gpu_nvfp4.yml"),
    ("proxy_1gpu_nvfp4", False, None, None),
])
def test_check_hardware(configs, name, te, cc, expect):
  msg = recipes.check_hardware(configs[name], te_available=te, gpu_cc=cc)
  # Same answer from the recipe file alone (what the train entry point checks before MaxText starts).
  assert recipes.check_argv([None, os.path.join(RECIPES, name + ".yml")], te_available=te, gpu_cc=cc) == msg
  if expect is None:
    assert msg is None
    return
  assert msg and "\n" not in msg and expect in msg, msg
  assert ("Transformer Engine" in msg) and (("not installed" in msg) == (not te))
  for suggested in _suggested(msg):  # a packaged recipe, never the one being run
    assert os.path.isfile(recipes.find_recipe(suggested)) and suggested != name + ".yml", suggested


def test_check_argv_applies_overrides():
  path = os.path.join(RECIPES, "llama3_8b_nvfp4.yml")
  assert recipes.check_argv([None, path], te_available=False, gpu_cc=None)
  assert recipes.check_argv([None, path, "attention=dot_product"], te_available=False, gpu_cc=None)  # backend=te
  assert recipes.check_argv([None, path, "attention=dot_product", "nvfp4_backend=emulate"], te_available=False,
                            gpu_cc=None) is None
  assert recipes.check_argv([None, "demo_nvfp4.yml", "nvfp4_backend=te"], te_available=False, gpu_cc=None)
  assert recipes.find_recipe("demo_nvfp4") == os.path.join(RECIPES, "demo_nvfp4.yml")
  with pytest.raises(recipes.RecipeError):
    recipes.find_recipe("no_such_recipe.yml")


def test_load_recipe_follows_the_chain_child_over_parent():
  c = recipes.load_recipe(os.path.join(RECIPES, "llama3_8b_nvfp4_c4.yml"))
  assert c["run_name"] == "llama3_8b_nvfp4_c4" and c["steps"] == 10000  # c4 base over llama3_8b_base (steps: 50)
  assert c["base_emb_dim"] == 4096 and c["base_config"] == "llama3_8b_c4_base.yml"  # the top file's key
  assert c["log_period"] == 100  # a key only MaxText's base.yml sets: the chain reaches it


# pydantic turns these into other types/values after the YAML merge (enums, dtypes, rules, derived paths)
_COERCED = {"logical_axis_rules", "data_sharding", "dtype", "weight_dtype", "grad_dtype", "mu_dtype", "tokenizer_path"}


@pytest.mark.parametrize("name", RUNNABLE)
def test_reader_gives_every_recipe_key_as_maxtext_builds_it(configs, resolved, name):
  """The one reader (train's start-up checks, doctor) equals pyconfig.initialize on every key the recipe
  chain sets, for every packaged recipe."""
  r = resolved[name]  # recipes.resolve([recipes/<name>.yml])
  mine = {k: r.values[k] for k, src in r.sources.items() if src in r.chain[:-1] and k not in _COERCED
          and k != "base_config"}
  assert mine and {k: configs[name][k] for k in mine} == {k: _value(v) for k, v in mine.items()}


# The demo pair's README flow (prepare-data, then both demo recipes trained on the embedded corpus with an eval)
# runs once, in tests/tools/test_reproduce.py::test_demo_pair_end_to_end (through `reproduce demo`).


def test_detect_hardware_does_not_start_jax():
  """It runs before jax.distributed.initialize in multi-process jobs, so it must not touch JAX."""
  import subprocess  # pylint: disable=import-outside-toplevel
  import sys  # pylint: disable=import-outside-toplevel

  code = ("import sys; from maxtext_nvfp4.tools import recipes; te, cc = recipes.detect_hardware(); "
          "print(type(te).__name__, cc, 'jax' in sys.modules)")
  r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
  te, cc, jax_loaded = r.stdout.split()
  assert r.returncode == 0 and te == "bool" and jax_loaded == "False", r.stdout + r.stderr
