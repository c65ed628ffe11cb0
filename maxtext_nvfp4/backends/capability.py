"""Which NVFP4 backend runs here: ``emulate`` (exact pure JAX, anywhere) or ``te`` (TE on Blackwell).

Rule (``nvfp4_backend``):

  * ``auto`` (default) -> ``te`` when every local JAX device is a GPU with compute capability >= 10.0
    **and** Transformer Engine JAX imports; otherwise ``emulate``, with the reason.
  * ``emulate`` -> ``emulate``, always.
  * ``te`` -> ``te`` under the same conditions as ``auto``; otherwise :class:`BackendError`, one line
    that says why and what to do, raised at config time (before any compilation).

Consumer Blackwell (compute capability 12.x: RTX 50xx, RTX PRO, DGX Spark's GB10): Transformer Engine
before :data:`SR_FIX_TE_VERSION` quantizes with stochastic rounding to all zeros there (no ``cvt.rs``
instruction on that family; the device-side error compiles to nothing in release builds), so the default
recipe, which rounds gradients stochastically, trains on zeroed gradients. Fixed by TE PR #3281
(https://github.com/NVIDIA/TransformerEngine/pull/3281, commit fc1fc0e, merged 2026-08-12), first in the
2.19 release branch (``release_v2.19``, VERSION 2.19.0; v2.18 was tagged before the merge). So on 12.x
with an older TE, ``auto`` picks ``emulate`` (saying why) and ``te`` is refused naming the minimum version.

Recipe options TE JAX does not have (``nvfp4_4over6``, ``nvfp4_row_scaled_activation``,
``nvfp4_backward_override``: TE PyTorch only, :func:`te_jax_option_problem`): given the run's ``settings``,
``auto`` picks ``emulate`` even on Blackwell and says which option made it, as for MoE experts; ``te`` is
refused in one line naming the option, before any device check.

Compile target: a program compiled ahead of time for other devices than the host's (MaxText's
``compile_topology``; :mod:`maxtext_nvfp4.backends.targets`) is judged by those devices. The code that builds such
a compile sets them with :func:`compile_target` for its duration; :func:`choose_backend` then judges them instead
of ``jax.local_devices()`` and says so (``compile target b200-4: ...``).

Why ``>= 10.0``: TE JAX refuses NVFP4 below that (``_check_fp4_support``: "Device compute capability
10.0 or higher required for NVFP4 execution."); Hopper (9.0) has no FP4 tensor cores.

This module never imports Transformer Engine (or any CUDA extension) at module load. The TE import is
attempted only inside :func:`te_unavailable_reason`, and :func:`choose_backend` calls it only after
the devices qualify, so on CPU/Hopper hosts TE is never imported. Tests pass fake ``devices`` and
monkeypatch :func:`te_version` / :func:`te_unavailable_reason` to fake TE presence.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib
import importlib.metadata
import logging
from typing import Any, Callable, Sequence

from maxtext_nvfp4.core import implementations
from maxtext_nvfp4.core import recipe_options
from maxtext_nvfp4.core import settings

BACKENDS = settings.BACKENDS
EMULATE, TE = implementations.EMULATE, implementations.TE
# TE JAX's NVFP4 requirement (transformer_engine/jax/quantize/helper.py `_check_fp4_support`).
MIN_COMPUTE_CAPABILITY = TE.min_compute_capability
# First Transformer Engine release with PR #3281's stochastic-rounding fix for compute capability 12.x.
SR_FIX_TE_VERSION = "2.19.0"
INSTALL_HINT = "install the te extra: pip install 'maxtext-nvfp4[te]'"
EMULATE_HINT = "or set nvfp4_backend=emulate"
# pip distributions that carry TE's JAX binding, most specific first.
TE_DISTRIBUTIONS = ("transformer-engine-jax", "transformer_engine_jax", "transformer-engine", "transformer_engine")

_log = logging.getLogger(__name__)
# (label, devices) of the compile target being built (compile_target), or None: the host's devices
_TARGET: list[tuple[str, tuple]] = []


class BackendError(ValueError):
  """``nvfp4_backend`` cannot be honoured here. The message is one line: why, and what to do."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class BackendChoice:
  """The backend a run uses and why (printed once at start and by ``maxtext-nvfp4 doctor``)."""

  # "emulate" (exact pure-JAX NVFP4) or "te" (Transformer Engine NVFP4 kernels on Blackwell).
  name: str
  # One line: the rule that decided, naming the device / TE state that mattered.
  reason: str

  @property
  def implementation(self) -> implementations.Implementation:
    """The table's entry for :attr:`name`: what this backend runs, refuses and reports."""
    return implementations.IMPLEMENTATIONS[self.name]


