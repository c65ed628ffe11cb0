"""``python -m maxtext_nvfp4.train_compile RECIPE compile_topology=TOPOLOGY [key=value ...]``: MaxText's ahead-of-time
compile of the train step, for hardware this host does not have, with the plugin registered.

``TOPOLOGY`` is one of MaxText's own (``v5e-4``, ``v6e-8``, ... for TPUs: MaxText's ``train_compile`` runs unchanged)
or a GPU target of this package with its device count, ``<target>-<devices>`` (``b200-4``, ``gb200-8``, ``h200-1``,
``a100-8``): compiled by :mod:`maxtext_nvfp4.integration.aot_compile` for compile-only devices of XLA's target spec.
The NVFP4 backend is chosen for the target, not the host (``nvfp4_backend=auto`` on a CPU host compiling for
B200s picks Transformer Engine when it imports), and the start-up line says so. For a GPU target it ends with the
step's memory per device against the target's HBM, and exits 1 when the step does not fit. Also
``maxtext-nvfp4 train-compile``.

Bad input is one line and exit code 2, as for ``train``: no or unknown ``compile_topology``, a missing compiler
(XLA:GPU's plugin or libtpu; ``scripts/setup_targets.sh`` builds ``.venv-targets`` with both), an invalid key.
The host's hardware and the dataset are not checked: nothing runs.
"""

from __future__ import annotations

import sys

_USAGE = ("usage: python -m maxtext_nvfp4.train_compile RECIPE compile_topology=TOPOLOGY [key=value ...]\n"
          "  TOPOLOGY: MaxText's (v5e-4, v6e-8, ...) or <target>-<devices> with target among {targets} (b200-4)")


def _fail(message: str) -> int:
  print(f"maxtext-nvfp4 train-compile: error: {message}", file=sys.stderr, flush=True)
  return 2


def _gib(n: float) -> str:
  return f"{n / 2**30:.2f} GiB"


def summary(step) -> tuple[str, bool]:
  """The closing lines for a GPU target (memory per device against HBM, compile time) and whether it fits."""
  from maxtext_nvfp4.backends import targets  # pylint: disable=import-outside-toplevel

  m = step.compiled.memory_analysis()
  total = m.argument_size_in_bytes + m.output_size_in_bytes + m.temp_size_in_bytes - m.alias_size_in_bytes
  name = targets.parse_topology(step.topology)[0]
  hbm = targets.memory_bytes(name)
  fits = hbm is None or total <= hbm
  mesh = " x ".join(f"{k} {v}" for k, v in step.mesh.items() if v > 1) or "one device"
  lines = [f"maxtext-nvfp4: compiled the train step for {step.topology} ({mesh}) in {step.compile_s} s"
           f" (traced and lowered in {step.lower_s} s); NVFP4 backend: {step.backend or 'not nvfp4'}",
           f"  per device (XLA's plan, compile-derived): arguments {_gib(m.argument_size_in_bytes)}, outputs"
           f" {_gib(m.output_size_in_bytes)}, temporaries {_gib(m.temp_size_in_bytes)}, aliased"
           f" {_gib(m.alias_size_in_bytes)}: {_gib(total)}"
           + (f" of the {name}'s {_gib(hbm)} HBM" if hbm else "")]
  if not fits:
    lines.append(f"  does NOT fit: {_gib(total)} > {_gib(hbm)}; lower per_device_batch_size or max_target_length,"
                 " raise ici_fsdp_parallelism, or pick a remat_policy that saves less")
  return "\n".join(lines), fits


def cli_main(argv: list[str]) -> int:
  """``maxtext-nvfp4 train-compile RECIPE compile_topology=... [key=value ...]``; returns the exit code."""
  from maxtext_nvfp4.backends import targets  # pylint: disable=import-outside-toplevel
  from maxtext_nvfp4.tools import train  # pylint: disable=import-outside-toplevel

  args = list(argv)
  if not args or args[0] in ("-h", "--help"):
    print(_USAGE.format(targets=", ".join(targets.GPU_TARGETS)))
    return 0 if args else 2
  if args[0].startswith("-"):
    return _fail(f"unknown option {args[0]!r}; {_USAGE.splitlines()[0][7:]}")
  try:
    args, cfg = train.check_command_line(args, compile_only=True)
  except train._config_error_types() as e:  # pylint: disable=protected-access
    return _fail(" ".join(str(e).split()))
  topology = str(cfg.get("compile_topology", "") or "")
  if not topology:
    return _fail("compile_topology is not set; add compile_topology=<target>-<devices> (e.g. b200-4; targets: "
                 f"{', '.join(targets.GPU_TARGETS)}) or one of MaxText's TPU topologies (e.g. v5e-4)")
  ours = targets.parse_topology(topology)
  if ours is not None:
    problem = targets.unavailable_reason(ours[0]) or (
        f"compile_topology={topology} names {ours[1]} devices; a compile target needs at least 1" if ours[1] < 1 else None)
    if problem:
      return _fail(problem)
  import maxtext_nvfp4  # pylint: disable=import-outside-toplevel

  maxtext_nvfp4.register()
  args = train.with_default_tokenizer(args, cfg)
  if not any(a.startswith("compile_topology_num_slices=") for a in args) and int(
      cfg.get("compile_topology_num_slices", -1) or -1) <= 0:
    args = [*args, "compile_topology_num_slices=1"]
  if ours is None:
    return _maxtext_train_compile(args, topology)
  from maxtext_nvfp4.integration import aot_compile  # pylint: disable=import-outside-toplevel

  try:
    step = aot_compile.compile_train_step([None, *args])
  except (targets.TargetError, *train._config_error_types()) as e:  # pylint: disable=protected-access
    return _fail(" ".join(str(e).split()))
  text, fits = summary(step)
  print(text, flush=True)
  return 0 if fits else 1


def _maxtext_train_compile(args: list[str], topology: str) -> int:
  """MaxText's own ``train_compile.main`` (TPU topologies, ``a3``), the plugin registered."""
  from maxtext_nvfp4.integration import touchpoints  # pylint: disable=import-outside-toplevel
  from maxtext_nvfp4.tools import train  # pylint: disable=import-outside-toplevel

  from maxtext_nvfp4.integration import compile_target  # pylint: disable=import-outside-toplevel

  try:
    platform = compile_target.maxtext_platform(topology)
  except ValueError as e:
    return _fail(f"{' '.join(str(e).split())[:300]}; or use <target>-<devices> for a GPU target")
  if platform == "tpu":
    import importlib.util  # pylint: disable=import-outside-toplevel

    if importlib.util.find_spec("libtpu") is None:
      return _fail(f"compile_topology={topology} needs libtpu at jax's own pin (jax 0.12.0.1: pip install"
                   " 'libtpu==0.0.50.*'; scripts/setup_targets.sh builds .venv-targets with it)")
  import importlib  # pylint: disable=import-outside-toplevel

  from absl import app  # pylint: disable=import-outside-toplevel

  module = importlib.import_module(touchpoints.adapter().train_compile_module)

  def main(argv):
    try:
      module.main(argv)
    except train._config_error_types() as e:  # pylint: disable=protected-access
      print(train.config_error_line(e).replace("train:", "train-compile:", 1), file=sys.stderr, flush=True)
      sys.exit(2)

  try:
    app.run(main, argv=["maxtext_nvfp4.train_compile", *args])
  except SystemExit as e:
    return e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
  return 0


if __name__ == "__main__":
  sys.exit(cli_main(sys.argv[1:]))
