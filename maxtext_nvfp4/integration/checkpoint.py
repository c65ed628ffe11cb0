"""Reading a MaxText training checkpoint and running MaxText on it: the checkpoint folder, the config,
the parameters (whole, or one at a time: :class:`ParamReader`), the run's eval batches, MaxText's forward.

The conversion to Hugging Face names and layouts is :mod:`.hf_conversion` (MaxText's own mappings); which
architecture each decoder block exports as is :mod:`.export_arch`. Errors are :class:`CheckpointError`
(one line: the path or key and the fix).
"""

from __future__ import annotations

import os
from typing import Any, Iterator

import numpy as np

from maxtext_nvfp4.integration import touchpoints


class CheckpointError(ValueError):
  """A checkpoint or config the exporter cannot use (message: one line with the path/key and the fix)."""


def maxtext_module(module_name: str):
  """Import a MaxText module and check it has every symbol of the adapter's ``touches`` we use."""
  import importlib  # pylint: disable=import-outside-toplevel

  module = importlib.import_module(module_name)
  touchpoints.check(module_name, module)
  return module


# The parameters' item in a step folder: MaxText's training checkpoints ("items": its TrainState, parameters under
# "params"), and Tunix's (MaxText's distillation trainer: "model_params", the student's NNX state, each parameter
# under its variable's "value"; MaxText's own load_parameters_path reads both).
ITEM_NAMES = ("items", "model_params")


def find_items(path: str) -> str:
  """The Orbax parameters item (``items``, or a Tunix checkpoint's ``model_params``) of a checkpoint given as a
  run's ``checkpoints`` dir (latest committed step), a step dir, or the item dir itself."""
  path = os.path.abspath(os.path.expanduser(path))
  if not os.path.isdir(path):
    raise CheckpointError(f"checkpoint {path}: no such directory (give a MaxText run's checkpoints/ or"
                          " checkpoints/<step>/ directory)")
  if os.path.basename(path) in ITEM_NAMES or os.path.exists(os.path.join(path, "_METADATA")):
    return path
  for name in ITEM_NAMES:
    if os.path.isdir(os.path.join(path, name)):
      return os.path.join(path, name)
  steps = sorted(((int(s), name) for s in os.listdir(path) for name in ITEM_NAMES if s.isdigit()
                  and os.path.isdir(os.path.join(path, s, name))
                  and os.path.exists(os.path.join(path, s, "commit_success.txt"))), reverse=True)
  if steps:
    return os.path.join(path, str(steps[0][0]), steps[0][1])
  raise CheckpointError(f"checkpoint {path}: no committed MaxText checkpoint in it (expected <step>/items with"
                        " commit_success.txt; train with enable_checkpointing=true)")


def load_config(config_args: list[str]) -> Any:
  """MaxText's config for ``[RECIPE.yml] key=value ...`` (MaxText's base.yml without a recipe), with the
  plugin registered so ``nvfp4_*`` keys are understood. Raises :class:`CheckpointError` (one line)."""
  import maxtext_nvfp4  # pylint: disable=import-outside-toplevel
  from maxtext.configs import pyconfig  # pylint: disable=import-outside-toplevel
  from maxtext_nvfp4.integration import config_errors  # pylint: disable=import-outside-toplevel

  maxtext_nvfp4.register()
  args = list(config_args)
  if not args or not args[0].endswith(".yml"):
    import maxtext  # pylint: disable=import-outside-toplevel

    args = [os.path.join(os.path.dirname(maxtext.__file__), "configs", "base.yml"), *args]
  argv = [None, *args, "skip_jax_distributed_system=true", "enable_checkpointing=false",
          "log_config=false"]
  try:
    return pyconfig.initialize(argv)
  except Exception as e:  # pylint: disable=broad-exception-caught  (MaxText raises many kinds)
    one = config_errors.one_line_error(e)
    raise CheckpointError(f"config {' '.join(args)}: {' '.join(str(one or e).split())}") from None


def params_of(tree) -> tuple[Any, bool] | None:
  """``(the subtree holding the parameters, whether it is a Tunix NNX state)`` of a checkpoint item's tree
  (:data:`ITEM_NAMES`), or None when it holds no MaxText parameters."""
  if isinstance(tree, dict) and "params" in tree:
    return tree["params"], False
  if isinstance(tree, dict) and "decoder" in tree:
    return tree, True
  return None


