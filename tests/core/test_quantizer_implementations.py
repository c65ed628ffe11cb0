"""The shared bitwise suite every implementation of the quantizer runs, and the dispatch between them.

Every implementation (``implementation=`` of ``core/quantizer/api.py``) against TE's golden vectors and the
independent numpy reference (``nvfp4_reference.py``), bit for bit: round to nearest on every input kind,
stochastic rounding given the same random bytes, fp32 operands. "triton" runs the Pallas kernels; on this CPU
the api takes them through Pallas's interpreter with the flush-to-zero-safe forms (on XLA:GPU the plain forms,
pinned to these by ``test_nvfp4_gpu_paths.py``). "mosaic_tpu" runs the Mosaic TPU kernels' bodies through the
interpreter, on XLA:CPU's arithmetic, which flushes fp32 subnormals as a TPU's does (its subnormal and tiny input
kinds are the flush-to-zero check; that Mosaic compiles the kernels for a TPU is ``test_tpu_kernels_compile.py``'s
job). A call an implementation does not compute must refuse when forced: :data:`COMPUTES` says which calls each
computes, so a lost (or a new) kernel fails here.

The dispatch: the forced path is the one that runs, the environment variable for a whole run, the argument
over the variable, the one-line errors, and the one log line per run and reason when a call leaves the kernels.
"""

from __future__ import annotations

import json
import logging

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from maxtext_nvfp4.core import compilers as compilers_lib
from maxtext_nvfp4.core import nvfp4 as nv
from maxtext_nvfp4.core.quantizer import api, pallas_mosaic_tpu, random_bits
from nvfp4_reference import (  # the independent oracle and its inputs (tests/core/nvfp4_reference.py)
    KINDS, MODE_KW, MODES, assert_bits_equal, golden_case_names, golden_mode, input_for, load_golden, make_input,
    quantize_ref, rht_ref, values_ref)

IMPLEMENTATIONS = nv.IMPLEMENTATIONS
# The calls each implementation computes, per mode: quantize (TE's byte layout) and quantize_values.
COMPUTES = {
    "xla": {"quantize": set(MODES), "values": set(MODES)},
    "triton": {"quantize": {"row", "2d", "rht_col"}, "values": {"row", "rht_col"}},
    "mosaic_tpu": {"quantize": set(MODES), "values": set(MODES)},
}


def test_implementations_are_the_ones_the_suite_covers():
  assert set(IMPLEMENTATIONS) == set(COMPUTES)


def _run(impl, what, mode, fn):
  """``fn()`` when ``impl`` computes this call; else checks that the forced call refuses, and returns None."""
  if mode in COMPUTES[impl][what]:
    return fn()
  with pytest.raises(nv.ImplementationUnavailableError, match=f"implementation='{impl}' cannot quantize") as e:
    fn()
  assert "\n" not in str(e.value)
  return None


def _check(impl, xb, mode, q, s8, amax, what, key=None):
  """quantize and quantize_values of the array ``xb`` under ``impl`` against (q, s8, amax) (the values: q * s8)."""
  t = _run(impl, "quantize", mode,
           lambda: nv.quantize(xb, **MODE_KW[mode], stochastic_key=key, implementation=impl))
  if t is not None:
    d = nv.as_numpy(t)
    assert_bits_equal(d["data"], q, f"{what} q")
    assert_bits_equal(d["scale"], s8, f"{what} scale")
    assert_bits_equal(np.float32(d["amax"]).reshape(1), np.float32(amax).reshape(1), f"{what} amax")
  values = _run(impl, "values", mode,
                lambda: nv.quantize_values(xb, **MODE_KW[mode], stochastic_key=key, implementation=impl))
  if values is not None:
    v, got_amax = values
    assert_bits_equal(np.asarray(v, np.float32), values_ref(q, s8, mode), f"{what} values")
    assert_bits_equal(np.float32(got_amax).reshape(1), np.float32(amax).reshape(1), f"{what} values' amax")
  return t


# ================================================================================================
# TE's golden vectors
# ================================================================================================
@pytest.fixture(scope="module")
def golden():
  return load_golden()


def test_golden_file_present(golden):
  z, idx = golden
  assert json.loads(str(z["__index_json__"]))["te_commit"].startswith("d0067d0")
  assert len(idx) == 22 and all(f"{n}_q" in z for n in idx)
  assert {golden_mode(c) for c in idx.values()} == set(MODES)


