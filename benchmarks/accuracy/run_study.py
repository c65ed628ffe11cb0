"""Accuracy study: emulated NVFP4 vs FP8/BF16, its ablations, and two peer FP4 paths -- one command.

  python benchmarks/accuracy/run_study.py            # the CPU study (see SIZINGS["cpu"]) + RESULTS.md + plots
  python benchmarks/accuracy/run_study.py --quick    # harness smoke test: few steps, 1 seed, into OUT only
  python benchmarks/accuracy/run_study.py --full     # the issue's sizing, for a machine with 2 free cores
  python benchmarks/accuracy/run_study.py --gpu      # a larger single-GPU variant (not run in this session)
  python benchmarks/accuracy/run_study.py --report-only   # rebuild the report from OUT's finished runs

Every run is one of three CPU demo models (4 layers, d=128, the 2048-token BPE on the embedded stdlib-source
corpus, held-out eval split): the Llama-style proxy (recipes/demo_{bf16,nvfp4}.yml, MaxText llama2 decoder:
every arm but the two families below), the MoE demo (recipes/demo_moe_*.yml, mixtral block, 4 experts top-2,
einsum path: arms moe_bf16 / moe_fp8 / moe_nvfp4) and the qwen3-block demo (recipes/demo_qwen3_*.yml, QK-norm:
arms qwen3_bf16 / qwen3_fp8 / qwen3_nvfp4). Each family's gaps are taken against its own bf16 / fp8 arms
(FAMILIES). Runs are trained by ``python -m maxtext_nvfp4.train`` (ours, BF16, FP8) or
``benchmarks/accuracy/peer_train.py`` (the qwix and jax.nn peers), with ``init_weights_seed = SEED`` and
``data_shuffle_seed = nvfp4_seed = 0`` (see build_runs): every run sees the same batches in the same order,
and for one seed every arm of a family starts from the same weights.

Numbers (exact definitions, also printed in RESULTS.md):

* final train loss = mean of ``learning/loss`` over the last ``max(1, ceil(steps / 10))`` steps;
* eval loss = MaxText's ``eval/avg_loss`` of the eval run after the last step (``steps = k * eval_interval
  + 1`` so the final eval sees the final weights; same eval batches in every run);
* relative gap of arm A vs B for seed s = ``(eval_A(s) - eval_B(s)) / eval_B(s)`` (paired by seed), reported
  as the mean over the seeds both arms ran;
* seed spread of an arm = ``max_s eval(s) - min_s eval(s)`` (and the sample std) over its seeds.

Targets (issue 10), evaluated mechanically in RESULTS.md:

* nvfp4 vs bf16: mean relative gap <= 1 %, and ``mean(eval_nvfp4) - mean(eval_bf16) <= mean(eval_fp8) -
  mean(eval_bf16) + spread``, spread = the larger of the nvfp4 / fp8 seed spreads;
* nvfp4 vs each peer: ``mean(eval_peer) - mean(eval_nvfp4) > spread`` (spread = the larger seed spread of
  the two arms; a single-seed peer borrows nvfp4's);
* ablations vs nvfp4 (seed 0, paired): the sign the paper predicts (``Arm.expect``), and whether
  ``|delta| > nvfp4's seed spread``.

Runs write ``OUT/<arm>_s<seed>/{train.log, metrics.jsonl, result.json}``; a run whose result.json exists is
not rerun (delete it to redo). ``--jobs 2`` trains two arms at once (each JAX process uses both cores).
``--carry SUMMARY_JSON`` reports every arm, taking an arm that has no run in OUT from a previous report's
study_summary.json (same eval steps required; marked † in the tables), e.g. to add arms to a published study
without rerunning it:

  python benchmarks/accuracy/run_study.py --arms moe_bf16,moe_fp8,moe_nvfp4 \
      --carry benchmarks/accuracy/study_summary.json
"""

from __future__ import annotations

import argparse
import concurrent.futures
import dataclasses
import datetime
import json
import math
import os
import platform
import re
import shlex
import shutil
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Sequence

REPO = Path(__file__).resolve().parents[2]
HERE = Path(__file__).resolve().parent
PEER_LAUNCHER = HERE / "peer_train.py"

_STEP_RE = re.compile(r"completed step: (\d+), seconds: ([-+\w.]+),.*?[ ,]loss: ([-+\w.]+)")
_EVAL_RE = re.compile(r"Completed eval after train step (\d+), loss=([-+\w.]+)")


@dataclasses.dataclass(frozen=True, kw_only=True)
class Arm:
  """One configuration of the study."""

  # Label in tables and run directories.
  name: str
  # key (>= 3 seeds), variant (TE PyTorch recipe variants, 3 seeds), ablation, switch, peer, diagnostic.
  group: str
  # Recipe file in recipes/.
  recipe: str
  # MaxText / nvfp4_* overrides on top of the recipe.
  overrides: tuple[str, ...] = ()
  # None: python -m maxtext_nvfp4.train; "qwix" / "jaxnn": benchmarks/accuracy/peer_train.py PEER.
  peer: str | None = None
  # Paper's direction of the eval-loss change vs the nvfp4 arm: +1 worse, -1 better, 0 not an ablation.
  expect: int = 0
  # One line for the report.
  description: str = ""
  # Model family (a key of FAMILY_BY_NAME): its bf16 arm is the baseline of the arm's relative gaps.
  family: str = "llama2"


@dataclasses.dataclass(frozen=True, kw_only=True)
class Family:
  """A model of the study with its own bf16 / fp8 / nvfp4 arms (gaps are taken within a family only)."""

  # Arm.family value.
  name: str
  # Heading of the family's table in the report.
  title: str
  # Names of the family's baseline, FP8 and NVFP4 arms.
  bf16: str
  fp8: str
  nvfp4: str
  # Labels of those arms in the target lines.
  labels: tuple[str, str, str]


FAMILIES: tuple[Family, ...] = (
    Family(name="llama2", title="Dense demo, MaxText `llama2` block (`recipes/demo_{bf16,nvfp4}.yml`)",
           bf16="bf16", fp8="fp8", nvfp4="nvfp4", labels=("BF16", "FP8", "nvfp4")),
    Family(name="moe", title="MoE demo, MaxText `mixtral` block, 4 experts top-2, einsum path"
                             " (`recipes/demo_moe_{bf16,nvfp4}.yml`); gaps vs moe_bf16 / moe_fp8",
           bf16="moe_bf16", fp8="moe_fp8", nvfp4="moe_nvfp4", labels=("moe_bf16", "moe_fp8", "moe_nvfp4")),
    Family(name="qwen3", title="Dense demo, MaxText `qwen3` block: QK-norm (`recipes/demo_qwen3_{bf16,nvfp4}.yml`);"
                               " gaps vs qwen3_bf16 / qwen3_fp8",
           bf16="qwen3_bf16", fp8="qwen3_fp8", nvfp4="qwen3_nvfp4", labels=("qwen3_bf16", "qwen3_fp8", "qwen3_nvfp4")),
)
FAMILY_BY_NAME = {f.name: f for f in FAMILIES}


