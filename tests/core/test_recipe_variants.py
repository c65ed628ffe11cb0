"""TE 2.20.2's NVFP4 recipe variants (4over6, E4M3 bound 256, row-scaled activations, backward overrides)
against an independent numpy reference (``variants_reference.py``, from TE's ``reference_nvfp4.py``), the GEMM
and the backward overrides against a direct composition of the quantizers, and the options seam
(derived pass signature, settings refusals). TE's own code is the oracle in tests/peers.

Inputs stay in fp32's normal range here (numpy keeps subnormals, XLA:CPU flushes them; see nvfp4's docstring).
"""

import dataclasses

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

import variants_reference as ref
from maxtext_nvfp4.core import gemm
from maxtext_nvfp4.core import nvfp4 as nv
from maxtext_nvfp4.core import recipe_options
from maxtext_nvfp4.core import settings


def _x(shape, seed=0, outliers=True):
  """bf16-grid fp32: normal rows at per-row scales over a few binades with some outliers, and (with
  ``outliers``) a flat top half, |x| in [0.5, 1] per 16-row band, where map-to-4 wins (so 4over6 picks both
  ways, also for 16x16 tiles)."""
  rng = np.random.default_rng(seed)
  x = rng.standard_normal(shape) * 2.0 ** rng.uniform(-3, 3, size=(shape[0], 1))
  if outliers:
    x.reshape(-1)[rng.integers(x.size, size=max(1, x.size // 64))] *= 8
    h = shape[0] // 32 * 16
    band = np.repeat(2.0 ** rng.uniform(-3, 3, size=(h // 16, 1)), 16, axis=0)
    x[:h] = np.sign(x[:h]) * rng.uniform(0.5, 1.0, size=(h, shape[1])) * band
  return np.asarray(x, np.float32).astype(ml_dtypes.bfloat16).astype(np.float32)


def _ours(t):
  """(q values, s8 per 1x16 row-block as TE stores it, amax) of an NVFP4Tensor of a 2D matrix, rowwise."""
  q = np.asarray(t.data.astype(jnp.float32))
  s = np.asarray(t.scale.astype(jnp.float32))
  if t.block_2d:
    s = np.repeat(s, 16, axis=0)
  return q, s, np.asarray(t.amax, np.float32).reshape(-1)


def _assert_same(got, want, what):
  (q, s, a), (rq, rs, ra) = got, want
  assert np.array_equal(q, rq), f"{what}: {int(np.sum(q != rq))} of {q.size} values differ"
  assert np.array_equal(s, rs), f"{what}: {int(np.sum(s != rs))} of {s.size} scales differ"
  assert np.array_equal(a.view(np.uint32), np.asarray(ra, np.float32).reshape(-1).view(np.uint32)), what


@pytest.mark.parametrize("tile,bound,err", [((1, 16), 256, "MAE"), ((1, 16), 448, "MSE"), ((16, 16), 256, "MSE"),
                                            ((16, 16), 448, "MAE")])
def test_4over6_equals_numpy_reference(tile, bound, err):
  x = _x((64, 128), seed=bound + len(err))
  rule = nv.ScaleRule(selection="4over6", e4m3_bound=bound, err_mode=err)
  t = nv.quantize(jnp.asarray(x, jnp.bfloat16), block_2d=tile == (16, 16), scale_rule=rule)
  picks = []
  want = ref.quantize(x, tile=tile, four_over_six=True, bound=bound, err_mode=err, picks=picks)
  _assert_same(_ours(t), want, f"4over6 {tile} {bound} {err}")
  assert t.e4m3_bound == bound
  # Both candidates are taken somewhere, else the selection would go untested.
  assert 0 < np.mean(picks[0]) < 1, f"4over6 picked one candidate everywhere ({np.mean(picks[0])})"


def test_4over6_2d_columnwise_copy_sums_the_error_along_axis_0():
  """TE's columnwise copy of a 16x16-tiled weight is the rowwise quantization of its transpose: ours with
  ``axis=0`` equals the reference on x.T, transposed back."""
  x = _x((48, 64), seed=3)
  rule = nv.ScaleRule(selection="4over6", e4m3_bound=256, err_mode="MSE")
  t = nv.quantize(jnp.asarray(x, jnp.bfloat16), block_2d=True, axis=0, scale_rule=rule)
  q, s, a = ref.quantize(x.T, tile=(16, 16), four_over_six=True, bound=256, err_mode="MSE")
  got_q = np.asarray(t.data.astype(jnp.float32)).T
  got_s = np.repeat(np.asarray(t.scale.astype(jnp.float32)).T, 16, axis=0)
  _assert_same((got_q, got_s, np.asarray(t.amax).reshape(-1)), (q, s, a), "2d columnwise")


@pytest.mark.parametrize("axis", [1, 0])
@pytest.mark.parametrize("four_over_six", [False, True])
def test_row_scaled_equals_numpy_reference(axis, four_over_six):
  """One amax per row of the quantized copy (axis 1: rows of x; axis 0: TE's columnwise copy, per column)."""
  x = _x((32, 64), seed=7)
  rule = nv.ScaleRule(row_scaled=True, selection="4over6" if four_over_six else "max",
                      e4m3_bound=256 if four_over_six else 448)
  t = nv.quantize(jnp.asarray(x, jnp.bfloat16), axis=axis, scale_rule=rule)
  xr = x if axis == 1 else x.T
  q, s, a = ref.quantize(xr, row_scaled=True, four_over_six=four_over_six, bound=rule.e4m3_bound)
  got_q = np.asarray(t.data.astype(jnp.float32))
  got_s = np.asarray(t.scale.astype(jnp.float32))
  if axis == 0:
    got_q, got_s = got_q.T, got_s.T
  _assert_same((got_q, got_s, np.asarray(t.amax).reshape(-1)), (q, s, a), f"row-scaled axis {axis}")
  assert t.amax.shape == ((32, 1) if axis == 1 else (1, 64))
  v, amax = nv.quantize_values(jnp.asarray(x, jnp.bfloat16), axis=axis, scale_rule=rule, dtype=jnp.float32)
  assert np.array_equal(np.asarray(v), np.asarray(nv.block_values(t, jnp.float32))) and amax.shape == t.amax.shape


def test_rules_te_refuses():
  with pytest.raises(ValueError, match="RHT"):
    nv.quantize(jnp.ones((16, 16)), axis=0, rht=True, scale_rule=nv.ScaleRule(selection="4over6"))
  with pytest.raises(ValueError, match="stochastic"):
    nv.quantize(jnp.ones((16, 16)), stochastic_key=jax.random.PRNGKey(0), scale_rule=nv.ScaleRule(selection="4over6"))
  with pytest.raises(ValueError, match="1x16"):
    nv.quantize(jnp.ones((16, 16)), block_2d=True, scale_rule=nv.ScaleRule(row_scaled=True))
  with pytest.raises(ValueError, match="4over6"):
    nv.ScaleRule(e4m3_bound=256)


def test_dequantize_kernel_order_is_te_cuda_formula():
  """``q * ((s8 * amax) * fl(1 / 6B))`` in fp32, then the cast (TE's CUDA dequantize), per tensor and per row."""
  x = _x((32, 64), seed=11)
  for rule in (nv.ScaleRule(selection="4over6", e4m3_bound=256), nv.ScaleRule(row_scaled=True)):
    t = nv.quantize(jnp.asarray(x, jnp.bfloat16), scale_rule=rule)
    q, s8, amax = ref.quantize(x, four_over_six=rule.selection == "4over6", bound=rule.e4m3_bound,
                               row_scaled=rule.row_scaled)
    inv = np.float32(1) / np.float32(6 * rule.e4m3_bound)
    a = amax.reshape(-1, 1) if rule.row_scaled else amax
    final = (np.repeat(s8, 16, axis=1) * a).astype(np.float32) * inv
    want = (q * final.astype(np.float32)).astype(np.float32)
    got = np.asarray(nv.dequantize_kernel_order(t, jnp.float32))
    assert np.array_equal(got, want), f"{rule}: {int(np.sum(got != want))} differ"


# ---------------------------------------------------------------------------------------------------
# The GEMM: against a direct composition of the reference quantizers
# ---------------------------------------------------------------------------------------------------
DN = (((1,), (0,)), ((), ()))


def _bf16_close(got, want):
  """|got - want| within one bf16 ulp of want (fp32 accumulation order and the final cast)."""
  got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
  ulp = np.ldexp(1.0, np.frexp(np.maximum(np.abs(want), 1e-30))[1] - 8)
  bad = np.abs(got - want) > ulp
  assert not bad.any(), f"{int(bad.sum())} of {bad.size} outside 1 bf16 ulp; max diff {np.max(np.abs(got - want))}"


def test_fprop_with_4over6_weights_and_row_scaled_x_is_the_composition():
  """y = sum_k (q s8)_x (q s8)_w * alpha, alpha[i] = fl(amax_x[i] fl(1/2688)) * fl(amax_w fl(1/1536)):
  x row-scaled (1x16 along K, bound 448), W 4over6 (16x16 tiles, error along K, bound 256)."""
  x, w = _x((32, 64), seed=1), _x((64, 48), seed=2) * np.float32(0.05)
  w = w.astype(ml_dtypes.bfloat16).astype(np.float32)
  r = gemm.GemmRecipe(four_over_six="weights", row_scaled_activation=True, stochastic_rounding=False)
  y = gemm.dot_general(jnp.asarray(x, jnp.bfloat16), jnp.asarray(w, jnp.bfloat16), DN, recipe=r,
                       preferred_element_type=jnp.float32)
  qx, sx, ax = ref.quantize(x, row_scaled=True)
  qw, sw, aw = ref.quantize(w.T, tile=(16, 16), four_over_six=True, bound=256)  # TE's (N, K) weight, rowwise
  vx = qx * np.repeat(sx, 16, axis=1)
  vw = (qw * np.repeat(sw, 16, axis=1)).T
  alpha = (ax.reshape(-1, 1) * (np.float32(1) / np.float32(2688))).astype(np.float32) * (
      aw * (np.float32(1) / np.float32(1536))).astype(np.float32)
  acc = vx.astype(np.float64) @ vw.astype(np.float64)  # exact products; ours sums them in fp32
  want = acc.astype(np.float32) * alpha.astype(np.float32)
  scale = (np.abs(vx).astype(np.float64) @ np.abs(vw).astype(np.float64)) * alpha  # fp32 summation error bound
  assert np.all(np.abs(np.asarray(y, np.float64) - want) <= 64 * 2.0**-24 * scale + 1e-30)
  # and the row scaling matters: with one tensor amax the result would differ
  assert not np.allclose(np.asarray(y), (acc * (np.float32(ax.max()) / np.float32(2688)) * aw / 1536), rtol=1e-3)


@pytest.mark.parametrize("override", ["high_precision", "dequantized"])
def test_backward_overrides_are_the_composition(override):
  """dx = dy · B(W)ᵀ, dW = B(x)ᵀ · dy with dy unquantized: B the identity (high_precision) or TE's CUDA
  dequantize of the fprop's quantization (dequantized), in the activation dtype."""
  x, w = _x((32, 64), seed=4), (_x((64, 48), seed=5) * np.float32(0.05))
  w = w.astype(ml_dtypes.bfloat16).astype(np.float32)
  dy = _x((32, 48), seed=6, outliers=False) * np.float32(1e-3)
  dy = dy.astype(ml_dtypes.bfloat16).astype(np.float32)
  r = gemm.GemmRecipe(backward_override=override, four_over_six="weights")
  assert r.precision("dgrad") == r.precision("wgrad") == ("bf16" if override == "high_precision" else "dequantized")
  assert not r.needs_key()
  xb, wb, dyb = (jnp.asarray(v, jnp.bfloat16) for v in (x, w, dy))
  _, vjp = jax.vjp(lambda a, b: gemm.dot_general(a, b, DN, recipe=r), xb, wb)
  dx, dw = vjp(dyb)
  if override == "high_precision":
    bx, bw = x, w
  else:
    q, s, a = ref.quantize(x)
    bx = (q * ((np.repeat(s, 16, 1) * a) * (np.float32(1) / np.float32(2688)))).astype(ml_dtypes.bfloat16)
    q, s, a = ref.quantize(w.T, tile=(16, 16), four_over_six=True, bound=256)
    bw = (q * ((np.repeat(s, 16, 1) * a) * (np.float32(1) / np.float32(1536)))).T.astype(ml_dtypes.bfloat16)
    bx, bw = bx.astype(np.float32), bw.astype(np.float32)
  _bf16_close(np.asarray(dx, np.float32), (dy.astype(np.float64) @ bw.T.astype(np.float64)).astype(np.float32))
  _bf16_close(np.asarray(dw, np.float32), (bx.T.astype(np.float64) @ dy.astype(np.float64)).astype(np.float32))


def test_4over6_2d_weights_fprop_and_dgrad_use_their_own_copies():
  """With 4over6 16x16 weights the dgrad multiplies TE's columnwise copy of W (its tiles' error summed along
  N, the rowwise quantization of W (K, N)): dx equals the composition with that copy."""
  x, w = _x((32, 64), seed=8), (_x((64, 48), seed=9) * np.float32(0.05))
  w = w.astype(ml_dtypes.bfloat16).astype(np.float32)
  dy = (_x((32, 48), seed=10, outliers=False) * np.float32(1e-3)).astype(ml_dtypes.bfloat16).astype(np.float32)
  r = gemm.GemmRecipe(four_over_six="weights", four_over_six_err_mode="MSE", stochastic_rounding=False)
  _, vjp = jax.vjp(lambda a, b: gemm.dot_general(a, b, DN, recipe=r),
                   jnp.asarray(x, jnp.bfloat16), jnp.asarray(w, jnp.bfloat16))
  dx, _ = vjp(jnp.asarray(dy, jnp.bfloat16))
  q, s, a = ref.quantize(w, tile=(16, 16), four_over_six=True, bound=256, err_mode="MSE")  # columnwise: W (K, N) rows
  qd, sd, ad = ref.quantize(dy)
  alpha = (ad * (np.float32(1) / np.float32(2688))).astype(np.float32) * (a * (np.float32(1) / np.float32(1536))).astype(np.float32)
  want = ((qd * np.repeat(sd, 16, 1)).astype(np.float64) @ (q * np.repeat(s, 16, 1)).T.astype(np.float64))
  _bf16_close(np.asarray(dx, np.float32), (want.astype(np.float32) * alpha).astype(np.float32))


# ---------------------------------------------------------------------------------------------------
# The options seam
# ---------------------------------------------------------------------------------------------------
# A non-default value for every option (alone valid with the other defaults).
_OTHER = {"rht": False, "stochastic_rounding": False, "two_d_weights": False, "four_over_six": "weights",
          "four_over_six_e4m3_use_256": "none", "four_over_six_err_mode": "MSE", "row_scaled_activation": True,
          "backward_override": "dequantized"}


def test_every_option_is_in_the_pass_signature():
  """Changing any RecipeOptions field changes the signature of some pass, so the late switch's lax.cond
  cannot treat two recipes that differ in it as one (the signature is derived from the fields)."""
  assert set(_OTHER) == {f.name for f in recipe_options.option_fields()}, "give the new option a value here"
  base = gemm.GemmRecipe(four_over_six="weights")  # so the 4over6 bound/err-mode options matter
  for name, v in _OTHER.items():
    other = dataclasses.replace(base if name.startswith("four_over_six_") else gemm.GemmRecipe(), **{name: v})
    orig = base if name.startswith("four_over_six_") else gemm.GemmRecipe()
    assert any(other._pass_signature(p) != orig._pass_signature(p) for p in ("fprop", "dgrad", "wgrad")), name
    static = gemm._Static(recipe=orig, switched=other, out_dtype=jnp.bfloat16, x_dtype=jnp.bfloat16,
                          w_dtype=jnp.bfloat16, k=16)
    assert not all(static.uniform(p) for p in ("fprop", "dgrad", "wgrad")), name


def test_settings_and_gemm_recipe_share_the_options():
  s = settings.Nvfp4Settings(**_OTHER | {"four_over_six": "all"})
  assert isinstance(s, recipe_options.RecipeOptions) and issubclass(gemm.GemmRecipe, recipe_options.RecipeOptions)
  keys = settings.config_keys()
  for f in recipe_options.option_fields():
    assert f.metadata["key"] in keys and settings.field_of_key(f.metadata["key"]) == f.name
  assert keys["nvfp4_4over6"] == "none" and keys["nvfp4_backward_override"] == "none"


@pytest.mark.parametrize("kw,match", [
    (dict(four_over_six="activations"), "nvfp4_4over6=activations with nvfp4_rht=true.*set nvfp4_rht=false"),
    (dict(four_over_six="all"), "nvfp4_4over6=all with nvfp4_rht=true"),
    (dict(four_over_six="biases"), "nvfp4_4over6='biases' is not allowed; choose one of: none, weights"),
    (dict(four_over_six_err_mode="mae"), "nvfp4_4over6_err_mode='mae' is not allowed; choose one of: MAE, MSE"),
    (dict(backward_override="fp8"), "nvfp4_backward_override='fp8' is not allowed"),
])
def test_settings_refusals_are_one_line(kw, match):
  with pytest.raises(settings.SettingsError, match=match) as e:
    settings.validate(settings.Nvfp4Settings(**kw))
  assert "\n" not in str(e.value)
  if kw.get("four_over_six") in ("all", "activations"):  # the fix the message names is accepted
    settings.validate(settings.Nvfp4Settings(**kw, rht=False))


def test_tensor_scopes_follow_te_make_quantizers():
  o = recipe_options.RecipeOptions(four_over_six="weights", four_over_six_e4m3_use_256="activations")
  assert o.uses_4over6("weight") and not o.uses_4over6("activation") and not o.uses_4over6("gradient")
  assert o.e4m3_bound("weight") == 448 and o.e4m3_bound("activation") == 448  # 256 only for 4over6 tensors
  o = recipe_options.RecipeOptions(four_over_six="all", rht=False)
  assert o.e4m3_bound("weight") == o.e4m3_bound("activation") == 256 and o.e4m3_bound("gradient") == 448
  assert recipe_options.RecipeOptions(row_scaled_activation=True).row_scaled("activation")
  assert not recipe_options.RecipeOptions(row_scaled_activation=True).row_scaled("weight")
