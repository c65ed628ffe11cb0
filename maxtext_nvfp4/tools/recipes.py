"""Recipes: find them, read their config exactly as the installed MaxText will, and refuse hardware they cannot use.

No JAX/MaxText import (OmegaConf and PyYAML only; MaxText's ``configs`` folder is located by path), so
``train`` and ``doctor`` can check a command line *before* anything heavy runs. This is the one recipe
reader and the one recipe finder of the package (train, doctor, reproduce use them).

**Finding** (:func:`find_recipe`): ``NAME`` is used as a path when that file exists (relative to the
working directory, like MaxText); otherwise a bare name (no folder part) is looked up, as ``NAME`` then
``NAME.yml``, in ``./recipes`` and then the packaged recipes (``maxtext_nvfp4/recipes``, carried by the
wheel). A folder, a missing file or a non-``.yml`` file is a :class:`RecipeError` (one line).

**Reading** (:func:`resolve`), the order of ``maxtext.configs.pyconfig._initialize_pydantic``:

1. ``_load_config``: the YAML, then its ``base_config`` looked up *beside the file first, then in
   MaxText's configs folder* (an absolute path as is), recursively; each child merged over its parent
   with ``OmegaConf.merge`` (nested mappings merge key by key). Values are typed by OmegaConf's YAML
   loader (``1e-4`` is a float, unlike PyYAML). A cycle, which MaxText would recurse on forever, is
   reported.
2. ``key=value`` overrides parsed by ``OmegaConf.from_cli`` (YAML-typed; ``a.b=1`` nests).
3. ``model_name`` other than ``default``: ``models/<name>.yml`` beside the recipe, then
   ``../models/``, then MaxText's ``configs/models/``; merged between the files and the overrides. With
   ``override_model_config`` true the model keys yield to the overrides; otherwise an override that
   changes a model key is the error MaxText raises.
4. ``M_<KEY>`` environment variables override existing keys (typed like the value they replace).

Then ``${...}`` interpolations are resolved. Not reproduced: the special merge of
``logical_axis_rules`` (rule lists are replaced, not merged by rule name) and the pydantic coercions and
derived keys (``num_decoder_layers`` etc.); the authoritative config is still ``pyconfig.initialize``.

Hardware rule (:func:`check_hardware`): a config needs Transformer Engine and a GPU of compute capability
at least ``c`` when it uses

* ``quantization=te_fp8_delayedscaling`` / ``te_fp8_currentscaling`` (c = 8.9, FP8 tensor cores),
* ``quantization=te_mxfp8`` / ``te_nvfp4`` / ``te_nvfp4_no_rht`` (c = 10.0, Blackwell),
* ``quantization=nvfp4`` with ``nvfp4_backend=te`` (c = 10.0),
* ``attention=cudnn_flash_te`` or ``quantization=te_no_quant`` (c = 8.0, TE's fused attention).

The requirement of a config is the maximum over the rules it triggers.
"""

from __future__ import annotations

import dataclasses
import glob
import os
import re
from typing import Any, Mapping, Sequence

from maxtext_nvfp4.backends.capability import MIN_COMPUTE_CAPABILITY
from maxtext_nvfp4.core import implementations

_PKG_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # maxtext_nvfp4/
# The recipes the wheel carries (in a checkout, a link to the repository's recipes/).
PACKAGED_RECIPES = os.path.join(_PKG_DIR, "recipes")
RECIPE_SUFFIX = ".yml"  # MaxText reads argv[1] as the config file only when it ends in .yml
_MAX_CHAIN = 32  # base_config files in one chain before we call it a cycle-free but absurd chain

# quantization value -> minimum compute capability (all need Transformer Engine)
_TE_QUANT_CC = {
    "te_no_quant": 8.0,
    "te_fp8_delayedscaling": 8.9,
    "te_fp8_currentscaling": 8.9,
    "te_mxfp8": MIN_COMPUTE_CAPABILITY,  # Blackwell: the FP4/MXFP8 tensor cores (one constant, backends/capability)
    "te_nvfp4": MIN_COMPUTE_CAPABILITY,
    "te_nvfp4_no_rht": MIN_COMPUTE_CAPABILITY,
}
_CUDNN_FLASH_TE_CC = 8.0



class RecipeError(ValueError):
  """A recipe or command line that cannot be found or read; the message is one line naming it and the fix."""


