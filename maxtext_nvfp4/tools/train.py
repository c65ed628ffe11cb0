"""``python -m maxtext_nvfp4.train RECIPE.yml [key=value ...]``: MaxText pre-training with the plugin registered.

Runs ``absl.app.run(maxtext.trainers.pre_train.train.main)`` (so MaxText's per-step
``completed step: ...`` lines are logged) after :func:`maxtext_nvfp4.register`. The backend choice and
the decoder GEMM precision table are logged once when MaxText builds the model. Also ``maxtext-nvfp4
train ...`` (:func:`cli_main`).

``RECIPE`` is a path or a packaged recipe name (``demo_nvfp4``; ``--list`` shows them), found and read
by :mod:`maxtext_nvfp4.tools.recipes` exactly as MaxText will read it. Before MaxText starts (no JAX
backend, nothing compiled, nothing written), the command line is checked and every problem ends the
process with ONE line on stderr and exit code 2: a recipe that is missing, unreadable, a folder, not
``.yml``, not YAML or not a mapping; a token that is not ``key=value``; a config key MaxText does not
know (with "did you mean"); a value of the wrong type for its MaxText field (``steps=abc``); an invalid
``nvfp4_*`` value; a local grain dataset that matches no file (for the demo data: how to
build it); hardware the recipe needs (with the proxy to use instead).

Conveniences over calling MaxText directly:

* MaxText installed with pip resolves its default ``tokenizer_path`` to a path that does not exist
  (``site-packages/maxtext/src/maxtext/assets/...``). When the effective config sets no
  ``tokenizer_path`` (command line, recipe chain, ``M_TOKENIZER_PATH``) and no ``model_name`` (whose
  Hugging Face tokenizer MaxText picks itself), we pass ``<maxtext package>/assets/tokenizers/tokenizer.llama2``
  and say so.
* Config errors MaxText finds later (ours and its pydantic ones) end the process with exit code 2 and
  one line, ``maxtext-nvfp4 train: error: ...``, without a traceback. (MaxText itself re-raises
  instead of exiting 2 whenever ``unittest`` is imported, which its own imports do.)
* MaxText's and its libraries' misleading messages (``[NO-OP] ... dependency missing``, "PyTorch was not
  found", the AQT deprecation for nvfp4, ...) are hidden, and one line says so
  (:mod:`maxtext_nvfp4.integration.log_filter`; ``MAXTEXT_NVFP4_VERBOSE=1`` shows them).
"""

from __future__ import annotations

import dataclasses
import math
import os
import re
import sys

import maxtext_nvfp4
from maxtext_nvfp4.core import implementations

_USAGE = ("usage: python -m maxtext_nvfp4.train [RECIPE] [key=value ...] | --list | --version\n"
          "  RECIPE: a .yml path or a packaged recipe name (--list); keys: MaxText's and nvfp4_* (docs/usage.md)")


def _fail(message: str, command: str = "train") -> int:
  print(f"maxtext-nvfp4 {command}: error: {message}", file=sys.stderr, flush=True)
  return 2


def default_tokenizer_path() -> str:
  """``<maxtext package>/assets/tokenizers/tokenizer.llama2`` (ships in the MaxText wheel)."""
  from maxtext_nvfp4.integration import touchpoints  # pylint: disable=import-outside-toplevel

  return os.path.join(touchpoints.maxtext_package_dir(), "assets", "tokenizers", "tokenizer.llama2")


def with_default_tokenizer(args: list[str], cfg: dict | None = None) -> list[str]:
  """``args`` (``[RECIPE] key=value ...``) plus ``tokenizer_path=<default>`` when the effective config sets
  neither ``tokenizer_path`` nor a ``model_name``. ``cfg``: :func:`_effective` of ``args`` if known."""
  cfg = _effective(args) if cfg is None else cfg
  if cfg.get("tokenizer_path") or str(cfg.get("model_name", "default") or "default") != "default":
    return args
  path = default_tokenizer_path()
  print(f"maxtext-nvfp4: no tokenizer_path given; using {path} (MaxText's pip-install default points to a"
        " missing file)", flush=True)
  return [*args, f"tokenizer_path={path}"]