_SWITCH = ("nvfp4_switch_at_step=0.8", "nvfp4_switch_to=bf16")
ARMS: tuple[Arm, ...] = (
    Arm(name="bf16", group="key", recipe="demo_bf16.yml", description="BF16 baseline (no quantization)"),
    Arm(name="fp8", group="key", recipe="demo_bf16.yml", overrides=("quantization=fp8",),
        description="MaxText quantization=fp8 (flax Fp8DirectDotGeneralOp, per-tensor delayed scaling:"
                    " the scale comes from a 1024-step amax history, 1 at step 0)"),
    Arm(name="nvfp4", group="key", recipe="demo_nvfp4.yml",
        description="ours, TE NVFP4BlockScaling recipe (1x16 E4M3 + FP32 tensor scale, 2D weights, RHT wgrad,"
                    " SR grads) on all projections of all layers"),
    Arm(name="nvfp4_no_rht", group="ablation", recipe="demo_nvfp4.yml", overrides=("nvfp4_rht=false",), expect=1,
        description="ours without the RHT on wgrad operands"),
    Arm(name="nvfp4_no_sr", group="ablation", recipe="demo_nvfp4.yml",
        overrides=("nvfp4_stochastic_rounding=false",), expect=1,
        description="ours with round-to-nearest gradients (no SR)"),
    Arm(name="nvfp4_1d_weights", group="ablation", recipe="demo_nvfp4.yml", overrides=("nvfp4_2d_weights=false",),
        expect=1, description="ours with 1x16 weight blocks (no 16x16 2D weight blocks)"),
    Arm(name="nvfp4_keep_last1", group="ablation", recipe="demo_nvfp4.yml",
        overrides=("nvfp4_keep_last_layers=1",), expect=-1,
        description="ours with the last of 4 decoder layers in BF16"),
    Arm(name="nvfp4_mlp_only", group="ablation", recipe="demo_nvfp4.yml", overrides=("nvfp4_targets=mlp",),
        expect=-1, description="ours on the MLP projections only (attention projections BF16)"),
    Arm(name="nvfp4_switch_fwd", group="switch", recipe="demo_nvfp4.yml",
        overrides=(*_SWITCH, "nvfp4_switch_scope=forward"), expect=-1,
        description="ours, fprop switched to BF16 for the last 20 % of steps"),
    Arm(name="nvfp4_switch_all", group="switch", recipe="demo_nvfp4.yml",
        overrides=(*_SWITCH, "nvfp4_switch_scope=all"), expect=-1,
        description="ours, all three GEMMs switched to BF16 for the last 20 % of steps"),
    Arm(name="qwix_nvfp4", group="peer", recipe="demo_bf16.yml",
        overrides=("quantization=fp4", "use_qwix_quantization=true"), peer="qwix",
        description="peer: qwix nvfp4 qtype via MaxText's qwix path, 16-element tiles fwd+bwd, no tensor scale"),
    Arm(name="qwix_nvfp4_fwd", group="diagnostic", recipe="demo_bf16.yml",
        overrides=("quantization=fp4", "use_qwix_quantization=true"), peer="qwix_fwd",
        description="diagnostic: the qwix peer's forward with BF16 gradients (isolates gradient underflow)"),
    Arm(name="nvfp4_fwd_only", group="diagnostic", recipe="demo_nvfp4.yml", peer="ours_fwd",
        description="diagnostic: ours with dgrad/wgrad in BF16 (quantizes the same GEMMs as the jax.nn peer)"),
    Arm(name="jaxnn_nvfp4", group="peer", recipe="demo_bf16.yml", peer="jaxnn",
        description="peer: jax.nn.scaled_dot_general nvfp4 (1x16 E4M3 scales, static global scale 1, bwd unquantized)"),
    # The MoE family: the CPU MoE demo (mixtral block, 4 experts of width 128, top-2, sparse_matmul=false:
    # RoutedMoE's einsum path, every expert on every token). No fp8 MoE recipe exists: the fp8 arm is the bf16
    # recipe with quantization=fp8, like the llama2 fp8 arm.
    Arm(name="moe_bf16", group="key", family="moe", recipe="demo_moe_bf16.yml",
        description="MoE demo, BF16 baseline (no quantization)"),
    Arm(name="moe_fp8", group="key", family="moe", recipe="demo_moe_bf16.yml", overrides=("quantization=fp8",),
        description="MoE demo, MaxText quantization=fp8: attention projections and the router through"
                    " Fp8DirectDotGeneralOp, the expert einsums wi_0/wi_1/wo through flax Fp8Einsum (one scale"
                    " per tensor over all experts); both per-tensor delayed scaling (amax history)"),
    Arm(name="moe_nvfp4", group="key", family="moe", recipe="demo_moe_nvfp4.yml",
        description="ours on the attention projections and every expert linear (one NVFP4 tensor per expert"
                    " weight and per expert token group), router BF16"),
    # The second dense family: the demo's size with MaxText's qwen3 block (QK-norm).
    Arm(name="qwen3_bf16", group="key", family="qwen3", recipe="demo_qwen3_bf16.yml",
        description="qwen3-block demo, BF16 baseline (no quantization)"),
    Arm(name="qwen3_fp8", group="key", family="qwen3", recipe="demo_qwen3_bf16.yml", overrides=("quantization=fp8",),
        description="qwen3-block demo, MaxText quantization=fp8 (Fp8DirectDotGeneralOp on every projection)"),
    Arm(name="qwen3_nvfp4", group="key", family="qwen3", recipe="demo_qwen3_nvfp4.yml",
        description="ours, the full TE recipe on all 7 projections of all 4 qwen3 layers"),
)
# TE 2.20.2 PyTorch recipe variants (issue 27), each with per-GEMM quantization statistics every 50 steps
# (nvfp4_diagnostics: observes only, the numbers of the run are unchanged). 4over6 on activations needs
# nvfp4_rht=false (TE refuses 4over6 with RHT): those arms change two things against nvfp4.
_DIAG = ("nvfp4_diagnostics=true", "nvfp4_diagnostics_interval=50")
VARIANT_ARMS: tuple[Arm, ...] = (
    Arm(name="nvfp4_diag", group="variant", recipe="demo_nvfp4.yml", overrides=_DIAG,
        description="the nvfp4 arm with diagnostics on (its per-GEMM quantization error is the variants' baseline)"),
    Arm(name="nvfp4_4o6_w", group="variant", recipe="demo_nvfp4.yml", overrides=("nvfp4_4over6=weights", *_DIAG),
        description="4over6 on the weights (16x16 tiles, MAE, E4M3 bound 256: TE's defaults)"),
    Arm(name="nvfp4_4o6_a", group="variant", recipe="demo_nvfp4.yml",
        overrides=("nvfp4_4over6=activations", "nvfp4_rht=false", *_DIAG),
        description="4over6 on the activations (both copies; MAE, bound 256), RHT off (TE refuses 4over6 with RHT)"),
    Arm(name="nvfp4_4o6_all", group="variant", recipe="demo_nvfp4.yml",
        overrides=("nvfp4_4over6=all", "nvfp4_rht=false", *_DIAG),
        description="4over6 on weights and activations (MAE, bound 256), RHT off"),
    Arm(name="nvfp4_rowscaled", group="variant", recipe="demo_nvfp4.yml",
        overrides=("nvfp4_row_scaled_activation=true", *_DIAG),
        description="row-scaled activations: one amax per row of each copy of x"),
    Arm(name="nvfp4_bwd_hp", group="variant", recipe="demo_nvfp4.yml",
        overrides=("nvfp4_backward_override=high_precision", *_DIAG),
        description="backward override high_precision: dgrad/wgrad in BF16 on the original operands"),
    Arm(name="nvfp4_bwd_dq", group="variant", recipe="demo_nvfp4.yml",
        overrides=("nvfp4_backward_override=dequantized", *_DIAG),
        description="backward override dequantized: dgrad/wgrad in BF16 on the forward's dequantized NVFP4 x and W"),
    Arm(name="nvfp4_no_rht3", group="variant", recipe="demo_nvfp4.yml", overrides=("nvfp4_rht=false", *_DIAG),
        description="nvfp4 without RHT, 3 seeds: the comparator of the 4over6-activation arms"),
)
# The same variants on the MoE demo (mixtral block, 4 experts top-2, einsum path): every expert linear is its own
# NVFP4 tensor, so 4over6 / row scaling / the backward overrides apply per expert. Gaps are taken against
# moe_nvfp4_diag (the MoE family's standard recipe with diagnostics) and moe_bf16.
MOE_VARIANT_ARMS: tuple[Arm, ...] = tuple(
    dataclasses.replace(a, name=f"moe_{a.name}", family="moe", recipe="demo_moe_nvfp4.yml",
                        description=f"MoE demo: {a.description}")
    for a in VARIANT_ARMS)
