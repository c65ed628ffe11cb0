"""The installed MaxText's patch series and ``maxtext-nvfp4 patch`` (apply / --check / --revert).

Never touches the installed MaxText: every write test works on a copy of the package in tmp_path. The
series generator (scripts/make_patch_series.py) is loaded from its file.
"""

from __future__ import annotations

import ast
import dataclasses
import hashlib
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import textwrap
import types
from pathlib import Path

import pytest
import yaml

from maxtext_nvfp4.integration import maxtext_versions
from maxtext_nvfp4.tools import cli
from maxtext_nvfp4.tools import patching
from maxtext_nvfp4.core import settings

REPO = Path(__file__).resolve().parents[2]
INSTALLED = Path(importlib.util.find_spec("maxtext").submodule_search_locations[0])
# The installed MaxText's release (the support matrix runs this file on each supported one) and its series.
VERSION = patching.maxtext_version(INSTALLED)
SERIES_DIR = REPO / "patches" / f"maxtext-{VERSION}"
PY = sys.executable


def _load_generator():
  spec = importlib.util.spec_from_file_location("make_patch_series", REPO / "scripts" / "make_patch_series.py")
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


# ------------------------------------------------------------------------------------------------
# helpers


def _tree_hashes(root: Path) -> dict[str, tuple[str, int]]:
  """{relative path: (sha256, mode)} of every file and dir under root."""
  out = {}
  for dirpath, dirnames, filenames in os.walk(root):
    for name in dirnames:
      p = Path(dirpath, name)
      out[str(p.relative_to(root)) + "/"] = ("dir", p.stat().st_mode)
    for name in filenames:
      p = Path(dirpath, name)
      out[str(p.relative_to(root))] = (hashlib.sha256(p.read_bytes()).hexdigest(), p.stat().st_mode)
  return out


@pytest.fixture
def pkg(tmp_path) -> Path:
  """A pristine copy of the installed maxtext package (no __pycache__), as <tmp>/site/maxtext."""
  dst = tmp_path / "site" / "maxtext"
  shutil.copytree(INSTALLED, dst, ignore=shutil.ignore_patterns("__pycache__"))
  assert patching.maxtext_version(dst) == VERSION
  return dst


def _patch(argv, capsys):
  rc = cli.main(["patch", *argv])
  out = capsys.readouterr()
  return rc, out.out + out.err


def _added_blocks(p: patching.Patch, path: str) -> list[list[str]]:
  """Per hunk: the lines ``p`` adds (not context) to ``path``, in order, without line endings."""
  (fp,) = [f for f in p.files if f.path == path]
  blocks = []
  for h in fp.hunks:
    # Hunks here only add lines, so the added ones are the post-image lines beyond the pre-image.
    it = iter(h.old)
    nxt = next(it, None)
    added = []
    for ln in h.new:
      if ln == nxt:
        nxt = next(it, None)
      else:
        added.append(ln.rstrip("\n"))
    assert nxt is None, "hunk removes lines"
    blocks.append(added)
  return blocks


def _added_lines(p: patching.Patch, path: str) -> list[str]:
  return [ln for b in _added_blocks(p, path) for ln in b]


@pytest.fixture(scope="module")
def series() -> list[patching.Patch]:
  return patching.load_series(VERSION)


# ------------------------------------------------------------------------------------------------
# the series itself


def test_series_is_upstream_style_one_concern_per_patch(series):
  files = sorted(SERIES_DIR.glob("*.patch"))
  assert [f.name[:5] for f in files] == ["0001-", "0002-", "0003-"]
  for f in files:
    head = f.read_text(encoding="utf-8").split("\ndiff --git ", 1)[0]
    assert head.startswith("From ") and "\nFrom: " in head and "\nDate: " in head and "\nSubject: [PATCH " in head
    message = head.split("\n\n", 1)[1].split("\n---\n", 1)[0]
    assert len(message.split()) >= 15, f"{f.name}: commit message body missing"
  touched = [sorted(fp.path for fp in p.files) for p in series]
  assert touched == [["configs/base.yml", "configs/types.py"], ["layers/quantizations.py"], ["train.py"]]
  assert series[2].files[0].creates
  for f in files:  # every path in the series is under src/maxtext/
    for ln in f.read_text(encoding="utf-8").splitlines():
      if ln.startswith(("--- a/", "+++ b/", "diff --git")):
        assert " a/src/maxtext/" in ln or ln.startswith(("--- a/src/maxtext/", "+++ b/src/maxtext/")), ln


