"""``maxtext-nvfp4`` command line: one subcommand per module, imported only when used."""

from __future__ import annotations

import importlib
import sys

# subcommand -> (module exposing ``cli_main(argv: list[str]) -> int``, one-line help)
COMMANDS = {
    "train": ("maxtext_nvfp4.tools.train", "run MaxText pre-training with the NVFP4 plugin registered"),
    "doctor": ("maxtext_nvfp4.tools.doctor", "report JAX/devices/TE/MaxText/patch state and the backend auto picks"),
    "verify-hardware": ("maxtext_nvfp4.tools.verify_hardware", "compare TE's NVFP4 kernels with the emulation (Blackwell)"),
    "prepare-data": ("maxtext_nvfp4.tools.data", "build a local MaxText-ready dataset (embedded corpus or your files)"),
    "compare": ("maxtext_nvfp4.tools.compare", "compare runs: throughput, loss gap, verdict, plots"),
    "reproduce": ("maxtext_nvfp4.tools.reproduce", "run a baseline/NVFP4 recipe pair back to back, then compare"),
    "patch": ("maxtext_nvfp4.tools.patching", "apply/check/revert the MaxText 0.2.5 patch series"),
    "export": ("maxtext_nvfp4.tools.export", "export a MaxText Llama checkpoint in ModelOpt's NVFP4 HF format (vLLM)"),
}


def _usage() -> str:
  lines = ["usage: maxtext-nvfp4 COMMAND [args...]", "", "commands:"]
  lines += [f"  {name:<16} {help_}" for name, (_, help_) in COMMANDS.items()]
  return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
  argv = list(sys.argv[1:] if argv is None else argv)
  if not argv or argv[0] in ("-h", "--help", "help"):
    print(_usage())
    return 0
  name, rest = argv[0], argv[1:]
  if name not in COMMANDS:
    print(f"maxtext-nvfp4: unknown command {name!r}\n\n{_usage()}", file=sys.stderr)
    return 2
  module = importlib.import_module(COMMANDS[name][0])
  return int(module.cli_main(rest) or 0)


if __name__ == "__main__":
  sys.exit(main())
