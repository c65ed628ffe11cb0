"""``maxtext-nvfp4 doctor``: what this machine will run, and why.

Reports the JAX version and default backend, every local device with its kind and CUDA compute
capability, whether Transformer Engine is installed (version from package metadata) and whether its
JAX binding imports, the MaxText version and the state of our MaxText patch series, which backend
``nvfp4_backend=auto`` picks and why, and, with ``--recipe FILE.yml [key=value ...]``, the effective
``nvfp4_*`` settings of that recipe (where each value came from) and the backend it would run on.

The recipe (a path or a packaged name) is found and read by :func:`maxtext_nvfp4.tools.recipes.resolve`,
the reader ``train`` uses, in MaxText's own order: ``base_config`` beside each file first, then
MaxText's configs folder; then the ``key=value`` overrides, the ``model_name`` YAML and ``M_*``
variables. A key no file sets shows its default (our settings' default; MaxText's ``base.yml`` carries
the ``nvfp4_*`` keys only when the patch series is applied).

Usage: ``maxtext-nvfp4 doctor [--json] [--recipe RECIPE] [key=value ...]``. Exit status 0; 2 with one
line on stderr when an argument is wrong, the recipe cannot be found or read, names a key MaxText does
not know (checked before JAX starts; no report), or its settings are invalid or cannot run here (after
the report, which shows the error too).
"""

from __future__ import annotations

import importlib
import importlib.metadata
import json
import platform
import sys
from pathlib import Path
from typing import Any, Sequence

import maxtext_nvfp4
from maxtext_nvfp4.backends import capability
from maxtext_nvfp4.core import settings as settings_mod
from maxtext_nvfp4.core import amax_scope
from maxtext_nvfp4.core import te_limits
from maxtext_nvfp4.tools import recipes as recipes_mod

def _jax_section() -> dict[str, Any]:
  try:
    import jax  # pylint: disable=import-outside-toplevel

    devices = jax.local_devices()
    return {
        "version": jax.__version__,
        "default_backend": jax.default_backend(),
        "process_count": jax.process_count(),
        "devices": [
            {
                "id": getattr(d, "id", None),
                "platform": getattr(d, "platform", None),
                "kind": getattr(d, "device_kind", None),
                "compute_capability": capability.device_compute_capability(d),
            }
            for d in devices
        ],
        "_devices": devices,
    }
  except Exception as e:  # pylint: disable=broad-except
    return {"version": None, "default_backend": None, "devices": [], "error": f"{type(e).__name__}: {e}"}


def _te_section() -> dict[str, Any]:
  version = capability.te_version()
  if version is None:
    return {"installed": False, "version": None, "jax_import": "not installed"}
  err = capability.te_unavailable_reason()  # TE is installed: try its JAX binding (this is a GPU host)
  return {"installed": True, "version": version, "jax_import": "ok" if err is None else err}


def _maxtext_section() -> dict[str, Any]:
  try:
    version = importlib.metadata.version("maxtext")
  except importlib.metadata.PackageNotFoundError:
    version = None
  out: dict[str, Any] = {"version": version}
  try:
    patching = importlib.import_module("maxtext_nvfp4.tools.patching")
  except ImportError as e:
    out["patch"] = {"state": "unavailable", "message": f"maxtext_nvfp4.tools.patching is not available ({e})"}
    return out
  try:
    st = patching.status()
    out["patch"] = st if isinstance(st, dict) else {"state": str(st), "message": str(st)}
  except Exception as e:  # pylint: disable=broad-except
    out["patch"] = {"state": "error", "message": f"{type(e).__name__}: {e}"}
  return out


def read_recipe(recipe: str, overrides: Sequence[str] = ()) -> recipes_mod.Recipe:
  """The recipe and overrides as train will read them; raises a one-line :class:`recipes_mod.RecipeError`
  (missing, unreadable, bad YAML, bad override) or :class:`settings_mod.SettingsError` (a key MaxText
  does not know)."""
  from maxtext_nvfp4.integration import config_errors  # pylint: disable=import-outside-toplevel

  r = recipes_mod.resolve([recipe, *overrides])
  known = set(config_errors.known_config_keys())
  for key in r.values:
    if key not in known and key != "base_config":
      src = r.sources.get(key, "")
      raise config_errors.unknown_key_error(key, "on the command line" if src == "command line" else f"(set in {src})")
  return r


