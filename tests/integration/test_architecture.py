"""The package layering, checked from the source (AST; nothing is imported).

Layers, lowest first; a module may import our modules of its own layer or a lower one only:

  core/         pure numerics, GEMM recipe, plan, settings -- no MaxText, no TE, no flax, no file I/O
  backends/     which backend runs, and the recipe in TE's terms (TE imported lazily, never MaxText)
  integration/  the only code that imports MaxText (every fact about a MaxText version: maxtext_versions/)
  tools/        command-line tools
  facades       maxtext_nvfp4/__main__.py, train.py, train_compile.py, sft.py, distill.py, maxtext_plugin.py (stable entry points); the package
                root __init__.py (version, register()) counts as integration

No import cycle at any level: module-level imports and function-level (lazy) ones alike. No MaxText
symbol of the adapter's ``touches`` is named outside integration/, no module the plugin patches is
named (as a string) outside the adapter files, and no package file outside the adapter names a MaxText version.
"""

from __future__ import annotations

import ast
import pathlib
import re

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
  facades = {"__init__.py", "__main__.py", "train.py", "train_compile.py", "sft.py", "distill.py", "maxtext_plugin.py"}
  stray = [str(p.relative_to(PKG)) for p in _modules()
           if p.parent == PKG and p.name not in facades]
  assert stray == []
  assert {p.name for p in PKG.iterdir() if p.is_dir() and (p / "__init__.py").exists()} == set(LAYERS)


def import_graph(sources: dict[str, str], top_level_only: bool) -> dict[str, set[str]]:
  """``{module: our modules it imports}`` of ``{module: source}`` (a name resolves to its longest module
  prefix; importing a package's submodule does not count as importing the package's own ``__init__``)."""
  known = set(sources)
  graph = {}
  for mod, source in sources.items():
    deps = set()
    for name, _ in imports(ast.parse(source), mod, top_level_only=top_level_only):
      while name and name not in known:
        name = name.rpartition(".")[0]
      if name and name != mod and name.startswith("maxtext_nvfp4"):
        deps.add(name)
    graph[mod] = deps
  return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
  """One import cycle of ``graph`` (``[a, b, ..., a]``), or None."""
  seen, stack = set(), []

  def visit(m):
    if m in stack:
      return stack[stack.index(m):] + [m]
    if m in seen:
      return None
    stack.append(m)
    for d in sorted(graph.get(m, ())):
      found = visit(d)
      if found:
        return found
    stack.pop()
    seen.add(m)
    return None

  for m in sorted(graph):
    found = visit(m)
    if found:
      return found
  return None


def _sources() -> dict[str, str]:
  return {module_name(p): p.read_text() for p in _modules()}


@pytest.mark.parametrize("top_level_only", [True, False], ids=["module-level", "function-level-too"])
def test_no_import_cycles(top_level_only):
  cycle = find_cycle(import_graph(_sources(), top_level_only=top_level_only))
  assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_the_cycle_check_sees_function_level_imports():
  # An injected cycle through a lazy (function-level) import: invisible to the module-level graph.
  sources = {"maxtext_nvfp4.integration.a": "from maxtext_nvfp4.integration import b\n",
             "maxtext_nvfp4.integration.b": "def f():\n  from maxtext_nvfp4.integration import a  # lazy\n"}
  assert find_cycle(import_graph(sources, top_level_only=True)) is None
  assert find_cycle(import_graph(sources, top_level_only=False)) == [
      "maxtext_nvfp4.integration.a", "maxtext_nvfp4.integration.b", "maxtext_nvfp4.integration.a"]
  # ... and in the real tree, with one injected lazy import from a low module back up to the factory
  real = _sources()
  real["maxtext_nvfp4.integration.traced"] += "\ndef _f():\n  from maxtext_nvfp4.integration import quantization\n"
  assert find_cycle(import_graph(real, top_level_only=False)) is not None


# ---------------------------------------------------------------------------------------------------
# MaxText version facts live in the adapter only
# ---------------------------------------------------------------------------------------------------

VERSIONS = PKG / "integration" / "maxtext_versions"


def _adapter_facts():
  """(every touched symbol part, the patched module paths) of every adapter file, read from their AST."""
  symbols, modules = set(), set()
  for path in VERSIONS.glob("v*.py"):
    for node in ast.walk(ast.parse(path.read_text())):
      if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "Touch":
        kw = {k.arg: k.value.value for k in node.keywords if isinstance(k.value, ast.Constant)}
        symbols.update(kw.get("symbol", "").split("."))
      if isinstance(node, ast.Assign) and isinstance(node.value, ast.Constant) and \
          str(node.value.value).startswith("maxtext."):
        modules.add(node.value.value)
  return symbols - {""}, modules


def _names_in(source: str) -> set[str]:
  """Identifiers and non-docstring string constants of ``source`` (comments and docstrings don't count)."""
  tree = ast.parse(source)
  docs = {id(n.body[0].value) for n in ast.walk(tree)
          if isinstance(n, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and n.body
          and isinstance(n.body[0], ast.Expr) and isinstance(n.body[0].value, ast.Constant)}
  out = set()
  for n in ast.walk(tree):
    if isinstance(n, ast.Name):
      out.add(n.id)
    elif isinstance(n, ast.Attribute):
      out.add(n.attr)
    elif isinstance(n, ast.alias):
      out.update(n.name.split("."))
    elif isinstance(n, ast.Constant) and isinstance(n.value, str) and id(n) not in docs:
      out.add(n.value)
  return out


def _own_definitions() -> set[str]:
  """Names our code outside integration/ defines (def/class): a touched symbol spelled like one of those
  (``main``, ``from_config``) is not MaxText's there. (integration/'s wrappers keep MaxText's names.)"""
  out = set()
  for p in _modules():
    if layer_of(module_name(p)) == LAYERS.index("integration"):
      continue
    out.update(n.name for n in ast.walk(ast.parse(p.read_text()))
               if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)))
  return out


