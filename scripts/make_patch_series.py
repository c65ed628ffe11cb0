"""Regenerate the MaxText patch series (``patches/maxtext-<version>/``) from pristine MaxText files and
``maxtext_nvfp4/core/settings.py``. Maintainers: run it after changing a key, default, choice or help text
in settings.py, then commit the regenerated patches.

    .venv/bin/python scripts/make_patch_series.py                        # installed maxtext -> patches/maxtext-<version>/
    .venv/bin/python scripts/make_patch_series.py PRISTINE_PKG OUT_DIR   # explicit source / output

``PRISTINE_PKG`` is an unpatched ``maxtext`` package dir (default: the installed one, which must read as
"not applied"; ``pip download --no-deps maxtext==0.2.5`` and unzip the wheel if yours is patched). The
script copies the touched files into a scratch git repo (``src/maxtext`` layout), makes one commit per
concern with a fixed author and date, and runs ``git format-patch --zero-commit --no-signature``, so the
output is reproducible; ``tests/tools/test_patching.py`` fails when the committed series differs from a
regeneration. The config hunks are rendered from settings.py, so MaxText's schema and ``base.yml`` keys
cannot drift from the plugin's. Needs ``git``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from maxtext_nvfp4.core import settings
from maxtext_nvfp4.integration import maxtext_versions
from maxtext_nvfp4.tools import patching

REPO = Path(__file__).resolve().parents[1]
_AUTHOR = ("maxtext-nvfp4", "maxtext-nvfp4@users.noreply.github.com")
_DATE = "2026-11-29T00:00:00+00:00"
# The pristine files the series edits (train.py is created).
_TOUCHED = ("configs/types.py", "configs/base.yml", "layers/quantizations.py")


def _yaml_scalar(v) -> str:
  if isinstance(v, bool):
    return "true" if v else "false"
  if isinstance(v, str):
    return json.dumps(v)
  return repr(v)


def render_schema_class() -> str:
  """The ``Nvfp4Quantization`` pydantic section of ``configs/types.py``: one Field per settings key."""
  lines = [
      "class Nvfp4Quantization(BaseModel):",
      '  """NVFP4 training (`quantization=nvfp4`), implemented by the maxtext_nvfp4 package.',
      "",
      "  Defaults follow Transformer Engine's NVFP4BlockScaling recipe; maxtext_nvfp4.core.settings documents each key.",
      '  """',
      "",
  ]
  for f in dataclasses.fields(settings.Nvfp4Settings):
    key = settings.config_key(f.name)
    choices = settings.schema_choices(f.name) if f.name in settings.CHOICES else None
    ann = f"Literal[{', '.join(repr(c) if c is None else json.dumps(c) for c in choices)}]" if choices else str(f.type)
    default = json.dumps(f.default) if isinstance(f.default, str) else repr(f.default)
    lines.append(f"  {key}: {ann} = Field({default}, description={json.dumps(settings.KEY_HELP[f.name])})")
  return "\n".join(lines) + "\n"


def render_base_yml_block() -> str:
  """The ``nvfp4_*`` keys with their defaults, for ``configs/base.yml``."""
  out = [
      '# NVFP4 training (quantization: "nvfp4"), implemented by the maxtext_nvfp4 package',
      "# (pip install maxtext-nvfp4). Defaults follow Transformer Engine's NVFP4BlockScaling recipe.",
  ]
  for f in dataclasses.fields(settings.Nvfp4Settings):
    out.append(f"{settings.config_key(f.name)}: {_yaml_scalar(f.default)} # {settings.KEY_HELP[f.name]}")
  return "\n".join(out) + "\n"


