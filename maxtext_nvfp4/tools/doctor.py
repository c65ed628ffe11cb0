"""``maxtext-nvfp4 doctor``: what this machine will run, and why.

Reports the JAX version and default backend, every local device with its kind and CUDA compute
capability, whether Transformer Engine is installed (version from package metadata) and whether its
JAX binding imports, the MaxText version and the state of our MaxText patch series, which backend
``nvfp4_backend=auto`` picks and why, and, with ``--recipe FILE.yml [key=value ...]``, the effective
``nvfp4_*`` settings of that recipe (where each value came from) and the backend it would run on.

Recipe files are read with pyyaml, not MaxText: ``base_config`` chains are followed only into our own
recipes directory (``maxtext_nvfp4/recipes``); a base outside it (MaxText's ``base.yml``) contributes
only our defaults, which the patch set's ``base.yml`` hunk mirrors. Command-line ``key=value``
overrides are YAML-typed, as MaxText's ``OmegaConf.from_cli`` does.

Usage: ``maxtext-nvfp4 doctor [--json] [--recipe FILE.yml] [key=value ...]``. Exit status 0, or 1 when
the recipe cannot be read or its settings are invalid.
"""

from __future__ import annotations

import argparse
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
from maxtext_nvfp4.core import te_limits

RECIPES_DIR = Path(maxtext_nvfp4.__file__).resolve().parent / "recipes"
_MAX_CHAIN = 16


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


def _resolve_base(current: Path, base: str) -> Path | None:
  """The base file when it lies in our recipes dir (next to ``current`` first, as MaxText looks)."""
  for cand in ((current.parent / base), (RECIPES_DIR / Path(base).name)):
    try:
      cand = cand.resolve()
    except OSError:
      continue
    if cand.is_file() and cand.parent == RECIPES_DIR.resolve():
      return cand
  return None


def load_recipe(path: str | Path, overrides: Sequence[str] = ()) -> dict[str, Any]:
  """Merge a recipe's ``base_config`` chain (ours only) and overrides; return values and sources.

  Returns ``{"file", "chain", "stopped_at", "values": {key: value}, "sources": {key: where}}`` with
  ``values`` holding every key seen (child over parent, overrides last).

  Raises:
    FileNotFoundError / ValueError: unreadable file, non-mapping YAML, malformed override, a cycle.
  """
  import yaml  # pylint: disable=import-outside-toplevel

  path = Path(path)
  if not path.is_file():
    raise FileNotFoundError(f"recipe {path} does not exist")
  chain: list[Path] = []
  contents: list[dict] = []  # parsed YAML of each chain file, read once
  stopped_at = None
  cur: Path | None = path.resolve()
  while cur is not None:
    if cur in chain:
      raise ValueError(f"base_config cycle at {cur}")
    if len(chain) >= _MAX_CHAIN:
      raise ValueError(f"base_config chain longer than {_MAX_CHAIN} files")
    chain.append(cur)
    data = yaml.safe_load(cur.read_text()) or {}
    if not isinstance(data, dict):
      raise ValueError(f"{cur}: expected a YAML mapping at top level, got {type(data).__name__}")
    contents.append(data)
    base = data.get("base_config")
    nxt = _resolve_base(cur, str(base)) if base else None
    if base and nxt is None:
      stopped_at = str(base)
    cur = nxt
  values: dict[str, Any] = {}
  sources: dict[str, str] = {}
  for f, data in reversed(list(zip(chain, contents))):  # parent first, child overrides
    for k, v in data.items():
      if k == "base_config":
        continue
      values[k] = v
      sources[k] = str(f)
  for item in overrides:
    key, sep, raw = item.partition("=")
    if not sep or not key:
      raise ValueError(f"override {item!r} is not of the form key=value")
    values[key] = yaml.safe_load(raw) if raw != "" else ""
    sources[key] = "command line"
  return {"file": str(path), "chain": [str(c) for c in chain], "stopped_at": stopped_at, "values": values,
          "sources": sources}