def _one_line(text: Any) -> str:
  return " ".join(str(text).split())


# ---------------------------------------------------------------------------------------------------
# Finding
# ---------------------------------------------------------------------------------------------------


def search_dirs(recipes_dir: str | None = None) -> list[str]:
  """Folders a bare recipe name is looked up in: ``recipes_dir`` alone when given, else ``./recipes`` then
  the packaged recipes (the same folder twice in a checkout is listed once)."""
  dirs = [recipes_dir] if recipes_dir else [os.path.join(os.getcwd(), "recipes"), PACKAGED_RECIPES]
  out, seen = [], set()
  for d in dirs:
    real = os.path.realpath(d)
    if real not in seen:
      seen.add(real)
      out.append(d)
  return out


def find_recipe(name: str, recipes_dir: str | None = None) -> str:
  """The recipe file ``name`` names (see the module docstring); raises :class:`RecipeError`."""
  name = os.path.expanduser(str(name))
  if not name.strip():
    raise RecipeError("the recipe name is empty; give a RECIPE.yml path or a packaged name (maxtext-nvfp4 recipes)")
  if os.path.isdir(name):
    raise RecipeError(f"recipe {name} is a directory; give a .yml file in it")
  if os.path.isfile(name):
    return _check_suffix(name)
  if os.path.dirname(name) == "" or recipes_dir:
    base = os.path.basename(name)
    for d in search_dirs(recipes_dir):
      for cand in (base, base + RECIPE_SUFFIX):
        path = os.path.join(d, cand)
        if os.path.isfile(path):
          return _check_suffix(path)
    raise RecipeError(f"recipe {name} not found (looked in: {', '.join(['.', *search_dirs(recipes_dir)])}); "
                      "see `maxtext-nvfp4 recipes` for the packaged ones")
  hint = ""
  if os.path.isfile(os.path.join(PACKAGED_RECIPES, os.path.basename(name))):
    hint = f"; the packaged recipe is named {os.path.splitext(os.path.basename(name))[0]} (no folder)"
  raise RecipeError(f"recipe {name} does not exist{hint or '; check the path (see `maxtext-nvfp4 recipes`)'}")


def _check_suffix(path: str) -> str:
  if not path.endswith(RECIPE_SUFFIX):
    raise RecipeError(f"recipe {path} does not end in {RECIPE_SUFFIX}: MaxText reads only .yml config files;"
                      f" rename it to {os.path.splitext(path)[0]}{RECIPE_SUFFIX}")
  return path


def describe(path: str, width: int = 110) -> str:
  """A recipe's one-line description: the first sentence of its header comment, cut to ``width``
  characters (``""`` when it has no header)."""
  words = []
  try:
    with open(path, encoding="utf-8") as f:
      for line in f:
        if not line.startswith("#"):
          break
        words += line.lstrip("#").split()
  except (OSError, UnicodeDecodeError):
    return ""
  text = " ".join(words)
  end = re.search(r"\w{5}\)?\.\s+(?=[A-Z])", text)  # a sentence end, not "sec. 4" or "App. D"
  text = text if end is None else text[:end.end()].rstrip()
  return text if len(text) <= width else text[:width - 3].rstrip() + "..."


def list_recipes(*, include_bases: bool = False) -> list[str]:
  """Paths of the packaged recipes (``*.yml``), sorted; the shared ``*_base.yml`` files only on request."""
  if not os.path.isdir(PACKAGED_RECIPES):
    return []
  names = sorted(f for f in os.listdir(PACKAGED_RECIPES) if f.endswith(RECIPE_SUFFIX))
  return [os.path.join(PACKAGED_RECIPES, f) for f in names if include_bases or not f.endswith("_base.yml")]


def recipes_listing() -> str:
  """``name  description`` lines for every packaged recipe (``maxtext-nvfp4 recipes``)."""
  paths = list_recipes()
  width = max((len(os.path.basename(p)) - len(RECIPE_SUFFIX) for p in paths), default=0)
  lines = [f"{os.path.basename(p)[:-len(RECIPE_SUFFIX)]:<{width}}  {describe(p)}" for p in paths]
  lines.append(f"(in {PACKAGED_RECIPES}; run one with: python -m maxtext_nvfp4.train NAME [key=value ...])")
  return "\n".join(lines)