def param_name(path, nnx_state: bool) -> str:
  """A parameter's flattened name as MaxText's conversion names it (``params-decoder-layers_0-...``), from its
  path in :func:`params_of`'s subtree (a Tunix NNX state: without the variable's ``value`` leaf)."""
  parts = [str(getattr(k, "key", k)) for k in path]
  if nnx_state:
    parts = ["params", *(parts[:-1] if parts and parts[-1] == "value" else parts)]
  return "-".join(parts)


def named_leaves(sub, nnx_state: bool) -> list[tuple[str, tuple[str, ...], Any]]:
  """``[(param_name, path, leaf)]`` of :func:`params_of`'s subtree: its parameters (a Tunix NNX state also holds
  the modules' RNG counters, under ``rngs``: not parameters, skipped)."""
  import jax  # pylint: disable=import-outside-toplevel

  out = []
  for path, leaf in jax.tree_util.tree_flatten_with_path(sub)[0]:
    parts = tuple(str(getattr(k, "key", k)) for k in path)
    if nnx_state and "rngs" in parts:
      continue
    out.append((param_name(path, nnx_state), parts, leaf))
  return out


def _restore_item(sub, nnx_state: bool):
  return sub if nnx_state else {"params": sub}


def read_params(items_dir: str) -> dict[str, np.ndarray]:
  """``{"params-decoder-layers_0-...": array}``: the checkpoint's parameters, flattened with MaxText's
  conversion naming (optimizer state is not read)."""
  import jax  # pylint: disable=import-outside-toplevel
  import orbax.checkpoint as ocp  # pylint: disable=import-outside-toplevel

  ckptr = ocp.PyTreeCheckpointer()
  try:
    meta = _quiet_metadata(ckptr, items_dir)
    tree = meta.item_metadata.tree if hasattr(meta, "item_metadata") else meta
    found = params_of(tree)
    if found is None:
      raise CheckpointError(f"checkpoint {items_dir}: no 'params' item (not a MaxText training checkpoint)")
    sub, nnx_state = found
    restore_args = jax.tree.map(lambda _: ocp.RestoreArgs(restore_type=np.ndarray), sub)
    restored = ckptr.restore(items_dir, args=ocp.args.PyTreeRestore(
        item=_restore_item(sub, nnx_state), restore_args=_restore_item(restore_args, nnx_state), partial_restore=True))
  except CheckpointError:
    raise
  except Exception as e:  # pylint: disable=broad-exception-caught  (Orbax/tensorstore raise many kinds)
    raise CheckpointError(f"checkpoint {items_dir}: cannot read it ({' '.join(str(e).split())[:200]})") from None
  return {name: np.asarray(v) for name, _, v in named_leaves(restored if nnx_state else restored["params"], nnx_state)}


class ParamReader:
  """One MaxText parameter at a time from a checkpoint (Orbax partial restore: only that array is read)."""

  def __init__(self, items_dir: str):
    import jax  # pylint: disable=import-outside-toplevel
    import orbax.checkpoint as ocp  # pylint: disable=import-outside-toplevel

    self.items_dir = items_dir
    self._ckptr = ocp.PyTreeCheckpointer()
    try:
      meta = _quiet_metadata(self._ckptr, items_dir)
    except Exception as e:  # pylint: disable=broad-exception-caught  (Orbax/tensorstore raise many kinds)
      raise CheckpointError(f"checkpoint {items_dir}: cannot read it ({' '.join(str(e).split())[:200]})") from None
    tree = meta.item_metadata.tree if hasattr(meta, "item_metadata") else meta
    found = params_of(tree)
    if found is None:
      raise CheckpointError(f"checkpoint {items_dir}: no 'params' item (not a MaxText training checkpoint)")
    self._tree, self._nnx_state = found
    leaves = named_leaves(self._tree, self._nnx_state)
    self.paths = {name: parts for name, parts, _ in leaves}
    self.shapes = {name: tuple(getattr(v, "shape", ())) for name, _, v in leaves}

  def read(self, key: str) -> np.ndarray:
    """The parameter ``key`` ("params-decoder-...") as a numpy array in its checkpoint dtype."""
    import orbax.checkpoint as ocp  # pylint: disable=import-outside-toplevel

    path = self.paths[key]
    node, item, args = self._tree, {}, {}
    d_item, d_args = item, args
    for part in path[:-1]:
      node = node[part]
      d_item, d_args = d_item.setdefault(part, {}), d_args.setdefault(part, {})
    d_item[path[-1]] = node[path[-1]]
    d_args[path[-1]] = ocp.RestoreArgs(restore_type=np.ndarray)
    try:
      got = self._ckptr.restore(self.items_dir, args=ocp.args.PyTreeRestore(
          item=_restore_item(item, self._nnx_state), restore_args=_restore_item(args, self._nnx_state),
          partial_restore=True))
    except Exception as e:  # pylint: disable=broad-exception-caught
      raise CheckpointError(f"checkpoint {self.items_dir}: cannot read {key} ({' '.join(str(e).split())[:200]})") from None
    node = got if self._nnx_state else got["params"]
    for part in path:
      node = node[part]
    return np.asarray(node)