# maxtext/train.py (patch 0003). Self-contained: it must not need maxtext_nvfp4 for non-nvfp4 runs.
TRAIN_PY = """\
# Copyright 2026 The maxtext-nvfp4 Authors
#
# Licensed under the Apache License, Version 2.0 (the "License");
# you may not use this file except in compliance with the License.
# You may obtain a copy of the License at
#
#    https://www.apache.org/licenses/LICENSE-2.0
#
# Unless required by applicable law or agreed to in writing, software
# distributed under the License is distributed on an "AS IS" BASIS,
# WITHOUT WARRANTIES OR CONDITIONS OF ANY KIND, either express or implied.
# See the License for the specific language governing permissions and
# limitations under the License.

\"\"\"Pre-training entry point: `python -m maxtext.train [CONFIG.yml] [key=value ...]`.

A short alias of `python -m maxtext.trainers.pre_train.train`: the same `main`, run under
`absl.app.run` so absl logging is configured and every step prints its `completed step: ...` line.
It also creates the folder of a local `metrics_file` once the config is read: MaxText appends to that
file without creating its folder, which would fail after compilation and the first training step.
An argument that is neither the first CONFIG.yml nor key=value (a recipe name such as `demo_nvfp4`)
stops at once with one line and exit code 2: MaxText would read it as an unknown key and end in a
traceback whose last line lists every config field (about 21,000 characters).
\"\"\"

import os
import sys

from absl import app

from maxtext.trainers.pre_train import train

_initialize = train.initialize


def ensure_metrics_dir(metrics_file: str) -> None:
  \"\"\"Create the folder of a local `metrics_file` (nothing for "", a bare file name or a URL).\"\"\"
  folder = os.path.dirname(metrics_file or "")
  if folder and "://" not in metrics_file:
    os.makedirs(folder, exist_ok=True)


def initialize(argv):
  \"\"\"`train.initialize`, then the metrics folder.\"\"\"
  config, recorder = _initialize(argv)
  ensure_metrics_dir(config.metrics_file)
  return config, recorder


def argument_error(argv) -> str | None:
  \"\"\"One line naming the fix for the first argument that is neither the leading `.yml` path nor
  `key=value`, else None.\"\"\"
  for i, arg in enumerate(argv[1:]):
    if "=" in arg or (i == 0 and arg.endswith(".yml")):
      continue
    where = "the config must be a .yml path" if i == 0 else "after the config, give key=value"
    fix = f"{arg}.yml" if i == 0 else f"{arg}=VALUE"
    try:  # a packaged maxtext-nvfp4 recipe name: say where its file is
      from maxtext_nvfp4.tools import recipes  # pylint: disable=import-outside-toplevel

      fix = recipes.find_recipe(arg) if i == 0 else fix
    except Exception:  # pylint: disable=broad-exception-caught  (not installed, or no such recipe)
      pass
    return f"python -m maxtext.train: error: {arg!r} is neither CONFIG.yml nor key=value ({where}); did you mean {fix}?"
  return None


def main(argv):
  error = argument_error(argv)
  if error:
    print(error, file=sys.stderr, flush=True)
    sys.exit(2)
  train.initialize = initialize  # train.main (and an elastic restart) reads the config through it
  train.main(argv)


if __name__ == "__main__":
  app.run(main)
"""

_COMMITS = (
    (
        "configs: add quantization=nvfp4 and the nvfp4_* keys",
        "Add the `nvfp4` QuantizationType and an Nvfp4Quantization schema section\n"
        "(mixed into MaxTextConfig) with the nvfp4_* keys, and the same keys with\n"
        "their defaults to base.yml, so `quantization=nvfp4 nvfp4_backend=emulate`\n"
        "validates from YAML and key=value overrides. nvfp4 is not an AQT mode, so\n"
        "it is exempt from the AQT deprecation warning.\n"
        "\n"
        "The keys, defaults and allowed values mirror maxtext_nvfp4.core.settings, the\n"
        "single source of truth; this patch is generated from it.",
    ),
    (
        "quantizations: route quantization=nvfp4 to maxtext_nvfp4",
        "configure_quantization() hands `nvfp4` to\n"
        "maxtext_nvfp4.maxtext_plugin.make_quantization(config, quant_mode_str)\n"
        "with a single call, before any other mode is considered, so the NVFP4\n"
        "recipe (emulated or Transformer Engine) lives in one place: the\n"
        "maxtext_nvfp4 package. _get_quant_config() is never reached for nvfp4.",
    ),
    (
        "train: add the `python -m maxtext.train` entry point",
        "A short pre-training entry point that runs\n"
        "maxtext.trainers.pre_train.train.main under absl.app.run, so absl logging\n"
        "is set up and the per-step `completed step: ...` lines are printed.\n"
        "It creates the folder of a local metrics_file once the config is read\n"
        "(the metrics writer appends to the file without creating its folder),\n"
        "and stops with one line (exit 2) on an argument that is neither the\n"
        "leading CONFIG.yml nor key=value, e.g. a recipe name, which MaxText\n"
        "would read as an unknown key (a traceback listing every config field).",
    ),
)


def _edit(text: str, anchor: str, replacement: str) -> str:
  if text.count(anchor) != 1:
    raise patching.PatchError(f"anchor not found exactly once while building the series: {anchor[:60]!r}")
  return text.replace(anchor, replacement)