def _recipe_section(recipe: recipes_mod.Recipe, devices) -> dict[str, Any]:
  values, sources = recipe.values, recipe.sources
  known = settings_mod.config_keys()
  out: dict[str, Any] = {
      "file": recipe.path,
      "chain": list(recipe.chain),
      "model_file": recipe.model_file,
      "quantization": values.get("quantization"),
  }
  mapping = {k: values.get(k, d) for k, d in known.items()}
  out["settings"] = {k: {"value": mapping[k], "source": sources.get(k, "default") if k in values else "default"}
                     for k in known}
  problem = recipes_mod.settings_error(values)
  if problem:
    out["error"] = problem
    return out
  s = settings_mod.from_config(mapping)
  # What Transformer Engine would refuse (core/te_limits): the emulation zero-pads it, nvfp4_backend=te stops.
  out["te_refusals"] = [r.as_dict() for r in te_limits.check(values, s)]
  out["amax_scope"] = amax_scope.operand_scopes(s.amax_scope)  # per operand: over what its amax is taken
  # The recipe options as the quantizers see them: per tensor, 4over6 / E4M3 bound / row-scaled amax.
  out["recipe_options"] = {
      "summary": s.describe(),
      "te_pytorch_only": s.te_pytorch_only(),
      "tensors": {t: {"4over6": s.uses_4over6(t), "e4m3_bound": s.e4m3_bound(t), "row_scaled": s.row_scaled(t)}
                  for t in ("weight", "activation", "gradient")},
      "backward": {p: s.backward_precision("nvfp4") for p in ("dgrad", "wgrad")},
      # nvfp4_qat: what an nvfp4-planned fprop computes ("serve": the export's W4A4, core/serving_gemm.py)
      "qat": {"mode": s.qat, "fprop": s.forward_precision("nvfp4")},
  }
  try:
    c = capability.choose_backend(s.backend, devices=devices, settings=s)
    out["backend"] = {"name": c.name, "reason": c.reason}
    if c.implementation.stops_at_te_limits:  # TE's recipe: the options it refuses, the toggles it is given
      from maxtext_nvfp4.backends import te as te_backend  # pylint: disable=import-outside-toplevel

      te_backend.check_te_settings(s)
      out["te_recipe"] = te_backend.recipe_kwargs(s)
  except capability.BackendError as e:
    out["backend"] = {"name": None, "reason": str(e)}
    out["error"] = str(e)
  return out


def collect(recipe: str | Path | recipes_mod.Recipe | None = None, overrides: Sequence[str] = ()) -> dict[str, Any]:
  """Everything ``doctor`` reports, as a JSON-serialisable dict (see the module docstring). ``recipe``: a
  path or packaged name (read with ``overrides``; an unreadable one gives ``{"file", "error"}``) or a
  :func:`read_recipe` result."""
  jax_info = _jax_section()
  devices = jax_info.pop("_devices", None)
  report: dict[str, Any] = {
      "maxtext_nvfp4": maxtext_nvfp4.__version__,
      "python": platform.python_version(),
      "jax": jax_info,
      "transformer_engine": _te_section(),
      "maxtext": _maxtext_section(),
  }
  if devices is not None:
    c = capability.choose_backend("auto", devices=devices)
    report["backend_auto"] = {"name": c.name, "reason": c.reason}
  else:
    report["backend_auto"] = {"name": "emulate", "reason": f"JAX devices unavailable ({jax_info.get('error')})"}
  if recipe is not None:
    if not isinstance(recipe, recipes_mod.Recipe):
      try:
        recipe = read_recipe(str(recipe), overrides)
      except (recipes_mod.RecipeError, settings_mod.SettingsError) as e:
        report["recipe"] = {"file": str(recipe), "error": str(e)}
        return report
    report["recipe"] = _recipe_section(recipe, devices)
  return report