ARMS = ARMS + VARIANT_ARMS + MOE_VARIANT_ARMS
ARM_BY_NAME = {a.name: a for a in ARMS}


@dataclasses.dataclass(frozen=True, kw_only=True)
class Sizing:
  """How big the study is."""

  # Mode name (--quick / --cpu / --full).
  name: str
  # Training steps of every run (= k * eval_interval + 1: the last eval sees the final weights).
  steps: int
  # MaxText eval_interval (evals after steps 0, eval_interval, ..., steps - 1).
  eval_interval: int
  # Eval batches per eval (batch 4 x 256 tokens each).
  eval_steps: int
  # Seeds of the key arms (bf16, fp8, nvfp4) and of the peers + diagnostics; ablations run seed 0 only.
  key_seeds: int
  peer_seeds: int
  # Arms run in parallel.
  jobs: int
  # Where RESULTS.md and plots go besides OUT (None: OUT only).
  publish: bool
  # Extra overrides of every run (model / batch for bigger sizings).
  overrides: tuple[str, ...] = ()


SIZINGS = {
    "quick": Sizing(name="quick", steps=7, eval_interval=6, eval_steps=2, key_seeds=1, peer_seeds=1, jobs=2,
                    publish=False),
    # What fits ~1 h of wall time on a 2-core machine shared with other work.
    "cpu": Sizing(name="cpu", steps=101, eval_interval=50, eval_steps=8, key_seeds=3, peer_seeds=3, jobs=2,
                  publish=True),
    # The sizing for 2 free cores (each run <= ~15 min, whole study <= ~2 h): not run in this session.
    "full": Sizing(name="full", steps=301, eval_interval=100, eval_steps=16, key_seeds=3, peer_seeds=3, jobs=1,
                   publish=True),
    # One GPU (H100/H200; emulated NVFP4 -- no FP4 tensor cores before Blackwell): the same corpus and
    # tokenizer, a ~30M-parameter decoder (8 layers, so keep_last1 keeps 12.5 % of the layers, near the
    # paper's ~15 %), 16k tokens per step, ~33M tokens per run (~13 epochs of the 2.5M-token embedded
    # corpus: use `maxtext-nvfp4 prepare-data --input ...` with a bigger corpus for a cleaner eval). NOT RUN.
    "gpu": Sizing(name="gpu", steps=2001, eval_interval=250, eval_steps=32, key_seeds=3, peer_seeds=3, jobs=1,
                  publish=True,
                  overrides=("hardware=gpu", "base_emb_dim=512", "base_num_query_heads=8", "base_num_kv_heads=8",
                             "head_dim=64", "base_mlp_dim=2048", "base_num_decoder_layers=8",
                             "max_target_length=1024", "per_device_batch_size=16", "learning_rate=1.e-3",
                             "grain_worker_count=1")),
}


@dataclasses.dataclass(frozen=True, kw_only=True)
class RunSpec:
  """One training run."""

  # The arm and seed.
  arm: Arm
  seed: int
  # Run directory (train.log, metrics.jsonl, result.json).
  out: Path
  # The command.
  argv: tuple[str, ...]

  @property
  def key(self) -> str:
    return f"{self.arm.name}_s{self.seed}"


def seeds_of(arm: Arm, sizing: Sizing) -> list[int]:
  n = sizing.key_seeds if arm.group in ("key", "variant") else sizing.peer_seeds if arm.group in ("peer", "diagnostic") else 1
  return list(range(n))