def test_schema_hunk_has_exactly_the_settings_keys_defaults_and_choices(series):
  added = _added_lines(series[0], "configs/types.py")
  assert '  NVFP4 = "nvfp4"' in added  # the QuantizationType member
  assert "    Nvfp4Quantization," in added  # mixed into MaxTextConfig
  (block,) = [b for b in _added_blocks(series[0], "configs/types.py") if "class Nvfp4Quantization(BaseModel):" in b]
  block = block[block.index("class Nvfp4Quantization(BaseModel):") :]
  (cls,) = ast.parse("\n".join(block)).body
  fields = {}
  for node in cls.body:
    if isinstance(node, ast.AnnAssign):
      call = node.value
      assert isinstance(call, ast.Call) and call.func.id == "Field"
      fields[node.target.id] = (node.annotation, ast.literal_eval(call.args[0]))
  expected = settings.config_keys()
  assert list(fields) == list(expected)
  for f in dataclasses.fields(settings.Nvfp4Settings):
    key = settings.config_key(f.name)
    ann, default = fields[key]
    assert default == f.default and type(default) is type(f.default), key
    if f.name in settings.CHOICES:
      assert isinstance(ann, ast.Subscript) and ann.value.id == "Literal", key
      assert tuple(ast.literal_eval(e) for e in ann.slice.elts) == settings.schema_choices(f.name), key
    else:
      assert ast.unparse(ann) == str(f.type), key


def test_base_yml_hunk_has_exactly_the_settings_keys_and_defaults(series):
  added = _added_lines(series[0], "configs/base.yml")
  values = yaml.safe_load("\n".join(added))
  assert list(values) == list(settings.config_keys())
  for key, default in settings.config_keys().items():
    assert values[key] == default and type(values[key]) is type(default), key


def test_quantizations_hunk_is_one_call_into_the_plugin(series):
  code = [ln.strip() for ln in _added_lines(series[1], "layers/quantizations.py") if ln.strip() and not ln.strip().startswith("#")]
  assert code == [
      'if config.quantization == "nvfp4":',
      "from maxtext_nvfp4.maxtext_plugin import make_quantization  # pylint: disable=import-outside-toplevel",
      "return make_quantization(config, quant_mode_str)",
  ]
  # It is the first statement of configure_quantization (after the docstring), so _get_quant_config
  # (which raises on unknown values) is never reached for nvfp4.
  (fp,) = series[1].files
  assert fp.hunks[0].new[fp.hunks[0].new.index('  """Configure quantization based on user config and quant mode."""\n') + 1] == (
      '  if config.quantization == "nvfp4":\n'
  )


def test_committed_series_matches_a_regeneration_from_settings(tmp_path, series):
  """The committed patches are what scripts/make_patch_series.py renders from pristine MaxText + settings.py now."""
  if shutil.which("git") is None:
    pytest.skip("git not installed")
  out = _load_generator().build_series(INSTALLED, tmp_path / "gen")
  regenerated = [patching.parse_patch(p.read_text(encoding="utf-8"), p.name) for p in sorted(out)]
  assert regenerated == series, f"patches/maxtext-{VERSION} is stale: run `.venv/bin/python scripts/make_patch_series.py`"
  for p in sorted(out):  # byte for byte, commit headers included (a fixed author and date)
    assert p.read_bytes() == (SERIES_DIR / p.name).read_bytes(), p.name