# ---------------------------------------------------------------------------------------------------
# Reading (pyconfig's order; file names and the environment prefix from the MaxText adapter)
# ---------------------------------------------------------------------------------------------------


def maxtext_configs_dir() -> str:
  """MaxText's ``configs`` folder (its ``base.yml`` and ``models/``), located without importing MaxText's
  modules (``import maxtext`` alone is an empty package)."""
  return os.path.join(_maxtext_facts()[0], _maxtext_facts()[1].configs_dir)


def _maxtext_facts():
  """``(maxtext package dir, the installed MaxText's adapter)``: where its config files are and how pyconfig
  reads them (base file, models folder, environment prefix) are facts of the MaxText version."""
  from maxtext_nvfp4.integration import touchpoints  # pylint: disable=import-outside-toplevel

  return touchpoints.maxtext_package_dir(), touchpoints.adapter()


@dataclasses.dataclass(frozen=True, kw_only=True)
class Recipe:
  """A command line's effective config, as MaxText will build it (before pydantic)."""

  # The top-level YAML actually read (MaxText's base.yml when the command line names none).
  path: str
  # Every file of the base_config chain, the top-level file first (absolute paths).
  chain: tuple[str, ...]
  # The model YAML merged in for model_name (None when model_name is "default" or has no file).
  model_file: str | None
  # Every key with its effective value (plain Python containers, interpolations resolved).
  values: Mapping[str, Any]
  # key -> where its value came from: a chain file, the model file, "command line" or "environment M_KEY".
  sources: Mapping[str, str]
  # The key=value tokens of the command line, in order.
  overrides: tuple[str, ...]

  def get(self, key: str, default: Any = None) -> Any:
    return self.values.get(key, default)


def _load_yaml(path: str, *, what: str):
  """``OmegaConf.load(path)`` as a mapping; every way it can fail is a one-line :class:`RecipeError`."""
  from omegaconf import OmegaConf  # pylint: disable=import-outside-toplevel
  import yaml  # pylint: disable=import-outside-toplevel

  if os.path.isdir(path):
    raise RecipeError(f"{what} {path} is a directory, not a YAML file")
  try:
    cfg = OmegaConf.load(path)
  except FileNotFoundError:
    raise RecipeError(f"{what} {path} does not exist") from None
  except PermissionError:
    raise RecipeError(f"{what} {path} is not readable (permission denied); fix its permissions") from None
  except OSError as e:
    raise RecipeError(f"{what} {path} cannot be read ({e.strerror or e})") from None
  except UnicodeDecodeError:
    raise RecipeError(f"{what} {path} is not a text file (not UTF-8); give a YAML recipe") from None
  except yaml.YAMLError as e:
    mark = getattr(e, "problem_mark", None)
    where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
    raise RecipeError(f"{what} {path} is not valid YAML{where}: {_one_line(getattr(e, 'problem', None) or e)}")\
        from None
  except Exception as e:  # pylint: disable=broad-exception-caught  (omegaconf's own errors: bad keys, ...)
    raise RecipeError(f"{what} {path} cannot be loaded: {_one_line(e)}") from None
  if not OmegaConf.is_dict(cfg):
    raise RecipeError(f"{what} {path} must be a YAML mapping of key: value lines, not a {type(cfg).__name__}")
  if not cfg:  # MaxText would train on pydantic's defaults alone: almost surely the wrong file
    raise RecipeError(f"{what} {path} is empty; a recipe starts with base_config: base.yml and sets keys")
  return cfg


def _base_path(current: str, base: str) -> str:
  """pyconfig._load_config's lookup: beside ``current`` first, then MaxText's configs folder."""
  if os.path.isabs(base):
    return base
  beside = os.path.join(os.path.dirname(current), base)
  return beside if os.path.isfile(beside) else os.path.join(maxtext_configs_dir(), base)