@pytest.mark.parametrize("name", golden_case_names() or ["<golden file missing>"])
def test_reference_reproduces_the_golden_vectors(golden, name):
  """The independent reference reproduces TE's golden vectors (validates the oracle itself), and so does the
  RHT alone (the reference's and the quantizer's)."""
  z, idx = golden
  c = idx[name]
  q, s8, _ = quantize_ref(z[name + "_x"], golden_mode(c))
  assert_bits_equal(q, z[name + "_q"], f"{name} reference q")
  assert_bits_equal(s8, z[name + "_scale"], f"{name} reference scale")
  if c["rht"]:
    assert_bits_equal(rht_ref(z[name + "_x"], 0), z[name + "_xrht"], f"{name} reference rht")
    x = jnp.asarray(z[name + "_x"]).astype(jnp.bfloat16)
    assert_bits_equal(nv.rht(x, axis=0), z[name + "_xrht"], f"{name} rht vs _xrht")


# Pallas's interpreter compiles each shape of "mosaic_tpu" anew (seconds on a 2-core host): its golden cases are
# the ones of the input kinds' shape (64x128, one compile per mode for the whole file); its many-tile cases are
# the stochastic-rounding test's (small tiles, below).
_MOSAIC_SHAPES = ("64x128",)
_GOLDEN_RUNS = [(impl, name) for impl in IMPLEMENTATIONS for name in golden_case_names() or ["<golden file missing>"]
                if impl != "mosaic_tpu" or name.endswith(_MOSAIC_SHAPES)]


@pytest.mark.parametrize("impl, name", _GOLDEN_RUNS, ids=[f"{i}-{n}" for i, n in _GOLDEN_RUNS])
def test_golden_vectors(golden, impl, name):
  z, idx = golden
  mode = golden_mode(idx[name])
  x = jnp.asarray(z[name + "_x"]).astype(jnp.bfloat16)
  t = _check(impl, x, mode, z[name + "_q"], z[name + "_scale"], z[name + "_amax"], f"{impl} {name}")
  if t is not None:
    assert_bits_equal(nv.dequantize(t), z[name + "_deq_jaxte"], f"{impl} {name} dequantize vs _deq_jaxte")


# ================================================================================================
# The independent reference
# ================================================================================================
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("impl", IMPLEMENTATIONS)
def test_reference_on_every_input_kind(impl, kind, mode):
  x = input_for(kind, mode)
  _check(impl, jnp.asarray(x, jnp.bfloat16), mode, *quantize_ref(x, mode), f"{impl} {kind}/{mode}")


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("impl", IMPLEMENTATIONS)
def test_reference_stochastic_rounding(impl, mode, monkeypatch):
  """SR given the same random bytes (``random_bits``: the reference takes them as its fractions): every input
  kind side by side. Forced "triton": SR in quantize's 16x16 tiles refuses (the tile kernel rounds to nearest;
  the rows and RHT codes kernels take SR). "mosaic_tpu" with small tiles: a 7x4 grid, each tile's elements at
  their global positions."""
  if impl == "mosaic_tpu":
    for table in ("_ROWS_TILE", "_COLS_TILE", "_TILES_TILE"):
      monkeypatch.setattr(pallas_mosaic_tpu, table, ((64,), (32,)))
  kinds = ("normal", "wide_tile", "zero_blocks", "tiny_clamped", "subnormal", "huge", "ties")
  x = np.concatenate([input_for(k, mode) for k in kinds], 0)
  key = jax.random.key(5)
  u = np.asarray(random_bits.random_bytes(key, x.shape)).astype(np.float64) / 256
  q, s8, amax = quantize_ref(x, mode, u=u)
  assert not np.array_equal(q, quantize_ref(x, mode)[0])  # SR moved some elements off the RNE result
  xb = jnp.asarray(x, jnp.bfloat16)
  if impl == "triton" and mode == "2d":
    with pytest.raises(nv.ImplementationUnavailableError, match="stochastic rounding"):
      nv.quantize(xb, **MODE_KW[mode], stochastic_key=key, implementation=impl)
    values = _run(impl, "values", mode, lambda: nv.quantize_values(xb, **MODE_KW[mode], stochastic_key=key,
                                                                   implementation=impl))
    if values is not None:
      assert_bits_equal(np.asarray(values[0], np.float32), values_ref(q, s8, mode), f"{impl} {mode} SR values")
      assert_bits_equal(np.float32(values[1]).reshape(1), np.float32(amax).reshape(1), f"{impl} {mode} SR amax")
    return
  _check(impl, xb, mode, q, s8, amax, f"{impl} {mode} SR", key=key)