def test_git_apply_agrees_with_our_hunk_application(tmp_path, pkg):
  """`git apply` (an independent implementation) accepts the series and produces the same bytes."""
  if shutil.which("git") is None:
    pytest.skip("git not installed")
  checkout = tmp_path / "checkout"
  (checkout / "src").mkdir(parents=True)
  shutil.copytree(pkg, checkout / "src" / "maxtext")
  subprocess.run(["git", "init", "-q"], cwd=checkout, check=True)
  subprocess.run(["git", "apply", *map(str, sorted(SERIES_DIR.glob("*.patch")))], cwd=checkout, check=True)
  assert patching.apply(pkg, log=lambda *_: None) == "applied"
  for rel in ("configs/types.py", "configs/base.yml", "layers/quantizations.py", "train.py"):
    assert (checkout / "src" / "maxtext" / rel).read_bytes() == (pkg / rel).read_bytes(), rel
  # A checkout (holding src/maxtext) is a valid --target; git-applied trees read as applied, and revert
  # (exact reverse application) gives back the pristine bytes.
  assert patching.status(checkout)["state"] == patching.APPLIED
  assert patching.revert(checkout, log=lambda *_: None) == "reverted"
  assert not (checkout / "src" / "maxtext" / "train.py").exists()
  for rel in ("configs/types.py", "configs/base.yml", "layers/quantizations.py"):
    assert (checkout / "src" / "maxtext" / rel).read_bytes() == (INSTALLED / rel).read_bytes(), rel


# ------------------------------------------------------------------------------------------------
# apply / check / revert on a copy


def test_apply_check_idempotent_and_revert_byte_identical(pkg, capsys):
  before = _tree_hashes(pkg)
  assert _patch(["--check", "--target", str(pkg)], capsys)[0] == 1
  assert patching.status(pkg)["state"] == patching.NOT_APPLIED

  rc, out = _patch(["--target", str(pkg)], capsys)
  assert rc == 0 and "applied 3 patches" in out
  assert (pkg / "train.py").is_file() and "nvfp4_backend" in (pkg / "configs/base.yml").read_text()
  st = patching.status(pkg)
  assert st["state"] == patching.APPLIED and st["maxtext_version"] == VERSION
  rc, out = _patch(["--check", "--target", str(pkg)], capsys)
  assert rc == 0 and out.startswith("applied")
  changed = {k for k, v in _tree_hashes(pkg).items() if before.get(k) != v}
  assert changed == {"configs/types.py", "configs/base.yml", "layers/quantizations.py", "train.py"}

  patched = _tree_hashes(pkg)
  rc, out = _patch(["--target", str(pkg)], capsys)
  assert rc == 0 and "already applied" in out
  assert _tree_hashes(pkg) == patched

  rc, out = _patch(["--revert", "--target", str(pkg)], capsys)
  assert rc == 0 and "reverted" in out
  assert _tree_hashes(pkg) == before  # content and mode of every file; train.py is gone
  assert _patch(["--check", "--target", str(pkg)], capsys)[0] == 1
  rc, out = _patch(["--revert", "--target", str(pkg)], capsys)
  assert rc == 0 and "not applied" in out
  assert _tree_hashes(pkg) == before


def test_wrong_version_is_refused_with_nothing_changed(pkg, capsys):
  vfile = pkg / "version.py"
  vfile.write_text(vfile.read_text().replace(f'__version__ = "{VERSION}"', '__version__ = "0.2.3"'))
  before = _tree_hashes(pkg)
  rc, out = _patch(["--target", str(pkg)], capsys)
  assert rc == 2 and "MaxText 0.2.3" in out and "not supported" in out
  assert all(v in out for v in patching.supported_versions()) and {"0.2.4", "0.2.5"} <= set(patching.supported_versions())
  assert _tree_hashes(pkg) == before
  assert _patch(["--check", "--target", str(pkg)], capsys)[0] == 2
  assert patching.status(pkg)["state"] == patching.UNKNOWN_VERSION
  assert _patch(["--revert", "--target", str(pkg)], capsys)[0] == 2
  assert _tree_hashes(pkg) == before


