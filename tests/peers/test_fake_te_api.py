"""The fake TE of tests/backends/test_te_backend.py checked against the real TE 2.20.2 Python API (ast, no import).

``SURFACE`` lists every TE name that the fake provides and our TE backend calls
(``backends/te.py``, ``integration/te_quantization.py``, ``backends/te_check.py``), with the parameters,
dataclass fields and enum members used. ``missing_in_te`` resolves each one in the unzipped wheel's
source, following ``from .x import *`` / ``from .x import name`` the way Python would, and reports what
is not there (a rename is a missing name). ``test_surface_covers_the_fake`` parses the fake itself, so a
name added to the fake without a SURFACE entry fails too. Nothing of TE is imported or executed.
"""

from __future__ import annotations

import ast
import dataclasses
import pathlib
import shutil

import pytest

import peer_support

TE_ROOT = peer_support.PEERS / "te"
FAKE = pathlib.Path(__file__).resolve().parents[1] / "backends" / "test_te_backend.py"


@dataclasses.dataclass(frozen=True, kw_only=True)
class Symbol:
  module: str  # dotted TE module it is reached through
  name: str  # dotted name inside the module ("Class.method" for a method)
  params: tuple[str, ...] = ()  # call parameters used (function/method)
  members: tuple[str, ...] = ()  # class attributes used: dataclass fields, enum members, fields read
  kwargs_to: str | None = None  # "module:Class" whose fields a **kwargs parameter accepts
  used_by: str = ""  # who calls it (ours or the fake)


REC, TEX, QZ = "transformer_engine.common.recipe", "transformer_engine.jax.cpp_extensions", "transformer_engine.jax.quantize"
SURFACE = (
    Symbol(module=REC, name="NVFP4BlockScaling", members=("disable_rht", "disable_stochastic_rounding",
                                                          "disable_2d_quantization"), used_by="backends/te.py"),
    Symbol(module=REC, name="Float8CurrentScaling", used_by="backends/te.py"),
    Symbol(module=REC, name="DelayedScaling", used_by="fake (MaxText's TE quantization)"),
    Symbol(module=REC, name="MXFP8BlockScaling", used_by="fake (MaxText's TE quantization)"),
    Symbol(module=REC, name="Recipe", used_by="fake (MaxText's TE quantization)"),
    Symbol(module=TEX, name="noop_collective_op_set", used_by="integration/te_quantization.py"),
    Symbol(module=TEX, name="CollectiveOp", members=("ALL_GATHER", "REDUCE_SCATTER"), used_by="fake"),
    Symbol(module=TEX, name="CollectiveOpSet.create", params=("forward_collective_op",), used_by="fake"),
    Symbol(module="transformer_engine.jax.flax.module", name="TransformerEngineBase.generate_quantizer_set",
           params=("postfix", "variable_collection", "quantization_checkpoint_name", "fp8_recipe", "n_groups"),
           used_by="integration/te_quantization.py"),
    Symbol(module="transformer_engine.jax.dense", name="dense",
           params=("x", "kernel", "contracting_dims", "quantizer_set", "collective_op_set"),
           used_by="integration/te_quantization.py"),
    Symbol(module=TEX, name="quantize", params=("x", "quantizer", "flatten_axis"), used_by="backends/te_check.py"),
    Symbol(module=TEX, name="gemm", params=("lhs", "rhs", "contracting_dims", "lhs_quantizer", "rhs_quantizer"),
           used_by="backends/te_check.py"),
    Symbol(module=QZ, name="QuantizerFactory.create",
           params=("scaling_mode", "q_dtype", "q_layout", "use_rht", "stochastic_rounding_rng_state"),
           kwargs_to=f"{QZ}.quantizer:NVFP4Quantizer", used_by="backends/te_check.py"),
    Symbol(module=QZ, name="ScalingMode", members=("NVFP4_1D_SCALING", "NVFP4_2D_SCALING"), used_by="backends/te_check.py"),
    Symbol(module=QZ, name="QuantizeLayout", members=("ROWWISE", "COLWISE", "ROWWISE_COLWISE"),
           used_by="backends/te_check.py"),
    Symbol(module=QZ, name="ScaledTensor1x", members=("data", "scale_inv", "amax", "data_layout"),
           used_by="backends/te_check.py (what tex.quantize returns)"),
    Symbol(module=QZ, name="ScaledTensor2x", members=("rowwise_tensor", "colwise_tensor"),
           used_by="backends/te_check.py"),
)


# ---- a small resolver over the wheel's source --------------------------------------------------
def _module_file(root, dotted):
  base = root.joinpath(*dotted.split("."))
  for f in (base / "__init__.py", base.with_suffix(".py")):
    if f.is_file():
      return f
  return None


def _parse(path, cache={}):  # pylint: disable=dangerous-default-value
  if path not in cache:
    cache[path] = ast.parse(path.read_text())
  return cache[path]