def _config_error_types() -> tuple[type, ...]:
  import pydantic  # pylint: disable=import-outside-toplevel

  from maxtext_nvfp4.core import settings  # pylint: disable=import-outside-toplevel

  from maxtext_nvfp4.backends import capability  # pylint: disable=import-outside-toplevel

  from maxtext_nvfp4.tools import recipes  # pylint: disable=import-outside-toplevel

  from maxtext_nvfp4.integration import maxtext_versions  # pylint: disable=import-outside-toplevel

  return (settings.SettingsError, pydantic.ValidationError, capability.BackendError, recipes.RecipeError,
          maxtext_versions.MaxTextVersionError)


def config_error_line(e: Exception, command: str = "train") -> str:
  """The one stderr line for a config error found once MaxText runs: ours (``maxtext-nvfp4 train: error:
  <key>=<value> ...``), or MaxText's pydantic validation text joined into one line and said to be MaxText's."""
  import pydantic  # pylint: disable=import-outside-toplevel

  text = " ".join(str(e).split())
  if isinstance(e, pydantic.ValidationError):
    text = f"MaxText refused the config: {text}"
  return f"maxtext-nvfp4 {command}: error: {text}"


def _pretrain(argv) -> None:
  from maxtext_nvfp4.integration import plugin  # pylint: disable=import-outside-toplevel

  plugin.run_pretrain(argv)


def _exit_2_on_config_error(runner, command: str):
  """``runner(argv)`` (a MaxText ``main``), but a config error exits 2 with its one line
  (:func:`config_error_line`; the log filter keeps MaxText's own ``MAXTEXT CONFIG ERROR`` banner of it out of
  the log)."""
  def main(argv):
    try:
      runner(argv)
    except _config_error_types() as e:
      print(config_error_line(e, command), file=sys.stderr, flush=True)
      sys.exit(2)
  return main


def _effective(args: list[str]) -> dict:
  """The command line's effective keys (:func:`recipes.resolve`); raises :class:`recipes.RecipeError`."""
  from maxtext_nvfp4.tools import recipes  # pylint: disable=import-outside-toplevel

  return dict(recipes.resolve(args).values)


def hardware_error(args: list[str], cfg: dict | None = None) -> str | None:
  """Why this machine cannot run the recipe (TE FP8, TE attention, ``nvfp4_backend=te``), or None.

  Checked before MaxText starts (no JAX backend is initialized: safe before ``jax.distributed``), so a
  Blackwell recipe on the wrong machine stops at once with the matching proxy/emulated recipe named.
  ``cfg``: :func:`_effective` of ``args`` when the caller already has it.
  """
  from maxtext_nvfp4.tools import recipes  # pylint: disable=import-outside-toplevel

  te, cc = recipes.detect_hardware()
  recipe = args[0] if args and "=" not in args[0] else None
  return recipes.check_hardware(_effective(args) if cfg is None else cfg, te_available=te, gpu_cc=cc, recipe=recipe)


def ensure_metrics_dir(args: list[str], cfg: dict | None = None) -> None:
  """MaxText appends to ``metrics_file`` without creating its folder; create it (``runs/`` in recipes)."""
  path = (_effective(args) if cfg is None else cfg).get("metrics_file")
  if isinstance(path, str) and path and "://" not in path and os.path.dirname(path):
    os.makedirs(os.path.dirname(path), exist_ok=True)


def _accelerator_present() -> bool:
  """An NVIDIA GPU (nvidia-smi) or a TPU (/dev/accel*, /dev/vfio) on this host; JAX is not touched."""
  import glob  # pylint: disable=import-outside-toplevel
  import shutil  # pylint: disable=import-outside-toplevel

  return bool(shutil.which("nvidia-smi") or glob.glob("/dev/accel*") or os.path.isdir("/dev/vfio"))