def build_runs(sizing: Sizing, out: Path, *, arms: Sequence[str] | None = None, python: str = sys.executable,
               extra: Sequence[str] = ()) -> list[RunSpec]:
  """Every run of the study, ordered so partial results are useful: the key arms and peers at seed 0, the
  extra seeds of the key arms, then the
  ablations and late switches (each a new multi-minute CPU compile), then the peers' extra seeds."""
  chosen = [ARM_BY_NAME[a] for a in arms] if arms else list(ARMS)
  runs = []
  for arm in chosen:
    for seed in seeds_of(arm, sizing):
      d = out / f"{arm.name}_s{seed}"
      launcher = [python, "-m", "maxtext_nvfp4.train"] if arm.peer is None else [python, str(PEER_LAUNCHER), arm.peer]
      argv = (*launcher, str(REPO / "recipes" / arm.recipe), *arm.overrides,
              f"run_name={arm.name}_s{seed}", f"base_output_directory={out / 'maxtext_runs'}",
              f"metrics_file={d / 'metrics.jsonl'}",
              # A seed is the initial weights only: the data order is identical in EVERY run (the issue's
              # "identical data order across runs"; with the order varying too, the eval spread of this short
              # proxy is dominated by which batches came last). nvfp4_seed (SR noise) stays 0 as well: it is
              # baked into the traced step, and keeping it fixed was meant to let JAX's persistent compilation
              # cache share the compiled step across seeds (in the CPU session the step still recompiled per
              # seed: the cache key differs for a reason not investigated). The SR decisions still differ
              # across seeds because the gradients they round do.
              f"init_weights_seed={seed}", "data_shuffle_seed=0", "nvfp4_seed=0",
              f"steps={sizing.steps}", f"eval_interval={sizing.eval_interval}", f"eval_steps={sizing.eval_steps}",
              "enable_checkpointing=false", *sizing.overrides, *extra)
      runs.append(RunSpec(arm=arm, seed=seed, out=d, argv=argv))
  def prio(r: RunSpec) -> int:
    if r.seed == 0:
      return {"key": 0, "peer": 1, "ablation": 3, "switch": 4, "diagnostic": 5, "variant": 6}[r.arm.group]
    return 2 if r.arm.group == "key" else 7 if r.arm.group == "variant" else 5

  return sorted(runs, key=prio)


# ------------------------------------------------------------------------------------------------ running


def parse_log(text: str) -> tuple[dict[int, float], dict[int, float], dict[int, float]]:
  """(train loss by step, step seconds by step, eval loss by train step) from MaxText's log lines."""
  train, secs, evals = {}, {}, {}
  for line in text.splitlines():
    m = _STEP_RE.search(line)
    if m:
      try:
        train[int(m.group(1))] = float(m.group(3))
        secs[int(m.group(1))] = float(m.group(2))
      except ValueError:
        pass
      continue
    m = _EVAL_RE.search(line)
    if m:
      try:
        evals[int(m.group(1))] = float(m.group(2))
      except ValueError:
        pass
  return train, secs, evals


def summarize(spec: RunSpec, *, rc: int, wall_s: float, steps: int) -> dict:
  """result.json of a finished run: losses from the metrics file (full precision) where MaxText kept them,
  else from the log (3 decimals; MaxText 0.2.5 truncates metrics_file at each eval)."""
  from maxtext_nvfp4.tools import metrics as metrics_io  # pylint: disable=import-outside-toplevel
  from maxtext_nvfp4.tools import reproduce  # pylint: disable=import-outside-toplevel

  log = (spec.out / "train.log").read_text(encoding="utf8", errors="replace")
  train, secs, evals = parse_log(log)
  metrics = spec.out / "metrics.jsonl"
  merged = metrics
  if metrics.exists():
    logged = {s: {"step": s, metrics_io.LOSS: v, metrics_io.STEP_TIME: secs.get(s), "source": metrics_io.SOURCE_LOG}
              for s, v in train.items()}
    merged, _ = reproduce.recover_missing_steps(metrics, logged)
    run = metrics_io.read(metrics, strict=False)  # full-precision values where the file kept them
    train.update({s: r[metrics_io.LOSS] for s, r in run.steps.items() if r.get("source") != metrics_io.SOURCE_LOG})
    evals.update(run.eval_loss)
  order = sorted(train)
  n_tail = max(1, math.ceil(steps / 10))
  tail = [train[s] for s in order[-n_tail:]]
  finite = all(math.isfinite(v) for v in train.values())
  final_eval_step = max(evals) if evals else None
  timed = [secs[s] for s in sorted(secs)[2:]]  # skip compile (step 0) and the first warm step
  return {
      "arm": spec.arm.name, "seed": spec.seed, "rc": rc, "wall_s": round(wall_s, 1),
      "argv": list(spec.argv), "steps_done": len(order), "steps": steps,
      "complete": rc == 0 and len(order) == steps and final_eval_step == steps - 1,
      "step0_loss": train.get(0), "final_train_loss": statistics.fmean(tail) if tail else None,
      "final_eval_step": final_eval_step, "final_eval_loss": evals.get(final_eval_step),
      "eval_loss": {str(k): v for k, v in sorted(evals.items())},
      "train_loss": {str(k): train[k] for k in order}, "finite": finite,
      "median_step_s": statistics.median(timed) if timed else None,
      "metrics_for_compare": str(merged),
  }


def run_one(spec: RunSpec, *, steps: int, lock: threading.Lock, stream=sys.stdout) -> dict:
  res_path = spec.out / "result.json"
  if res_path.exists():
    res = json.loads(res_path.read_text())
    if res.get("complete") and res.get("argv") == list(spec.argv):  # a changed command is rerun
      with lock:
        print(f"[{spec.key}] done earlier: eval {res['final_eval_loss']}", file=stream, flush=True)
      return res
  shutil.rmtree(spec.out, ignore_errors=True)
  spec.out.mkdir(parents=True)
  maxtext_dir = Path(next(a for a in spec.argv if a.startswith("base_output_directory=")).split("=", 1)[1])
  shutil.rmtree(maxtext_dir / spec.key, ignore_errors=True)
  with lock:
    print(f"[{spec.key}] start {datetime.datetime.now(datetime.timezone.utc):%H:%M:%S}Z: {shlex.join(spec.argv)}",
          file=stream, flush=True)
  t0 = time.monotonic()
  env = dict(os.environ, PYTHONUNBUFFERED="1")
  with open(spec.out / "train.log", "w", encoding="utf8") as log:
    rc = subprocess.run(list(spec.argv), stdout=log, stderr=subprocess.STDOUT, cwd=REPO, env=env,
                        check=False).returncode
  res = summarize(spec, rc=rc, wall_s=time.monotonic() - t0, steps=steps)
  res_path.write_text(json.dumps(res, indent=1) + "\n")
  with lock:
    print(f"[{spec.key}] end rc={rc} {res['wall_s']:.0f}s: train {_f(res['final_train_loss'])} eval "
          f"{_f(res['final_eval_loss'])} ({res['steps_done']}/{steps} steps"
          f"{'' if res['complete'] else ', INCOMPLETE'})", file=stream, flush=True)
  return res


