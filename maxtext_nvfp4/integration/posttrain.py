"""MaxText's post-training trainers with the plugin registered, and what the plugin needs from them.

* ``sft`` (``maxtext.trainers.post_train.sft.train_sft_native``): MaxText's pre-training loop with
  ``use_sft=True``. It calls the pre-training module's ``train_step`` / ``eval_step``, which the plugin already
  wraps (:mod:`maxtext_nvfp4.integration.step`): the step, the late switch, the SR keys and the diagnostics work
  as in pre-training, unchanged.
* ``distill`` (``maxtext.trainers.post_train.distillation.train_distill``): Tunix's ``PeftTrainer`` loop with
  MaxText's ``MaxTextDistillationTrainer``; its ``_train_step(model, optimizer, inputs)`` and ``_eval_step(model,
  inputs)`` are wrapped (:func:`patch_distill`) to publish ``model.training_step`` -- the student's step counter,
  which MaxText keeps in the ``ModelBundle`` and restores with the checkpoint -- as :func:`step.with_step` does
  for pre-training: the train step as a training step (diagnostics), the eval step as the current step. Without
  it every step would draw the SR bits of step 0 and the late switch would never fire.

:func:`run` runs the trainer's own ``main(argv)``; the modules are the adapter's ``posttrain_modules``.
"""

from __future__ import annotations

import importlib

from maxtext_nvfp4.integration import step as step_lib
from maxtext_nvfp4.integration import touchpoints

TRAINERS = ("sft", "distill")


class PosttrainUnavailable(RuntimeError):
  """The installed MaxText (or its Python environment) cannot run this trainer (one line: why, the fix)."""


def trainer_module(trainer: str) -> str:
  """The MaxText module of ``trainer`` on the installed version; :class:`PosttrainUnavailable` otherwise."""
  facts = touchpoints.adapter()
  module = facts.posttrain_modules.get(trainer)
  if module is None:
    verified = "0.2.5"
    raise PosttrainUnavailable(f"maxtext-nvfp4 {trainer} runs MaxText {verified}'s {trainer} trainer; the installed"
                               f" MaxText {facts.version} was not verified with it (pip install 'maxtext=={verified}')")
  return module


# What MaxText 0.2.5's distillation trainer calls on Tunix's CheckpointManager (distillation_utils.py
# MaxTextCheckpointManager: save -> self._save_checkpointables, maybe_restore -> self._checkpointer), which the
# google-tunix release on PyPI (0.1.7) does not have: it keeps an Orbax CheckpointManager in _checkpoint_manager.
TUNIX_API = ("_save_checkpointables",)


def check_importable(trainer: str) -> None:
  """:class:`PosttrainUnavailable` (one line) when the trainer cannot run in this Python environment: the
  distillation trainer needs Tunix, with the CheckpointManager API MaxText 0.2.5 calls (:data:`TUNIX_API`)."""
  import importlib.util  # pylint: disable=import-outside-toplevel

  trainer_module(trainer)
  if trainer != "distill":
    return
  why = ("MaxText 0.2.5's MaxTextCheckpointManager calls Tunix's CheckpointManager._save_checkpointables and"
         " ._checkpointer, which google-tunix 0.1.7 (the release on PyPI) does not have")
  if importlib.util.find_spec("tunix") is None:
    raise PosttrainUnavailable(f"MaxText's distillation trainer runs on Tunix, which is not installed; install a"
                               f" google-tunix newer than 0.1.7 ({why})")
  from tunix.sft import checkpoint_manager  # pylint: disable=import-outside-toplevel

  missing = [a for a in TUNIX_API if not hasattr(checkpoint_manager.CheckpointManager, a)]
  if missing:
    raise PosttrainUnavailable(f"the installed Tunix cannot run MaxText's distillation trainer: {why}; install a"
                               " newer google-tunix (its main branch has them)")


def run(trainer: str, argv) -> None:
  """MaxText's ``<trainer>.main(argv)`` with the plugin registered."""
  from maxtext_nvfp4.integration import plugin  # pylint: disable=import-outside-toplevel

  plugin.register()
  importlib.import_module(trainer_module(trainer)).main(argv)


def _bundle_step(model):
  """``ModelBundle.training_step`` (a traced int scalar inside the jitted step), or None."""
  var = getattr(model, "training_step", None)
  if var is None:
    return None
  return var[...]


def patch_distill(module) -> None:
  """Publish the student's step inside ``MaxTextDistillationTrainer._train_step`` / ``_eval_step``."""
  cls = module.MaxTextDistillationTrainer

  def make_train(orig):
    def _train_step(self, model, optimizer, inputs, *args, **kwargs):
      with step_lib.step_context(_bundle_step(model), training=True):
        return orig(self, model, optimizer, inputs, *args, **kwargs)
    return _train_step

  def make_eval(orig):
    def _eval_step(self, model, inputs, *args, **kwargs):
      with step_lib.step_context(_bundle_step(model)):
        return orig(self, model, inputs, *args, **kwargs)
    return _eval_step

  cls._train_step = touchpoints.wrap_once(cls._train_step, make_train)  # pylint: disable=protected-access
  cls._eval_step = touchpoints.wrap_once(cls._eval_step, make_eval)  # pylint: disable=protected-access