def test_half_applied_tree_is_refused_with_nothing_changed(pkg, series, capsys):
  # Apply only 0002 (the configure_quantization hook), as a partial `git am` would leave it.
  (fp,) = series[1].files
  q = pkg / fp.path
  q.write_text(patching._apply_hunks(q.read_text(), fp, reverse=False))  # pylint: disable=protected-access
  before = _tree_hashes(pkg)
  st = patching.status(pkg)
  assert st["state"] == patching.PARTIAL
  assert st["files"][f"{series[1].name}:layers/quantizations.py"] == patching.APPLIED
  assert st["files"][f"{series[0].name}:configs/types.py"] == patching.NOT_APPLIED
  rc, out = _patch(["--check", "--target", str(pkg)], capsys)
  assert rc == 2 and out.startswith("partial")
  rc, out = _patch(["--target", str(pkg)], capsys)
  assert rc == 2 and "partially patched" in out
  rc, out = _patch(["--revert", "--target", str(pkg)], capsys)
  assert rc == 2 and "partially patched" in out
  assert _tree_hashes(pkg) == before


def test_locally_edited_context_is_a_conflict_not_a_fuzzy_apply(pkg, capsys):
  types_py = pkg / "configs" / "types.py"
  # a context line of the enum hunk (the member NVFP4 is added after), deleted locally
  anchor = maxtext_versions.select(VERSION).patch_anchors["quantization_enum_last"]
  types_py.write_text(types_py.read_text().replace(anchor, ""))
  before = _tree_hashes(pkg)
  st = patching.status(pkg)
  assert st["state"] == patching.PARTIAL and any(v.startswith("conflict") for v in st["files"].values())
  assert _patch(["--target", str(pkg)], capsys)[0] == 2
  assert _tree_hashes(pkg) == before


def test_edited_after_patching_revert_is_refused(pkg, capsys):
  patching.apply(pkg, log=lambda *_: None)
  (pkg / "train.py").write_text((pkg / "train.py").read_text() + "# local edit\n")
  before = _tree_hashes(pkg)
  rc, out = _patch(["--revert", "--target", str(pkg)], capsys)
  assert rc == 2 and "train.py" in out and "locally modified" in out and "nothing changed" in out
  assert len(out.strip().splitlines()) == 1
  assert _tree_hashes(pkg) == before


def test_failure_midway_restores_everything(pkg, monkeypatch):
  before = _tree_hashes(pkg)
  real = patching._write_atomic  # pylint: disable=protected-access
  calls = []

  def flaky(path, data, mode):
    calls.append(path)
    if len(calls) == 3:  # two files already rewritten when the third write fails
      raise PermissionError(13, "Permission denied", str(path))
    real(path, data, mode)

  monkeypatch.setattr(patching, "_write_atomic", flaky)
  with pytest.raises(patching.PatchError, match="nothing changed"):
    patching.apply(pkg, log=lambda *_: None)
  monkeypatch.setattr(patching, "_write_atomic", real)
  assert len(calls) >= 3
  assert {k: v[0] for k, v in _tree_hashes(pkg).items()} == {k: v[0] for k, v in before.items()}
  assert patching.status(pkg)["state"] == patching.NOT_APPLIED


def test_read_only_target_fails_cleanly(pkg, capsys, monkeypatch):
  before = _tree_hashes(pkg)
  if os.geteuid() == 0:
    # root ignores permission bits; simulate what os.access reports on a read-only install instead.
    real_access = os.access
    monkeypatch.setattr(os, "access", lambda p, m, **kw: False if m & os.W_OK else real_access(p, m, **kw))
  else:
    for dirpath, _, filenames in os.walk(pkg):
      for n in filenames:
        os.chmod(Path(dirpath, n), 0o444)
      os.chmod(dirpath, 0o555)
    before = _tree_hashes(pkg)
  try:
    rc, out = _patch(["--target", str(pkg)], capsys)
    assert rc == 2 and "read-only" in out and "nothing was changed" in out
    assert _tree_hashes(pkg) == before
  finally:
    for dirpath, _, _ in os.walk(pkg):
      os.chmod(dirpath, 0o755)