def ensure_data(python: str) -> None:
  """The recipes read data/embedded/ (relative to the repo root): build it with prepare-data if missing."""
  if (REPO / "data" / "embedded" / "manifest.json").exists():
    return
  print("data/embedded missing: running maxtext-nvfp4 prepare-data", flush=True)
  subprocess.run([python, "-m", "maxtext_nvfp4", "prepare-data"], cwd=REPO, check=True)


# ------------------------------------------------------------------------------------------------ analysis


def _f(v, fmt="{:.4f}") -> str:
  return "n/a" if v is None or (isinstance(v, float) and not math.isfinite(v)) else fmt.format(v)


@dataclasses.dataclass(frozen=True, kw_only=True)
class ArmStats:
  """One arm over its finished seeds."""

  # The arm.
  arm: Arm
  # seed -> result.json of the complete runs.
  runs: dict
  # Number of runs attempted but incomplete (failed / diverged / cut short).
  incomplete: int
  # True when the runs are not in OUT but carried over from a previous report's study_summary.json (--carry).
  carried: bool = False

  def evals(self) -> dict[int, float]:
    return {s: r["final_eval_loss"] for s, r in self.runs.items() if r["final_eval_loss"] is not None}

  def mean(self, key="final_eval_loss") -> float | None:
    vals = [r[key] for r in self.runs.values() if r[key] is not None]
    return statistics.fmean(vals) if vals else None

  def spread(self) -> float | None:
    v = list(self.evals().values())
    return max(v) - min(v) if len(v) >= 2 else None

  def std(self) -> float | None:
    v = list(self.evals().values())
    return statistics.stdev(v) if len(v) >= 2 else None


def eval_steps_of(sizing: Sizing) -> list[int]:
  """The train steps after which MaxText evaluates: 0, eval_interval, ..., steps - 1."""
  return list(range(0, sizing.steps, sizing.eval_interval))


def load_carry(path: Path, sizing: Sizing) -> dict[str, dict[int, dict]]:
  """``{arm: {seed: record}}`` from a previous report's study_summary.json, for --carry.

  An arm is taken only if every record evaluated after exactly this sizing's eval steps (a summary of
  another sizing is refused arm by arm, with a message); each record is marked ``carried_from``.
  """
  data = json.loads(path.read_text(encoding="utf8"))
  want = [str(s) for s in eval_steps_of(sizing)]
  out = {}
  for arm, seeds in data.items():
    if arm not in ARM_BY_NAME:
      print(f"--carry {path}: arm {arm} is not an arm of this study: ignored", file=sys.stderr)
      continue
    recs = {int(s): {**r, "carried_from": r.get("carried_from", str(path))} for s, r in seeds.items()}
    if not recs or any(list(r.get("eval_loss", {})) != want for r in recs.values()):
      print(f"--carry {path}: arm {arm} was evaluated after other steps than {', '.join(want)}"
            f" (another sizing): not carried", file=sys.stderr)
      continue
    out[arm] = recs
  return out


def collect(out: Path, runs: Sequence[RunSpec], carry: dict[str, dict[int, dict]] | None = None
            ) -> dict[str, ArmStats]:
  """The finished runs of ``runs`` by arm; with ``carry``, an arm with no result.json at all in OUT takes
  its records from ``carry`` (never mixed with runs of OUT within one arm)."""
  by_arm: dict[str, dict] = {}
  bad: dict[str, int] = {}
  attempted: set[str] = set()
  for r in runs:
    p = r.out / "result.json"
    by_arm.setdefault(r.arm.name, {})
    if not p.exists():
      continue
    attempted.add(r.arm.name)
    res = json.loads(p.read_text())
    if res.get("complete") and res.get("finite"):
      by_arm[r.arm.name][r.seed] = res
    else:
      bad[r.arm.name] = bad.get(r.arm.name, 0) + 1
  del out
  carried = {a for a in by_arm if a not in attempted and a in (carry or {})}
  for a in carried:
    by_arm[a] = dict(carry[a])
  return {a: ArmStats(arm=ARM_BY_NAME[a], runs=v, incomplete=bad.get(a, 0), carried=a in carried)
          for a, v in by_arm.items()}


def paired_rel_gap(a: ArmStats, b: ArmStats) -> tuple[float | None, float | None, float | None, int]:
  """(mean, min, max) over shared seeds of (eval_a - eval_b) / eval_b, and the number of shared seeds."""
  ea, eb = a.evals(), b.evals()
  gaps = [(ea[s] - eb[s]) / eb[s] for s in sorted(set(ea) & set(eb))]
  if not gaps:
    return None, None, None, 0
  return statistics.fmean(gaps), min(gaps), max(gaps), len(gaps)


def _pct(v) -> str:
  return "n/a" if v is None else f"{100 * v:+.2f} %"


def table(stats: dict[str, ArmStats], family: Family | None = None) -> list[str]:
  """The table of one family's arms (default: llama2), gaps against that family's own bf16 / fp8 arms."""
  family = family or FAMILIES[0]
  bf16, fp8 = stats.get(family.bf16), stats.get(family.fp8)
  head = ["arm", "seeds", "final train loss", "eval loss (mean)", "eval seed spread (max-min / std)",
          f"rel. gap vs {family.labels[0]} (mean [min, max])", f"rel. gap vs {family.labels[1]}",
          "step-0 loss (seed 0)", "median s/step (shared CPU)"]
  lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
  for arm in ARMS:
    st = stats.get(arm.name)
    if st is None or arm.family != family.name:
      continue
    if not st.runs:
      what = f"0 ({st.incomplete} failed/incomplete)" if st.incomplete else "not run"
      lines.append(f"| {arm.name} | {what} |" + " n/a |" * (len(head) - 2))
      continue
    def gap(base):
      if base is None or base is st or not base.runs:
        return "—" if base is st else "n/a"
      m, lo, hi, n = paired_rel_gap(st, base)
      return _pct(m) + (f" [{_pct(lo)}, {_pct(hi)}]" if n >= 2 else "")
    spread = st.spread()
    sp = f"{_f(spread)} / {_f(st.std())}" if spread is not None else "1 seed"
    s0 = st.runs[0]["step0_loss"] if 0 in st.runs else None
    ms = statistics.fmean([r["median_step_s"] for r in st.runs.values() if r["median_step_s"]] or [float("nan")])
    n = f"{len(st.runs)}" + (f" (+{st.incomplete} failed)" if st.incomplete else "")
    label = arm.name + (" †" if st.carried else "")
    lines.append(f"| {label} | {n} | {_f(st.mean('final_train_loss'))} | {_f(st.mean())} | {sp} | "
                 f"{gap(bf16)} | {gap(fp8)} | {_f(s0, '{:.4f}')} | {_f(ms, '{:.2f}')} |")
  return lines