def maxtext_fact_leaks(module: str, source: str, symbols: set[str], modules: set[str]) -> list[str]:
  """MaxText version facts ``source`` names outside the adapter: a touched symbol outside integration/, or a
  patched module's path as a string anywhere but ``integration/maxtext_versions/``."""
  if module.startswith("maxtext_nvfp4.integration.maxtext_versions"):
    return []
  names = _names_in(source)
  out = []
  if layer_of(module) != LAYERS.index("integration"):
    out += [f"{module} names MaxText's {s}" for s in sorted(symbols & names)]
  out += [f"{module} names the patched MaxText module {m!r}" for m in sorted(modules & names)]
  return out


def test_maxtext_facts_live_only_in_the_adapter():
  symbols, modules = _adapter_facts()
  symbols -= _own_definitions()
  assert {"_initialize_pydantic", "TransformerEngineQuantization", "sparse_matmul", "gmm"} <= symbols
  assert "maxtext.configs.pyconfig" in modules
  leaks = [leak for mod, src in _sources().items() for leak in maxtext_fact_leaks(mod, src, symbols, modules)]
  assert leaks == []


@pytest.mark.parametrize("module,source,expect", [
    ("maxtext_nvfp4.core.plan", "def f(m):\n  return m.sparse_matmul\n", "sparse_matmul"),
    ("maxtext_nvfp4.tools.doctor", "X = getattr(object, '_initialize_pydantic', None)\n", "_initialize_pydantic"),
    ("maxtext_nvfp4.integration.plugin", "_PYCONFIG = 'maxtext.configs.pyconfig'\n", "maxtext.configs.pyconfig"),
    ("maxtext_nvfp4.integration.patches", "def f(m):\n  return m.sparse_matmul\n", None),  # integration may
])
def test_the_fact_check_catches_an_injected_maxtext_name(module, source, expect):
  symbols, modules = _adapter_facts()
  symbols -= _own_definitions()
  found = maxtext_fact_leaks(module, source, symbols, modules)
  if expect is None:
    assert found == []
  else:
    assert len(found) == 1 and expect in found[0], found


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


def _adapter_versions() -> set[str]:
  """The MaxText versions the adapter files declare (``version="0.2.5"`` in their ``MaxTextVersion``), from the AST."""
  out = set()
  for path in VERSIONS.glob("v*.py"):
    for node in ast.walk(ast.parse(path.read_text())):
      if isinstance(node, ast.Call):
        out.update(k.value.value for k in node.keywords
                   if k.arg == "version" and isinstance(k.value, ast.Constant) and isinstance(k.value.value, str))
  return out


def maxtext_version_mentions(module: str, source: str, versions: set[str]) -> list[str]:
  """Every line of ``source`` -- code, comments and docstrings alike -- that names one of the MaxText
  ``versions``, unless ``module`` is an adapter file (``integration/maxtext_versions/``)."""
  if module.startswith("maxtext_nvfp4.integration.maxtext_versions"):
    return []
  pattern = re.compile(r"(?<![\w.])(" + "|".join(re.escape(v) for v in sorted(versions)) + r")(?![\w.]*\d)")
  return [f"{module}:{i} names MaxText {m.group(1)}: {line.strip()[:80]}"
          for i, line in enumerate(source.splitlines(), 1) for m in [pattern.search(line)] if m]


def test_no_package_file_outside_the_adapter_names_a_maxtext_version():
  versions = _adapter_versions()
  assert {"0.2.4", "0.2.5"} <= versions
  found = [hit for mod, src in _sources().items() for hit in maxtext_version_mentions(mod, src, versions)]
  assert found == []


@pytest.mark.parametrize("module,source,expect", [
    ("maxtext_nvfp4.integration.posttrain", 'VERIFIED = "0.2.5"\n', "0.2.5"),
    ("maxtext_nvfp4.tools.train", "# MaxText 0.2.4 configs/types.py: ...\n", "0.2.4"),
    ("maxtext_nvfp4.tools.metrics", '"""Plain MaxText 0.2.5 truncates the file."""\n', "0.2.5"),
    ("maxtext_nvfp4.tools.train", 'PINS = "google-metrax==0.2.4"\n', "0.2.4"),  # a pin that looks like one: adapter
    ("maxtext_nvfp4.tools.train", 'X = "0.2.50 10.2.5 0.2.5.1"\n', None),  # other versions
    ("maxtext_nvfp4.integration.maxtext_versions.v0_2_5", 'ADAPTER = MaxTextVersion(version="0.2.5")\n', None),
])
def test_the_version_check_catches_an_injected_version(module, source, expect):
  found = maxtext_version_mentions(module, source, _adapter_versions())
  if expect is None:
    assert found == []
  else:
    assert len(found) == 1 and f"names MaxText {expect}" in found[0], found