def _resolve_relative(dotted, level, target, is_pkg):
  parts = dotted.split(".")
  parts = parts if is_pkg else parts[:-1]
  parts = parts[: len(parts) - (level - 1)] if level > 1 else parts
  return ".".join(parts + ([target] if target else []))


def find(root, dotted, name):
  """The ast node defining ``name`` in module ``dotted`` (following imports), or None."""
  return find_def(root, dotted, name)[0]


def find_def(root, dotted, name, depth=0):
  """(ast node defining ``name`` reached from module ``dotted``, the module defining it), or (None, None)."""
  f = _module_file(root, dotted)
  if f is None or depth > 8:
    return None, None
  tree = _parse(f)
  is_pkg = f.name == "__init__.py"
  for node in tree.body:
    if isinstance(node, (ast.FunctionDef, ast.ClassDef)) and node.name == name:
      return node, dotted
    if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == name for t in node.targets):
      return node, dotted
    if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) and node.target.id == name:
      return node, dotted
  for node in tree.body:
    if isinstance(node, ast.ImportFrom) and node.module is not None or isinstance(node, ast.ImportFrom) and node.level:
      src = _resolve_relative(dotted, node.level, node.module, is_pkg) if node.level else node.module
      for alias in node.names:
        if alias.name == "*":
          sub = _module_file(root, src)
          if sub is not None and _exports(root, src, name):
            hit = find_def(root, src, name, depth + 1)
            if hit[0] is not None:
              return hit
        elif (alias.asname or alias.name) == name:
          hit = find_def(root, src, alias.name, depth + 1)
          if hit[0] is None and _module_file(root, f"{src}.{alias.name}") is not None:
            return ast.Module(body=[], type_ignores=[]), f"{src}.{alias.name}"  # a submodule
          if hit[0] is not None:
            return hit
  sub = _module_file(root, f"{dotted}.{name}")
  return (ast.Module(body=[], type_ignores=[]), f"{dotted}.{name}") if sub is not None else (None, None)


def _exports(root, dotted, name):
  """``from dotted import *`` brings ``name``: in ``__all__`` if the module defines one, else not private."""
  tree = _parse(_module_file(root, dotted))
  for node in tree.body:
    if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "__all__" for t in node.targets):
      try:
        return name in ast.literal_eval(node.value)
      except ValueError:
        return True
  return not name.startswith("_")


def _class_attrs(cls):
  names = set()
  for node in cls.body:
    if isinstance(node, (ast.FunctionDef, ast.ClassDef)):
      names.add(node.name)
    elif isinstance(node, ast.Assign):
      names.update(t.id for t in node.targets if isinstance(t, ast.Name))
    elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
      names.add(node.target.id)
  for node in ast.walk(cls):  # self.x = ... in methods (plain classes)
    if isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store) and isinstance(node.value, ast.Name) \
        and node.value.id == "self":
      names.add(node.attr)
  return names


def _class_with_bases(root, module, cls):
  """[cls, its bases...] resolved inside the wheel (for inherited members)."""
  out, todo = [], [(module, cls)]
  while todo and len(out) < 10:
    mod, c = todo.pop()
    out.append(c)
    for b in c.bases:
      bname = b.id if isinstance(b, ast.Name) else b.attr if isinstance(b, ast.Attribute) else None
      hit, where = find_def(root, mod, bname) if bname else (None, None)
      if isinstance(hit, ast.ClassDef):
        todo.append((where, hit))
  return out


def _params(fn):
  a = fn.args
  return {p.arg for p in a.posonlyargs + a.args + a.kwonlyargs}, a.kwarg is not None


def missing_in_te(root, surface=SURFACE):
  """Every symbol, parameter or member of ``surface`` that TE's source at ``root`` lacks, one line each."""
  problems = []
  for s in surface:
    head, *rest = s.name.split(".")
    node, where = find_def(root, s.module, head)
    if node is None:
      problems.append(f"{s.module}.{head}: not found (used by {s.used_by})")
      continue
    if rest:
      assert isinstance(node, ast.ClassDef), s
      meth = next((n for c in _class_with_bases(root, where, node) for n in c.body
                   if isinstance(n, ast.FunctionDef) and n.name == rest[0]), None)
      if meth is None:
        problems.append(f"{s.module}.{s.name}: not found (used by {s.used_by})")
        continue
      node = meth
    if s.params:
      have, has_kwargs = _params(node)
      extra = set()
      if s.kwargs_to and has_kwargs:
        mod, cname = s.kwargs_to.split(":")
        target, twhere = find_def(root, mod, cname)
        extra = set().union(*(_class_attrs(c) for c in _class_with_bases(root, twhere, target))) if target else set()
      for p in s.params:
        if p not in have and p not in extra:
          problems.append(f"{s.module}.{s.name}: no parameter {p!r} (used by {s.used_by})")
    if s.members:
      assert isinstance(node, ast.ClassDef), s
      have = set().union(*(_class_attrs(c) for c in _class_with_bases(root, where, node)))
      for m in s.members:
        if m not in have:
          problems.append(f"{s.module}.{s.name}: no member {m!r} (used by {s.used_by})")
  return problems