def _paired(a: ArmStats, b: ArmStats) -> str:
  """Per-seed paired differences eval_a(s) - eval_b(s): range and how many are positive."""
  ea, eb = a.evals(), b.evals()
  d = [ea[s] - eb[s] for s in sorted(set(ea) & set(eb))]
  if not d:
    return "no shared seed"
  return (f"paired per seed: [{min(d):+.4f}, {max(d):+.4f}], {a.arm.name} worse in {sum(x > 0 for x in d)}/{len(d)}"
          " seed(s)")


def _one_seed(*arms: ArmStats) -> str:
  return " (1 seed each: no spread measured)" if all(a.spread() is None for a in arms) else ""


def verdicts(stats: dict[str, ArmStats]) -> list[str]:
  """The issue's targets, evaluated with the formulas of the module docstring."""
  g = stats.get
  have = lambda s: s is not None and s.runs  # noqa: E731
  out = key_verdicts(stats, FAMILIES[0])
  nv = g("nvfp4")
  for peer in ("qwix_nvfp4", "jaxnn_nvfp4"):
    p = g(peer)
    if have(nv) and have(p):
      spread = max(x for x in (nv.spread(), p.spread(), 0.0) if x is not None)
      d = p.mean() - nv.mean()
      verdict = "MET (nvfp4 better beyond the spread)" if d > spread else (
          "NOT MET: nvfp4 better but within the spread" if d > 0 else "NOT MET: the peer is better")
      out.append(f"- **nvfp4 better than {peer}**: eval {p.mean():.4f} - {nv.mean():.4f} = {d:+.4f} vs spread "
                 f"{spread:.4f}{_one_seed(nv, p)} -> {verdict}; {_paired(p, nv)}")
    elif p is not None and not p.runs:
      out.append(f"- **nvfp4 better than {peer}**: the peer has no complete run ({p.incomplete} failed)")
  fwd = g("nvfp4_fwd_only")
  for peer in ("jaxnn_nvfp4", "qwix_nvfp4_fwd"):
    p = g(peer)
    if have(fwd) and have(p):  # forward-only NVFP4 against forward-only NVFP4: the same GEMMs quantized
      out.append(f"- diagnostic, forward-only vs forward-only: {peer} - nvfp4_fwd_only = "
                 f"{p.mean() - fwd.mean():+.4f} nats (eval means); {_paired(p, fwd)}")
  if have(fwd) and have(nv):
    out.append(f"- diagnostic, cost of our NVFP4 backward: nvfp4 - nvfp4_fwd_only = {nv.mean() - fwd.mean():+.4f}"
               f" nats (eval means); {_paired(nv, fwd)}")
  if have(nv):
    spread = nv.spread()
    e0 = nv.evals().get(0)
    for arm in ARMS:
      st = g(arm.name)
      if arm.expect == 0 or st is None or not st.runs or e0 is None or 0 not in st.evals():
        continue
      d = st.evals()[0] - e0
      exp = "worse (+)" if arm.expect > 0 else "better (-)"
      same = (d > 0) == (arm.expect > 0)
      beyond = spread is not None and abs(d) > spread
      word = ("reproduces" if same and beyond else "same direction, within seed spread" if same
              else "opposite direction" + ("" if beyond else ", within seed spread"))
      out.append(f"- ablation **{arm.name}** vs nvfp4 (seed 0): {d:+.4f} nats ({_pct(d / e0)}); paper: {exp} -> "
                 f"{word}" + ("" if spread is not None else " (no seed spread yet)"))
  for family in FAMILIES[1:]:
    out += key_verdicts(stats, family)
  return out


def key_verdicts(stats: dict[str, ArmStats], family: Family) -> list[str]:
  """Targets 1 and 2 of one family: its nvfp4 arm against its own bf16 and fp8 arms."""
  out = []
  nv, bf, f8 = stats.get(family.nvfp4), stats.get(family.bf16), stats.get(family.fp8)
  bf_l, f8_l, nv_l = family.labels
  have = lambda s: s is not None and s.runs  # noqa: E731
  if have(nv) and have(bf):
    m, _, _, n = paired_rel_gap(nv, bf)
    ok = m <= 0.01
    out.append(f"- **{nv_l} eval-loss gap vs {bf_l} <= 1 % relative**: {_pct(m)} (mean of {n} paired seed(s)) -> "
               f"{'MET' if ok else 'NOT MET'}; {_paired(nv, bf)}")
  if have(nv) and have(bf) and have(f8):
    spread = max(x for x in (nv.spread(), f8.spread(), 0.0) if x is not None)
    d_nv, d_f8 = nv.mean() - bf.mean(), f8.mean() - bf.mean()
    ok = d_nv <= d_f8 + spread
    out.append(f"- **{nv_l} gap <= {f8_l} gap + seed spread**: {nv_l} {d_nv:+.4f} vs {f8_l} {d_f8:+.4f} + spread "
               f"{spread:.4f}{_one_seed(nv, f8)} (nats, eval loss means) -> {'MET' if ok else 'NOT MET'}; {nv_l} vs"
               f" {f8_l} {_paired(nv, f8)}")
  return out


# ------------------------------------------------------------------------------------------------ plots


PLOT_GROUPS = ("key_and_peers", "ablations", *(f.name for f in FAMILIES[1:]))