def _recipe_section(path, overrides, devices) -> dict[str, Any]:
  try:
    loaded = load_recipe(path, overrides)
  except (OSError, ValueError) as e:
    return {"file": str(path), "error": str(e)}
  except Exception as e:  # pylint: disable=broad-except  # yaml.YAMLError and friends
    return {"file": str(path), "error": f"{type(e).__name__}: {e}"}
  values, sources = loaded["values"], loaded["sources"]
  known = settings_mod.config_keys()
  unknown = sorted(k for k in values if k.startswith("nvfp4_") and k not in known)
  out: dict[str, Any] = {
      "file": loaded["file"],
      "chain": loaded["chain"],
      "base_not_followed": loaded["stopped_at"],
      "quantization": values.get("quantization"),
  }
  if unknown:
    out["error"] = f"unknown key(s) {', '.join(unknown)}; known nvfp4 keys: {', '.join(known)}"
    return out
  mapping = {k: values.get(k, d) for k, d in known.items()}
  out["settings"] = {k: {"value": mapping[k], "source": sources.get(k, "default")} for k in known}
  try:
    s = settings_mod.from_config(mapping)
    steps = values.get("steps")
    settings_mod.validate(
        s,
        num_layers=values.get("base_num_decoder_layers"),
        steps=int(steps) if isinstance(steps, (int, float)) else None,
        # MaxText's base.yml default is scan_layers: true; kept layers need it false.
        scan_layers=values.get("scan_layers", True),
    )
  except (ValueError, TypeError) as e:
    out["error"] = str(e)
    return out
  # What Transformer Engine would refuse (core/te_limits): the emulation zero-pads it, nvfp4_backend=te stops.
  out["te_refusals"] = [r.as_dict() for r in te_limits.check(values, s)]
  try:
    c = capability.choose_backend(s.backend, devices=devices)
    out["backend"] = {"name": c.name, "reason": c.reason}
    if c.name == "te":
      from maxtext_nvfp4.backends import te as te_backend  # pylint: disable=import-outside-toplevel

      te_backend.check_te_settings(s)
      out["te_recipe"] = te_backend.recipe_kwargs(s)
  except capability.BackendError as e:
    out["backend"] = {"name": None, "reason": str(e)}
    out["error"] = str(e)
  return out


def collect(recipe_path: str | Path | None = None, overrides: Sequence[str] = ()) -> dict[str, Any]:
  """Everything ``doctor`` reports, as a JSON-serialisable dict (see the module docstring)."""
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
  if recipe_path is not None:
    report["recipe"] = _recipe_section(recipe_path, overrides, devices)
  return report


def format_human(r: dict[str, Any]) -> str:
  """The report as aligned text lines."""
  j, te, mt = r["jax"], r["transformer_engine"], r["maxtext"]
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
  lines.append(f"Backend auto: {b['name']} -- {b['reason']}")
  rec = r.get("recipe")
  if rec is not None:
    lines.append(f"Recipe:       {rec['file']}")
    if rec.get("chain") and len(rec["chain"]) > 1:
      lines.append("  base_config chain: " + " <- ".join(rec["chain"]))
    if rec.get("base_not_followed"):
      lines.append(f"  base_config {rec['base_not_followed']!r} not followed (outside our recipes dir; defaults apply)")
    if rec.get("quantization") is not None:
      lines.append(f"  quantization = {rec['quantization']}")
    for k, v in (rec.get("settings") or {}).items():
      lines.append(f"  {k:<26} = {v['value']!r:<10} ({v['source']})")
    if rec.get("backend"):
      name = rec["backend"]["name"] or "none"
      lines.append(f"  backend: {name} -- {rec['backend']['reason']}")
    if rec.get("te_recipe"):
      lines.append(f"  TE NVFP4BlockScaling({', '.join(f'{k}={v}' for k, v in rec['te_recipe'].items())})")
    refused = [te_limits.Refusal(**d) for d in rec.get("te_refusals") or []]
    if refused:
      lines.append(f"  {te_limits.REFUSAL_PREFIX} {len(refused)} limit(s) broken (emulate pads them; te stops):")
      lines.extend(f"    {r.text()}" for r in refused)
    if rec.get("error"):
      lines.append(f"  ERROR: {rec['error']}")
  return "\n".join(lines)


def cli_main(argv: list[str]) -> int:
  p = argparse.ArgumentParser(prog="maxtext-nvfp4 doctor", description=__doc__.split("\n\n")[0])
  p.add_argument("--json", action="store_true", help="print one JSON object (for scripts)")
  p.add_argument("--recipe", metavar="FILE.yml", help="also show this recipe's effective nvfp4_* settings")
  p.add_argument("overrides", nargs="*", metavar="key=value", help="overrides applied to --recipe")
  a = p.parse_args(argv)
  if a.overrides and not a.recipe:
    p.error("key=value overrides need --recipe FILE.yml")
  report = collect(a.recipe, a.overrides)
  if a.json:
    print(json.dumps(report, indent=2, sort_keys=False, default=str))
  else:
    print(format_human(report))
  return 1 if (report.get("recipe") or {}).get("error") else 0


if __name__ == "__main__":
  sys.exit(cli_main(sys.argv[1:]))
