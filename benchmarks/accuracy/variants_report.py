"""The recipe-variant section of RESULTS.md (issue 27): eval loss of each TE PyTorch variant arm against the
standard recipe (nvfp4) and BF16, paired by seed, beside the per-GEMM quantization error from the diagnostics.

  python benchmarks/accuracy/variants_report.py OUT [--carry benchmarks/accuracy/study_summary.json] [--family moe]

OUT: the run_study.py output directory of the variant arms (``<arm>_s<seed>/result.json`` and
``metrics.jsonl``). The standard recipe is ``nvfp4_diag`` (the nvfp4 arm with diagnostics, which observe
only), run in OUT with the same code as the variants. bf16 comes from OUT when run there, else from
``--carry`` (the published study's summary: bf16 does not touch this package's code, and the data must be
the same -- prepare-data's content sha256 is printed in the runs' logs). Numbers as run_study.py defines them:
eval loss = MaxText's eval after the last step; a difference A - B is paired by seed (mean over seeds, and
each seed); the seed spread of an arm is max - min of its eval losses over the seeds.

Per-GEMM error: ``nvfp4/<group>/<tensor>_rel_err`` (``sqrt(sq_err / sq_norm)`` of the operand as the fprop /
dgrad quantizes it, core/diagnostics.py) from each run's metrics file, at the last step that reported it,
averaged over the groups (attention / mlp, first / middle / last layer) and the seeds.

``--family moe``: the same table for the MoE demo's variant arms (``moe_<variant>``, run_study.py's
MOE_VARIANT_ARMS) against ``moe_nvfp4_diag`` and ``moe_bf16``.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
from pathlib import Path

VARIANTS = ("nvfp4_diag", "nvfp4_4o6_w", "nvfp4_4o6_a", "nvfp4_4o6_all", "nvfp4_rowscaled", "nvfp4_bwd_hp",
            "nvfp4_bwd_dq", "nvfp4_no_rht3")
TENSORS = ("x", "w", "dy")


def _runs(out: Path, arm: str) -> dict[int, dict]:
  res = {}
  for p in sorted(out.glob(f"{arm}_s*/result.json")):
    r = json.loads(p.read_text())
    if r.get("complete"):
      res[int(r["seed"])] = r
  return res


def _carried(path: Path | None, arm: str) -> dict[int, dict]:
  if path is None:
    return {}
  d = json.loads(path.read_text()).get(arm, {})
  return {int(s): r for s, r in d.items()}


def _rel_err(run_dir: Path) -> dict[str, float]:
  """Mean over groups of each tensor's rel_err at the last step that reported it (empty without diagnostics)."""
  p = run_dir / "metrics.jsonl"
  if not p.exists():
    return {}
  last: dict[str, tuple[int, float]] = {}
  for line in p.read_text().splitlines():
    try:
      rec = json.loads(line)
    except json.JSONDecodeError:
      continue
    step = int(rec.get("step", -1))
    for k, v in rec.items():
      if k.startswith("nvfp4/") and k.endswith("_rel_err") and isinstance(v, (int, float)):
        if k not in last or step >= last[k][0]:
          last[k] = (step, float(v))
  out = {}
  for t in TENSORS:
    vals = [v for k, (_, v) in last.items() if k.rsplit("/", 1)[1] == f"{t}_rel_err"]
    if vals:
      out[t] = statistics.fmean(vals)
  return out


def main(argv=None) -> int:
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("out")
  p.add_argument("--carry", help="study_summary.json of the published study (bf16 / nvfp4 not in OUT)")
  p.add_argument("--family", choices=("llama2", "moe"), default="llama2",
                 help="the dense demo's variant arms (default) or the MoE demo's (moe_<variant>)")
  a = p.parse_args(argv)
  out = Path(a.out)
  carry = Path(a.carry) if a.carry else None
  prefix = "moe_" if a.family == "moe" else ""
  bf16_name, std_name = f"{prefix}bf16", f"{prefix}nvfp4_diag"
  bf16_here = _runs(out, bf16_name)
  base = {"bf16": bf16_here or _carried(carry, bf16_name), "nvfp4_diag": _runs(out, std_name)}
  lines = [f"{bf16_name}: {'run in OUT' if bf16_here else 'carried from ' + str(carry)}; standard recipe:"
           f" {std_name} (OUT).", ""]
  lines.append("| arm | seeds | eval loss (mean) | seed spread | vs nvfp4: mean (per seed) | vs bf16 (rel.) |"
               " x rel_err | w rel_err | dy rel_err |")
  lines.append("|---|---|---|---|---|---|---|---|---|")
  nv_spread = None
  for variant in ("bf16", *VARIANTS):
    arm = prefix + variant
    runs = base[variant] if variant in base else _runs(out, arm)
    if not runs:
      lines.append(f"| {arm} | 0 | not run | | | | | | |")
      continue
    ev = {s: r["final_eval_loss"] for s, r in runs.items()}
    mean = statistics.fmean(ev.values())
    spread = max(ev.values()) - min(ev.values()) if len(ev) > 1 else float("nan")
    if variant == "nvfp4_diag":
      nv_spread = spread
    def paired(ref):
      common = sorted(set(ev) & set(base[ref]))
      d = [ev[s] - base[ref][s]["final_eval_loss"] for s in common]
      return common, d
    cs, d = paired("nvfp4_diag")
    vs_nv = (f"{statistics.fmean(d):+.4f} ({', '.join(f'{x:+.4f}' for x in d)})" if d and variant != "nvfp4_diag" else "")
    cb, db = paired("bf16")
    rel = ([x / base["bf16"][s]["final_eval_loss"] for s, x in zip(cb, db)] if db and variant != "bf16" else [])
    vs_bf = f"{100 * statistics.fmean(rel):+.2f} %" if rel else ""
    errs = [_rel_err(out / f"{arm}_s{s}") for s in runs]  # carried arms have no metrics here: empty
    cols = []
    for t in TENSORS:
      vals = [e[t] for e in errs if t in e]
      cols.append(f"{statistics.fmean(vals):.4f}" if vals else "")
    sp = f"{spread:.4f}" if math.isfinite(spread) else "n/a"
    lines.append(f"| {arm} | {len(ev)} | {mean:.4f} | {sp} | {vs_nv} | {vs_bf} | {' | '.join(cols)} |")
  if nv_spread is not None:
    lines.append("")
    lines.append(f"Standard recipe ({std_name}) seed spread: {nv_spread:.4f} nats.")
  print("\n".join(lines))
  return 0


if __name__ == "__main__":
  sys.exit(main())