def plots(stats: dict[str, ArmStats], out: Path) -> dict[str, Path]:
  """compare-tool plots (seed 0): key arms + peers vs BF16, ablations/switches vs nvfp4, and each other
  family's bf16 / fp8 / nvfp4. Carried arms have no metrics file here and are left out."""
  from maxtext_nvfp4.tools import compare  # pylint: disable=import-outside-toplevel

  groups = {
      "key_and_peers": ["bf16", "fp8", "nvfp4", "nvfp4_fwd_only", "qwix_nvfp4", "qwix_nvfp4_fwd", "jaxnn_nvfp4"],
      "ablations": ["nvfp4", "nvfp4_no_rht", "nvfp4_no_sr", "nvfp4_1d_weights", "nvfp4_keep_last1",
                    "nvfp4_mlp_only", "nvfp4_switch_fwd", "nvfp4_switch_all"],
      **{f.name: [f.bf16, f.fp8, f.nvfp4] for f in FAMILIES[1:]},
  }
  made = {}
  for name, arms in groups.items():
    args = [f"{a}={stats[a].runs[0]['metrics_for_compare']}" for a in arms
            if a in stats and 0 in stats[a].runs and "metrics_for_compare" in stats[a].runs[0]]
    if len(args) < 2:
      continue
    d = out / "compare" / name
    with open(os.devnull, "w", encoding="utf8") as sink:
      compare.run_compare(args, out=str(d), label=f"accuracy study, seed 0: {name}", stream=sink)
    if (d / "loss.png").exists():
      made[name] = d
  return made


# ------------------------------------------------------------------------------------------------ report

BEGIN, END = "<!-- BEGIN GENERATED by run_study.py -->", "<!-- END GENERATED -->"


def hardware_line() -> str:
  try:
    cpu = next((ln.split(":", 1)[1].strip() for ln in open("/proc/cpuinfo", encoding="utf8")
                if ln.startswith("model name")), platform.processor())
  except OSError:
    cpu = platform.processor()
  return f"{os.cpu_count()} CPU core(s) ({cpu}), {platform.system()} {platform.release()}, no accelerator"


def generated_section(sizing: Sizing, stats: dict[str, ArmStats], command: str, started: str,
                      plot_rel: dict[str, str]) -> str:
  import jax  # pylint: disable=import-outside-toplevel

  n_runs = sum(len(s.runs) for s in stats.values() if not s.carried)
  n_bad = sum(s.incomplete for s in stats.values())
  walls = [r["wall_s"] for s in stats.values() if not s.carried for r in s.runs.values()]
  carried = [s for s in stats.values() if s.carried]
  tables = []
  for family in FAMILIES:
    if any(a.family == family.name and a.name in stats for a in ARMS):
      tables += [f"#### {family.title}", "", *table(stats, family), ""]
  lines = [
      BEGIN, "",
      f"- Command: {command}",
      f"- Date: {started} (UTC start), report written {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M}Z",
      f"- Hardware: {hardware_line()}; JAX {jax.__version__} ({jax.default_backend()}); NVFP4 is the exact"
      " pure-JAX emulation",
      f"- Sizing `{sizing.name}`: {sizing.steps} steps of the demo recipe's batch ("
      + (" ".join(sizing.overrides) if sizing.overrides else "4 sequences x 256 tokens, 1 device") + "),"
      f" eval after steps 0, {sizing.eval_interval}, ... {sizing.steps - 1} on {sizing.eval_steps} held-out batches;"
      f" seeds: key arms {sizing.key_seeds}, peers {sizing.peer_seeds}, others 1; {sizing.jobs} run(s) in parallel",
      f"- Runs: {n_runs} complete, {n_bad} incomplete/failed; wall time per run {min(walls or [0]):.0f}-"
      f"{max(walls or [0]):.0f} s",
      *([f"- † Carried over, not rerun in this invocation: {sum(len(s.runs) for s in carried)} run(s) of "
         f"{', '.join(s.arm.name for s in carried)}, numbers from "
         f"{', '.join(sorted({str(r.get('carried_from')) for s in carried for r in s.runs.values()}))} (a previous"
         " report of this sizing: its date, data and hardware are in the text below, not in the lines above)"]
        if carried else []),
      "",
      "Each family's relative gaps are against its own BF16 / FP8 arms.", "",
      *tables,
      "Definitions: final train loss = mean of the last ceil(steps/10) training losses; eval loss = `eval/avg_loss`"
      " after the last step; relative gap = (eval_arm - eval_base) / eval_base per seed, averaged over the seeds"
      " both arms ran ([min, max] over seeds when >= 2); seed spread = max - min of the arm's eval losses over"
      " seeds (std after the slash); step-0 loss = seed 0's loss on the first batch at the shared initial weights (it"
      " differs from BF16 only through the arm's forward quantization: a check that the path is active; arms"
      " with the same forward at step 0 show the same value); s/step is a median on a machine shared with"
      " other jobs, not a speed measurement.", "",
      "### Targets (evaluated mechanically)", "",
      *verdicts(stats), "",
  ]
  if plot_rel:
    lines += ["### Plots (compare tool, seed 0)", ""]
    for name, rel in plot_rel.items():
      lines.append(f"![{name}]({rel})")
      lines.append("")
  lines.append(END)
  return "\n".join(lines)


def write_results(path: Path, section: str, header: str) -> None:
  """Replace the generated section of ``path`` (text outside the markers is kept), or create it."""
  if path.exists():
    text = path.read_text(encoding="utf8")
    if BEGIN in text and END in text:
      pre, rest = text.split(BEGIN, 1)
      post = rest.split(END, 1)[1]
      path.write_text(pre + section + post, encoding="utf8")
      return
  path.parent.mkdir(parents=True, exist_ok=True)  # a new --publish-dir
  path.write_text(header + "\n\n" + section + "\n", encoding="utf8")


def shrink_png(src: Path, dst: Path, *, colors: int = 64) -> None:
  """Copy a plot as a 64-colour palette PNG (committed plots stay well under 200 KB; line plots lose nothing
  visible). Falls back to a plain copy without Pillow."""
  try:
    from PIL import Image  # pylint: disable=import-outside-toplevel  (matplotlib depends on Pillow)
  except ImportError:
    shutil.copyfile(src, dst)
    return
  with Image.open(src) as im:
    im.convert("RGB").quantize(colors=colors).save(dst, "PNG", optimize=True)