def format_human(r: dict[str, Any]) -> str:
  """The report as aligned text lines."""
  j, te, mt = r["jax"], r["transformer_engine"], r["maxtext"]
  import_error = te["jax_import"] if te.get("installed") and te.get("jax_import") not in (None, "ok") else None

  def once(reason: str) -> str:
    """The TE import error is printed on the TE line; later lines point at it instead of repeating it."""
    return reason.replace(f" ({import_error})", " (the import error on the TE line)") if import_error else reason

  lines = [f"maxtext-nvfp4 {r['maxtext_nvfp4']} (Python {r['python']})"]
  lines.append(f"JAX:          {j.get('version')} (default backend: {j.get('default_backend')})"
               + (f"  ERROR {j['error']}" if j.get("error") else ""))
  for d in j.get("devices", []):
    cc = d["compute_capability"]
    lines.append(f"  device {d['id']}: {d['platform']} {d['kind']}" + (f", compute capability {cc:.1f}" if cc is not None else ""))
  if te["installed"]:
    lines.append(f"TE:           Transformer Engine {te['version']} installed; JAX binding: {te['jax_import']}")
  else:
    lines.append(f"TE:           not installed ({capability.INSTALL_HINT} on Blackwell)")
  patch = mt.get("patch", {})
  lines.append(f"MaxText:      {mt.get('version') or 'not installed'}; patch series: {patch.get('state')}"
               + (f" ({patch['message']})" if patch.get("message") else ""))
  b = r["backend_auto"]
  lines.append(f"Backend auto: {b['name']} -- {once(b['reason'])}")
  rec = r.get("recipe")
  if rec is not None:
    lines.append(f"Recipe:       {rec['file']}")
    if rec.get("chain") and len(rec["chain"]) > 1:
      lines.append("  base_config chain: " + " <- ".join(rec["chain"]))
    if rec.get("model_file"):
      lines.append(f"  model_name config: {rec['model_file']}")
    if rec.get("quantization") is not None:
      lines.append(f"  quantization = {rec['quantization']}")
    for k, v in (rec.get("settings") or {}).items():
      lines.append(f"  {k:<26} = {v['value']!r:<10} ({v['source']})")
    if rec.get("backend"):
      name = rec["backend"]["name"] or "none"
      lines.append(f"  backend: {name} -- {once(rec['backend']['reason'])}")
    opts = rec.get("recipe_options")
    if opts:
      only = f" (TE PyTorch only: {', '.join(opts['te_pytorch_only'])})" if opts["te_pytorch_only"] else ""
      lines.append(f"  recipe options: {opts['summary']}{only}")
      for t, v in opts["tensors"].items():
        lines.append(f"    {t:<10} 4over6={str(v['4over6']).lower():<5} e4m3_bound={v['e4m3_bound']}"
                     f" row_scaled={str(v['row_scaled']).lower()}")
      lines.append(f"    nvfp4 dgrad/wgrad run as: {opts['backward']['dgrad']}")
      if opts.get("qat"):
        lines.append(f"    nvfp4_qat={opts['qat']['mode']}: nvfp4 fprop runs as: {opts['qat']['fprop']}")
    if rec.get("te_recipe"):
      lines.append(f"  TE NVFP4BlockScaling({', '.join(f'{k}={v}' for k, v in rec['te_recipe'].items())})")
    for op, where in (rec.get("amax_scope") or {}).items():
      lines.append(f"  amax of {op:<2} over {where}")
    refused = [te_limits.Refusal(**d) for d in rec.get("te_refusals") or []]
    if refused:
      lines.append(f"  {te_limits.REFUSAL_PREFIX} {len(refused)} limit(s) broken (emulate pads them; te stops):")
      lines.extend(f"    {r.text()}" for r in refused)
    if rec.get("error"):
      lines.append(f"  ERROR: {once(rec['error'])}")
  return "\n".join(lines)


def cli_main(argv: list[str]) -> int:
  from maxtext_nvfp4.tools import cli  # pylint: disable=import-outside-toplevel

  p = cli.ArgumentParser(prog="maxtext-nvfp4 doctor", description=__doc__.split("\n\n")[0])
  p.add_argument("--json", action="store_true", help="print one JSON object (for scripts)")
  p.add_argument("--recipe", metavar="RECIPE", help="also show this recipe's effective nvfp4_* settings (a .yml"
                 " path or a packaged name)")
  p.add_argument("overrides", nargs="*", metavar="key=value", help="overrides applied to --recipe")
  a = p.parse_intermixed_args(argv)
  if a.overrides and not a.recipe:
    p.error("key=value overrides need --recipe RECIPE")
  recipe = None
  if a.recipe is not None:
    try:
      recipe = read_recipe(a.recipe, a.overrides)
    except (recipes_mod.RecipeError, settings_mod.SettingsError) as e:
      print(f"maxtext-nvfp4 doctor: error: {' '.join(str(e).split())}", file=sys.stderr)
      return 2
  report = collect(recipe)
  if a.json:
    print(json.dumps(report, indent=2, sort_keys=False, default=str))
  else:
    print(format_human(report))
  error = (report.get("recipe") or {}).get("error")
  if error:
    print(f"maxtext-nvfp4 doctor: error: {' '.join(str(error).split())}", file=sys.stderr)
    return 2
  return 0


if __name__ == "__main__":
  sys.exit(cli_main(sys.argv[1:]))
