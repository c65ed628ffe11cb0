"""``python -m maxtext_nvfp4.sft | .distill RECIPE [key=value ...]``: MaxText's own post-training with the plugin.

Also ``maxtext-nvfp4 sft ...`` / ``maxtext-nvfp4 distill ...``. The command line is the train command's
(:func:`maxtext_nvfp4.tools.train.run_trainer`: the same recipe lookup, checks, one-line errors with exit code
2, conveniences and run record), then MaxText's trainer runs unchanged (its logs, metrics, checkpoints):

* ``sft``: ``maxtext.trainers.post_train.sft.train_sft_native`` -- the pre-training loop with ``use_sft=True``
  (prompt/completion or chat data, loss on the completion by default), from a checkpoint;
* ``distill``: ``maxtext.trainers.post_train.distillation.train_distill`` -- a student (the recipe, with
  ``student_overrides``) learns from a frozen teacher (the recipe's YAML with ``teacher_overrides``; MaxText
  gives the teacher no command-line key). QAD = an NVFP4 student distilled from its own bf16 checkpoint.

Checked before MaxText starts, each one line and exit code 2 (on top of the train command's checks):

* a checkpoint to start from: ``load_parameters_path`` (the student / the model; also
  ``teacher_overrides.load_parameters_path``) must name a MaxText checkpoint: a run's ``checkpoints/`` folder
  (its latest committed step is used), a step folder, or its ``items`` folder (the line says how to make one);
* the checkpoint's shapes against the recipe's model (:mod:`maxtext_nvfp4.tools.model_shapes`: every dimension
  that differs, with both values and the key);
* teacher against student: the vocabulary and the batch shape they share (MaxText's own checks raise a
  traceback), each checkpoint against its own config;
* MaxText versions and environments that cannot run the trainer (distillation needs Tunix).

Conveniences: the checkpoint given as a run folder is resolved to its items folder and said; the SFT run
records ``use_sft=true`` (so ``export`` calibrates on the SFT data); the teacher gets the keys this command adds
for the machine (``skip_jax_distributed_system``, the default ``tokenizer_path``, the absolute
``base_output_directory``), since MaxText hands it none of the command line.
"""

from __future__ import annotations

import os
import sys

from maxtext_nvfp4.tools import train as train_cli

# distillation: keys the teacher must share with the student (MaxText builds both from one input pipeline)
SHARED_BATCH_KEYS = ("per_device_batch_size", "max_target_length", "gradient_accumulation_steps")
# keys this command (or the user, for the machine) sets on the command line that the teacher needs too
MACHINE_KEYS = ("skip_jax_distributed_system", "hardware", "tokenizer_path", "tokenizer_type",
                "base_output_directory", "attention")

_HOW_TO_GET_ONE = ("make one with `python -m maxtext_nvfp4.train demo_bf16 enable_checkpointing=true` (the CPU"
                   " demo: runs/demo_bf16/checkpoints), or convert a Hugging Face model with MaxText's"
                   " checkpoint_conversion.to_maxtext (docs/posttrain.md)")


def _usage(command: str) -> str:
  what = ("MaxText's SFT (the pre-training loop with use_sft=True) from a checkpoint" if command == "sft" else
          "MaxText's distillation: a student (the recipe) learns from a frozen teacher (teacher_overrides)")
  return (f"usage: python -m maxtext_nvfp4.{command} [RECIPE] [key=value ...] | --list | --version\n"
          f"  {what}; RECIPE: a .yml path or a packaged recipe name (--list; e.g. "
          f"{'sft_demo_nvfp4' if command == 'sft' else 'distill_demo_nvfp4'}); keys: MaxText's and nvfp4_*"
          " (nvfp4_qat=full|forward|serving; docs/posttrain.md)")


def _error(message: str) -> Exception:
  from maxtext_nvfp4.tools import recipes  # pylint: disable=import-outside-toplevel

  return recipes.RecipeError(message)


def _set(args: list[str], key: str, value) -> list[str]:
  """``args`` with ``key=value`` replacing any ``key=...`` token (the recipe path stays first)."""
  return [a for a in args if not a.startswith(f"{key}=")] + [f"{key}={value}"]


