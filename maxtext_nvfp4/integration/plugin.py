"""Registration: :func:`register` installs the import hook that patches MaxText's modules as they load.

Nothing registers on import: the entry points call :func:`register` (``maxtext_nvfp4.register()``, the
train CLI, :func:`maxtext_nvfp4.maxtext_plugin.make_quantization` of the patch series, the tools that run
MaxText in-process). Each MaxText module the adapter lists in ``patched_modules`` is patched
(:mod:`maxtext_nvfp4.integration.patches`) when it is first imported, or at once if it already is, after
its symbols are checked against the adapter's ``touches``; so registering imports neither JAX nor MaxText.
"""

from __future__ import annotations

import importlib.abc
import sys
import threading
from typing import Any

from maxtext_nvfp4.integration import patches
from maxtext_nvfp4.integration import touchpoints


def run_pretrain(argv) -> None:
  """MaxText's pre-training ``main(argv)`` (the adapter's ``train_module``), with the plugin registered."""
  import importlib  # pylint: disable=import-outside-toplevel

  register()
  importlib.import_module(touchpoints.adapter().train_module).main(argv)


def run_posttrain(trainer: str, argv) -> None:
  """MaxText's post-training ``<trainer>.main(argv)`` (``sft``, ``distill``: the adapter's ``posttrain_modules``),
  with the plugin registered."""
  import importlib  # pylint: disable=import-outside-toplevel

  from maxtext_nvfp4.integration import posttrain  # pylint: disable=import-outside-toplevel

  register()
  importlib.import_module(posttrain.trainer_module(trainer)).main(argv)


_lock = threading.RLock()
_finder: Any = None


def _apply(name: str, module, check: bool = True) -> None:
  with _lock:
    if getattr(module, "_maxtext_nvfp4_patched", False):
      return
    if check:  # a __main__ copy is still executing (later names not defined yet): the real module is checked
      touchpoints.check(name, module)
    patches.PATCHES[touchpoints.adapter().patched_modules[name]](module)
    module._maxtext_nvfp4_patched = True  # pylint: disable=protected-access


class _PatchingLoader(importlib.abc.Loader):
  """Runs the real loader, then our patch for that module (before anyone can use it)."""

  def __init__(self, loader, name):
    self._loader = loader
    self._name = name

  def create_module(self, spec):
    return self._loader.create_module(spec)

  def exec_module(self, module):
    self._loader.exec_module(module)
    _apply(self._name, module)

  def __getattr__(self, attr):  # get_source, get_resource_reader, ... of the real loader
    return getattr(self._loader, attr)


class _PatchFinder(importlib.abc.MetaPathFinder):
  """Finds the MaxText modules we patch with the other finders and wraps their loader."""

  def find_spec(self, fullname, path, target=None):
    if fullname not in touchpoints.adapter().patched_modules:
      return None
    for finder in sys.meta_path:
      if finder is self or not hasattr(finder, "find_spec"):
        continue
      spec = finder.find_spec(fullname, path, target)
      if spec is not None:
        break
    else:
      return None
    if spec.loader is not None and hasattr(spec.loader, "exec_module"):
      spec.loader = _PatchingLoader(spec.loader, fullname)
    return spec


def register() -> None:
  """Make MaxText accept ``quantization=nvfp4`` and the ``nvfp4_*`` keys (idempotent, cheap).

  Picks the installed MaxText's adapter first: an unsupported version fails here, in one line
  (:class:`~maxtext_nvfp4.integration.maxtext_versions.MaxTextVersionError`).
  """
  global _finder
  facts = touchpoints.adapter()
  with _lock:
    if _finder is None:
      _finder = _PatchFinder()
      sys.meta_path.insert(0, _finder)
    for name in facts.patched_modules:
      module = sys.modules.get(name)
      if module is not None:
        _apply(name, module)
    # `python -m maxtext.trainers.pre_train.train` (e.g. with the patch set) runs MaxText's train module as
    # __main__: its train_step is looked up there, so wrap that copy too.
    main = sys.modules.get("__main__")
    if getattr(getattr(main, "__spec__", None), "name", None) == facts.train_module and hasattr(main, "train_step"):
      _apply(facts.train_module, main, check=False)

