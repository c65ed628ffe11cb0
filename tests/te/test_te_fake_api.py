"""The fake TE the CPU suite uses (tests/backends/test_te_backend.py) against the real TE JAX it stands for.

``SURFACE`` (tests/peers/test_fake_te_api.py) lists every TE name the fake provides and our TE backend calls, with
the parameters, fields and members used; the peers stage resolves them in TE's source without importing it. Here
each is imported from the installed TE and checked with ``inspect``: the function takes those parameters, the
dataclass has those fields, the enum has those members -- and the fake's own callables take the same parameters
as TE's (a fake that drifted from TE's signature fails).
"""

import dataclasses
import importlib
import importlib.util
import inspect
import pathlib

import pytest

_TESTS = pathlib.Path(__file__).resolve().parents[1]


def _load(path: pathlib.Path, name: str):
  import sys  # pylint: disable=import-outside-toplevel

  sys.path.insert(0, str(path.parent))
  spec = importlib.util.spec_from_file_location(name, path)
  module = importlib.util.module_from_spec(spec)
  sys.modules[name] = module  # dataclasses resolve their module's annotations through sys.modules
  spec.loader.exec_module(module)
  return module


SURFACE = _load(_TESTS / "peers" / "test_fake_te_api.py", "fake_te_surface").SURFACE


def _resolve(module: str, dotted: str):
  obj = importlib.import_module(module)
  for part in dotted.split("."):
    obj = getattr(obj, part)
  return obj


def _names(obj) -> set[str]:
  names = set(dir(obj))
  if dataclasses.is_dataclass(obj):
    names |= {f.name for f in dataclasses.fields(obj)}
  names |= set(getattr(obj, "__annotations__", {}))
  return names


@pytest.mark.parametrize("sym", SURFACE, ids=lambda s: f"{s.module}.{s.name}")
def test_each_name_the_fake_stands_for_exists_in_real_te_with_its_parameters(sym):
  obj = _resolve(sym.module, sym.name)
  if sym.params:
    params = inspect.signature(obj).parameters
    missing = [p for p in sym.params if p not in params]
    if missing and sym.kwargs_to:  # accepted through **kwargs by the class it constructs
      module, cls = sym.kwargs_to.split(":")
      accepted = inspect.signature(_resolve(module, cls)).parameters
      assert any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()), sym
      missing = [p for p in missing if p not in accepted]
    assert not missing, f"{sym.module}.{sym.name} has no parameter {missing} (has {list(params)})"
  for member in sym.members:
    assert member in _names(obj), f"{sym.module}.{sym.name} has no {member}"


def test_the_fakes_callables_take_tes_parameters():
  """The fake's dense / generate_quantizer_set / recipe fields are TE's (names, in order, defaults of keywords)."""
  fake = _load(_TESTS / "backends" / "test_te_backend.py", "fake_te_backend")
  from transformer_engine.common import recipe  # pylint: disable=import-outside-toplevel # pytype: disable=import-error
  from transformer_engine.jax import dense  # pylint: disable=import-outside-toplevel # pytype: disable=import-error
  from transformer_engine.jax.flax import module  # pylint: disable=import-outside-toplevel # pytype: disable=import-error

  real_dense = inspect.signature(dense.dense).parameters
  for p in inspect.signature(fake.fake_dense).parameters:
    assert p in real_dense, f"fake dense takes {p}, TE's dense does not"
  real_gqs = inspect.signature(module.TransformerEngineBase.generate_quantizer_set).parameters
  fake_gqs = inspect.signature(fake.FakeTransformerEngineBase.generate_quantizer_set).parameters
  assert list(fake_gqs) == [p for p in real_gqs if p in fake_gqs], (list(fake_gqs), list(real_gqs))
  for p in fake_gqs:
    if p != "self":
      assert fake_gqs[p].default == real_gqs[p].default, (p, fake_gqs[p].default, real_gqs[p].default)
  real_fields = {f.name: f.default for f in dataclasses.fields(recipe.NVFP4BlockScaling)}
  for f in dataclasses.fields(fake.FakeNVFP4BlockScaling):
    assert f.name in real_fields and f.default == real_fields[f.name], (f.name, f.default, real_fields.get(f.name))