def with_single_host_cpu_defaults(args: list[str], cfg: dict | None = None) -> list[str]:
  """``skip_jax_distributed_system=true`` for a single process on a host without accelerators.

  With the default ``hardware: tpu`` and checkpointing on, MaxText calls
  ``jax.distributed.initialize()`` and fails on a CPU-only host ("coordinator_address should be
  defined"). Not added when the user sets the key, asks for a multi-process hardware mode, or a JAX
  coordinator is configured in the environment.
  """
  if any(a.startswith("skip_jax_distributed_system=") for a in args):
    return args
  if "JAX_COORDINATOR_ADDRESS" in os.environ or _accelerator_present():
    return args
  cfg = _effective(args) if cfg is None else cfg
  if str(cfg.get("hardware", "tpu")) not in ("tpu", ""):
    return args
  if not cfg.get("enable_checkpointing", True) or cfg.get("skip_jax_distributed_system"):
    return args
  print("maxtext-nvfp4: no accelerator on this host; passing skip_jax_distributed_system=true (single process)",
        flush=True)
  return [*args, "skip_jax_distributed_system=true"]


# keys whose relative paths MaxText resolves against the working directory (recorded absolute for export)
PATH_KEYS = ("tokenizer_path", "grain_train_files", "grain_eval_files", "metrics_file", "hf_data_dir")


def with_absolute_output_dir(args: list[str], cfg: dict) -> tuple[list[str], dict]:
  """``base_output_directory`` made absolute (Orbax refuses a relative checkpoint path, after compiling:
  "Checkpoint path should be absolute"). The recipes say ``runs``: resolved against the working directory,
  as MaxText resolves ``metrics_file``. Set where the value came from (command line or ``M_`` variable)."""
  base = cfg.get("base_output_directory")
  if not isinstance(base, str) or not base or "://" in base or os.path.isabs(base):
    return args, cfg
  absolute = os.path.abspath(os.path.expanduser(base))
  if "M_BASE_OUTPUT_DIRECTORY" in os.environ:
    os.environ["M_BASE_OUTPUT_DIRECTORY"] = absolute
  else:
    args = [a for a in args if not a.startswith("base_output_directory=")] + [f"base_output_directory={absolute}"]
  return args, {**cfg, "base_output_directory": absolute}


def _host_cpu_devices() -> int:
  """JAX's CPU device count on this host, without starting JAX (``--xla_force_host_platform_device_count``)."""
  m = re.search(r"--xla_force_host_platform_device_count=(\d+)", os.environ.get("XLA_FLAGS", ""))
  return int(m.group(1)) if m else 1


def mesh_problem(cfg: dict, devices: int) -> str | None:
  """Why MaxText's mesh of ``cfg`` cannot be built from ``devices`` devices in one slice (MaxText asserts
  "Number of devices per slice ... does not match the product of the ICI parallelism"), or None."""
  def axes(prefix):
    return {k: int(v) for k, v in cfg.items() if re.fullmatch(prefix + r"_\w+_parallelism", k)
            and isinstance(v, int) and not isinstance(v, bool)}

  ici, dcn = axes("ici"), axes("dcn")
  fixed = math.prod(v for v in ici.values() if v > 0)
  fill = any(v == -1 for v in ici.values())
  slices = math.prod(v for v in dcn.values() if v > 0)
  if slices > 1:
    keys = ", ".join(f"{k}={v}" for k, v in dcn.items() if v > 1)
    return f"{keys} asks for {slices} slices (this host is one)"
  if (devices % fixed != 0) if fill else (fixed != devices):
    keys = " x ".join(f"{k}={v}" for k, v in ici.items() if v > 1) or "the ICI parallelism"
    many = sum(v > 1 for v in ici.values()) > 1
    return (f"{keys} needs {fixed} devices per slice, but this host has {devices} CPU device"
            f"{'s' if devices != 1 else ''} ({'set them to 1, or one to -1' if many else 'set it to 1 or -1'})")
  return None


