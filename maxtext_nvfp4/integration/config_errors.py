"""Config errors as one line: pydantic errors on our keys, MaxText's unknown-key error, field-type checks.

Every function returns (or raises) a :class:`maxtext_nvfp4.core.settings.SettingsError` naming the key
and the fix; MaxText's ``_handle_config_exception`` then prints ``MAXTEXT CONFIG ERROR: ...`` (exit 2).
"""

from __future__ import annotations

import re

from maxtext_nvfp4.core import settings as settings_lib
from maxtext_nvfp4.integration import touchpoints


def one_line_error(e) -> Exception | None:
  """A pydantic ValidationError on ``quantization``/``nvfp4_*`` as one line (key=value: allowed), or None (also for
  any other exception: a missing recipe file is an ``OSError``)."""
  if not callable(getattr(e, "errors", None)):
    return None
  ours = [err for err in e.errors() if err.get("loc") and str(err["loc"][0]).startswith(("nvfp4_", "quantization"))]
  if not ours:
    return None
  parts = [f"{err['loc'][0]}={err.get('input')!r}: {err['msg']}" for err in ours]
  return settings_lib.SettingsError("; ".join(parts))


def unknown_key(e: Exception) -> str | None:
  """The key of MaxText's unknown-key ``ValueError`` (one line of every field name, ~21,000 characters), or
  None when ``e`` is another error (the pattern is the MaxText adapter's ``unknown_key_pattern``)."""
  match = re.match(touchpoints.adapter().unknown_key_pattern, str(e))
  return None if match is None else match.group(1)


def known_config_keys() -> list[str]:
  """Every key MaxText's pyconfig accepts (``MaxTextConfig`` fields, fields of its nested models, the
  multimodal keys it ignores) plus the ``nvfp4_*`` keys; for "did you mean" only."""
  from maxtext.configs import types  # pylint: disable=import-outside-toplevel

  keys, todo = set(settings_lib.config_keys()), [types.MaxTextConfig.model_fields, types.Multimodal.model_fields]
  while todo:
    for name, field in todo.pop().items():
      keys.add(name)
      if hasattr(getattr(field, "annotation", None), "model_fields"):
        todo.append(field.annotation.model_fields)
  return sorted(keys)


def unknown_key_error(key: str, where: str = "") -> settings_lib.SettingsError:
  """One line for a key MaxText does not know, with the closest known keys (difflib) as the fix."""
  import difflib  # pylint: disable=import-outside-toplevel

  close = difflib.get_close_matches(key, known_config_keys(), n=2, cutoff=0.75)
  fix = (f"did you mean {' or '.join(repr(c) for c in close)}?" if close
         else "see docs/usage.md for the nvfp4_* keys and MaxText's base.yml for the others")
  return settings_lib.SettingsError(f"unknown config key {key!r}{' ' + where if where else ''}; {fix}")


def field_error(values, keys) -> settings_lib.SettingsError | None:
  """The first of ``keys`` whose value in ``values`` fails its own ``MaxTextConfig`` field type, as one line
  (``steps='abc': Input should be a valid integer``), else None.

  Field types only (no model validators, which depend on the whole config MaxText builds), and only for
  plain top-level fields whose value MaxText passes to pydantic unchanged: a check that can refuse only
  what MaxText's own validation refuses.
  """
  import pydantic  # pylint: disable=import-outside-toplevel
  from maxtext.configs import types  # pylint: disable=import-outside-toplevel

  fields = types.MaxTextConfig.model_fields
  rewritten = touchpoints.adapter().rewritten_keys  # their raw value may fail the bare annotation: MaxText judges
  for key in keys:
    value = values.get(key)
    if key not in fields or key in rewritten or value is None or (isinstance(value, str) and value.lower()
                                                                         in ("", "none")):
      continue
    try:
      pydantic.TypeAdapter(fields[key].annotation).validate_python(value)
    except pydantic.ValidationError as e:
      return settings_lib.SettingsError(f"{key}={value!r}: {e.errors()[0]['msg']}")
    except Exception:  # pylint: disable=broad-exception-caught  (an annotation TypeAdapter cannot build)
      continue
  return None
