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

* MaxText 0.2.5 installed with pip resolves its default ``tokenizer_path`` to a path that does not exist
  (``site-packages/maxtext/src/maxtext/assets/...``). When the effective config sets no
  ``tokenizer_path`` (command line, recipe chain, ``M_TOKENIZER_PATH``) and no ``model_name`` (whose
  Hugging Face tokenizer MaxText picks itself), we pass ``<maxtext package>/assets/tokenizers/tokenizer.llama2``
  and say so.
* Config errors MaxText finds later (ours and its pydantic ones) end the process with exit code 2 and
  the one-line ``MAXTEXT CONFIG ERROR: ...`` message, without a traceback. (MaxText itself re-raises
  instead of exiting 2 whenever ``unittest`` is imported, which its own imports do.)
"""

from __future__ import annotations

import os
import sys

import maxtext_nvfp4

_USAGE = ("usage: python -m maxtext_nvfp4.train [RECIPE] [key=value ...] | --list | --version\n"
          "  RECIPE: a .yml path or a packaged recipe name (--list); keys: MaxText's and nvfp4_* (docs/usage.md)")


def _fail(message: str) -> int:
  print(f"maxtext-nvfp4 train: error: {message}", file=sys.stderr, flush=True)
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


def _main_exit_2_on_config_error(argv):
  """``train.main(argv)``, but a config error exits 2 with its one line (MaxText already logged it)."""
  from maxtext_nvfp4.integration import plugin  # pylint: disable=import-outside-toplevel

  try:
    plugin.run_pretrain(argv)
  except _config_error_types() as e:
    print(f"MAXTEXT CONFIG ERROR: {' '.join(str(e).split())}", file=sys.stderr, flush=True)
    sys.exit(2)


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

  With the default ``hardware: tpu`` and checkpointing on, MaxText 0.2.5 calls
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


def check_command_line(args: list[str]) -> tuple[list[str], dict]:
  """``(args with the recipe resolved to its path, effective config)``, or :class:`recipes.RecipeError` /
  :class:`settings.SettingsError` with the one line to print: everything :func:`cli_main` refuses before
  MaxText starts (see the module docstring). Imports MaxText's config schema (for unknown keys) only."""
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
  problem = (nvfp4 and recipes.settings_error(cfg)) or hardware_error(args, cfg) or recipes.missing_data_error(cfg)
  if problem:
    raise recipes.RecipeError(problem)
  return args, cfg


def cli_main(argv: list[str]) -> int:
  """``maxtext-nvfp4 train [RECIPE] [key=value ...]``; returns the process exit code."""
  args = list(argv)
  if args and args[0] in ("-h", "--help"):
    print(_USAGE)
    return 0
  if args and args[0] in ("--list", "--version"):
    from maxtext_nvfp4.tools import recipes  # pylint: disable=import-outside-toplevel

    print(recipes.recipes_listing() if args[0] == "--list" else f"maxtext-nvfp4 {maxtext_nvfp4.__version__}")
    return 0
  if args and args[0].startswith("-"):
    return _fail(f"unknown option {args[0]!r}; usage: python -m maxtext_nvfp4.train [RECIPE] [key=value ...]"
                 " (--list shows the packaged recipes)")
  try:
    args, cfg = check_command_line(args)
  except _config_error_types() as e:
    return _fail(" ".join(str(e).split()))
  ensure_metrics_dir(args, cfg)
  # Step lines must reach a log file line by line (a killed run otherwise loses its buffered tail).
  for stream in (sys.stdout, sys.stderr):
    if hasattr(stream, "reconfigure"):
      stream.reconfigure(line_buffering=True)
  maxtext_nvfp4.register()
  args = with_single_host_cpu_defaults(with_default_tokenizer(args, cfg), cfg)
  from absl import app  # pylint: disable=import-outside-toplevel

  try:
    app.run(_main_exit_2_on_config_error, argv=["maxtext_nvfp4.train", *args])
  except SystemExit as e:
    return e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
  return 0


if __name__ == "__main__":
  sys.exit(cli_main(sys.argv[1:]))
