"""The config schema: ``quantization: nvfp4`` in MaxText's ``QuantizationType`` and :data:`Nvfp4MaxTextConfig`.

``Nvfp4MaxTextConfig`` is ``MaxTextConfig`` plus every ``nvfp4_*`` key of :mod:`maxtext_nvfp4.core.settings`
(choices as ``Literal`` so pydantic's error lists them; None too where "none" is a choice, which MaxText's
pyconfig turns into None; a YAML boolean where a choice is a word YAML reads as one: ``key=off`` on MaxText's
command line arrives as ``False``), built when MaxText's ``configs.types`` is patched.
"""

from __future__ import annotations

import dataclasses
from typing import Annotated, Any, Literal

from maxtext_nvfp4.core import settings as settings_lib

QUANTIZATION = "nvfp4"

_PY_TYPES = {"bool": bool, "int": int, "float": float, "str": str}
Nvfp4MaxTextConfig: Any = None  # built on registration: MaxTextConfig + the nvfp4_* keys


# YAML 1.1 (MaxText's parser) reads these words as booleans.
_YAML_BOOL_WORDS = {True: ("on", "yes", "true"), False: ("off", "no", "false")}


def _yaml_bool_to_choice(choices: tuple):
  """A validator turning the boolean YAML made of a choice word (``off`` -> False) back into that choice."""
  def convert(value):
    if isinstance(value, bool):
      return next((w for w in _YAML_BOOL_WORDS[value] if w in choices), value)
    return value
  return convert


def _field_annotations() -> dict[str, Any]:
  """``{config key: annotation}``: ``Literal[choices]`` for enumerated keys, else the settings type."""
  import pydantic  # pylint: disable=import-outside-toplevel

  out = {}
  for f in dataclasses.fields(settings_lib.Nvfp4Settings):
    choices = settings_lib.schema_choices(f.name) if f.name in settings_lib.CHOICES else None
    typ = f.type if isinstance(f.type, type) else _PY_TYPES[str(f.type)]
    ann = Literal[choices] if choices else typ
    if choices and any(w in choices for words in _YAML_BOOL_WORDS.values() for w in words):
      ann = Annotated[ann, pydantic.BeforeValidator(_yaml_bool_to_choice(choices))]
    out[settings_lib.config_key(f.name)] = ann
  return out


def patch_types(types) -> None:
  """``QuantizationType`` gains ``NVFP4``; :data:`Nvfp4MaxTextConfig` is built once (idempotent)."""
  qt = types.QuantizationType
  if QUANTIZATION not in qt._value2member_map_:  # pylint: disable=protected-access
    # Extend the str-Enum in place (a subclass/replacement would break `is`/== checks elsewhere).
    member = str.__new__(qt, QUANTIZATION)
    member._name_ = "NVFP4"  # pylint: disable=protected-access
    member._value_ = QUANTIZATION  # pylint: disable=protected-access
    member._sort_order_ = len(qt._member_names_)  # pylint: disable=protected-access
    member.__objclass__ = qt
    qt._member_map_["NVFP4"] = member  # pylint: disable=protected-access
    qt._value2member_map_[QUANTIZATION] = member  # pylint: disable=protected-access
    qt._member_names_.append("NVFP4")  # pylint: disable=protected-access
    type.__setattr__(qt, "NVFP4", member)
    types.MaxTextConfig.model_rebuild(force=True)

  global Nvfp4MaxTextConfig
  if Nvfp4MaxTextConfig is None:
    import pydantic  # pylint: disable=import-outside-toplevel

    defaults = settings_lib.config_keys()
    fields = {
        key: (ann, pydantic.Field(defaults[key], description=settings_lib.KEY_HELP[settings_lib.field_of_key(key)]))
        for key, ann in _field_annotations().items()
    }
    Nvfp4MaxTextConfig = pydantic.create_model("Nvfp4MaxTextConfig", __base__=types.MaxTextConfig, **fields)


def is_nvfp4(config) -> bool:
  q = getattr(config, "quantization", "")
  return str(getattr(q, "value", q)) == QUANTIZATION
