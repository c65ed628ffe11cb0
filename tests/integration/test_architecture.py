"""The package layering, checked from the source (AST; nothing is imported).

Layers, lowest first; a module may import our modules of its own layer or a lower one only:

  core/         pure numerics, GEMM recipe, plan, settings -- no MaxText, no TE, no flax, no file I/O
  backends/     which backend runs, and the recipe in TE's terms (TE imported lazily, never MaxText)
  integration/  the only code that imports MaxText (every symbol it touches: touchpoints.TOUCHES)
  tools/        command-line tools
  facades       maxtext_nvfp4/__main__.py, train.py, maxtext_plugin.py (stable entry points); the package
                root __init__.py (version, register()) counts as integration
"""

from __future__ import annotations

import ast
import pathlib

import pytest

PKG = pathlib.Path(__file__).resolve().parents[2] / "maxtext_nvfp4"
LAYERS = ("core", "backends", "integration", "tools")
FACADE = len(LAYERS)
# third-party top-level packages and the only layers allowed to import them
THIRD_PARTY_LAYERS = {"maxtext": ("integration",), "transformer_engine": ("backends", "integration"),
                      "flax": ("integration",)}


def layer_of(module: str) -> int:
  """Layer index of a dotted module name inside maxtext_nvfp4 (facades above every layer)."""
  parts = module.split(".")
  if module == "maxtext_nvfp4":  # the package root: __version__ and register() (the plugin)
    return LAYERS.index("integration")
  if len(parts) >= 2 and parts[1] in LAYERS:
    return LAYERS.index(parts[1])
  return FACADE


def module_name(path: pathlib.Path) -> str:
  rel = path.relative_to(PKG.parent).with_suffix("")
  parts = list(rel.parts)
  if parts[-1] == "__init__":
    parts.pop()
  return ".".join(parts)


def imports(tree: ast.AST, module: str, top_level_only: bool = False) -> list[tuple[str, int]]:
  """``(imported dotted name, line)`` for every import in ``tree`` (function-level ones too unless
  ``top_level_only``); ``from a import b`` yields ``a.b`` when that names one of our modules."""
  nodes = tree.body if top_level_only else list(ast.walk(tree))
  out = []
  for node in nodes:
    if isinstance(node, ast.Import):
      out += [(a.name, node.lineno) for a in node.names]
    elif isinstance(node, ast.ImportFrom):
      base = node.module or ""
      if node.level:  # relative import
        pkg = module.split(".")[: -node.level] if not module.endswith("__init__") else module.split(".")
        base = ".".join(pkg + ([base] if base else []))
      for a in node.names:
        out.append((f"{base}.{a.name}" if base.startswith("maxtext_nvfp4") else base, node.lineno))
  return out


def violations(module: str, source: str) -> list[str]:
  """Every layering rule ``source`` (the text of ``module``) breaks, one line each."""
  tree = ast.parse(source)
  mine = layer_of(module)
  out = []
  for name, line in imports(tree, module):
    if name == "maxtext_nvfp4" or name.startswith("maxtext_nvfp4."):
      target = name
      # `from maxtext_nvfp4.core import plan` names maxtext_nvfp4.core.plan; `import maxtext_nvfp4` a facade
      if layer_of(target) > mine:
        out.append(f"{module}:{line} imports {name} (layer {layer_of(target)} > {mine})")
      continue
    top = name.split(".")[0]
    allowed = THIRD_PARTY_LAYERS.get(top)
    if allowed is not None and (mine == FACADE or LAYERS[mine] not in allowed):
      out.append(f"{module}:{line} imports {name} (only {'/, '.join(allowed)}/ may)")
  if mine == LAYERS.index("core"):
    for node in ast.walk(tree):
      if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "open":
        out.append(f"{module}:{node.lineno} opens a file (core/ does no file I/O)")
  return out


def _modules():
  return sorted(PKG.rglob("*.py"))


@pytest.mark.parametrize("path", _modules(), ids=lambda p: str(p.relative_to(PKG)))
def test_module_respects_the_layering(path):
  assert violations(module_name(path), path.read_text()) == []


def test_every_module_sits_in_a_layer_folder_or_is_a_facade():
  facades = {"__init__.py", "__main__.py", "train.py", "maxtext_plugin.py"}
  stray = [str(p.relative_to(PKG)) for p in _modules()
           if p.parent == PKG and p.name not in facades]
  assert stray == []
  assert {p.name for p in PKG.iterdir() if p.is_dir() and (p / "__init__.py").exists()} == set(LAYERS)


def test_no_import_cycles_at_module_level():
  graph = {}
  for path in _modules():
    mod = module_name(path)
    deps = set()
    for name, _ in imports(ast.parse(path.read_text()), mod, top_level_only=True):
      while name and name not in {module_name(p) for p in _modules()}:
        name = name.rpartition(".")[0]
      if name and name != mod and name.startswith("maxtext_nvfp4"):
        deps.add(name)
    graph[mod] = deps
  seen, stack = set(), []

  def visit(m):
    if m in stack:
      raise AssertionError("import cycle: " + " -> ".join(stack[stack.index(m):] + [m]))
    if m in seen:
      return
    stack.append(m)
    for d in graph.get(m, ()):
      visit(d)
    stack.pop()
    seen.add(m)

  for m in graph:
    visit(m)


@pytest.mark.parametrize("module,source,expect", [
    ("maxtext_nvfp4.core.gemm", "from maxtext_nvfp4.integration import plugin\n", "layer 2 > 0"),
    ("maxtext_nvfp4.core.plan", "def f():\n  from maxtext_nvfp4.tools import compare\n", "layer 3 > 0"),
    ("maxtext_nvfp4.backends.te", "import maxtext.layers.quantizations\n", "only integration/"),
    ("maxtext_nvfp4.core.nvfp4", "import flax.linen as nn\n", "only integration/"),
    ("maxtext_nvfp4.core.settings", "x = open('f').read()\n", "opens a file"),
    ("maxtext_nvfp4.tools.doctor", "from maxtext_nvfp4.integration import plugin\n", None),
    ("maxtext_nvfp4.tools.train", "def f():\n  from maxtext.trainers.pre_train import train\n", "only integration/"),
])
def test_the_checker_catches_upward_imports(module, source, expect):
  found = violations(module, source)
  if expect is None:
    assert found == []
  else:
    assert len(found) == 1 and expect in found[0], found