# fp32 operands reach the kernels' arithmetic as bf16 ones do (widened by bits): "mosaic_tpu" runs one layout
# without the RHT and the RHT's own (exact sums at every scale).
_FP32_RUNS = [(impl, mode) for impl in IMPLEMENTATIONS for mode in MODES
              if impl != "mosaic_tpu" or mode in ("row", "rht_col")]


@pytest.mark.parametrize("impl, mode", _FP32_RUNS, ids=[f"{i}-{m}" for i, m in _FP32_RUNS])
def test_reference_on_fp32_operands(impl, mode):
  """fp32 operands used as given (values off the bf16 grid): rows from 1e-20 to 1e20; for the RHT, 11-bit
  integers at a power-of-two scale per group (their 16-term sums are exact: the sum order does not matter)."""
  rng = np.random.default_rng(17)
  if mode == "rht_col":
    scale = np.exp2(rng.integers(-40, 40, (4, 1, 128))).astype(np.float32)
    x = (rng.integers(-1024, 1025, (4, 16, 128)) * scale).astype(np.float32).reshape(64, 128)
  else:
    x = (rng.standard_normal((64, 128)) * 10.0 ** rng.integers(-20, 20, (64, 1))).astype(np.float32)
  assert not np.array_equal(x, np.asarray(jnp.asarray(x, jnp.bfloat16), np.float32))
  _check(impl, jnp.asarray(x), mode, *quantize_ref(x, mode), f"{impl} fp32/{mode}")


# ================================================================================================
# The dispatch
# ================================================================================================
_X = jnp.asarray(make_input("normal", (32, 64), 3), jnp.bfloat16)


def _cpu_program(fn):
  return jax.jit(fn).lower(_X).as_text()


@pytest.fixture
def compilers(monkeypatch):
  """``compilers(*platforms)``: this process as if exactly these kernel compilers ("cuda": XLA:GPU's plugin,
  "tpu": libtpu) were installed; the automatic dispatch traces their kernels' branches."""

  def install(*platforms):
    monkeypatch.setattr(compilers_lib, "installed", lambda: frozenset(platforms))
    jax.clear_caches()  # the quantizer's inner jit keeps the traces made under the previous environment

  yield install
  jax.clear_caches()


def test_the_forced_implementation_is_the_one_that_runs(compilers):
  """On this CPU: "triton" lowers the interpreted kernels (a loop over the grid), "xla" and the automatic
  choice the XLA form (no loop, no kernel); the jaxpr of "xla" holds no kernel at all, the automatic one, with
  XLA:GPU's compiler installed, holds the kernels for XLA:GPU."""
  compilers("cuda")
  programs = {impl: _cpu_program(lambda x, impl=impl: nv.quantize_values(x, implementation=impl))
              for impl in (None, "xla", "triton")}
  assert "stablehlo.while" in programs["triton"]
  assert "stablehlo.while" not in programs["xla"] and "stablehlo.while" not in programs[None]
  jaxprs = {impl: str(jax.make_jaxpr(lambda x, impl=impl: nv.quantize_values(x, implementation=impl))(_X))
            for impl in (None, "xla")}
  assert "pallas_call" not in jaxprs["xla"] and "pallas_call" in jaxprs[None]


