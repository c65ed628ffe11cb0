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
  it every step would draw the SR bits of step 0 and the late switch would never fire. MaxText's
  ``MaxTextCheckpointManager`` calls a Tunix API newer than google-tunix 0.1.7 (PyPI's; the adapter's
  ``tunix_checkpoint_api``): :func:`bridge_tunix_v0` provides it from 0.1.7's own checkpoint manager when it is missing.

:func:`maxtext_nvfp4.integration.plugin.run_posttrain` runs the trainer's own ``main(argv)``; the modules are the
adapter's ``posttrain_modules``.
"""

from __future__ import annotations

import itertools

from maxtext_nvfp4.integration import maxtext_versions
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
    verified = maxtext_versions.trainer_versions(trainer)[-1]
    raise PosttrainUnavailable(f"maxtext-nvfp4 {trainer} runs MaxText {verified}'s {trainer} trainer; the installed"
                               f" MaxText {facts.version} was not verified with it (pip install 'maxtext=={verified}')")
  return module


def check_importable(trainer: str) -> None:
  """:class:`PosttrainUnavailable` (one line) when the trainer cannot run in this Python environment: the
  distillation trainer needs Tunix (``google-tunix``; 0.1.7 runs with :func:`patch_distill`'s bridge)."""
  import importlib.util  # pylint: disable=import-outside-toplevel

  trainer_module(trainer)
  if trainer == "distill" and importlib.util.find_spec("tunix") is None:
    pins = " ".join(touchpoints.adapter().tunix_pins)
    raise PosttrainUnavailable(
        f"MaxText's distillation trainer runs on Tunix, which is not installed: pip install --no-deps {pins} && pip"
        " install pandas (google-tunix's own dependency list would downgrade transformers; scripts/setup.sh does this)")


class _TunixV0Checkpointer:
  """What MaxTextCheckpointManager uses of Tunix's newer ``_checkpointer``, on Tunix 0.1.7's Orbax
  ``CheckpointManager``: ``wait`` and ``close``; ``load_checkpointables`` (the Grain iterator) raises, which
  MaxText's ``restore_iterator`` logs as "Could not restore input pipeline" (the iterator is not saved here)."""

  def __init__(self, manager):
    self._manager = manager

  def wait(self) -> None:
    self._manager.wait_until_finished()

  def close(self) -> None:
    """Tunix 0.1.7's own ``close`` closes the manager."""

  def load_checkpointables(self, step, checkpointables):
    raise NotImplementedError(f"step {step}: {', '.join(checkpointables)} not saved (Tunix 0.1.7 saves the model"
                              " and the optimizer only)")


def _save_checkpointables(self, step, checkpointables, force=False, custom_metadata=None):
  """Tunix 0.1.7's save of MaxText's checkpointables: ``model_params`` and ``optimizer_state`` as Orbax PyTrees
  (Tunix 0.1.7's own layout, which MaxText's ``load_parameters_path`` reads: restore key ``model_params``); the
  Grain iterator (``iter``) is not saved (said once)."""
  import orbax.checkpoint as ocp  # pylint: disable=import-outside-toplevel

  manager = self._checkpoint_manager  # pylint: disable=protected-access
  if manager is None or (not force and not manager.should_save(step)):
    return False
  if "iter" in checkpointables:
    from maxtext_nvfp4.integration.log_once import log_once  # pylint: disable=import-outside-toplevel

    log_once("maxtext-nvfp4: Tunix 0.1.7 checkpoints hold the student and its optimizer, not the input pipeline's"
             " position (a resumed distillation restarts its data)")
  import jax  # pylint: disable=import-outside-toplevel

  args = {name: ocp.args.PyTreeSave(item=tree, save_args=jax.tree.map(lambda _: ocp.SaveArgs(), tree))
          for name, tree in checkpointables.items() if name in ("model_params", "optimizer_state")}
  return manager.save(step, args=ocp.args.Composite(**args), custom_metadata=custom_metadata or {}, force=force)


def _stop_at_max_steps(orig):
  """Tunix 0.1.7's ``PeftTrainer.train`` skips its ``max_steps`` stop when ``is_managed_externally`` (MaxText's
  distillation sets it): feed it only the batches of the steps left, so it ends at ``steps`` as MaxText means."""
  def train(self, train_ds, eval_ds=None, *args, **kwargs):
    max_steps = self.config.max_steps
    if max_steps is not None and getattr(self, "is_managed_externally", False):
      accum = int(self.config.get_with_default("gradient_accumulation_steps", 1) or 1)
      left = max(0, (int(max_steps) - int(self._train_steps)) * accum)  # pylint: disable=protected-access
      train_ds = itertools.islice(iter(train_ds), left)
    return orig(self, train_ds, eval_ds, *args, **kwargs)
  return train


def bridge_tunix_v0(manager_cls, trainer_cls) -> bool:
  """On a Tunix without the API MaxText's distillation calls (the adapter's ``tunix_checkpoint_api``; google-tunix
  0.1.7): give
  ``MaxTextCheckpointManager`` (``manager_cls``) ``_save_checkpointables`` and ``_checkpointer`` from 0.1.7's own
  manager, and make ``MaxTextDistillationTrainer.train`` (``trainer_cls``) stop at ``steps``. True when bridged;
  MaxText's own methods run unchanged on top."""
  base = manager_cls.__mro__[1]
  api = touchpoints.adapter().tunix_checkpoint_api
  if all(hasattr(base, a) for a in api) or getattr(manager_cls, "_maxtext_nvfp4_bridged", False):
    return False
  manager_cls._save_checkpointables = _save_checkpointables  # pylint: disable=protected-access
  manager_cls._checkpointer = property(  # pylint: disable=protected-access
      lambda self: None if self._checkpoint_manager is None else _TunixV0Checkpointer(self._checkpoint_manager))
  manager_cls._maxtext_nvfp4_bridged = True  # pylint: disable=protected-access
  trainer_cls.train = touchpoints.wrap_once(trainer_cls.train, _stop_at_max_steps)
  return True


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
  from maxtext.trainers.post_train.distillation import distillation_utils  # pylint: disable=import-outside-toplevel

  bridge_tunix_v0(distillation_utils.MaxTextCheckpointManager, cls)
