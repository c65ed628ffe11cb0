"""``maxtext-nvfp4 verify-hardware``: run :mod:`maxtext_nvfp4.backends.te_check` and report.

For users with Blackwell (compute capability >= 10.0) and Transformer Engine JAX; elsewhere it exits
with status 2 and one line: why (the capability reason) and what it needs. What is checked and the pass criteria: the docstring of
:mod:`maxtext_nvfp4.backends.te_check`.
"""

from __future__ import annotations

import json
import sys

from maxtext_nvfp4.backends import capability
from maxtext_nvfp4.backends.te_check import run_checks


def _format(results, choice) -> str:
  lines = [f"backend: {choice.name} ({choice.reason})"]
  for r in results:
    status = "PASS" if r["passed"] else "FAIL"
    if "error" in r:
      detail = r["error"]
    elif r["kind"] == "bitwise":
      detail = (f"data mismatches {r['data_mismatches']}/{r['elements']}, scale mismatches {r['scale_mismatches']},"
                f" amax {'equal' if r['amax_equal'] else 'DIFFERS'} ({r['amax_te']!r} vs {r['amax_emulated']!r})")
    elif r["kind"] == "gemm":
      detail = (f"rel diff {r['rel_frobenius']:.2e}, max |diff| {r['max_abs_diff']:.3e}, "
                f"{r['violations']} elements outside {r['tolerance']} abs+rel")
    else:
      detail = (f"SR MAE TE {r['te']['sr_mae']:.3e} vs emulated {r['emulated']['sr_mae']:.3e} (RNE {r['te']['rn_mae']:.3e}),"
                f" nonzero fraction {r['te']['sr_nonzero_fraction']:.3f}")
    lines.append(f"{status}  {r['check']:<32} {detail}")
  ok = all(r["passed"] for r in results)
  lines.append("all checks passed" if ok else "SOME CHECKS FAILED: TE's NVFP4 kernels disagree with the reference here")
  return "\n".join(lines)


def not_here_reason(choice: capability.BackendChoice) -> str:
  """Why verify-hardware cannot run where ``nvfp4_backend=auto`` chose ``choice`` (not ``te``), and what
  it needs; no "use the emulation" advice: the emulation is what it checks TE against."""
  why = choice.reason.removeprefix("nvfp4_backend=auto: ").split("; using the exact emulation")[0]
  return (f"verify-hardware cannot run here: {why}; it needs every local device to be a Blackwell GPU (compute"
          f" capability >= {capability.MIN_COMPUTE_CAPABILITY:.1f}) with Transformer Engine JAX ({capability.INSTALL_HINT})")


def cli_main(argv: list[str]) -> int:
  """Exit 0: all checks pass; 1: a check failed; 2: a bad argument, or no Blackwell+TE here (one line)."""
  from maxtext_nvfp4.tools import cli  # pylint: disable=import-outside-toplevel

  p = cli.ArgumentParser(prog="maxtext-nvfp4 verify-hardware", description=__doc__.split("\n\n")[0])
  p.add_argument("--json", action="store_true", help="print one JSON object")
  p.add_argument("--m", type=int, default=256, help="tokens (multiple of 64 for RHT)")
  p.add_argument("--k", type=int, default=512, help="input features (multiple of 128)")
  p.add_argument("--n", type=int, default=256, help="output features (multiple of 128)")
  p.add_argument("--seed", type=int, default=0)
  p.add_argument("--sr-draws", type=int, default=8, help="stochastic-rounding samples")
  a = p.parse_args(argv)
  for name, v, mult in (("m", a.m, 64), ("k", a.k, 128), ("n", a.n, 128), ("sr-draws", a.sr_draws, 1)):
    if v <= 0 or v % mult:
      p.error(f"--{name}={v} must be a positive multiple of {mult}" + (" (TE's RHT/GEMM kernels need it)" if mult > 1 else ""))
  choice = capability.choose_backend("auto")
  if choice.implementation.min_compute_capability is None:  # the emulation: no device kernels to check
    reason = not_here_reason(choice)
    if a.json:
      print(json.dumps({"ran": False, "reason": reason}))
    else:
      print(reason, file=sys.stderr)
    return 2
  results = run_checks(a.m, a.k, a.n, a.seed, a.sr_draws)
  ok = all(r["passed"] for r in results)
  if a.json:
    print(json.dumps({"ran": True, "backend": {"name": choice.name, "reason": choice.reason},
                      "te_version": capability.te_version(), "shape": {"m": a.m, "k": a.k, "n": a.n},
                      "passed": ok, "checks": results}, indent=2, default=float))
  else:
    print(_format(results, choice))
  return 0 if ok else 1


if __name__ == "__main__":
  sys.exit(cli_main(sys.argv[1:]))
