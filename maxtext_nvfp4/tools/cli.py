"""``maxtext-nvfp4`` command line: one subcommand per module, imported only when used.

Also the argument parser every subcommand uses (:class:`ArgumentParser`): a usage error is ONE line on
stderr (``maxtext-nvfp4 CMD: error: ...; see --help``) and exit code 2, like every other bad input.
"""

from __future__ import annotations

import argparse
import difflib
import importlib
import sys

from maxtext_nvfp4.tools.shell_command import shell_command  # noqa: F401  (re-exported: printed commands)

# subcommand -> (module exposing ``cli_main(argv: list[str]) -> int``, one-line help)
COMMANDS = {
    "train": ("maxtext_nvfp4.tools.train", "run MaxText pre-training with the NVFP4 plugin registered"),
    "train-compile": ("maxtext_nvfp4.tools.train_compile",
                      "compile the train step ahead of time for a target (b200-4, v5e-4): backend, memory vs HBM"),
    "sft": ("maxtext_nvfp4.sft", "run MaxText's SFT (fine-tuning, NVFP4 QAT) from a checkpoint with the plugin"),
    "distill": ("maxtext_nvfp4.distill", "run MaxText's distillation (NVFP4 student, QAD) with the plugin"),
    "prepare-sft-data": ("maxtext_nvfp4.tools.sft_data", "build the fine-tuning demo's prompt/completion data"),
    "recipes": ("maxtext_nvfp4.tools.cli", "list the packaged recipes with a one-line description each"),
    "doctor": ("maxtext_nvfp4.tools.doctor", "report JAX/devices/TE/MaxText/patch state and the backend auto picks"),
    "verify-hardware": ("maxtext_nvfp4.tools.verify_hardware", "compare TE's NVFP4 kernels with the emulation (Blackwell)"),
    "prepare-data": ("maxtext_nvfp4.tools.data", "build a local MaxText-ready dataset (embedded corpus or your files)"),
    "compare": ("maxtext_nvfp4.tools.compare", "compare runs: throughput, loss gap, verdict, plots"),
    "reproduce": ("maxtext_nvfp4.tools.reproduce", "run a baseline/NVFP4 recipe pair back to back, then compare"),
    "study": ("maxtext_nvfp4.tools.study", "long comparison of arms in resumable chunks (bf16/fp8/nvfp4/late switch)"),
    "patch": ("maxtext_nvfp4.tools.patching", "apply/check/revert the MaxText patch series"),
    "export": ("maxtext_nvfp4.tools.export", "export a MaxText Llama checkpoint in ModelOpt's NVFP4 HF format (vLLM)"),
    "eval-quantized": ("maxtext_nvfp4.tools.eval_quantized", "eval loss of a checkpoint with its linears served in bf16/NVFP4/FP8"),
}


class ArgumentParser(argparse.ArgumentParser):
  """``argparse.ArgumentParser`` whose errors are one line on stderr with exit code 2 (argparse prints
  the usage block first)."""

  def error(self, message: str):
    self.exit(2, f"{self.prog}: error: {' '.join(str(message).split())}; see {self.prog} --help\n")


def _usage() -> str:
  lines = ["usage: maxtext-nvfp4 COMMAND [args...]   (maxtext-nvfp4 --version)", "", "commands:"]
  lines += [f"  {name:<16} {help_}" for name, (_, help_) in COMMANDS.items()]
  return "\n".join(lines)


def version() -> str:
  import maxtext_nvfp4  # pylint: disable=import-outside-toplevel

  return f"maxtext-nvfp4 {maxtext_nvfp4.__version__}"


def cli_main(argv: list[str]) -> int:
  """``maxtext-nvfp4 recipes``: the packaged recipes, one line each."""
  from maxtext_nvfp4.tools import recipes  # pylint: disable=import-outside-toplevel

  p = ArgumentParser(prog="maxtext-nvfp4 recipes", description="List the packaged recipes.")
  p.parse_args(argv)
  print(recipes.recipes_listing())
  return 0


def main(argv: list[str] | None = None) -> int:
  argv = list(sys.argv[1:] if argv is None else argv)
  if not argv or argv[0] in ("-h", "--help", "help"):
    print(_usage())
    return 0
  if argv[0] in ("--version", "-V", "version"):
    print(version())
    return 0
  name, rest = argv[0], argv[1:]
  if name not in COMMANDS:
    close = difflib.get_close_matches(name, list(COMMANDS), n=1, cutoff=0.6)
    hint = f"did you mean {close[0]!r}? " if close else ""
    print(f"maxtext-nvfp4: error: unknown command {name!r}; {hint}commands: {', '.join(COMMANDS)}", file=sys.stderr)
    return 2
  module = importlib.import_module(COMMANDS[name][0])
  try:
    return int(module.cli_main(rest) or 0)
  except SystemExit as e:  # argparse's --help (0) and our one-line usage errors (2)
    return e.code if isinstance(e.code, int) else (0 if e.code is None else 1)


if __name__ == "__main__":
  sys.exit(main())