def cpu_host_error(args: list[str], cfg: dict) -> str | None:
  """On a host without accelerators: one line naming EVERY setting of a GPU-node recipe that cannot run
  here (``attention=cudnn_flash_te``, ``nvfp4_backend=te``, a mesh for more devices) and the CPU-sized
  recipe to use, so fixing one does not reveal the next. None when nothing but TE quantization is amiss
  (:func:`hardware_error` says that) or when an accelerator or a JAX coordinator is present."""
  if _accelerator_present() or "JAX_COORDINATOR_ADDRESS" in os.environ:
    return None
  from maxtext_nvfp4.tools import recipes  # pylint: disable=import-outside-toplevel

  needs = [what for what, _ in recipes.requirements(cfg)]
  attention = any(w.startswith("attention=") for w in needs)
  mesh = mesh_problem(cfg, _host_cpu_devices())
  if not attention and mesh is None:
    return None
  nvfp4 = str(cfg.get("quantization", "")) == "nvfp4"
  blockers = []
  if attention:
    blockers.append("attention=cudnn_flash_te needs Transformer Engine on an NVIDIA GPU (set attention=dot_product)")
  insisted = implementations.insisted(cfg.get("nvfp4_backend", implementations.AUTO))
  if nvfp4 and insisted is not None and insisted.min_compute_capability is not None:
    blockers.append(f"nvfp4_backend={insisted.name} needs TE on Blackwell (set nvfp4_backend=emulate)")
  for w in needs:
    if w.startswith("quantization=") and not w.startswith("quantization=nvfp4"):
      blockers.append(f"{w} needs Transformer Engine on an NVIDIA GPU")
  if mesh:
    blockers.append(mesh)
  recipe = os.path.basename(args[0]) if args and "=" not in args[0] else "this config"
  alt = "demo_nvfp4.yml (CPU-sized, exact NVFP4 emulation)" if nvfp4 else "demo_bf16.yml (CPU-sized)"
  tail = "" if recipe.startswith("demo_") else f"; on CPU use {alt} instead"
  return f"{recipe} cannot run on this host (no GPU or TPU): {'; '.join(blockers)}{tail}"


def expert_parallel_error(cfg: dict) -> str | None:
  """One line when an expert-parallel-only MoE flag is on while expert parallelism is 1, else None."""
  if cfg.get("override_logical_axis_rules") or not isinstance(cfg.get("num_experts", 1), int):
    return None
  ep = {k: cfg.get(k, 1) for k in ("ici_expert_parallelism", "dcn_expert_parallelism")}
  if not all(isinstance(v, int) and v >= 1 for v in ep.values()) or math.prod(ep.values()) > 1:
    return None
  from maxtext_nvfp4.integration import touchpoints  # pylint: disable=import-outside-toplevel

  for flag, off in touchpoints.adapter().ep_only_flags.items():
    if flag in cfg and cfg[flag] != off and cfg[flag] is not None:
      value = str(cfg[flag]).lower() if isinstance(cfg[flag], bool) else cfg[flag]
      return (f"{flag}={value} works only with expert parallelism, but ici_expert_parallelism="
              f"{ep['ici_expert_parallelism']} and dcn_expert_parallelism={ep['dcn_expert_parallelism']}; set"
              f" {flag}={str(off).lower()}, or ici_expert_parallelism > 1")
  return None


def moe_error(cfg: dict) -> str | None:
  """The plugin's one-line MoE refusals (``te_moe_block``, ``use_batch_split_schedule``, the sparse path's
  ``use_ring_of_experts`` / expert parallelism), asked before MaxText starts: inside MaxText's pydantic
  validation they would arrive wrapped in its multi-line error text. None when fine or not decidable here."""
  if str(cfg.get("quantization", "")) != "nvfp4" or not isinstance(cfg.get("num_experts", 1), int) \
      or int(cfg.get("num_experts", 1)) <= 1:
    return None
  import types  # pylint: disable=import-outside-toplevel

  from maxtext_nvfp4.core import settings  # pylint: disable=import-outside-toplevel

  try:
    from maxtext_nvfp4.integration import moe_refusals  # pylint: disable=import-outside-toplevel

    ns = types.SimpleNamespace(**{**cfg, "num_decoder_layers": int(cfg.get("base_num_decoder_layers", 0))})
    moe_refusals.check_model(ns, settings.from_config(ns), "emulate", num_devices=None)
  except settings.SettingsError as e:
    return " ".join(str(e).split())
  except Exception:  # pylint: disable=broad-exception-caught  (not decidable from the keys: MaxText will say)
    return None
  return None