def test_targets_and_status_of_the_installed_maxtext_are_read_only_probes(tmp_path):
  st = patching.status()  # the real install: only read
  assert st["target"] == str(INSTALLED.resolve()) and st["maxtext_version"] == VERSION
  assert st["state"] in (patching.APPLIED, patching.NOT_APPLIED)
  bad = patching.status(tmp_path)
  assert bad["state"] == patching.ERROR and "neither a MaxText checkout" in bad["message"]
  with pytest.raises(patching.PatchError, match="not a directory"):
    patching.resolve_target(tmp_path / "missing")


def test_parser_handles_no_newline_at_eof_and_signature_lines(tmp_path):
  text = textwrap.dedent("""\
      From 0000000000000000000000000000000000000000 Mon Sep 17 00:00:00 2001
      Subject: [PATCH] demo: a long subject
       folded onto a second line

      body
      ---
      diff --git a/src/maxtext/x.txt b/src/maxtext/x.txt
      --- a/src/maxtext/x.txt
      +++ b/src/maxtext/x.txt
      @@ -1,2 +1,2 @@
       a
      -- 
      \\ No newline at end of file
      +b
      \\ No newline at end of file
      -- 
      2.39.5
      """)
  p = patching.parse_patch(text)
  assert p.subject == "demo: a long subject folded onto a second line"
  (fp,) = p.files
  assert fp.hunks[0].old == ("a\n", "- ") and fp.hunks[0].new == ("a\n", "b")
  assert patching._apply_hunks("a\n- ", fp, reverse=False) == "a\nb"  # pylint: disable=protected-access
  assert patching._apply_hunks("a\nb", fp, reverse=True) == "a\n- "  # pylint: disable=protected-access


def test_generated_train_py_creates_the_metrics_folder(tmp_path, series, monkeypatch):
  """maxtext/train.py (patch 0003) makes the folder of metrics_file once MaxText's initialize has read the
  config (issue: `metrics_file=new_dir/m.jsonl` trained, then died with FileNotFoundError). Loaded with
  a fake maxtext.trainers.pre_train.train, so nothing heavy is imported."""
  (fp,) = series[2].files
  source = patching._apply_hunks(None, fp, reverse=False)  # pylint: disable=protected-access
  calls = []
  metrics = tmp_path / "new_dir" / "sub" / "m.jsonl"
  fake = types.ModuleType("maxtext.trainers.pre_train.train")
  fake.initialize = lambda argv: (types.SimpleNamespace(metrics_file=str(metrics)), "recorder")

  def fake_main(argv):  # MaxText's train.main: reads the config through the module-level initialize
    config, _ = fake.initialize(argv)
    calls.append((argv, os.path.isdir(os.path.dirname(config.metrics_file))))

  fake.main = fake_main
  parent = types.ModuleType("maxtext.trainers.pre_train")
  parent.train = fake
  for name, mod in (("maxtext", types.ModuleType("maxtext")), ("maxtext.trainers", types.ModuleType("maxtext.trainers")),
                    ("maxtext.trainers.pre_train", parent), ("maxtext.trainers.pre_train.train", fake)):
    monkeypatch.setitem(sys.modules, name, mod)
  module = types.ModuleType("patched_maxtext_train")
  exec(compile(source, "maxtext/train.py", "exec"), module.__dict__)  # pylint: disable=exec-used
  module.main(["train", "cfg.yml"])
  assert calls == [(["train", "cfg.yml"], True)]
  for no_folder in ("", "m.jsonl", "gs://bucket/run/m.jsonl"):
    module.ensure_metrics_dir(no_folder)
  assert sorted(p.name for p in tmp_path.iterdir()) == ["new_dir"] and not os.path.exists("gs:")


# ------------------------------------------------------------------------------------------------
# end to end: patched MaxText vs plugin mode