def te_version() -> str | None:
  """Installed Transformer Engine (JAX) version from package metadata, or None. Never imports TE."""
  for dist in TE_DISTRIBUTIONS:
    try:
      return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
      continue
  return None


def te_unavailable_reason() -> str | None:
  """None when ``transformer_engine.jax`` imports, else a short reason (the import error).

  This *does* import TE JAX (and so its CUDA extension); call it only where TE may be used.
  """
  try:
    importlib.import_module("transformer_engine.jax")
  except Exception as e:  # ImportError, or OSError/RuntimeError from a CUDA library mismatch
    msg = str(e).splitlines()[0] if str(e) else ""
    return f"{type(e).__name__}: {msg}" if msg else type(e).__name__
  return None


def device_compute_capability(device) -> float | None:
  """Compute capability of a CUDA device as a float (``"10.0"`` -> 10.0, ``"12.0"`` -> 12.0).

  None for non-GPU devices and GPUs that do not report one (ROCm). JAX exposes it as the string
  attribute ``device.compute_capability`` on CUDA devices.
  """
  if getattr(device, "platform", None) != "gpu":
    return None
  cc = getattr(device, "compute_capability", None)
  if cc is None:
    return None
  try:
    return float(cc)
  except (TypeError, ValueError):
    try:  # tolerate "10.0a"-style strings or (major, minor) tuples
      if isinstance(cc, (tuple, list)):
        return float(f"{int(cc[0])}.{int(cc[1])}")
      major, _, minor = str(cc).partition(".")
      return float(f"{int(major)}.{int(''.join(ch for ch in minor if ch.isdigit()) or 0)}")
    except (TypeError, ValueError, IndexError):
      return None


def describe_device(device) -> str:
  """``"gpu 0 (NVIDIA B200, cc 10.0)"`` / ``"cpu 0 (cpu)"``: one device for messages and doctor."""
  platform = getattr(device, "platform", "?")
  kind = getattr(device, "device_kind", "?")
  cc = device_compute_capability(device)
  extra = f", cc {cc:.1f}" if cc is not None else ""
  return f"{platform} {getattr(device, 'id', '?')} ({kind}{extra})"


def _device_problem(devices: Sequence[Any]) -> str | None:
  """None when every device is a GPU with cc >= 10.0; else why not (naming the first bad device)."""
  if not devices:
    return "no JAX devices are visible"
  for d in devices:
    cc = device_compute_capability(d)
    if getattr(d, "platform", None) != "gpu":
      return f"device {describe_device(d)} is not a GPU; TE's NVFP4 kernels need NVIDIA Blackwell (compute capability >= 10.0)"
    if cc is None:
      return f"device {describe_device(d)} reports no CUDA compute capability; TE's NVFP4 kernels need compute capability >= 10.0"
    if cc < MIN_COMPUTE_CAPABILITY:
      return f"device {describe_device(d)} has compute capability {cc:.1f} < 10.0 (no FP4 tensor cores)"
  return None