def te_shapes_error(cfg: dict) -> str | None:
  """With ``nvfp4_backend=te``: the TE backend's one-line refusal of a decoder GEMM shape TE cannot run
  (decided from the keys alone, before any device check), else None."""
  insisted = implementations.insisted(cfg.get("nvfp4_backend", implementations.AUTO))
  if str(cfg.get("quantization", "")) != "nvfp4" or insisted is None or not insisted.stops_at_te_limits:
    return None
  from maxtext_nvfp4.backends import capability  # pylint: disable=import-outside-toplevel
  from maxtext_nvfp4.backends import te as te_backend  # pylint: disable=import-outside-toplevel
  from maxtext_nvfp4.integration import parsed_config  # pylint: disable=import-outside-toplevel

  try:
    run = parsed_config.parse(cfg)
    te_backend.check_te_gemms(run.settings, run.layout)
  except capability.BackendError as e:
    return str(e)
  return None


def check_command_line(args: list[str], *, compile_only: bool = False) -> tuple[list[str], dict]:
  """``(args with the recipe resolved to its path, effective config)``, or :class:`recipes.RecipeError` /
  :class:`settings.SettingsError` with the one line to print: everything :func:`cli_main` refuses before
  MaxText starts (see the module docstring). Imports MaxText's config schema (for unknown keys) only.

  ``compile_only``: for an ahead-of-time compile (``train_compile``), which needs neither this host's hardware
  nor the dataset: those checks are skipped."""
  from maxtext_nvfp4.integration import config_errors  # pylint: disable=import-outside-toplevel
  from maxtext_nvfp4.tools import recipes  # pylint: disable=import-outside-toplevel

  resolved = recipes.resolve(args)
  if args and "=" not in args[0]:
    args = [resolved.path, *args[1:]]  # MaxText needs the .yml path (it would look for a bare name in src/)
  cfg = dict(resolved.values)
  known = set(config_errors.known_config_keys())
  for key in cfg:
    if key not in known and key != "base_config":
      src = resolved.sources.get(key, "")
      where = "on the command line" if src == "command line" else f"(set in {src})" if src else ""
      raise config_errors.unknown_key_error(key, where)
  maxtext_base = os.path.join(recipes.maxtext_configs_dir(), "base.yml")  # its values are MaxText's own
  bad_type = config_errors.field_error(cfg, [k for k, src in resolved.sources.items() if src != maxtext_base])
  if bad_type is not None:
    raise bad_type
  nvfp4 = str(cfg.get("quantization", "")) == "nvfp4"  # MaxText checks nvfp4_* keys for this mode only
  here = not compile_only
  problem = ((nvfp4 and recipes.settings_error(cfg)) or te_shapes_error(cfg) or (here and cpu_host_error(args, cfg))
             or (here and hardware_error(args, cfg))
             or moe_error(cfg) or expert_parallel_error(cfg) or (here and recipes.missing_data_error(cfg)))
  if problem:
    raise recipes.RecipeError(problem)
  return args, cfg


def cli_main(argv: list[str]) -> int:
  """``maxtext-nvfp4 train [RECIPE] [key=value ...]``; returns the process exit code."""
  return run_trainer(argv, command="train", runner=_pretrain, usage=_USAGE)