# Plugin mode without our entry point: exactly what `python -m maxtext_nvfp4.train` does (import the
# package, register the plugin, then run MaxText's own train.main under absl).
_PLUGIN_LAUNCHER = (
    "import maxtext_nvfp4\nmaxtext_nvfp4.register()\n"
    "from absl import app\n"
    "from maxtext.trainers.pre_train import train\n"
    "app.run(train.main)\n"
)


def _plugin_command() -> list[str] | None:
  from maxtext_nvfp4 import maxtext_plugin  # pylint: disable=import-outside-toplevel

  if not hasattr(maxtext_plugin, "make_quantization"):
    return None
  if importlib.util.find_spec("maxtext_nvfp4.train") is not None:
    return [PY, "-m", "maxtext_nvfp4.train"]
  return [PY, "-c", _PLUGIN_LAUNCHER]


def _losses(path: Path) -> list[float]:
  rows = [json.loads(ln) for ln in path.read_text().splitlines() if ln.strip()]
  return [r["learning/loss"] for r in sorted(rows, key=lambda r: r["step"])]


@pytest.mark.slow
def test_patched_maxtext_train_matches_plugin_mode(pkg, tmp_path):
  plugin_cmd = _plugin_command()
  if plugin_cmd is None:
    pytest.skip("maxtext_nvfp4.maxtext_plugin.make_quantization does not exist yet")
  assert patching.apply(pkg, log=lambda *_: None) == patching.APPLIED
  recipe = REPO / "recipes" / "demo_nvfp4.yml"
  # Tiny model (1 layer, emb 64, NVFP4 on the MLP's three GEMMs with RHT and SR) on synthetic data: three
  # steps, compile dominates. One front door against the other, so one layer shows any difference.
  common = [
      "steps=3", "dataset_type=synthetic", "per_device_batch_size=1", "max_target_length=32", "eval_interval=-1",
      "base_num_decoder_layers=1", "base_emb_dim=64", "base_mlp_dim=128", "base_num_query_heads=4",
      "base_num_kv_heads=4", "head_dim=16", "vocab_size=256", "scan_layers=false",
      "tokenizer_type=sentencepiece", f"tokenizer_path={INSTALLED}/assets/tokenizers/tokenizer.llama2",
      f"base_output_directory={tmp_path}/out", "enable_checkpointing=false", "enable_goodput_recording=false",
      "monitor_goodput=false", "attention=dot_product", "quantization=nvfp4", "nvfp4_backend=emulate",
      "nvfp4_stochastic_rounding=true", "nvfp4_rht=true", "nvfp4_targets=mlp",
  ]
  args = [str(recipe), *common] if recipe.is_file() else common
  env = dict(os.environ, JAX_PLATFORMS="cpu", HF_HUB_OFFLINE="1")
  env.pop("PYTHONPATH", None)
  runs = {}
  for mode, cmd, pythonpath in (
      ("patched", [PY, "-m", "maxtext.train"], str(pkg.parent)),
      ("plugin", plugin_cmd, None),
  ):
    metrics = tmp_path / f"{mode}_metrics" / "m.jsonl"  # a folder that does not exist yet
    e = dict(env, **({"PYTHONPATH": pythonpath} if pythonpath else {}))
    r = subprocess.run([*cmd, *args, f"run_name={mode}", f"metrics_file={metrics}"], env=e, cwd=tmp_path,
                       capture_output=True, text=True, timeout=300)
    log = r.stdout + r.stderr
    assert r.returncode == 0, f"{mode} run failed:\n{log[-4000:]}"
    runs[mode] = (_losses(metrics), log)
  patched_losses, patched_log = runs["patched"]
  assert len(patched_losses) == 3 and all(x == x for x in patched_losses)
  # (`maxtext.train` exists only in the patched copy, so the run above imported MaxText from it.)
  assert patched_log.count("completed step:") >= 3  # absl logging is set up: per-step lines
  assert "emulat" in patched_log  # quantization=nvfp4 reached maxtext_nvfp4 (backend choice logged)
  assert patched_losses == runs["plugin"][0]  # bit-identical losses: one implementation, two front doors