def _quiet_metadata(ckptr, items_dir):
  """Orbax's metadata with its absl "Metadata file does not exist" warning (every MaxText checkpoint) muted."""
  import logging  # pylint: disable=import-outside-toplevel

  absl_log = logging.getLogger("absl")
  level = absl_log.level
  absl_log.setLevel(logging.ERROR)
  try:
    return ckptr.metadata(items_dir)
  finally:
    absl_log.setLevel(level)


def eval_batches(config, num_batches: int) -> Iterator[dict[str, np.ndarray]]:
  """Up to ``num_batches`` batches of the run's eval data (MaxText's own input pipeline; its train data
  when the config has no eval split), as numpy ``inputs`` / ``inputs_position`` / ``inputs_segmentation`` /
  ``targets`` / ``targets_segmentation``."""
  create_data_iterator = maxtext_module("maxtext.input_pipeline.input_pipeline_interface").create_data_iterator
  from maxtext.utils import maxtext_utils  # pylint: disable=import-outside-toplevel

  mesh = maxtext_utils.get_mesh_from_config(config)
  try:
    train_it, eval_it = create_data_iterator(config, mesh)
  except Exception as e:  # pylint: disable=broad-exception-caught  (the pipelines raise many kinds)
    raise CheckpointError(f"calibration data: cannot open the run's data ({' '.join(str(e).split())[:200]}):"
                          " check the dataset keys") from None
  it = eval_it if eval_it is not None else train_it
  for _ in range(num_batches):
    try:
      batch = next(it)
    except StopIteration:
      return
    yield {k: np.asarray(batch[k]) for k in ("inputs", "inputs_position", "inputs_segmentation", "targets",
                                             "targets_segmentation")}


def maxtext_logits(config, params_tree: dict, tokens: np.ndarray, positions=None, segment_ids=None) -> np.ndarray:
  """MaxText's own forward (Linen wrapper of its model, dropout off) of ``tokens`` with ``params_tree``
  (``{"params": {...}}`` as in the checkpoint): ``[B, T, vocab]`` logits as numpy fp32. Positions default
  to ``arange``, segment ids to one segment."""
  import jax.numpy as jnp  # pylint: disable=import-outside-toplevel
  from maxtext.utils import maxtext_utils  # pylint: disable=import-outside-toplevel

  model_creation_utils = maxtext_module("maxtext.utils.model_creation_utils")
  mesh = maxtext_utils.get_mesh_from_config(config)
  model = model_creation_utils.from_config(config, mesh=mesh)
  tokens = jnp.asarray(tokens, jnp.int32)
  positions = jnp.broadcast_to(jnp.arange(tokens.shape[1]), tokens.shape) if positions is None else positions
  segment_ids = jnp.ones_like(tokens) if segment_ids is None else segment_ids
  with mesh:
    logits = model.apply(params_tree, tokens, jnp.asarray(positions), decoder_segment_ids=jnp.asarray(segment_ids),
                         enable_dropout=False)
  return np.asarray(logits, np.float32)