def start_checkpoint(path, key: str) -> str:
  """The items folder of the checkpoint ``key`` names (a run's checkpoints/, a step or an items folder)."""
  from maxtext_nvfp4.integration import checkpoint  # pylint: disable=import-outside-toplevel

  if not isinstance(path, str) or not path.strip():
    raise _error(f"{key} is not set: nothing to start from; set {key}=<a MaxText run's checkpoints folder>;"
                 f" {_HOW_TO_GET_ONE}")
  if "://" in path:
    return path  # a bucket: MaxText (Orbax) reads it, and says what is wrong
  try:
    return checkpoint.find_items(path)
  except checkpoint.CheckpointError as e:
    raise _error(f"{key}={path}: {' '.join(str(e).split())}; {_HOW_TO_GET_ONE}") from None


def model_view(cfg: dict):
  """The model dimensions of an effective config dict as :func:`model_shapes.config_dimensions` reads a MaxText
  config (``emb_dim`` from ``base_emb_dim`` ...), or None when ``global_parameter_scale`` rescales them."""
  import types  # pylint: disable=import-outside-toplevel

  from maxtext_nvfp4.tools import model_shapes  # pylint: disable=import-outside-toplevel

  if int(cfg.get("global_parameter_scale", 1) or 1) != 1:
    return None
  values = {dim: cfg[key] for dim, key in model_shapes.CONFIG_KEY.items() if cfg.get(key) is not None}
  if cfg.get("num_experts", 1) in (None, 0, 1):
    values.pop("num_experts", None)
    values.pop("moe_mlp_dim", None)
  return types.SimpleNamespace(**values, param_scan_axis=cfg.get("param_scan_axis", 1))


def check_shapes(items: str, cfg: dict, who: str) -> None:
  """One line when the checkpoint ``items`` does not have the model ``cfg`` describes (``who``: whose)."""
  from maxtext_nvfp4.tools import model_shapes  # pylint: disable=import-outside-toplevel

  view = model_view(cfg)
  if view is None or "://" in items:
    return
  try:
    dims = model_shapes.dimensions(model_shapes.parameter_shapes(items), param_scan_axis=int(view.param_scan_axis))
  except Exception as e:  # pylint: disable=broad-exception-caught  (Orbax raises many kinds)
    raise _error(f"{who} checkpoint {items}: cannot read its parameter shapes ({' '.join(str(e).split())[:160]})"
                 ) from None
  bad = model_shapes.mismatches(dims, model_shapes.config_dimensions(view))
  if bad:
    raise _error(f"{who} checkpoint {items} does not have the recipe's model: {'; '.join(bad)}; start from a"
                 " checkpoint of this model, or set the recipe's model keys to the checkpoint's")


def _announce(key: str, given, items: str) -> None:
  if os.path.abspath(str(given)) != items:
    print(f"maxtext-nvfp4: {key}: starting from {items}", flush=True)


# Why LoRA is refused: MaxText applies it (qwix.apply_lora_to_model) only in its Tunix SFT trainer (sft.train_sft),
# which these commands do not run: LoRA never ran with the plugin's GEMMs.
LORA_REFUSAL = ("LoRA (lora.enable_lora=true) is applied only by MaxText's Tunix SFT trainer (sft.train_sft: qwix LoRA"
                " on the model's projections), which maxtext-nvfp4 sft does not run (it runs sft.train_sft_native):"
                " LoRA was never run with quantization=nvfp4; fine-tune every weight instead (lora.enable_lora=false)")


def _lora_error(cfg: dict) -> str | None:
  lora = cfg.get("lora")
  return LORA_REFUSAL if isinstance(lora, dict) and lora.get("enable_lora") else None


def prepare_sft(args: list[str], cfg: dict) -> tuple[list[str], dict]:
  """The sft command's own checks and rewrites (module docstring)."""
  from maxtext_nvfp4.integration import posttrain  # pylint: disable=import-outside-toplevel

  try:
    posttrain.check_importable("sft")
  except posttrain.PosttrainUnavailable as e:
    raise _error(str(e)) from None
  lora = _lora_error(cfg)
  if lora:
    raise _error(lora)
  if cfg.get("load_full_state_path"):
    key, given = "load_full_state_path", cfg["load_full_state_path"]
  else:
    key, given = "load_parameters_path", cfg.get("load_parameters_path")
  items = start_checkpoint(given, key)
  check_shapes(items, cfg, "the")
  _announce(key, given, items)
  args = _set(_set(args, key, items), "use_sft", "true")
  return args, {**cfg, key: items, "use_sft": True}


def _resolved(recipe_path: str) -> dict:
  from maxtext_nvfp4.tools import recipes  # pylint: disable=import-outside-toplevel

  return dict(recipes.resolve([recipe_path]).values)


