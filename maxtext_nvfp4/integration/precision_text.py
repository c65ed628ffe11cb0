"""The start-up precision table: every decoder GEMM of a config with its fprop/dgrad/wgrad precisions."""

from __future__ import annotations

from maxtext_nvfp4.core import layout as layout_lib
from maxtext_nvfp4.core import plan as plan_lib
from maxtext_nvfp4.core import settings as settings_lib
from maxtext_nvfp4.integration import model_layout


def precision_table_text(config, layout: layout_lib.ModelLayout | None = None) -> str:
  """The precision table of ``config`` (every decoder GEMM, fprop/dgrad/wgrad, before/after the switch)."""
  s = settings_lib.from_config(config)
  layout = layout or model_layout.layout_of(config)
  rows = plan_lib.precision_table(s, num_layers=layout.num_layers, roles=layout.roles, scan_layers=layout.scan_layers)
  switch = s.switch_step(config.steps)
  head = (f"maxtext-nvfp4: decoder GEMM precisions (targets={s.targets}, keep_first={s.keep_first_layers},"
          f" keep_last={s.keep_last_layers}, fallback={s.fallback}"
          + (f", switch at step {switch} to {s.switch_to} scope={s.switch_scope})" if switch is not None else ")"))
  path = ("sparse_matmul=true: the grouped GEMM, per device" if bool(getattr(config, "sparse_matmul", False))
          else "sparse_matmul=false: the expert einsums")
  moe = ("\nMoE: router = gate logits, always bf16; dispatch/combine (routing) = MaxText's, in high"
         " precision; expert_* = one GEMM per expert (own amax per expert weight and per expert token group;"
         f" {path})" if layout.moe_layers else "")
  options = f"\nrecipe options: {s.describe()}" + (
      f" (TE PyTorch only: {', '.join(s.te_pytorch_only())})" if s.te_pytorch_only() else "")
  return head + options + "\n" + plan_lib.format_precision_table(rows, switch_step=switch) + moe