def _version_tuple(version: str) -> tuple:
  """``"2.19.0"`` -> ``(2, 19, 0)``; a pre-release or dev build (``2.19.0.dev0+g1``) sorts below its release."""
  try:
    from packaging.version import Version  # pylint: disable=import-outside-toplevel

    return (Version(version),)
  except Exception:  # pylint: disable=broad-exception-caught  (no packaging, or an unparsable version)
    nums = []
    for part in version.split("+")[0].split("."):
      if not part.isdigit():
        return tuple(nums) + (-1,)
      nums.append(int(part))
    return tuple(nums)


def sr_zero_problem(devices: Sequence[Any], version: str | None) -> str | None:
  """None unless a device has compute capability 12.x and TE ``version`` predates the SR fix; else why."""
  for d in devices:
    cc = device_compute_capability(d)
    if cc is not None and 12.0 <= cc < 13.0 and version is not None and (
        _version_tuple(version) < _version_tuple(SR_FIX_TE_VERSION)):
      return (f"device {describe_device(d)} is consumer Blackwell, where Transformer Engine {version} < {SR_FIX_TE_VERSION}"
              " rounds stochastically to all zeros (TE PR #3281), so NVFP4 gradients would be zero")
  return None


def _te_problem(version: str | None) -> str | None:
  """None when TE JAX is usable, else why. Imports TE: call it only once the devices qualify."""
  if version is None:
    return "Transformer Engine is not installed"
  err = te_unavailable_reason()
  return None if err is None else f"Transformer Engine {version} is installed but transformer_engine.jax fails to import ({err})"


def te_jax_option_problem(s) -> str | None:
  """``"<key>=<value> (...)"`` for the first recipe option of ``s`` TE JAX (2.20.2) does not have, or None.

  Its ``NVFP4BlockScaling`` has these fields, but TE JAX's quantize config reads only disable_rht,
  disable_stochastic_rounding and disable_2d_quantization (``NVFP4ScalingQuantizeConfig``): 4over6, row-scaled
  activations and the backward override exist in TE PyTorch only.
  """
  qat = str(getattr(s, "qat", "full"))
  if qat == "serving":
    return ("nvfp4_qat=serving (the export's W4A4 forward: 1x16 weight blocks, per-token activation scales; TE's"
            " kernels compute the training recipe's)")
  if qat == "forward":
    return ("nvfp4_qat=forward (a high-precision backward, TE PyTorch's backward_override=high_precision, which"
            " Transformer Engine JAX does not implement)")
  opts = recipe_options.options_of(s).te_pytorch_only()
  if not opts:
    return None
  return f"{opts[0]} (a TE PyTorch recipe option that Transformer Engine JAX does not implement)"


@contextlib.contextmanager
def compile_target(label: str, devices: Sequence[Any]):
  """Within this context :func:`choose_backend` judges ``devices`` (a compile target, e.g. ``label="b200-4"``)."""
  _TARGET.append((label, tuple(devices)))
  try:
    yield
  finally:
    _TARGET.pop()


def current_target() -> tuple[str, tuple] | None:
  """``(label, devices)`` of the compile target being built, or None (the host's devices count)."""
  return _TARGET[-1] if _TARGET else None


