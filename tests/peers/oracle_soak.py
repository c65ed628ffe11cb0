"""Run the TE-reference differential oracle on many cases, in batches, from one process (local soak runs).

  nice -n 10 .venv/bin/python tests/peers/oracle_soak.py --cases 10000 --batch 1000 --seed 1 [--max-elements N]

Each batch is ``te_cases.generate(seed + k, batch, ...)`` through one peer process and
``test_te_reference_oracle.compare``; our compiled functions are reused across batches. Prints one line
per batch and a total (the lines benchmarks/RESULTS.md's "Peer oracles" section records). Exit 1 on any
mismatch.
"""

import argparse
import os
import pathlib
import sys
import tempfile
import time

sys.path[:0] = [str(pathlib.Path(__file__).resolve().parent), str(pathlib.Path(__file__).resolve().parents[1])]
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import te_cases  # noqa: E402
import test_te_reference_oracle as oracle  # noqa: E402


def main():
  p = argparse.ArgumentParser()
  p.add_argument("--cases", type=int, default=10000)
  p.add_argument("--batch", type=int, default=1000)
  p.add_argument("--seed", type=int, default=1)
  p.add_argument("--shapes", type=int, default=16)
  p.add_argument("--max-elements", type=int, default=0, help="0: every shape of te_cases.SHAPES")
  a = p.parse_args()
  totals = dict(cases=0, equal=0, zero_sign=0, torch_flush=0, order=0, bad=0)
  by_mode, by_dist = {}, {}
  t0 = time.time()
  for k in range((a.cases + a.batch - 1) // a.batch):
    seed = a.seed + k
    n = min(a.batch, a.cases - k * a.batch)
    cases = te_cases.generate(seed, n, a.shapes, a.max_elements or None)
    with tempfile.TemporaryDirectory() as tmp:
      te = oracle.run_te(pathlib.Path(tmp), cases)
    res = oracle.compare(cases, oracle.quantize_ours(cases), te)
    for c in cases:
      by_mode[c.mode] = by_mode.get(c.mode, 0) + 1
      by_dist[c.dist] = by_dist.get(c.dist, 0) + 1
    totals["cases"] += n
    totals["equal"] += len(res["ok"])
    totals["zero_sign"] += res["zero_sign"]
    totals["torch_flush"] += len(res["torch_flush"])
    totals["order"] += len(res["order"])
    totals["bad"] += len(res["bad"])
    shapes = sorted({c.x.shape for c in cases})
    print(f"batch seed={seed} cases={n} shapes={shapes} equal={len(res['ok'])} zero_sign_codes={res['zero_sign']}"
          f" torch_flush={len(res['torch_flush'])} order={len(res['order'])} mismatches={len(res['bad'])}"
          f" {res['bad'][:3]} [{time.time() - t0:.0f} s]", flush=True)
  print(f"TOTAL {totals} by mode {by_mode} by dist {by_dist} [{time.time() - t0:.0f} s]", flush=True)
  return 1 if totals["bad"] else 0


if __name__ == "__main__":
  sys.exit(main())
