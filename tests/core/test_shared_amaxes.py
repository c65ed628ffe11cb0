"""One amax pass for both of an operand's quantizations (issue 51): ``nvfp4.amaxes(x)`` -- max |x| and max |RHT(x)|
along axis 0 from one read of x, TE's ``nvte_hadamard_transform_amax`` -- equals the XLA form, numpy's max and the
quantizer's own RHT amax bit for bit; ``quantize`` / ``quantize_values`` given them give the bits they compute
alone (the RHT kernels then take their block maxima from their own tiles), and a wrong amax changes them; ``gemm``
uses the pass for dy when its GEMM reads codes, with the same gradients. CPU, Pallas's interpreter."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from maxtext_nvfp4.core import gemm
from maxtext_nvfp4.core import gemm_kernels
from maxtext_nvfp4.core import nvfp4 as nv
from maxtext_nvfp4.core.quantizer import api
from maxtext_nvfp4.core.quantizer import xla as xla_form


def _operand(shape, seed, dtype=jnp.bfloat16):
  rng = np.random.default_rng(seed)
  x = rng.standard_normal(shape) * np.exp(rng.uniform(-3, 3, shape))
  x[0, :5] = [0.0, -0.0, 3.0e4, -448.0, 2.0**-20]
  x[16:32, 2] = 1e-33  # a group of subnormal-size values (tiny: the RHT at 2**64 scale)
  return jnp.asarray(x, dtype)


def _bits(a):
  a = np.asarray(a)
  return a.view({1: np.uint8, 2: np.uint16, 4: np.uint32}[a.dtype.itemsize])


def _same(t0, t1):
  for f in ("data", "scale", "amax"):
    np.testing.assert_array_equal(_bits(getattr(t0, f)), _bits(getattr(t1, f)), err_msg=f)


_INPUTS = {
    "bf16": lambda: _operand((64, 48), 0),
    "fp32": lambda: _operand((64, 48), 1, jnp.float32),
    "nan": lambda: _operand((64, 48), 2).at[37, 5].set(jnp.nan),
    "inf": lambda: _operand((64, 48), 3).at[3, 40].set(-jnp.inf),
    "zeros": lambda: jnp.zeros((32, 16), jnp.bfloat16),
}


@pytest.mark.parametrize("name", sorted(_INPUTS))
def test_amaxes_kernel_equals_the_xla_form_numpy_and_the_quantizers_rht_amax(name):
  x = _INPUTS[name]()
  got = nv.amaxes(x, implementation="triton")
  amax, rht_amax = xla_form.amaxes(x)
  np.testing.assert_array_equal(_bits(got.amax), _bits(amax))
  np.testing.assert_array_equal(_bits(got.rht_amax), _bits(rht_amax))
  xf = np.asarray(x, np.float32)
  want = np.float32(np.nan) if np.isnan(xf).any() else np.abs(xf).max()
  np.testing.assert_array_equal(np.float32(got.amax), want)
  own = nv.quantize(x, axis=0, rht=True, implementation="xla").amax  # the quantizer's own post-RHT amax
  np.testing.assert_array_equal(_bits(got.rht_amax), _bits(own))


_CALLS = {  # name: (quantize kwargs, columns appended to x for the call: the gemm's dgrad pads dy's columns)
    "rows": (dict(axis=1), 0),
    "rows_sr_padded": (dict(axis=1, stochastic_key=True), 16),
    "cols": (dict(axis=0), 0),
    "cols_rht": (dict(axis=0, rht=True), 0),
    "cols_rht_sr": (dict(axis=0, rht=True, stochastic_key=True), 0),
}


@pytest.mark.parametrize("impl", ["triton", "xla"])
@pytest.mark.parametrize("call", sorted(_CALLS))
def test_quantize_given_amaxes_gives_its_own_bits_and_a_wrong_amax_changes_them(impl, call):
  kw, pad = _CALLS[call]
  kw = {**kw, "stochastic_key": jax.random.key(7)} if kw.get("stochastic_key") else kw
  x = _INPUTS["nan" if impl == "xla" else "bf16"]()
  a = nv.amaxes(x, implementation="triton")
  xc = jnp.pad(x, ((0, 0), (0, pad)))
  impl = "xla" if impl == "triton" and call == "cols" else impl  # no kernel takes axis 0 without the RHT
  _same(nv.quantize(xc, implementation=impl, **kw), nv.quantize(xc, implementation=impl, amaxes=a, **kw))
  v0, m0 = nv.quantize_values(xc, implementation=impl, **kw)
  v1, m1 = nv.quantize_values(xc, implementation=impl, amaxes=a, **kw)
  np.testing.assert_array_equal(_bits(v0), _bits(v1))
  np.testing.assert_array_equal(_bits(m0), _bits(m1))
  if impl == "triton" or "nan" not in call:
    y = _INPUTS["bf16"]()
    b = nv.amaxes(y, implementation="triton")
    wrong = nv.Amaxes(amax=b.amax * 2, rht_amax=b.rht_amax * 2)
    yc = jnp.pad(y, ((0, 0), (0, pad)))
    t0, t1 = (nv.quantize(yc, implementation=impl, amaxes=g, **kw) for g in (b, wrong))
    assert not np.array_equal(_bits(t0.scale), _bits(t1.scale)), call
    np.testing.assert_array_equal(np.float32(t1.amax), np.float32(wrong.rht_amax if kw.get("rht") else wrong.amax))


def test_amaxes_under_vmap_one_pair_per_slice_and_the_quantizers_take_them():
  xs = jnp.stack([_operand((32, 32), 4), _operand((32, 32), 5) * 3])
  keys = jax.random.split(jax.random.key(9), 2)
  a = jax.vmap(lambda x: nv.amaxes(x, implementation="triton"))(xs)
  for i in range(2):
    one = nv.amaxes(xs[i], implementation="triton")
    np.testing.assert_array_equal(_bits(a.amax[i]), _bits(one.amax))
    np.testing.assert_array_equal(_bits(a.rht_amax[i]), _bits(one.rht_amax))
  for kw in (dict(axis=1), dict(axis=0, rht=True)):
    q = lambda x, k, am, kw=kw: nv.quantize(x, stochastic_key=k, implementation="triton", amaxes=am, **kw)  # noqa: E731
    _same(jax.vmap(q)(xs, keys, a), jax.vmap(lambda x, k, q=q: q(x, k, None))(xs, keys))


def test_amaxes_errors_and_where_it_is_none():
  x = _operand((32, 32), 6)
  a = nv.amaxes(x, implementation="triton")
  with pytest.raises(TypeError, match="amaxes must be an Amaxes"):
    nv.quantize(x, amaxes=(a.amax, a.rht_amax))
  with pytest.raises(ValueError, match="1x16 blocks under TE's standard rule"):
    nv.quantize(x, block_2d=True, amaxes=a)
  with pytest.raises(ValueError, match="1x16 blocks under TE's standard rule"):
    nv.quantize(x, scale_rule=nv.ScaleRule(selection="4over6", e4m3_bound=256), amaxes=a)
  with pytest.raises(ValueError, match="RHT along axis 0 of a 2D x"):
    nv.quantize_values(x, axis=1, rht=True, amaxes=a)
  with pytest.raises(ValueError, match="a 2D floating-point operand"):
    nv.amaxes(x[0])
  with pytest.raises(ValueError):
    nv.amaxes(x[:24])  # rows not a multiple of 16
  with pytest.raises(nv.ImplementationUnavailableError, match="column count is not a multiple of 4"):
    nv.amaxes(_operand((32, 34), 7), implementation="triton")
  assert nv.amaxes(x, implementation="xla") is None and nv.amaxes(x, implementation="mosaic_tpu") is None
  # automatic: the kernel pass only in a process that can compile for XLA:GPU (else each call its own amax)
  assert (nv.amaxes(x) is None) == ("cuda" not in api._compilable_kernel_platforms(api._default_platform()))


def _fwd_bwd(x, w, key):
  recipe = gemm.GemmRecipe(stochastic_rounding=True)  # RHT on (the default)

  def loss(x, w):
    y = gemm.dot_general(x, w, (((1,), (0,)), ((), ())), recipe=recipe, key=key, preferred_element_type=jnp.float32)
    return jnp.sum(y * jnp.arange(y.size, dtype=jnp.float32).reshape(y.shape) / y.size)

  return jax.grad(loss, argnums=(0, 1))


def test_gemm_backward_takes_dys_amaxes_in_one_pass_with_the_same_gradients(monkeypatch):
  """With the Pallas GEMM (it reads codes) and the Triton quantizer, dgrad's and wgrad's dy quantizations share
  one amax pass (the kernel ``nvfp4_rht_amaxes``, no separate RHT-amax kernel for dy); dx and dW equal the
  program where each pass takes its own amax bit for bit. Under the default GEMM ("xla") there is no shared pass."""
  rng = np.random.default_rng(8)
  x = jnp.asarray(rng.standard_normal((32, 32)), jnp.bfloat16)
  w = jnp.asarray(rng.standard_normal((32, 48)) * 0.05, jnp.bfloat16)
  fn = _fwd_bwd(x, w, jax.random.key(3))
  monkeypatch.setenv(api.IMPLEMENTATION_ENV, "triton")
  monkeypatch.setenv(gemm_kernels.IMPLEMENTATION_ENV, "triton")

  def run():
    jax.clear_caches()  # the custom_vjp's traced backward
    jaxpr = str(jax.make_jaxpr(fn)(x, w))
    return [np.asarray(g, np.float32) for g in jax.jit(fn)(x, w)], jaxpr

  def kernels(jaxpr):  # (shared passes, RHT-amax kernels): each pallas_call's name, once per traced branch
    shared = jaxpr.count("nvfp4_rht_amaxes")
    return shared, jaxpr.count("nvfp4_rht_amax") - shared

  got, jaxpr = run()
  monkeypatch.setattr(gemm, "_dy_amaxes", lambda static, dy: None)
  want, alone = run()
  # dy's RHT-amax kernel became the shared pass; x's RHT copy for wgrad (made in the forward) keeps its own
  (shared, rht), (shared_alone, rht_alone) = kernels(jaxpr), kernels(alone)
  assert shared_alone == 0 and shared > 0 and rht == rht_alone - shared == shared, (kernels(jaxpr), kernels(alone))
  for name, g, wnt in zip(("dx", "dw"), got, want):
    assert np.abs(wnt).max() > 0, name
    np.testing.assert_array_equal(g.view(np.uint32), wnt.view(np.uint32), err_msg=name)
  monkeypatch.undo()
  monkeypatch.setenv(api.IMPLEMENTATION_ENV, "triton")
  monkeypatch.delenv(gemm_kernels.IMPLEMENTATION_ENV, raising=False)
  jax.clear_caches()
  assert "nvfp4_rht_amaxes" not in str(jax.make_jaxpr(fn)(x, w))
  jax.clear_caches()