def choose_backend(requested: str = "auto", *, devices: Sequence[Any] | None = None,
                   settings: Any = None) -> BackendChoice:
  """Resolve ``nvfp4_backend`` to ``emulate`` or ``te`` (see the module docstring for the rule).

  Args:
    requested: ``auto`` | ``emulate`` | ``te``.
    devices: the devices to judge (default: the compile target's, :func:`compile_target`, else
      ``jax.local_devices()``); anything with ``platform``,
      ``device_kind``, ``id`` and, for CUDA, ``compute_capability`` works (tests pass fakes).
    settings: the run's ``Nvfp4Settings`` (optional): a recipe option TE JAX lacks makes ``auto`` emulate
      (saying which) and ``te`` fail.

  Raises:
    BackendError: unknown ``requested``, or ``te`` requested where it cannot run (one line).
  """
  requested = str(getattr(requested, "value", requested))
  if requested not in BACKENDS:
    raise BackendError(f"nvfp4_backend={requested!r} is not allowed; choose one of: {', '.join(BACKENDS)}")
  insisted = implementations.insisted(requested)
  if insisted is not None and insisted.min_compute_capability is None:  # runs on any device: nothing to judge
    return BackendChoice(name=insisted.name, reason=f"nvfp4_backend={insisted.name} requested: {insisted.description}")
  strict = insisted is not None  # nvfp4_backend=te: where TE cannot run, refuse instead of emulating
  option_problem = te_jax_option_problem(settings) if settings is not None else None
  if option_problem and strict:
    raise BackendError(f"nvfp4_backend=te cannot run {option_problem}; set nvfp4_backend=emulate (or auto, which"
                       " runs it emulated), or drop the option")
  where, target_label = "every local device is", None
  if devices is None and _TARGET:
    target_label, devices = _TARGET[-1]
    where = f"compile target {target_label}: every device is"
  if devices is None:
    import jax  # pylint: disable=import-outside-toplevel

    devices = jax.local_devices()
  devices = list(devices)
  version = te_version()
  device_problem = _device_problem(devices)
  if device_problem and target_label:
    device_problem = f"compile target {target_label}: {device_problem}"
  te_problem = None if device_problem else _te_problem(version)

  sr_problem = None if (device_problem or te_problem) else sr_zero_problem(devices, version)
  if sr_problem is not None:
    fix = f"pip install 'transformer-engine-jax>={SR_FIX_TE_VERSION}'"
    if strict:
      raise BackendError(f"nvfp4_backend=te cannot run: {sr_problem}; {fix}, or set nvfp4_backend=emulate")
    return BackendChoice(name=EMULATE.name, reason=f"nvfp4_backend=auto: {sr_problem}; using the exact emulation ({fix}"
                                                " to use TE)")
  if device_problem is None and te_problem is None and option_problem:
    return BackendChoice(name=EMULATE.name, reason=f"nvfp4_backend=auto: Transformer Engine {version} could run here,"
                                                f" but not {option_problem}; using the exact emulation")
  if device_problem is None and te_problem is None:
    kinds = sorted({describe_device(d).split(" (", 1)[1].rstrip(")") for d in devices})
    reason = f"{where} a GPU with compute capability >= 10.0 ({'; '.join(kinds)}) and Transformer Engine {version} JAX imports"
    return BackendChoice(name=TE.name, reason=f"nvfp4_backend={requested}: {reason}")
  if te_problem is not None:
    if strict:
      raise BackendError(f"nvfp4_backend=te cannot run: {te_problem}; {INSTALL_HINT}, {EMULATE_HINT}")
    return BackendChoice(name=EMULATE.name, reason=f"nvfp4_backend=auto: {te_problem}; using the exact emulation ({INSTALL_HINT} to use TE)")
  if strict:
    te_note = "" if version is not None else f" (and Transformer Engine is not installed: {INSTALL_HINT})"
    raise BackendError(f"nvfp4_backend=te cannot run: {device_problem}{te_note}; set nvfp4_backend=emulate (or auto) to run the exact emulation here")
  te_note = f"Transformer Engine {version} installed" if version is not None else "Transformer Engine not installed"
  return BackendChoice(name=EMULATE.name, reason=f"nvfp4_backend=auto: {device_problem}; {te_note}; using the exact emulation")


_announced: set[tuple[str, str]] = set()


def announce(choice: BackendChoice, log: Callable[[str], None] | None = None) -> bool:
  """Log ``choice`` once per process (MaxText builds its quantization object several times per run).

  Returns True when it logged, False when this exact choice was already announced.
  """
  key = (choice.name, choice.reason)
  if key in _announced:
    return False
  _announced.add(key)
  (log or _log.warning)(f"maxtext-nvfp4: NVFP4 backend = {choice.name} ({choice.reason})")
  return True
