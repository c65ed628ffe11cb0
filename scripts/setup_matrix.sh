#!/usr/bin/env bash
# Create ./.venv-matrix: the support matrix's second pair, MaxText 0.2.4 + jax/jaxlib 0.11.2 (the H200 image's
# jax), with maxtext-nvfp4 installed editable and --no-deps into it. Idempotent: re-running only reinstalls
# when this script or pyproject.toml changed.
#
# The dependency set is pyproject.toml's own list with three pins replaced (maxtext, jax, jaxlib); every other
# pin stays the main .venv's, so a failure here points at MaxText or jax and not at a third package, and on a
# machine where scripts/setup.sh ran first pip's cache already holds all but the three replaced wheels.
# Those shared pins accept this pair: flax 0.12.12 and tokamax 0.0.17 need jax >= 0.11.1; MaxText 0.2.4's
# requirements (dependencies/requirements/generated_requirements/cuda12-requirements.txt in its wheel) ask for
# flax>=0.12.7 qwix>=0.1.8 optax>=0.2.8 orbax-checkpoint>=0.12.1 pydantic>=2.13.4 tokamax>=0.0.12,!=0.1.0
# grain>=0.2.18 drjax>=0.2.0 pathwaysutils>=0.1.10 aqtp>=0.9.0, all met. MaxText's wheels declare no
# dependencies, so the list is installed explicitly.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${VENV_MATRIX:-.venv-matrix}
# The pair under test: "name==version" replacing pyproject's pin of the same name.
MATRIX_PINS=("maxtext==0.2.4" "jax==0.11.2" "jaxlib==0.11.2")
# What MaxText 0.2.4 imports that 0.2.5 does not need: its train.py imports maxtext.common.goodput, whose gcloud
# stub falls back only under DECOUPLE_GCLOUD=TRUE in 0.2.4 (0.2.5 stubs a missing ml_goodput_measurement itself).
# It is in 0.2.4's own requirements (ml-goodput-measurement>=0.2.0): ~10 small wheels (google-cloud-logging, ...).
MATRIX_EXTRA=("ml-goodput-measurement==0.2.3")
PY=$(bash scripts/find_python.sh)
if [ ! -x "$VENV/bin/python" ]; then
  echo "[setup-matrix] creating $VENV with $PY"
  "$PY" -m venv "$VENV"
fi
stamp="$VENV/.maxtext_nvfp4_matrix_installed"
want=$(cat pyproject.toml scripts/setup_matrix.sh | sha256sum | cut -c1-16)
if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
  echo "[setup-matrix] installing ${MATRIX_PINS[*]} and pyproject's other dependencies into $VENV"
  reqs="$VENV/matrix-requirements.txt"
  # pyproject's dependencies + dev extras, with the matrix pins in place of pyproject's (tomllib: Python >= 3.11).
  "$VENV/bin/python" - "$reqs" "${MATRIX_PINS[@]}" <<'EOF'
import re, sys, tomllib
out, pins = sys.argv[1], sys.argv[2:]
name = lambda req: re.split(r"[\s\[<>=!~;]", req, maxsplit=1)[0].lower().replace("_", "-")
project = tomllib.load(open("pyproject.toml", "rb"))["project"]
replaced = {name(p): p for p in pins}
# The dev extras' jax-cuda12 compiler plugin is pinned to the main pair's jaxlib (deviceless XLA:GPU compiles,
# the gpu stage): a plugin of another jaxlib's version has no place beside jax 0.11.2.
deps = [replaced.get(name(d), d) for d in project["dependencies"] + project["optional-dependencies"]["dev"]
        if not name(d).startswith("jax-cuda")]
missing = set(replaced) - {name(d) for d in deps}
if missing:
  sys.exit(f"setup_matrix: pyproject.toml pins none of {sorted(missing)}; MATRIX_PINS names a package it does not list")
open(out, "w").write("\n".join(deps) + "\n")
EOF
  printf '%s\n' "${MATRIX_EXTRA[@]}" >> "$reqs"
  # --no-compile: see scripts/setup.sh.
  "$VENV/bin/python" -m pip install -q --no-compile -r "$reqs"
  # The package itself without its dependencies: pyproject pins maxtext 0.2.5 / jax 0.12.0.1.
  "$VENV/bin/python" -m pip install -q --no-compile --no-deps -e .
  echo "$want" > "$stamp"
fi
"$VENV/bin/python" -c 'import maxtext_nvfp4; from importlib import metadata as m; print("[setup-matrix] ok: maxtext", m.version("maxtext"), "jax", m.version("jax"), "jaxlib", m.version("jaxlib"))'