def test_the_environment_variable_chooses_for_a_whole_run_and_the_argument_overrides_it(monkeypatch, compilers):
  compilers("cuda")
  monkeypatch.setenv(nv.IMPLEMENTATION_ENV, "triton")
  assert "stablehlo.while" in _cpu_program(lambda x: nv.quantize_values(x))
  assert "stablehlo.while" not in _cpu_program(lambda x: nv.quantize_values(x, implementation="xla"))
  with pytest.raises(nv.ImplementationUnavailableError,
                     match=f"{nv.IMPLEMENTATION_ENV}=triton cannot quantize this call: quantize in 1x16 blocks "
                           "along an axis other than the last without RHT; unset it or set it to auto"):
    nv.quantize(_X, axis=0)
  monkeypatch.setenv(nv.IMPLEMENTATION_ENV, "xla")
  assert "pallas_call" not in str(jax.make_jaxpr(lambda x: nv.quantize_values(x))(_X))
  monkeypatch.setenv(nv.IMPLEMENTATION_ENV, "auto")
  assert "pallas_call" in str(jax.make_jaxpr(lambda x: nv.quantize_values(x))(_X))
  monkeypatch.setenv(nv.IMPLEMENTATION_ENV, "cuda")
  with pytest.raises(ValueError,
                     match=rf"{nv.IMPLEMENTATION_ENV}='cuda': choose one of \('auto', 'xla', 'triton', 'mosaic_tpu'\)"):
    nv.quantize(_X)


def test_bad_or_impossible_requests_are_one_line_errors():
  with pytest.raises(ValueError,
                     match=r"implementation='pallas': choose one of \('xla', 'triton', 'mosaic_tpu'\), or None"):
    nv.quantize_values(_X, implementation="pallas")
  cases = {
      "a scale rule other than TE's standard one": dict(scale_rule=nv.ScaleRule(row_scaled=True)),
      "1x16 blocks along an axis other than the last without RHT": dict(axis=0),
      "a float16 operand": dict(dtype=jnp.float16),
  }
  for reason, kw in cases.items():
    x = _X.astype(kw.pop("dtype", jnp.bfloat16))
    with pytest.raises(nv.ImplementationUnavailableError) as e:
      nv.quantize_values(x, implementation="triton", **kw)
    assert reason in str(e.value) and "\n" not in str(e.value), str(e.value)
  x4 = _X.reshape(2, 2, 8, 64)
  with pytest.raises(nv.ImplementationUnavailableError, match="a second vmap"):
    jax.vmap(jax.vmap(lambda a: nv.quantize_values(a, implementation="triton")))(x4)
  got = jax.vmap(lambda a: nv.quantize_values(a, implementation="triton"))(x4[0])  # one vmap: the batched kernel
  want = jax.vmap(lambda a: nv.quantize_values(a, implementation="xla"))(x4[0])
  assert_bits_equal(np.asarray(got[0], np.float32), np.asarray(want[0], np.float32), "one vmap, triton vs xla")


@pytest.fixture
def fallback_log(monkeypatch, caplog):
  """The log lines of calls that leave the kernels, with the once-per-run memory emptied for this test."""
  monkeypatch.setattr(api, "_logged", set())
  monkeypatch.delenv(nv.IMPLEMENTATION_ENV, raising=False)
  caplog.set_level(logging.INFO, logger="maxtext_nvfp4")
  return lambda: [r.getMessage() for r in caplog.records if r.name == "maxtext_nvfp4"]


# The line comes from the call's trace: the log tests use shapes no other test traces (a cached program logs
# nothing).
_Y = jnp.asarray(make_input("normal", (48, 336), 4), jnp.bfloat16)


def test_a_call_that_leaves_the_kernels_logs_one_line_per_run_and_reason(fallback_log):
  nv.quantize_values(_Y)
  nv.quantize_values(_Y * 2)
  jax.jit(lambda x: nv.quantize_values(x, axis=0, rht=True))(_Y)  # another call with a kernel, the same reason
  lines = fallback_log()
  assert len(lines) == 1, lines
  assert "the XLA form, not the Pallas Triton kernels, for every call: the default device is cpu" in lines[0]
  nv.quantize(_Y, scale_rule=nv.ScaleRule(selection="4over6"))
  nv.quantize(_Y, block_2d=True, scale_rule=nv.ScaleRule(selection="4over6"))
  nv.quantize_values(_Y, implementation="xla", scale_rule=nv.ScaleRule(selection="4over6"))  # forced: no line
  lines = fallback_log()
  assert len(lines) == 2 and "a scale rule other than TE's standard one" in lines[1], lines


def _primitive_names(jaxpr) -> set[str]:
  names = set()
  for eqn in jaxpr.eqns:
    names.add(eqn.primitive.name)
    for p in eqn.params.values():
      for j in p if isinstance(p, (tuple, list)) else (p,):
        inner = getattr(j, "jaxpr", None)
        if inner is not None and hasattr(inner, "eqns"):
          names |= _primitive_names(inner)
  return names