def read_chain(path: str):
  """``(merged OmegaConf config, chain of files, {key: file that set it})`` of ``path`` and its
  ``base_config`` chain, merged as ``pyconfig._load_config`` does."""
  from omegaconf import OmegaConf  # pylint: disable=import-outside-toplevel

  chain, cfgs = [], []
  cur, what = os.path.abspath(path), "recipe"
  while True:
    if cur in chain:
      raise RecipeError(f"recipe {path}: base_config cycle ({' -> '.join(chain + [cur])}); break the loop")
    if len(chain) >= _MAX_CHAIN:
      raise RecipeError(f"recipe {path}: base_config chain longer than {_MAX_CHAIN} files")
    cfg = _load_yaml(cur, what=what)
    chain.append(cur)
    cfgs.append(cfg)
    base = cfg.get("base_config") if "base_config" in cfg else None
    if base is None:
      break
    if not isinstance(base, str) or not base:
      raise RecipeError(f"{cur}: base_config must be a file name (e.g. base.yml), got {base!r}")
    nxt = _base_path(cur, base)
    if not os.path.isfile(nxt):
      raise RecipeError(f"{cur}: base_config {base!r} not found (looked beside it and in MaxText's configs folder"
                        f" {maxtext_configs_dir()}); fix the name or copy the file beside the recipe")
    cur, what = os.path.abspath(nxt), "base_config"
  sources: dict[str, str] = {}
  merged = OmegaConf.create({})
  for f, cfg in reversed(list(zip(chain, cfgs))):  # parent first, each child over it
    merged = OmegaConf.merge(merged, cfg)
    sources.update({str(k): f for k in cfg.keys()})
  return merged, tuple(chain), sources


def split_command_line(args: Sequence[str]) -> tuple[str | None, list[str]]:
  """``[RECIPE] key=value ...`` -> ``(RECIPE or None, overrides)``; a token that is neither is an error.

  The first token is the recipe when it has no ``=`` (a path or a packaged name); every other token must
  be ``key=value`` with a non-empty key.
  """
  args = [str(a) for a in args if a is not None]
  recipe = None
  if args and "=" not in args[0]:
    recipe, args = args[0], args[1:]
  for tok in args:
    key = tok.split("=", 1)[0]
    if "=" not in tok or not key.strip() or key != key.strip():
      raise RecipeError(f"argument {tok!r} is not key=value (only the first argument may be the recipe);"
                        " write overrides as key=value, e.g. steps=100")
  return recipe, args


def resolve(args: Sequence[str], *, recipes_dir: str | None = None, environ: Mapping[str, str] | None = None)\
    -> Recipe:
  """The effective config of a trainer command line ``[RECIPE] key=value ...`` (module docstring: the
  MaxText order). No recipe: MaxText's ``base.yml`` plus the overrides. Raises :class:`RecipeError`."""
  from omegaconf import OmegaConf  # pylint: disable=import-outside-toplevel

  environ = os.environ if environ is None else environ
  name, overrides = split_command_line(args)
  path = (find_recipe(name, recipes_dir) if name is not None
          else os.path.join(maxtext_configs_dir(), _maxtext_facts()[1].base_config))
  merged, chain, sources = read_chain(path)
  try:
    cli = OmegaConf.from_cli(list(overrides))
  except Exception as e:  # pylint: disable=broad-exception-caught
    raise RecipeError(f"command-line overrides cannot be parsed: {_one_line(e)}") from None
  temp = OmegaConf.merge(merged, cli)
  model_cfg, model_file = {}, None
  model_name = str(temp.get("model_name", "default") or "default").replace("-Instruct", "")
  if model_name != "default":
    models = _maxtext_facts()[1].models_dir
    for cand in (os.path.join(os.path.dirname(path), models, f"{model_name}.yml"),
                 os.path.join(os.path.dirname(os.path.dirname(path)), models, f"{model_name}.yml"),
                 os.path.join(maxtext_configs_dir(), models, f"{model_name}.yml")):
      if os.path.isfile(cand):
        model_file = os.path.abspath(cand)
        break
    if model_file is not None:
      loaded = _load_yaml(model_file, what="model config")
      if temp.get("override_model_config"):
        model_cfg = {k: v for k, v in loaded.items() if k not in cli}
      else:
        model_cfg = loaded
        clash = sorted(str(k) for k in loaded.keys() if k in cli and _plain(loaded, k) != _plain(cli, k))
        if clash:
          raise RecipeError(f"{', '.join(clash)} set on the command line but also by model_name={model_name}"
                            f" ({model_file}); add override_model_config=true to let the command line win")
  try:
    final = OmegaConf.to_container(OmegaConf.merge(merged, OmegaConf.create(model_cfg), cli), resolve=True)
  except Exception as e:  # pylint: disable=broad-exception-caught  (a ${...} that does not resolve)
    raise RecipeError(f"recipe {path}: {_one_line(e)}") from None
  sources.update({str(k): model_file for k in (model_cfg.keys() if model_cfg else ())})
  sources.update({str(k): "command line" for k in cli.keys()})
  for key in list(final):
    env_key = _maxtext_facts()[1].env_prefix + str(key).upper()
    if env_key not in environ:
      continue
    if key in cli:
      raise RecipeError(f"{key} is set both on the command line and by the environment variable {env_key};"
                        f" unset {env_key} or drop the override")
    final[key] = _env_value(key, environ[env_key], final[key])
    sources[key] = f"environment {env_key}"
  return Recipe(path=path, chain=chain, model_file=model_file, values=final, sources=sources,
                overrides=tuple(overrides))