def test_every_name_the_fake_and_our_backend_use_exists_in_te_2_20_2():
  assert (TE_ROOT / "VERSION").read_text().strip() == "2.20.2"
  assert missing_in_te(TE_ROOT) == []


# ---- the fake's surface (parsed from tests/backends/test_te_backend.py) ---------------------------------
def fake_surface():
  """(names assigned on the fake's modules/namespaces, {fake function: its parameters})."""
  tree = ast.parse(FAKE.read_text())
  names, params = set(), {}
  fake_modules = ("recipe", "tex", "flax_mod", "dense_mod", "qmod")

  def ns_kwargs(value):
    if isinstance(value, ast.Call) and getattr(value.func, "id", getattr(value.func, "attr", "")) in ("SimpleNamespace", "ns"):
      names.update(k.arg for k in value.keywords if k.arg)

  for node in ast.walk(tree):
    if isinstance(node, ast.Assign):
      for t in node.targets:
        for tt in (t.elts if isinstance(t, ast.Tuple) else [t]):
          if isinstance(tt, ast.Attribute) and isinstance(tt.value, ast.Name) and tt.value.id in fake_modules:
            names.add(tt.attr)
            ns_kwargs(node.value)
    if isinstance(node, ast.FunctionDef) and node.name in ("_one", "quantize", "create"):  # what fake TE returns
      for r in ast.walk(node):
        if isinstance(r, ast.Return):
          ns_kwargs(r.value)
    if isinstance(node, ast.ClassDef) and node.name.startswith("Fake"):
      names.update(n.target.id for n in node.body if isinstance(n, ast.AnnAssign))
    if isinstance(node, ast.FunctionDef) and node.name in ("fake_dense", "generate_quantizer_set", "create", "quantize", "gemm"):
      have, _ = _params(node)
      params[node.name] = have - {"self", "kw"}
  return names, params


FAKE_TO_SURFACE = {"fake_dense": "dense", "generate_quantizer_set": "TransformerEngineBase.generate_quantizer_set",
                   "create": "QuantizerFactory.create", "quantize": "quantize", "gemm": "gemm"}
# Names the fake binds that are its own wiring, not TE API: submodule links, and the fields of the
# quantizer record its create() returns (TE's is an NVFP4Quantizer; ours only passes it back to TE).
_FAKE_ONLY = {"module", "cpp_extensions", "flax", "dense", "jax", "common", "recipe", "quantize",
              "scaling_mode", "q_layout", "use_rht", "sr"}


def test_surface_covers_the_fake():
  names, params = fake_surface()
  covered = {s.name.split(".")[0] for s in SURFACE} | {m for s in SURFACE for m in s.members} | _FAKE_ONLY
  covered |= {s.name.split(".")[-1] for s in SURFACE}
  assert names - covered == set(), "the fake provides TE names SURFACE does not check: add them"
  by_name = {s.name: s for s in SURFACE}
  for fake_fn, params_used in params.items():
    s = by_name[FAKE_TO_SURFACE[fake_fn]]
    assert params_used <= set(s.params) | {"x", "kernel"}, (fake_fn, params_used - set(s.params))


@pytest.mark.parametrize("edit,expect", [
    (("jax/dense.py", "def dense(", "def dense_general("), "transformer_engine.jax.dense.dense: not found"),
    (("jax/dense.py", "    quantizer_set: QuantizerSet", "    quantizer_sets: QuantizerSet"),
     "dense: no parameter 'quantizer_set'"),
    (("common/recipe/__init__.py", "disable_stochastic_rounding", "no_stochastic_rounding"),
     "NVFP4BlockScaling: no member 'disable_stochastic_rounding'"),
    (("jax/quantize/scaling_modes.py", "NVFP4_2D_SCALING =", "NVFP4_2D ="), "ScalingMode: no member 'NVFP4_2D_SCALING'"),
])
def test_an_injected_rename_is_reported(tmp_path, edit, expect):
  root = tmp_path / "te"
  shutil.copytree(TE_ROOT / "transformer_engine", root / "transformer_engine",
                  ignore=shutil.ignore_patterns("pytorch", "*.so", "__pycache__"))
  rel, old, new = edit
  f = root / "transformer_engine" / rel
  text = f.read_text()
  assert old in text, (rel, old)
  f.write_text(text.replace(old, new))
  _parse.__defaults__[0].clear()  # the ast cache is keyed by path; this tree is new
  problems = missing_in_te(root)
  assert any(expect in p for p in problems), problems