def test_automatic_dispatch_traces_the_kernels_of_installed_compilers_only(monkeypatch, compilers):
  """Without XLA:GPU's plugin or libtpu (and a CPU as the default device) no program traced here can run the
  Pallas kernels: the automatic choice is the XLA form with no kernel branch (tracing the kernels costs seconds
  per model). With a compiler installed, its kernels' branch is traced beside the XLA form."""
  f = lambda a: nv.quantize_values(a, axis=0, rht=True)  # noqa: E731  (Triton and Mosaic both take this call)

  def traced(*installed):
    compilers(*installed)
    return jax.make_jaxpr(f)(_Y)

  bare = traced()
  assert "pallas_call" not in _primitive_names(bare.jaxpr), bare
  assert "reduce_max" in _primitive_names(bare.jaxpr)  # sanity: the quantizer's own program (its amax)
  for installed, kernels in ((("cuda",), 1), (("tpu",), 1), (("cuda", "tpu"), 2)):
    jaxpr = traced(*installed)
    assert "pallas_call" in _primitive_names(jaxpr.jaxpr), installed
    assert str(jaxpr).count("pallas_call") >= kernels, installed
  # the default device's own platform counts as installed (a GPU or TPU process always has its compiler)
  monkeypatch.setattr(api, "_default_platform", lambda: "gpu")
  on_gpu = traced()
  assert api._compilable_kernel_platforms(api._default_platform()) == {"cuda"} and "pallas_call" in _primitive_names(on_gpu.jaxpr)


def test_on_a_gpu_a_second_vmap_logs_its_line(fallback_log, monkeypatch):
  """With a GPU as the default device (the platform the line reports), the kernels' vmap rule says why a
  second vmap takes the XLA form; one vmap takes the batched kernel, silently."""
  monkeypatch.setattr(api, "_default_platform", lambda: "gpu")
  x4 = _Y.reshape(2, 2, 12, 336)
  jax.make_jaxpr(jax.vmap(lambda a: nv.quantize_values(a)))(x4[0])
  assert fallback_log() == []
  jax.make_jaxpr(jax.vmap(jax.vmap(lambda a: nv.quantize_values(a))))(x4)
  lines = fallback_log()
  assert len(lines) == 1 and "a second vmap" in lines[0] and nv.IMPLEMENTATION_ENV in lines[0], lines


def _tpu_program(fn, x):
  """The StableHLO of ``fn(x)`` lowered for a TPU (no TPU needed: Mosaic kernels lower to a custom call)."""
  return jax.jit(fn).trace(x).lower(lowering_platforms=("tpu",)).as_text()


def test_on_a_tpu_the_automatic_choice_is_the_mosaic_kernels(fallback_log, monkeypatch):
  """Lowered for a TPU with a TPU as the default device: every call of TE's standard rule runs the Mosaic kernels
  (one custom call each, two with the RHT's amax kernel), silently; a call they do not compute takes the XLA form
  with one log line naming them and the reason; a second vmap logs its own line."""
  monkeypatch.setattr(api, "_default_platform", lambda: "tpu")
  x = jnp.asarray(make_input("normal", (48, 352), 6), jnp.bfloat16)  # a shape no other test traces
  key = jax.random.key(1)
  calls = {
      "values 1x16": (lambda a: nv.quantize_values(a, stochastic_key=key), 1),
      "codes 16x16": (lambda a: nv.quantize(a, block_2d=True), 1),
      "codes RHT SR": (lambda a: nv.quantize(a, axis=0, rht=True, stochastic_key=key), 2),
  }
  for what, (fn, kernels) in calls.items():
    assert _tpu_program(fn, x).count("@tpu_custom_call") == kernels, what
  assert fallback_log() == []
  text = _tpu_program(lambda a: nv.quantize(a, scale_rule=nv.ScaleRule(selection="4over6")), x)
  assert "tpu_custom_call" not in text
  lines = fallback_log()
  assert len(lines) == 1 and "the XLA form, not the Pallas Mosaic TPU kernels, for a scale rule other than" in lines[0]
  assert f"{nv.IMPLEMENTATION_ENV}=xla or =mosaic_tpu chooses" in lines[0], lines
  jax.make_jaxpr(jax.vmap(jax.vmap(lambda a: nv.quantize_values(a))))(x.reshape(2, 2, 12, 352))
  lines = fallback_log()
  assert len(lines) == 2 and "a second vmap" in lines[1] and "Mosaic" in lines[1], lines