def _plain(cfg, key):
  from omegaconf import OmegaConf  # pylint: disable=import-outside-toplevel

  try:
    return OmegaConf.to_container(OmegaConf.create({key: cfg[key]}), resolve=True)[key]
  except Exception:  # pylint: disable=broad-exception-caught
    return cfg[key]


def _env_value(key: str, raw: str, current: Any) -> Any:
  """pyconfig's ``M_KEY`` parsing: typed like the value it replaces (bools as true/false/1/0/yes/no)."""
  env_key = _maxtext_facts()[1].env_prefix + key.upper()
  if isinstance(current, bool):
    low = raw.strip().lower()
    if low in ("true", "1", "yes", "y", "t"):
      return True
    if low in ("false", "0", "no", "n", "f"):
      return False
    raise RecipeError(f"{env_key}={raw!r} is not a boolean; use true or false")
  if isinstance(current, (str, int, float)):
    try:
      return type(current)(raw)
    except ValueError:
      raise RecipeError(f"{env_key}={raw!r} is not a {type(current).__name__} (the type of {key})") from None
  raise RecipeError(f"{env_key}: {key} is a {type(current).__name__}, which MaxText cannot take from the environment")


def load_recipe(path: str) -> dict[str, Any]:
  """Effective keys of one recipe file (its chain down to MaxText's ``base.yml``), no overrides."""
  return dict(resolve([path]).values)


def _type_error(key: str, v: Any, want: type, choices: tuple[str, ...]) -> str:
  """One line for an ``nvfp4_*`` value of the wrong type, in YAML's spelling (``no`` arrives as false, ``1`` as an
  integer, an empty value as null), with the choices of an enumerated key."""
  shown = "null (empty)" if v is None else str(v).lower() if isinstance(v, bool) else repr(v) if isinstance(v, str) \
      else str(v)
  yaml = ("" if isinstance(v, str) else " (YAML read it as null: nothing after =)" if v is None
          else " (YAML read it as a boolean: yes/no/on/off)" if isinstance(v, bool)
          else " (YAML read it as a number)" if want is str else "")
  if choices:
    return f"{key}={shown}{yaml} is not allowed; choose one of: {', '.join(choices)}"
  kind = {bool: "true or false", int: "an integer", float: "a number", str: "a string"}[want]
  return f"{key}={shown}{yaml} must be {kind}"


def _cmd() -> str:
  from maxtext_nvfp4.tools.shell_command import shell_command  # pylint: disable=import-outside-toplevel

  return shell_command()


def settings_error(values: Mapping[str, Any]) -> str | None:
  """One line when the ``nvfp4_*`` keys of an effective config are invalid (type, choice, range, or
  against ``base_num_decoder_layers`` / ``steps`` / ``scan_layers``), else None: the checks the plugin
  runs inside MaxText's pyconfig, made before MaxText starts. A key no file sets takes its default."""
  from maxtext_nvfp4.core import settings  # pylint: disable=import-outside-toplevel

  types, mapping = settings.field_types(), {}
  for key, default in settings.config_keys().items():
    v = values.get(key, default)
    want = types[key]
    choices = settings.CHOICES.get(settings.field_of_key(key), ())
    if v is None and "none" in choices:
      v = "none"  # what MaxText's pyconfig makes of "none", read back as from_config does
    ok = (isinstance(v, bool) if want is bool else isinstance(v, str) if want is str
          else isinstance(v, (int, float)) and not isinstance(v, bool) and (want is float or float(v).is_integer()))
    if not ok:
      return _type_error(key, v, want, choices)
    mapping[key] = int(v) if want is int else v
  steps, layers = values.get("steps"), values.get("base_num_decoder_layers")
  try:
    settings.validate(settings.from_config(mapping), num_layers=layers if isinstance(layers, int) else None,
                      steps=steps if isinstance(steps, int) else None,
                      scan_layers=values.get("scan_layers", True))  # MaxText's base.yml: true
  except settings.SettingsError as e:
    return str(e)
  return None


