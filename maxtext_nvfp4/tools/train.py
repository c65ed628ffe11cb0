"""``python -m maxtext_nvfp4.train RECIPE.yml [key=value ...]``: MaxText pre-training with the plugin registered.

Runs ``absl.app.run(maxtext.trainers.pre_train.train.main)`` (so MaxText's per-step
``completed step: ...`` lines are logged) after :func:`maxtext_nvfp4.register`. The backend choice and
the decoder GEMM precision table are logged once when MaxText builds the model. Also ``maxtext-nvfp4
train ...`` (:func:`cli_main`).

Two conveniences over calling MaxText directly:

* MaxText 0.2.5 installed with pip resolves its default ``tokenizer_path`` to a path that does not exist
  (``site-packages/maxtext/src/maxtext/assets/...``). When neither the command line, the recipe YAML (or a
  ``base_config`` beside it) nor ``M_TOKENIZER_PATH`` sets ``tokenizer_path``, we pass ``<maxtext package>/assets/tokenizers/tokenizer.llama2``
  and say so.
* Config errors (ours and MaxText's pydantic ones) end the process with exit code 2 and the one-line
  ``MAXTEXT CONFIG ERROR: ...`` message MaxText logs, without a traceback. (MaxText itself re-raises
  instead of exiting 2 whenever ``unittest`` is imported, which its own imports do.)
"""

from __future__ import annotations

import os
import sys

import maxtext_nvfp4

_USAGE = "usage: python -m maxtext_nvfp4.train [RECIPE.yml] [key=value ...]   (MaxText config keys and nvfp4_* keys)"


def _yaml_keys(path: str) -> dict:
  """Top-level keys of a recipe YAML (``{}`` if unreadable; MaxText reports real problems itself)."""
  try:
    import yaml  # pylint: disable=import-outside-toplevel

    with open(path, encoding="utf-8") as f:
      data = yaml.safe_load(f)
    return data if isinstance(data, dict) else {}
  except (OSError, ValueError, ImportError):
    return {}
  except Exception:  # pylint: disable=broad-exception-caught  (yaml.YAMLError)
    return {}


def _yaml_sets_tokenizer(path: str) -> bool:
  """Whether the recipe or a ``base_config`` it inherits from (beside it, as MaxText looks first) sets one.

  MaxText's packaged base.yml has ``tokenizer_path: ""``, so a chain ending there sets none.
  """
  for _ in range(16):  # base_config chains are short; a cycle must not hang us
    keys = _yaml_keys(path)
    if keys.get("tokenizer_path"):
      return True
    base = keys.get("base_config")
    if not isinstance(base, str):
      return False
    path = base if os.path.isabs(base) else os.path.join(os.path.dirname(path), base)
    if not os.path.isfile(path):
      return False
  return False


def default_tokenizer_path() -> str:
  """``<maxtext package>/assets/tokenizers/tokenizer.llama2`` (ships in the MaxText wheel)."""
  from maxtext_nvfp4.integration import touchpoints  # pylint: disable=import-outside-toplevel

  return os.path.join(touchpoints.maxtext_package_dir(), "assets", "tokenizers", "tokenizer.llama2")


def with_default_tokenizer(args: list[str]) -> list[str]:
  """``args`` (``[RECIPE.yml] key=value ...``) plus ``tokenizer_path=<default>`` when nothing sets it."""
  if any(a.startswith("tokenizer_path=") for a in args) or "M_TOKENIZER_PATH" in os.environ:
    return args
  if args and args[0].endswith(".yml") and _yaml_sets_tokenizer(args[0]):
    return args
  path = default_tokenizer_path()
  print(f"maxtext-nvfp4: no tokenizer_path given; using {path} (MaxText's pip-install default points to a"
        " missing file)", flush=True)
  return [*args, f"tokenizer_path={path}"]


def _config_error_types() -> tuple[type, ...]:
  import pydantic  # pylint: disable=import-outside-toplevel

  from maxtext_nvfp4.core import settings  # pylint: disable=import-outside-toplevel

  from maxtext_nvfp4.backends import capability  # pylint: disable=import-outside-toplevel

  return (settings.SettingsError, pydantic.ValidationError, capability.BackendError)


def _main_exit_2_on_config_error(argv):
  """``train.main(argv)``, but a config error exits 2 with its one line (MaxText already logged it)."""
  from maxtext_nvfp4.integration import plugin  # pylint: disable=import-outside-toplevel

  try:
    plugin.run_pretrain(argv)
  except _config_error_types() as e:
    print(f"MAXTEXT CONFIG ERROR: {' '.join(str(e).split())}", file=sys.stderr, flush=True)
    sys.exit(2)


def _effective(args: list[str]) -> dict:
  """The command line's effective keys (recipe chain + overrides); ``{}`` for an unreadable recipe
  (MaxText reports that itself)."""
  from maxtext_nvfp4.tools import recipes  # pylint: disable=import-outside-toplevel

  try:
    return recipes.effective_config(args)
  except Exception:  # pylint: disable=broad-exception-caught
    return {}


def hardware_error(args: list[str], cfg: dict | None = None) -> str | None:
  """Why this machine cannot run the recipe (TE FP8, TE attention, ``nvfp4_backend=te``), or None.

  Checked before MaxText starts (no JAX backend is initialized: safe before ``jax.distributed``), so a
  Blackwell recipe on the wrong machine stops at once with the matching proxy/emulated recipe named.
  ``cfg``: :func:`_effective` of ``args`` when the caller already has it.
  """
  from maxtext_nvfp4.tools import recipes  # pylint: disable=import-outside-toplevel

  te, cc = recipes.detect_hardware()
  return recipes.check_hardware(_effective(args) if cfg is None else cfg, te_available=te, gpu_cc=cc)


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


def cli_main(argv: list[str]) -> int:
  """``maxtext-nvfp4 train [RECIPE.yml] [key=value ...]``; returns the process exit code."""
  args = list(argv)
  if args and args[0] in ("-h", "--help"):
    print(_USAGE)
    return 0
  cfg = _effective(args)  # read the recipe chain once for the three start-up checks below
  problem = hardware_error(args, cfg)
  if problem:
    print(f"maxtext-nvfp4: {problem}", file=sys.stderr, flush=True)
    return 2
  ensure_metrics_dir(args, cfg)
  # Step lines must reach a log file line by line (a killed run otherwise loses its buffered tail).
  for stream in (sys.stdout, sys.stderr):
    if hasattr(stream, "reconfigure"):
      stream.reconfigure(line_buffering=True)
  maxtext_nvfp4.register()
  args = with_single_host_cpu_defaults(with_default_tokenizer(args), cfg)
  from absl import app  # pylint: disable=import-outside-toplevel

  try:
    app.run(_main_exit_2_on_config_error, argv=["maxtext_nvfp4.train", *args])
  except SystemExit as e:
    return e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
  return 0


if __name__ == "__main__":
  sys.exit(cli_main(sys.argv[1:]))
