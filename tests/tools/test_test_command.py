"""The README's test command names test files and node ids by path (scripts/test.sh, scripts/test_matrix.sh,
benchmarks/gpu/run.sh): a renamed test must fail here, not leave a stage that collects nothing (pytest's exit 5)."""
import ast
import pathlib
import re

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
SCRIPTS = ["scripts/test.sh", "scripts/test_matrix.sh", "benchmarks/gpu/run.sh"]
NODE = re.compile(r"(tests/[\w/]+\.py)(?:::(\w+))?")


def _named_nodes():
  out = []
  for s in SCRIPTS:
    p = ROOT / s
    if p.exists():
      out += [(s, m.group(1), m.group(2)) for m in NODE.finditer(p.read_text())]
  return out


def _test_functions(path):
  tree = ast.parse((ROOT / path).read_text())
  return {n.name for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))}


def test_the_scripts_name_some_nodes():
  nodes = _named_nodes()
  assert any(f.startswith("tests/") and t for _, f, t in nodes), nodes


@pytest.mark.parametrize("script, path, name", _named_nodes(), ids=lambda v: str(v))
def test_every_node_the_test_command_names_exists(script, path, name):
  assert (ROOT / path).exists(), f"{script} names {path}, which does not exist"
  if name:
    assert name in _test_functions(path), f"{script} names {path}::{name}, which is not a function there"