# ---------------------------------------------------------------------------------------------------
# Data the command line reads
# ---------------------------------------------------------------------------------------------------


def missing_data_error(values: Mapping[str, Any]) -> str | None:
  """One line when a local grain dataset the config trains on matches no file, else None.

  Checked: ``grain_train_files`` (and ``grain_eval_files`` when ``eval_interval > 0``) with
  ``dataset_type=grain``; ``;``-separated mixtures (``path,weight``) per entry; URLs (``gs://``) are left
  to MaxText. Relative patterns are relative to the working directory, as MaxText reads them.
  """
  if str(values.get("dataset_type", "")) != "grain":
    return None
  keys = ["grain_train_files"]
  if isinstance(values.get("eval_interval"), int) and values["eval_interval"] > 0:
    keys.append("grain_eval_files")
  for key in keys:
    spec = values.get(key)
    if not isinstance(spec, str) or not spec:
      continue
    for entry in spec.split(";"):
      pattern = entry.split(",")[0].strip()
      if not pattern or "://" in pattern or glob.glob(os.path.expanduser(pattern)):
        continue
      if pattern.startswith("data/embedded_sft/"):
        fix = (f"build the fine-tuning demo data here first with `{_cmd()} prepare-sft-data` (writes"
               " data/embedded_sft/ in the current directory), or run from the directory that holds data/")
      elif pattern.startswith("data/embedded/"):
        fix = (f"build the demo data here first with `{_cmd()} prepare-data` (writes data/embedded/ in the"
               " current directory), or run from the directory that holds data/")
      else:
        fix = f"check the path or set {key}=... to your files"
      return f"{key}={pattern} matches no file (relative to {os.getcwd()}); {fix}"
  return None


# ---------------------------------------------------------------------------------------------------
# Hardware
# ---------------------------------------------------------------------------------------------------


def _get(config: Any, key: str, default: Any = None) -> Any:
  v = config.get(key, default) if isinstance(config, Mapping) else getattr(config, key, default)
  v = getattr(v, "value", v)  # MaxText enums (QuantizationType) -> plain strings
  return default if v is None else v


def _cc_float(gpu_cc: Any) -> float | None:
  if gpu_cc is None:
    return None
  if isinstance(gpu_cc, (tuple, list)):
    return float(f"{int(gpu_cc[0])}.{int(gpu_cc[1])}")
  return float(gpu_cc)


def requirements(config: Any) -> list[tuple[str, float]]:
  """``[(what needs TE, min compute capability), ...]`` for a config (mapping or MaxText config object)."""
  need = []
  quant = str(_get(config, "quantization", "") or "")
  if quant in _TE_QUANT_CC:
    need.append((f"quantization={quant}", _TE_QUANT_CC[quant]))
  insisted = implementations.insisted(_get(config, "nvfp4_backend", implementations.AUTO))
  if quant == "nvfp4" and insisted is not None and insisted.min_compute_capability is not None:
    need.append((f"quantization=nvfp4 with nvfp4_backend={insisted.name}", insisted.min_compute_capability))
  if str(_get(config, "attention", "")) == "cudnn_flash_te":
    need.append(("attention=cudnn_flash_te", _CUDNN_FLASH_TE_CC))
  return need