def report(sizing: Sizing, runs: Sequence[RunSpec], out: Path, *, command: str, started: str,
           publish_dir: Path | None, carry: dict[str, dict[int, dict]] | None = None) -> Path:
  stats = collect(out, runs, carry)
  made = plots(stats, out)
  header = "# Accuracy study: emulated NVFP4 vs FP8/BF16 and vs other FP4 paths"
  dest = publish_dir or out
  plot_rel = {}
  for name in PLOT_GROUPS:
    png = dest / "plots" / f"{name}_loss.png"
    if name in made:
      png.parent.mkdir(parents=True, exist_ok=True)
      shrink_png(made[name] / "loss.png", png)
      plot_rel[name] = f"plots/{name}_loss.png"
    elif png.exists() and any(s.carried for s in stats.values()):  # the carried runs' plot, not rebuilt
      plot_rel[f"{name} (carried runs, plot not rebuilt)"] = f"plots/{name}_loss.png"
  results = dest / "RESULTS.md"
  write_results(results, generated_section(sizing, stats, command, started, plot_rel), header)
  keys = ("final_train_loss", "final_eval_loss", "step0_loss", "wall_s", "median_step_s", "eval_loss")
  (dest / "study_summary.json").write_text(json.dumps(
      {a: {str(s): {**{k: r[k] for k in keys}, **({"carried_from": r["carried_from"]} if "carried_from" in r else {})}
           for s, r in st.runs.items()} for a, st in stats.items()}, indent=1) + "\n")
  return results


# ------------------------------------------------------------------------------------------------ CLI


def build_parser() -> argparse.ArgumentParser:
  p = argparse.ArgumentParser(prog="run_study.py", description=__doc__.split("\n\n")[0])
  mode = p.add_mutually_exclusive_group()
  mode.add_argument("--quick", action="store_const", dest="mode", const="quick", help="smoke test (OUT only)")
  mode.add_argument("--cpu", action="store_const", dest="mode", const="cpu", help="the CPU study (default)")
  mode.add_argument("--full", action="store_const", dest="mode", const="full", help="the issue's full sizing")
  mode.add_argument("--gpu", action="store_const", dest="mode", const="gpu", help="single-GPU variant (bigger model)")
  p.set_defaults(mode="cpu")
  p.add_argument("--out", help="run directory (default out/accuracy_<mode>)")
  p.add_argument("--arms", help="comma-separated subset of: " + ",".join(ARM_BY_NAME))
  p.add_argument("--jobs", type=int, help="runs in parallel (default: the sizing's)")
  p.add_argument("--steps", type=int, help="override the sizing's steps (use k * eval_interval + 1)")
  p.add_argument("--key-seeds", type=int, help="override the number of seeds of bf16/fp8/nvfp4")
  p.add_argument("--peer-seeds", type=int, help="override the number of seeds of the peers")
  p.add_argument("--publish-dir", help="where RESULTS.md + plots go (default: benchmarks/accuracy for --cpu/--full,"
                 " OUT for --quick)")
  p.add_argument("--dry-run", action="store_true", help="print the commands only")
  p.add_argument("--report-only", action="store_true", help="no training: rebuild the report from OUT")
  p.add_argument("--carry", metavar="SUMMARY_JSON",
                 help="report every arm; an arm with no run in OUT takes its numbers from this study_summary.json"
                      " of a previous report (same sizing), marked † in the tables")
  p.add_argument("--python", default=sys.executable, help="interpreter of the training runs")
  p.add_argument("extra", nargs="*", metavar="KEY=VALUE", help="extra MaxText overrides for every run")
  return p


def resolve(a: argparse.Namespace) -> tuple[Sizing, Path, list[RunSpec], Path | None]:
  """(sizing, OUT, the runs to train, publish dir) of a command line."""
  sizing = SIZINGS[a.mode]
  repl = {k: v for k, v in (("jobs", a.jobs), ("steps", a.steps), ("key_seeds", a.key_seeds),
                            ("peer_seeds", a.peer_seeds)) if v is not None}
  if repl:
    sizing = dataclasses.replace(sizing, **repl)
  if sizing.steps < 2 or sizing.jobs < 1 or sizing.key_seeds < 1 or sizing.peer_seeds < 1:
    raise ValueError("--steps must be >= 2; --jobs, --key-seeds, --peer-seeds >= 1")
  if (sizing.steps - 1) % sizing.eval_interval:
    raise ValueError(f"--steps {sizing.steps}: use k * {sizing.eval_interval} + 1 so the last eval sees the final"
                     " weights")
  arms = [x for x in (a.arms or "").split(",") if x]
  unknown = [x for x in arms if x not in ARM_BY_NAME]
  if unknown:
    raise ValueError(f"unknown arm(s) {', '.join(unknown)}; choose from {', '.join(ARM_BY_NAME)}")
  bad = [x for x in a.extra if "=" not in x or x.startswith("=")]
  if bad:
    raise ValueError(f"overrides must be KEY=VALUE: {' '.join(bad)}")
  out = Path(a.out or REPO / "out" / f"accuracy_{sizing.name}").absolute()
  runs = build_runs(sizing, out, arms=arms or None, python=a.python, extra=a.extra)
  publish = Path(a.publish_dir).absolute() if a.publish_dir else (HERE if sizing.publish else None)
  return sizing, out, runs, publish


def main(argv: Sequence[str] | None = None) -> int:
  a = build_parser().parse_args(argv)
  try:
    sizing, out, runs, publish = resolve(a)
    carry = None
    if a.carry:
      carry = load_carry(Path(a.carry), sizing)
  except (ValueError, OSError) as e:
    print(f"run_study.py: error: {e}", file=sys.stderr)
    return 2
  # --carry: the report covers every arm (those not run in OUT from the summary), training only the chosen ones.
  report_runs = build_runs(sizing, out, python=a.python, extra=a.extra) if carry is not None else runs
  args = [x for x in (argv if argv is not None else sys.argv[1:]) if x != "--report-only"]
  command = "`" + " ".join(["python benchmarks/accuracy/run_study.py", shlex.join(args)]).strip() + "`"
  if a.report_only:
    command += " (this report rebuilt from its finished runs with `--report-only`)"
  if a.dry_run:
    for r in runs:
      print(f"# {r.key}\n{shlex.join(r.argv)}")
    return 0
  started = f"{datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M}Z"
  out.mkdir(parents=True, exist_ok=True)
  if not a.report_only:
    ensure_data(a.python)
    print(f"accuracy study ({sizing.name}): {len(runs)} runs, {sizing.jobs} at a time, into {out}", flush=True)
    lock = threading.Lock()
    with concurrent.futures.ThreadPoolExecutor(max_workers=sizing.jobs) as pool:
      futs = [pool.submit(run_one, r, steps=sizing.steps, lock=lock) for r in runs]
      for f in futs:
        f.result()
  path = report(sizing, report_runs, out, command=command, started=started, publish_dir=publish, carry=carry)
  print(f"wrote {path}")
  print(path.read_text(encoding="utf8").split(BEGIN, 1)[1].split(END, 1)[0])
  return 0


if __name__ == "__main__":
  sys.exit(main())