def test_mosaic_kernels_under_one_vmap_and_their_refusals():
  """One vmap (MoE's experts): one kernel over the batch, each slice with its own amax and SR key, the XLA form's
  bits; the calls the kernels do not compute are one-line errors when forced."""
  rng = np.random.default_rng(8)
  xb = jnp.asarray(rng.standard_normal((3, 32, 64)) * np.exp2(rng.integers(-30, 30, (3, 1, 1))), jnp.bfloat16)
  keys = jax.random.split(jax.random.key(4), 3)
  run = lambda impl: jax.vmap(lambda a, k: nv.quantize_values(a, stochastic_key=k, implementation=impl))  # noqa: E731
  got, want = run("mosaic_tpu")(xb, keys), run("xla")(xb, keys)
  assert_bits_equal(np.asarray(got[0], np.float32), np.asarray(want[0], np.float32), "one vmap, mosaic_tpu vs xla")
  assert_bits_equal(np.asarray(got[1]), np.asarray(want[1]), "one vmap, amax per slice")
  codes = jax.vmap(lambda a: nv.quantize(a, axis=0, rht=True, implementation="mosaic_tpu"))(xb)
  for i in range(3):
    one = nv.quantize(xb[i], axis=0, rht=True, implementation="xla")
    assert_bits_equal(np.asarray(nv.pack(codes.data[i])), np.asarray(nv.pack(one.data)), f"batched codes {i}")
    assert_bits_equal(np.asarray(codes.scale[i], np.float32), np.asarray(one.scale, np.float32), f"scales {i}")
  cases = {
      "a float16 operand": (xb[0].astype(jnp.float16), {}),
      "1x16 blocks along an axis other than the last (or axis 0 of a 2D operand)": (xb, dict(axis=1)),
      "RHT along an axis other than axis 0 of a 2D operand": (xb[0], dict(axis=1, rht=True)),
      "that does not tile": (jnp.ones((16, 16 * 257), jnp.bfloat16), {}),  # 257 blocks: no tile divides them
  }
  for reason, (x, kw) in cases.items():
    with pytest.raises(nv.ImplementationUnavailableError, match="implementation='mosaic_tpu' cannot quantize") as e:
      nv.quantize_values(x, implementation="mosaic_tpu", **kw)
    assert reason in str(e.value) and "\n" not in str(e.value), str(e.value)



def test_block_values_on_a_tpu_are_the_same_products():
  """``block_values``' TPU form (the data as (K/16, 16, N), the scales broadcast along sublanes) against the
  repeat form every other platform runs, bit for bit: 16x16 tiles and 1x16 blocks along axis 0, with RHT, on
  the subnormal input kind; 1x16 blocks along the last axis keep the repeat form."""
  from maxtext_nvfp4.core.quantizer import tensor  # pylint: disable=import-outside-toplevel

  x = jnp.asarray(input_for("subnormal", "2d"), jnp.bfloat16)  # 64x128, the every-kind tests' (compiled) call
  for kw in (dict(block_2d=True), dict(axis=0), dict(axis=0, rht=True)):
    t = nv.quantize(x, implementation="xla", **kw)
    want = np.asarray(tensor._block_values_repeat(t, jnp.bfloat16), np.float32)  # pylint: disable=protected-access
    got = np.asarray(tensor._block_values_blocked(t, jnp.bfloat16), np.float32)  # pylint: disable=protected-access
    assert_bits_equal(got, want, f"block_values {kw}")
  assert tensor._blocked_view(nv.quantize(x, implementation="xla")) is None  # pylint: disable=protected-access
  text = jax.jit(lambda t: nv.block_values(t)).trace(nv.quantize(x, block_2d=True)).lower(
      lowering_platforms=("tpu",)).as_text()
  # x (64, 128): the data as (4, 16, 128) blocks of rows; no (64, 8, 16) lane-blocked scales (the repeat form's)
  assert "stablehlo.multiply" in text and "tensor<4x16x128xf32>" in text and "64x8x16" not in text