def _suggestion(config: Any, on_gpu: bool, recipe: str | None = None) -> str:
  """The proxy / emulated recipe matching a config's precision (packaged names), never ``recipe`` itself:
  a recipe that already is the suggestion (``demo_nvfp4.yml nvfp4_backend=te``) is told to emulate."""
  quant = str(_get(config, "quantization", "") or "")
  if quant == "nvfp4":
    alt = ("nvfp4_backend=emulate (exact, no FP4 speed-up), or proxy_1gpu_nvfp4.yml on one GPU" if on_gpu
           else "nvfp4_backend=emulate (the exact emulation), or demo_nvfp4.yml for a CPU-sized model")
  elif "nvfp4" in quant or quant == "te_mxfp8":
    alt = "proxy_1gpu_nvfp4.yml on one GPU" if on_gpu else "demo_nvfp4.yml on CPU (exact emulation)"
  elif quant.startswith("te_fp8"):
    alt = "proxy_1gpu_fp8.yml (XLA FP8, no Transformer Engine)" if on_gpu else "demo_bf16.yml on CPU"
  else:
    alt = "attention=dot_product" + (", or proxy_1gpu_nvfp4.yml" if on_gpu else ", or demo_bf16.yml on CPU")
  if str(_get(config, "attention", "")) == "cudnn_flash_te" and "attention=dot_product" not in alt and on_gpu:
    alt += " (with attention=dot_product if TE is missing)"
  if recipe and os.path.basename(recipe) in alt and quant == "nvfp4":
    alt = "nvfp4_backend=emulate (or auto): the exact emulation runs on this machine"
  return alt


def check_hardware(config: Any, *, te_available: bool, gpu_cc: float | tuple[int, int] | None,
                   recipe: str | None = None) -> str | None:
  """None when this machine can run ``config``; else a one-line message saying what is missing and which
  proxy/emulated recipe to use instead.

  ``config``: a mapping of config keys (e.g. :attr:`Recipe.values` of :func:`resolve`) or MaxText's
  config object. ``te_available``: ``transformer_engine.jax`` imports. ``gpu_cc``: the smallest compute
  capability over the GPUs in use (``10.0`` or ``(10, 0)``), None when there is no NVIDIA GPU.
  """
  need = requirements(config)
  if not need:
    return None
  cc = _cc_float(gpu_cc)
  what, min_cc = max(need, key=lambda n: n[1])
  problems = []
  if not te_available:
    problems.append("Transformer Engine (JAX) is not installed/importable")
  if cc is None:
    problems.append("there is no NVIDIA GPU")
  elif cc < min_cc:
    problems.append(f"the GPU has compute capability {cc:.1f} < {min_cc:.1f}")
  if not problems:
    return None
  needs = ", ".join(w for w, _ in need)
  return (f"this recipe needs Transformer Engine on a GPU with compute capability >= {min_cc:.1f} ({needs}), but"
          f" {' and '.join(problems)}; use {_suggestion(config, cc is not None, recipe)} instead")


def detect_hardware() -> tuple[bool, float | None]:
  """``(te_available, min GPU compute capability or None)`` without initializing any JAX backend.

  Safe before ``jax.distributed.initialize`` (which must run before the first ``jax.devices()`` of a
  multi-process job): the compute capability comes from ``nvidia-smi --query-gpu=compute_cap`` (GPUs in
  ``CUDA_VISIBLE_DEVICES`` only, as nvidia-smi reports them), TE availability from the installed package
  (``transformer_engine`` importable spec; its CUDA extension is not loaded). No nvidia-smi: no GPU.
  """
  import importlib.util  # pylint: disable=import-outside-toplevel
  import shutil  # pylint: disable=import-outside-toplevel
  import subprocess  # pylint: disable=import-outside-toplevel

  te_available = importlib.util.find_spec("transformer_engine") is not None
  smi = shutil.which("nvidia-smi")
  if smi is None:
    return te_available, None
  try:
    out = subprocess.run([smi, "--query-gpu=compute_cap", "--format=csv,noheader"], capture_output=True, text=True,
                         timeout=30, check=True).stdout
    ccs = [float(line.strip()) for line in out.splitlines() if line.strip()]
  except (OSError, subprocess.SubprocessError, ValueError):
    return te_available, None
  return te_available, (min(ccs) if ccs else None)


def check_argv(argv: Sequence[str], *, te_available: bool, gpu_cc: float | tuple[int, int] | None) -> str | None:
  """:func:`check_hardware` for a trainer command line ``[prog, RECIPE, key=value, ...]`` (argv[0] ignored;
  no recipe means MaxText's base.yml, which needs nothing)."""
  r = resolve(list(argv)[1:])
  return check_hardware(r.values, te_available=te_available, gpu_cc=gpu_cc, recipe=r.path)