def prepare_distill(args: list[str], cfg: dict) -> tuple[list[str], dict]:
  """The distill command's own checks and rewrites (module docstring)."""
  from maxtext_nvfp4.tools import recipes  # pylint: disable=import-outside-toplevel

  lora = _lora_error(cfg)
  if lora:
    raise _error(lora)
  teacher_over = dict(cfg.get("teacher_overrides") or {})
  student_over = dict(cfg.get("student_overrides") or {})
  student = {**cfg, **student_over}
  s_items = start_checkpoint(student.get("load_parameters_path"), "load_parameters_path")
  check_shapes(s_items, student, "the student's")
  _announce("load_parameters_path", student.get("load_parameters_path"), s_items)
  args = _set(args, "load_parameters_path", s_items)
  cfg = {**cfg, "load_parameters_path": s_items}
  if cfg.get("offline_data_dir"):
    return _runnable(args, cfg)
  # MaxText builds the teacher from the recipe file alone (no command-line key) plus teacher_overrides
  recipe_path = args[0] if args and "=" not in args[0] else None
  teacher = {**(_resolved(recipe_path) if recipe_path else {}), **teacher_over}
  t_items = start_checkpoint(teacher.get("load_parameters_path"), "teacher_overrides.load_parameters_path")
  for key in ("vocab_size", *SHARED_BATCH_KEYS):
    if student.get(key) != teacher.get(key):
      where = "teacher_overrides" if key in teacher_over else "the recipe file (the teacher gets no command-line key)"
      raise _error(f"teacher/student mismatch: {key} is {teacher.get(key)} for the teacher ({where}) and"
                   f" {student.get(key)} for the student; distillation needs them equal"
                   f"{' (one vocabulary)' if key == 'vocab_size' else ' (one input pipeline feeds both)'}: set"
                   f" {key} in the recipe file, not on the command line or in one side's overrides")
  if str(teacher.get("quantization", "")) == "nvfp4":
    problem = recipes.settings_error(teacher)
    if problem:
      raise _error(f"teacher_overrides: {problem}")
    print("maxtext-nvfp4: the teacher runs quantization=nvfp4 (the recipe's; set teacher_overrides.quantization=''"
          " for a bf16 teacher)", flush=True)
  check_shapes(t_items, teacher, "the teacher's")
  _announce("teacher_overrides.load_parameters_path", teacher.get("load_parameters_path"), t_items)
  args = _set(args, "teacher_overrides.load_parameters_path", t_items)
  return _runnable(args, {**cfg, "teacher_overrides": {**teacher_over, "load_parameters_path": t_items}})


def _runnable(args, cfg):
  """``(args, cfg)`` once the environment can run MaxText's distillation trainer (checked last: a config error is
  worth knowing before installing anything)."""
  from maxtext_nvfp4.integration import posttrain  # pylint: disable=import-outside-toplevel

  try:
    posttrain.check_importable("distill")
  except posttrain.PosttrainUnavailable as e:
    raise _error(str(e)) from None
  return args, cfg


def with_machine_keys_for_teacher(argv: list[str]) -> list[str]:
  """``argv`` (``[prog, RECIPE, key=value ...]``) plus ``teacher_overrides.<key>=<value>`` for each machine key
  set on the command line that the overrides do not set themselves (:data:`MACHINE_KEYS`)."""
  given = {a.split("=", 1)[0] for a in argv[2:] if "=" in a}
  extra = [f"teacher_overrides.{a}" for a in argv[2:]
           if "=" in a and a.split("=", 1)[0] in MACHINE_KEYS and f"teacher_overrides.{a.split('=', 1)[0]}" not in given]
  return [*argv, *extra]


def _run_sft(argv) -> None:
  from maxtext_nvfp4.integration import plugin  # pylint: disable=import-outside-toplevel

  plugin.run_posttrain("sft", argv)


def _run_distill(argv) -> None:
  from maxtext_nvfp4.integration import plugin  # pylint: disable=import-outside-toplevel

  plugin.run_posttrain("distill", with_machine_keys_for_teacher(list(argv)))


def sft_main(argv: list[str]) -> int:
  """``maxtext-nvfp4 sft [RECIPE] [key=value ...]``; returns the exit code."""
  return train_cli.run_trainer(argv, command="sft", runner=_run_sft, usage=_usage("sft"), prepare=prepare_sft)


def distill_main(argv: list[str]) -> int:
  """``maxtext-nvfp4 distill [RECIPE] [key=value ...]``; returns the exit code."""
  return train_cli.run_trainer(argv, command="distill", runner=_run_distill, usage=_usage("distill"),
                               prepare=prepare_distill)


if __name__ == "__main__":
  sys.exit(sft_main(sys.argv[1:]))
