"""The start-up precision table: the decoder GEMMs of a config with their fprop/dgrad/wgrad precisions.

Shown as runs of identical layers (``0-1``, ``2-123``, ``124-125``: a few lines at any depth); the
per-layer table (one line per GEMM: 885 lines for Llama 3.1 405B) with ``MAXTEXT_NVFP4_VERBOSE=1``.
"""

from __future__ import annotations

import os

from maxtext_nvfp4.core import layout as layout_lib
from maxtext_nvfp4.core import plan as plan_lib
from maxtext_nvfp4.integration import parsed_config

# Set to 1: the per-layer precision table, and the library messages log_filter hides.
VERBOSE_ENV = "MAXTEXT_NVFP4_VERBOSE"


# the start-up line of each nvfp4_qat mode (after the recipe options)
QAT_TEXT = {
    "full": "",
    "forward": "\nnvfp4_qat=forward: NVFP4 forward, dgrad/wgrad in bf16 on the original operands (straight-through;"
               " = nvfp4_backward_override=high_precision)",
    "serving": "\nnvfp4_qat=serving: fprop 'serve' = the export's W4A4 (fp32 master weights in 1x16 blocks, q/k/v and"
               " gate/up sharing one global scale, per-token activation scales; core/serving_gemm.py), dgrad/wgrad in"
               " bf16 (straight-through)",
}


def verbose() -> bool:
  """Whether ``MAXTEXT_NVFP4_VERBOSE`` asks for everything (any value but "", "0", "false", "no")."""
  return os.environ.get(VERBOSE_ENV, "").strip().lower() not in ("", "0", "false", "no")


def precision_table_text(config, layout: layout_lib.ModelLayout | None = None, *, per_layer: bool | None = None) -> str:
  """The precision table of ``config`` (decoder GEMMs, fprop/dgrad/wgrad, before/after the switch); ``layout``:
  its decoder when the caller already has it.

  ``per_layer``: one line per GEMM instead of runs of identical layers (None: :func:`verbose`).
  """
  return parsed_table_text(parsed_config.parse(config, layout=layout), per_layer=per_layer)


def parsed_table_text(run: parsed_config.ParsedConfig, *, per_layer: bool | None = None) -> str:
  """:func:`precision_table_text` of a config already read."""
  config, s, layout = run.config, run.settings, run.layout
  rows = plan_lib.precision_table(s, num_layers=layout.num_layers, roles=layout.roles, scan_layers=layout.scan_layers)
  switch = s.switch_step(config.steps)
  head = (f"maxtext-nvfp4: decoder GEMM precisions (targets={s.targets}, keep_first={s.keep_first_layers},"
          f" keep_last={s.keep_last_layers}, fallback={s.fallback}"
          + (f", switch at step {switch} to {s.switch_to} scope={s.switch_scope})" if switch is not None else ")"))
  path = ("sparse_matmul=true: the grouped GEMM, per device" if bool(getattr(config, "sparse_matmul", False))
          else "sparse_matmul=false: the expert einsums")
  moe = ("\nMoE: router = gate logits, always bf16; dispatch/combine (routing) = MaxText's, in high precision;"
         "\n  expert_* = one GEMM per expert (own amax per expert weight and per expert token group;"
         f" {path})" if layout.moe_layers else "")
  options = f"\nrecipe options: {s.describe()}" + (
      f" (TE PyTorch only: {', '.join(s.te_pytorch_only())})" if s.te_pytorch_only() else "") + QAT_TEXT[s.qat]
  if verbose() if per_layer is None else per_layer:
    table = plan_lib.format_precision_table(rows, switch_step=switch)
  else:
    runs = plan_lib.precision_runs(rows)
    table = plan_lib.format_precision_runs(runs, switch_step=switch)
    if len(runs) < len(rows):
      table += f"\n(runs of identical layers; one line per GEMM: {VERBOSE_ENV}=1)"
  return head + options + "\n" + table + moe