def run_trainer(argv: list[str], *, command: str, runner, usage: str, prepare=None) -> int:
  """The trainer command line (:func:`cli_main` and the post-training commands of
  :mod:`maxtext_nvfp4.tools.posttrain`): check it (exit 2 and one line ``maxtext-nvfp4 <command>: error:
  ...``), register the plugin, then ``runner(argv)`` -- MaxText's own ``main`` -- under absl.

  ``prepare(args, cfg) -> (args, cfg)``: the command's own checks and rewrites after the common ones (raises
  one of the config error types with its line); ``usage``: the ``--help`` text.
  """
  args = list(argv)
  if args and args[0] in ("-h", "--help"):
    print(usage)
    return 0
  if args and args[0] in ("--list", "--version"):
    from maxtext_nvfp4.tools import recipes  # pylint: disable=import-outside-toplevel

    print(recipes.recipes_listing() if args[0] == "--list" else f"maxtext-nvfp4 {maxtext_nvfp4.__version__}")
    return 0
  if args and args[0].startswith("-"):
    return _fail(f"unknown option {args[0]!r}; usage: python -m maxtext_nvfp4.{command} [RECIPE] [key=value ...]"
                 " (--list shows the packaged recipes)", command)
  try:
    args, cfg = check_command_line(args)
    if prepare is not None:
      args, cfg = prepare(args, cfg)
  except _config_error_types() as e:
    return _fail(" ".join(str(e).split()), command)
  args, cfg = with_absolute_output_dir(args, cfg)
  absent = _absent_folders(cfg)  # what a run MaxText refuses must not leave behind
  ensure_metrics_dir(args, cfg)
  # Step lines must reach a log file line by line (a killed run otherwise loses its buffered tail).
  for stream in (sys.stdout, sys.stderr):
    if hasattr(stream, "reconfigure"):
      stream.reconfigure(line_buffering=True)
  maxtext_nvfp4.register()
  from maxtext_nvfp4.integration import log_filter  # pylint: disable=import-outside-toplevel

  log_filter.install()
  args = with_single_host_cpu_defaults(with_default_tokenizer(args, cfg), cfg)
  record = _record_run(args, cfg)
  from absl import app  # pylint: disable=import-outside-toplevel

  rc = 0
  try:
    app.run(_exit_2_on_config_error(runner, command), argv=[f"maxtext_nvfp4.{command}", *args])
  except SystemExit as e:
    rc = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
  if record:
    _settle_record(record, rc)
  if rc == 2:  # a config error MaxText found: the run did not start
    for folder in absent:
      try:
        os.rmdir(folder)  # only when empty
      except OSError:
        pass
  if rc == 0:
    print(closing_line(command, cfg, record), flush=True)
  return rc


def _absent_folders(cfg: dict) -> list[str]:
  """The local folders a run creates (the metrics file's, ``base_output_directory`` and the run folder under it)
  that do not exist yet, deepest first."""
  from maxtext_nvfp4.tools import run_record  # pylint: disable=import-outside-toplevel

  found = []
  for path in (run_record.run_dir(cfg), cfg.get("base_output_directory"),
               os.path.dirname(str(cfg.get("metrics_file") or ""))):
    if isinstance(path, str) and path and "://" not in path:
      path = os.path.abspath(path)
      while path != os.path.dirname(path) and not os.path.exists(path):
        found.append(path)
        path = os.path.dirname(path)
  return sorted(set(found), key=lambda p: -p.count(os.sep))


def closing_line(command: str, cfg: dict, record: "_Record | None") -> str:
  """The last line of a finished run: where its metrics, run record, checkpoints and TensorBoard events went (and
  the export command when there are checkpoints), so nobody has to read MaxText's config dump to find them."""
  from maxtext_nvfp4.tools import cli  # pylint: disable=import-outside-toplevel
  from maxtext_nvfp4.tools import run_record  # pylint: disable=import-outside-toplevel

  folder = run_record.run_dir(cfg)
  metrics = cfg.get("metrics_file")
  metrics = "not written (metrics_file is empty)" if not metrics else \
      metrics if "://" in str(metrics) else os.path.abspath(str(metrics))
  parts = [f"metrics {metrics}"]
  if folder is None:
    base = cfg.get("base_output_directory") or "(MaxText's default)"
    parts.append(f"checkpoints and TensorBoard events under {base}/<run_name> (no run record: not a local run folder)")
    return f"maxtext-nvfp4 {command}: done; " + "; ".join(parts)
  recorded = record is not None and os.path.isfile(record.path)
  parts.append(f"run record {record.path if recorded else 'not written'}")
  steps = sorted(_checkpoint_steps(folder), key=int)
  ckpt = os.path.join(folder, "checkpoints")
  if steps:
    parts.append(f"checkpoints {ckpt} (step{'s' if len(steps) > 1 else ''} {', '.join(steps[-3:])}"
                 f"{', ...' if len(steps) > 3 else ''})")
  else:
    parts.append("no checkpoints (enable_checkpointing=true writes them)" if not cfg.get("enable_checkpointing", True)
                 else f"no checkpoints in {ckpt}")
  tb = os.path.join(folder, "tensorboard")
  if os.path.isdir(tb):
    parts.append(f"TensorBoard {tb}")
  line = f"maxtext-nvfp4 {command}: done; " + "; ".join(parts)
  if steps and recorded:
    synthetic = str(cfg.get("dataset_type", "")) == "synthetic"  # export calibrates on the run's eval data
    line += (f"\nnext: {cli.shell_command()} export {ckpt} --out {folder}_hf"
             + (" --weights-only" if synthetic else "") + "   (docs/export.md)")
  return line