def build_series(pristine_pkg: str | os.PathLike, out_dir: str | os.PathLike) -> list[Path]:
  """Write ``0001..0003-*.patch`` for the pristine MaxText package at ``pristine_pkg`` into ``out_dir``."""
  pristine_pkg, out_dir = Path(pristine_pkg), Path(out_dir)
  env = dict(os.environ, GIT_AUTHOR_NAME=_AUTHOR[0], GIT_AUTHOR_EMAIL=_AUTHOR[1], GIT_COMMITTER_NAME=_AUTHOR[0],
             GIT_COMMITTER_EMAIL=_AUTHOR[1], GIT_AUTHOR_DATE=_DATE, GIT_COMMITTER_DATE=_DATE, GIT_CONFIG_NOSYSTEM="1",
             GIT_CONFIG_GLOBAL=os.devnull)
  with tempfile.TemporaryDirectory() as tmp:
    repo = Path(tmp)

    def git(*a):
      return subprocess.run(["git", "-c", "core.autocrlf=false", *a], cwd=repo, env=env, check=True,
                            capture_output=True, text=True).stdout

    git("init", "-q")
    for rel in _TOUCHED:
      (repo / patching.SERIES_PREFIX / rel).parent.mkdir(parents=True, exist_ok=True)
      shutil.copyfile(pristine_pkg / rel, repo / patching.SERIES_PREFIX / rel)
    git("add", "-A")
    git("commit", "-q", "-m", f"MaxText {patching.maxtext_version(pristine_pkg)} (pristine files)")
    src = repo / patching.SERIES_PREFIX

    # 1. configs: enum member, schema section, MaxTextConfig mixin, no AQT warning; base.yml keys.
    t = (src / "configs/types.py").read_text(encoding="utf-8")
    version = patching.maxtext_version(pristine_pkg) or "unknown"
    anchors = maxtext_versions.select(version).patch_anchors  # the pristine files' anchors, per MaxText version
    t = _edit(t, anchors["quantization_enum_last"], anchors["quantization_enum_last"] + '  NVFP4 = "nvfp4"\n')
    t = _edit(t, "\n\nclass ModelArchitecture(BaseModel):",
              "\n\n" + render_schema_class() + "\n\nclass ModelArchitecture(BaseModel):")
    t = _edit(t, "    Quantization,\n    # Core Model Architecture\n",
              "    Quantization,\n    Nvfp4Quantization,\n    # Core Model Architecture\n")
    t = _edit(t, '          "fp8",\n          "nanoo_fp8",\n      ) and not self.quantization.startswith("te_"):',
              '          "fp8",\n          "nanoo_fp8",\n          "nvfp4",\n      ) and not self.quantization.startswith("te_"):')
    (src / "configs/types.py").write_text(t, encoding="utf-8")
    b = (src / "configs/base.yml").read_text(encoding="utf-8")
    b = _edit(b, anchors["base_yml_quantization_comment"],
              anchors["base_yml_quantization_comment"]
              + "# 'nvfp4' for NVFP4 training (maxtext_nvfp4 package; see the nvfp4_* keys below).\n")
    b = _edit(b, 'te_comm_gemm_overlap: "disabled"\n', 'te_comm_gemm_overlap: "disabled"\n\n' + render_base_yml_block())
    (src / "configs/base.yml").write_text(b, encoding="utf-8")
    git("commit", "-q", "-a", "-m", _COMMITS[0][0] + "\n\n" + _COMMITS[0][1])

    # 2. quantizations: one call into the plugin.
    q = (src / "layers/quantizations.py").read_text(encoding="utf-8")
    q = _edit(q, '  """Configure quantization based on user config and quant mode."""\n',
              '  """Configure quantization based on user config and quant mode."""\n'
              '  if config.quantization == "nvfp4":\n'
              "    # NVFP4 training is implemented by the maxtext_nvfp4 package (pip install maxtext-nvfp4).\n"
              "    from maxtext_nvfp4.maxtext_plugin import make_quantization  # pylint: disable=import-outside-toplevel\n"
              "\n"
              "    return make_quantization(config, quant_mode_str)\n\n")
    (src / "layers/quantizations.py").write_text(q, encoding="utf-8")
    git("commit", "-q", "-a", "-m", _COMMITS[1][0] + "\n\n" + _COMMITS[1][1])

    # 3. maxtext.train
    (src / "train.py").write_text(TRAIN_PY, encoding="utf-8")
    git("add", "-A")
    git("commit", "-q", "-m", _COMMITS[2][0] + "\n\n" + _COMMITS[2][1])

    out_dir.mkdir(parents=True, exist_ok=True)
    for old in out_dir.glob("*.patch"):
      old.unlink()
    names = git("format-patch", "--zero-commit", "--no-signature", "-3", "-o", str(out_dir.resolve())).split()
  return [Path(n) for n in names]


def main(argv: list[str]) -> int:
  ap = argparse.ArgumentParser(description=__doc__.split("\n\n", 1)[0])
  ap.add_argument("pristine_pkg", nargs="?", help="unpatched maxtext package dir (default: the installed maxtext)")
  ap.add_argument("out_dir", nargs="?", help="output folder (default: patches/maxtext-<version>/ of this repository)")
  args = ap.parse_args(argv)
  try:
    if shutil.which("git") is None:
      raise patching.PatchError("git is not installed; the series is written with `git format-patch`")
    if args.pristine_pkg is not None and not Path(args.pristine_pkg).is_dir():
      raise patching.PatchError(f"PRISTINE_PKG {args.pristine_pkg} is not a directory; pass an unpatched maxtext package dir")
    pkg = patching.resolve_target(args.pristine_pkg)
    state = patching.status(pkg)["state"] if args.pristine_pkg is None else patching.NOT_APPLIED
    if state != patching.NOT_APPLIED:
      raise patching.PatchError(f"the installed maxtext at {pkg} is not pristine ({state}); run"
                                " `maxtext-nvfp4 patch --revert` or pass an unpatched maxtext package dir")
    out = Path(args.out_dir) if args.out_dir else REPO / "patches" / f"maxtext-{patching.maxtext_version(pkg)}"
    for p in build_series(pkg, out):
      print(p)
  except patching.PatchError as e:
    print(f"make_patch_series: error: {e}", file=sys.stderr)
    return 2
  return 0


if __name__ == "__main__":
  sys.exit(main(sys.argv[1:]))