@dataclasses.dataclass(frozen=True, kw_only=True)
class _Record:
  """The run record this launch wrote, and what it replaced (so a launch that changes nothing can take it back)."""

  # the record's path (<run folder>/maxtext_nvfp4_run.json)
  path: str
  # whether this launch created the run folder
  created: bool
  # the record an earlier launch left there (its text), or None
  previous: str | None
  # the checkpoint steps in <run folder>/checkpoints before MaxText started
  checkpoints: frozenset[str]


def _checkpoint_steps(folder: str) -> frozenset[str]:
  try:
    return frozenset(n for n in os.listdir(os.path.join(folder, "checkpoints")) if n.isdigit())
  except OSError:
    return frozenset()


def _record_run(args: list[str], cfg: dict) -> _Record | None:
  """Write :mod:`maxtext_nvfp4.tools.run_record` beside the run's checkpoints (a local run with a
  ``run_name``), keeping what it replaces for :func:`_settle_record`; None when there is no such folder."""
  from maxtext_nvfp4.tools import run_record  # pylint: disable=import-outside-toplevel

  folder = run_record.run_dir(cfg)
  if folder is None:
    return None
  if args and args[0].endswith(".yml"):
    args = [os.path.abspath(args[0]), *args[1:]]
  absolute = [f"{k}={os.path.abspath(v)}" for k in PATH_KEYS for v in [cfg.get(k)]
              if isinstance(v, str) and v and "://" not in v and not os.path.isabs(v) and v != "default"]
  created = not os.path.exists(folder)
  path = os.path.join(folder, run_record.RECORD)
  try:
    with open(path, encoding="utf-8") as f:
      previous = f.read()
  except OSError:
    previous = None
  checkpoints = _checkpoint_steps(folder)
  try:
    path = run_record.write(folder, [*args, *absolute], cfg, maxtext_nvfp4.__version__)
  except OSError as e:
    print(f"maxtext-nvfp4: could not record the run's config in {folder} ({e.strerror}); export will need --config",
          flush=True)
    return None
  return _Record(path=path, created=created, previous=previous, checkpoints=checkpoints)


def _settle_record(record: _Record, rc: int) -> None:
  """After MaxText returned ``rc``: the record must describe the checkpoints it sits beside. A launch that wrote
  no new checkpoint step while earlier ones are there (a config MaxText refused, a crash, a run without
  checkpointing) gives the earlier launch's record back (or removes its own, and the folder it created when
  nothing else is in it); a refused launch (``rc == 2``) always does."""
  folder = os.path.dirname(record.path)
  after = _checkpoint_steps(folder)
  if rc != 2 and (after - record.checkpoints or not record.checkpoints):
    return
  try:
    if record.previous is not None:
      from maxtext_nvfp4.tools import outputs  # pylint: disable=import-outside-toplevel

      outputs.publish_file(record.path, record.previous)
    else:
      os.unlink(record.path)
      if record.created:
        os.rmdir(folder)  # only when empty: MaxText may have written logs there
  except OSError:
    pass


if __name__ == "__main__":
  sys.exit(cli_main(sys.argv[1:]))
