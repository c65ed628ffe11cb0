"""Reference forward of a decoder-only LM in Hugging Face's layout and order of operations (pure JAX, fp32).

One forward for every exported family (``integration/export_arch.py``), shaped by :class:`DecoderShape`:

    h        = embed_tokens[tokens]  (* sqrt(hidden) in fp32 when scale_embeddings: Gemma)
    per layer i:
      x      = norm(h, input_layernorm)     norm(x, w) = w * x/rms(x)   (norm_plus_one, Gemma: (1 + w) * x/rms(x))
                                            (post_norms, Olmo 3: no input norm, x = h)
      q,k,v  = x @ W{q,k,v}^T (+ b{q,k,v} when attention_bias)        heads [B, T, H, D]
      q,k    = norm_D(q, q_norm), norm_D(k, k_norm)                               (qk_norm: Qwen3, Gemma 3)
               (qk_norm_full, Olmo 3: norm over all heads at once, [H * D], before the split into heads)
      q,k    = rope(q), rope(k)        HF's rotate_half: halves layout, theta ** (-2j / D) (/ factor: linear)
               (rope_yarn, Olmo 3: YaRN's frequencies, halves layout, cos and sin * rope_attention_factor)
               (rope_interleaved, Llama 4: pairs (x_2j, x_2j+1) rotated as complex numbers, HF's
               apply_rotary_emb; rope_llama3: HF's llama3 frequencies; nope_layers: no RoPE at all)
      q,k    = q / rms(q), k / rms(k)  over D, no weight           (qk_l2_norm, Llama 4: RoPE layers only)
      q      = q * (log(floor((pos + 1) / floor_scale) + 1) * attn_scale + 1)  (attn_temperature, Llama 4:
               NoPE layers only)
      s      = q k^T * attn_scale      (1/sqrt(D); Gemma: query_pre_attn_scalar ** -0.5)
      s      = cap * tanh(s / cap)                                                (attn_softcap: Gemma 2)
      o      = softmax(s, causal, within segment, sliding layers: i - j < window) v   (GQA: k, v repeated)
               (attention_chunk_size c, Llama 4's RoPE layers: also i // c == j // c, token indices)
      a      = o @ Wo^T                (sandwich_norms, Gemma: a = norm(a, post_attention_layernorm))
      h      = h + a
      x      = norm(h, post_attention_layernorm)   (sandwich_norms: norm(h, pre_feedforward_layernorm))
               (post_norms, Olmo 3: h = h + norm(a, post_attention_layernorm); x = h)
      dense: m = down(act(gate(x)) * up(x))        act: silu, or gelu_tanh (Gemma's gelu_pytorch_tanh)
                                                   (under mlp_block: mlp, Llama 4's feed_forward)
      MoE:   r = x @ router^T;  (w, e) = top_k(r);  w = softmax(w)               (Mixtral; = Qwen3-MoE's
             softmax -> top_k -> renormalize); m = sum_k w_k * down_e(silu(gate_e(x)) * up_e(x))
             (sigmoid, DeepSeek-V3: s = sigmoid(r); e = top_k(s + e_score_correction_bias) within the
             topk_group groups of best top-2 sums; w = s_e / (sum s_e + 1e-20) * routed_scaling_factor;
             m += shared_experts(x); layers < moe.first_dense are dense)
             (sigmoid_input, Llama 4: (v, e) = top_k(r); expert e's input is x * sigmoid(v), its output
             summed with weight 1; m += shared_expert(x); MoE layers: moe.layers)
      h      = h + m                   (sandwich_norms, post_norms: h + norm(m, post_feedforward_layernorm))
    logits   = norm(h, norm) @ lm_head^T    (lm_head absent: tied to embed_tokens)
    logits   = cap * tanh(logits / cap)                                           (final_softcap: Gemma)

MLA (``mla``, DeepSeek-V3) replaces q, k, v: per head d = nope + rope,
    q        = q_b(norm(q_a(x), q_a_layernorm))  (q_proj(x) without q_lora)   -> [q_nope | q_pe]
    [c | k_pe] = kv_a_proj_with_mqa(x);  [k_nope | v] = kv_b(norm(c, kv_a_layernorm))   (k_pe: one head)
    q_pe, k_pe = rope_interleaved(.): pairs (x_2i, x_2i+1) rotated by YaRN's frequencies (HF's
                 apply_rotary_pos_emb_interleave; output [x_even' | x_odd'])
    s        = [q_nope | q_pe] [k_nope | k_pe]^T * d ** -0.5 * mscale ** 2,  mscale = 0.1 m ln(factor) + 1

The amax dict is what a ModelOpt ``max`` calibration records: ``max |input|`` of every linear, an expert's
over the tokens routed to it only (0 when none was). ``act`` is applied to the inputs of the linears
named in ``served`` (serving modes). MoE experts are computed densely (every expert on every token, then
combined with the routing weights): exact, and fine at calibration/eval sizes.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np


@dataclasses.dataclass(frozen=True, kw_only=True)
class MoeShape:
  """The routed-experts block of an MoE layer, in HF names."""

  # routed experts per layer, and how many each token uses
  num_experts: int
  top_k: int
  # the module under ``model.layers.<i>`` holding ``gate`` (the router) and ``experts.<e>``: "mlp" / "block_sparse_moe"
  block: str
  # the expert's (gate, up, down) linear names: ("gate_proj", "up_proj", "down_proj") or Mixtral's ("w1", "w3", "w2")
  expert_linears: tuple[str, str, str]
  # "softmax" (top-k logits, softmaxed), "sigmoid" (DeepSeek-V3: e_score_correction_bias for the choice,
  # n_group groups of which topk_group are eligible, weights normalized then times routed_scaling_factor) or
  # "sigmoid_input" (Llama 4: the sigmoid of the top-k logit scales the expert's input; outputs summed)
  scoring: str = "softmax"
  n_group: int = 1
  topk_group: int = 1
  routed_scaling_factor: float = 1.0
  # a dense SwiGLU ``<block>.shared_experts`` added to the routed output (DeepSeek)
  shared_experts: bool = False
  # layers before this one have a dense MLP (``mlp.{gate,up,down}_proj``) instead of experts
  first_dense: int = 0
  # the routed layers when not all of them are (Llama 4's moe_layers; None: every layer from first_dense on)
  layers: tuple[int, ...] | None = None
  # the router's and the shared experts' module names under ``block`` (Llama 4: router, shared_expert)
  router: str = "gate"
  shared_name: str = "shared_experts"


@dataclasses.dataclass(frozen=True, kw_only=True)
class YarnShape:
  """HF's ``yarn`` RoPE (``modeling_rope_utils._compute_yarn_parameters``, truncate on, attention_factor 1)."""

  # frequency interpolation factor, the pretraining context, the ramp's rotation bounds
  factor: float
  original_max_position_embeddings: int
  beta_fast: float
  beta_slow: float
  # the softmax scale's mscale ** 2 term: 0.1 * mscale * ln(factor) + 1 (HF's mscale_all_dim; MLA only)
  mscale: float = 0.0


@dataclasses.dataclass(frozen=True, kw_only=True)
class Llama3Rope:
  """HF's ``llama3`` RoPE frequencies (``modeling_rope_utils._compute_llama3_parameters``)."""

  # low frequencies are divided by factor; wavelengths between original / high_freq_factor and
  # original / low_freq_factor are blended
  factor: float
  low_freq_factor: float
  high_freq_factor: float
  original_max_position_embeddings: int


@dataclasses.dataclass(frozen=True, kw_only=True)
class MlaShape:
  """Multi-head latent attention (DeepSeek-V3's ``self_attn``)."""

  # low-rank query (0: a plain q_proj) and key-value ranks
  q_lora_rank: int
  kv_lora_rank: int
  # per-head dims: the un-rotated and rotated q/k parts, and v
  qk_nope_head_dim: int
  qk_rope_head_dim: int
  v_head_dim: int
  # the RoPE of the rotated part (interleaved pairs)
  yarn: YarnShape


@dataclasses.dataclass(frozen=True, kw_only=True)
class DecoderShape:
  """The HF config fields the forward needs."""

  # decoder layers
  num_layers: int
  # query heads / key-value heads / per-head dim
  num_heads: int
  num_kv_heads: int
  head_dim: int
  # RMSNorm epsilon and RoPE base (rope_theta; default RoPE only)
  rms_norm_eps: float
  rope_theta: float
  # per-head RMSNorm of q and k before RoPE (Qwen3: self_attn.q_norm / k_norm)
  qk_norm: bool = False
  # biases on q/k/v (Qwen2: self_attn.{q,k,v}_proj.bias)
  attention_bias: bool = False
  # routed experts in every layer (None: a dense SwiGLU MLP)
  moe: MoeShape | None = None
  # Gemma: norms apply (1 + w); embeddings are multiplied by sqrt(hidden) (fp32); each block's output is
  # normed before the residual add (post_attention_layernorm / post_feedforward_layernorm) and the MLP's
  # input by pre_feedforward_layernorm
  norm_plus_one: bool = False
  scale_embeddings: bool = False
  sandwich_norms: bool = False
  # the MLP activation: "silu", or "gelu_tanh" (HF's gelu_pytorch_tanh)
  activation: str = "silu"
  # softmax scale of q k^T (None: 1 / sqrt(head_dim))
  attn_scale: float | None = None
  # tanh soft-capping cap * tanh(x / cap) of the attention scores and of the final logits (None: off)
  attn_softcap: float | None = None
  final_softcap: float | None = None
  # layers with sliding-window attention (query i attends to keys j with i - j < sliding_window) and their
  # RoPE base (None: rope_theta); the other layers' RoPE positions are divided by rope_linear_factor
  sliding_layers: tuple[int, ...] = ()
  sliding_window: int = 0
  local_rope_theta: float | None = None
  rope_linear_factor: float = 1.0
  # multi-head latent attention instead of q/k/v projections (DeepSeek-V3; num_kv_heads = num_heads)
  mla: MlaShape | None = None
  # Olmo 2/3: no input or pre-MLP norm; each block's output is normed before the residual add
  # (post_attention_layernorm / post_feedforward_layernorm)
  post_norms: bool = False
  # q_norm / k_norm over all heads at once (weights [H * D] / [KV * D], before the split into heads: Olmo 3)
  qk_norm_full: bool = False
  # YaRN RoPE (HF's halves layout) in every layer, cos and sin times rope_attention_factor (Olmo 3; the
  # YarnShape's mscale is not used here); None: default RoPE
  rope_yarn: YarnShape | None = None
  rope_attention_factor: float = 1.0
  # Llama 4: layers without RoPE (NoPE: no q/k norm, no chunking; temperature tuning); the others rotate
  # interleaved pairs (rope_interleaved) with llama3 frequencies (rope_llama3; None: default), L2-normalize q
  # and k after RoPE (qk_l2_norm) and attend within chunks of attention_chunk_size tokens (0: no chunks)
  nope_layers: tuple[int, ...] = ()
  rope_interleaved: bool = False
  rope_llama3: Llama3Rope | None = None
  qk_l2_norm: bool = False
  attention_chunk_size: int = 0
  # NoPE layers' query temperature (attn_scale, floor_scale) (None: off)
  attn_temperature: tuple[float, float] | None = None
  # the dense MLP's module under the layer ("mlp"; Llama 4: "feed_forward")
  mlp_block: str = "mlp"


def rms_norm(x, w, eps):
  var = jnp.mean(x * x, axis=-1, keepdims=True)
  return w * (x * jax.lax.rsqrt(var + eps))


def rope(x, positions, theta, factor=1.0, inv_freq=None, attention_factor=1.0):
  """HF's default RoPE on ``[B, T, H, D]``: ``x * cos + rotate_half(x) * sin``, halves layout; ``factor``:
  HF's ``linear`` RoPE (inverse frequencies / factor); ``inv_freq`` (e.g. YaRN's) replaces theta's, and cos
  and sin are multiplied by ``attention_factor`` (HF's ``attention_scaling``)."""
  d = x.shape[-1]
  if inv_freq is None:
    inv_freq = 1.0 / (theta ** (jnp.arange(0, d, 2, dtype=jnp.float32) / d))
    if factor != 1.0:
      inv_freq = inv_freq / np.float32(factor)
  freqs = positions[..., None].astype(jnp.float32) * inv_freq  # [B, T, D/2]
  emb = jnp.concatenate([freqs, freqs], axis=-1)[:, :, None, :]
  cos, sin = jnp.cos(emb), jnp.sin(emb)
  if attention_factor != 1.0:
    cos, sin = cos * np.float32(attention_factor), sin * np.float32(attention_factor)
  x1, x2 = x[..., : d // 2], x[..., d // 2 :]
  return x * cos + jnp.concatenate([-x2, x1], axis=-1) * sin


def yarn_inv_freq(dim: int, theta: float, y: YarnShape):
  """HF's YaRN inverse frequencies (= MaxText's YarnRotaryEmbedding, truncate on): with
  f_j = theta ** (-2j / dim) and a ramp r_j clipped to [0, 1] from floor(low) to ceil(high) (the dims where
  beta_fast / beta_slow rotations fit the original context), inv_j = f_j / factor * r_j + f_j * (1 - r_j)."""
  def corr(rot):
    return dim * math.log(y.original_max_position_embeddings / (rot * 2 * math.pi)) / (2 * math.log(theta))

  low, high = max(math.floor(corr(y.beta_fast)), 0), min(math.ceil(corr(y.beta_slow)), dim - 1)
  high = high + 0.001 if low == high else high
  ramp = jnp.clip((jnp.arange(dim // 2, dtype=jnp.float32) - low) / (high - low), 0, 1)
  f = 1.0 / (theta ** (jnp.arange(0, dim, 2, dtype=jnp.float32) / dim))
  return f / np.float32(y.factor) * ramp + f * (1 - ramp)


def llama3_inv_freq(dim: int, theta: float, r: Llama3Rope):
  """HF's llama3 inverse frequencies: f_j = theta ** (-2j / dim), wavelength w_j = 2 pi / f_j; f_j when
  w_j < original / high_freq_factor, f_j / factor when w_j > original / low_freq_factor, else
  (1 - s) f_j / factor + s f_j with s = (original / w_j - low_freq_factor) / (high_freq_factor - low_freq_factor)."""
  f = 1.0 / (theta ** (jnp.arange(0, dim, 2, dtype=jnp.float32) / dim))
  wavelen = np.float32(2 * math.pi) / f
  low_wavelen = np.float32(r.original_max_position_embeddings / r.low_freq_factor)
  high_wavelen = np.float32(r.original_max_position_embeddings / r.high_freq_factor)
  scaled = jnp.where(wavelen > low_wavelen, f / np.float32(r.factor), f)
  smooth = (np.float32(r.original_max_position_embeddings) / wavelen - np.float32(r.low_freq_factor)) / np.float32(
      r.high_freq_factor - r.low_freq_factor)
  smoothed = (1 - smooth) * scaled / np.float32(r.factor) + smooth * scaled
  medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
  return jnp.where(medium, smoothed, scaled)


def rope_interleaved(x, positions, inv_freq):
  """RoPE of interleaved pairs on ``[B, T, H, D]``: ``[x_even cos - x_odd sin | x_odd cos + x_even sin]``."""
  ang = positions[..., None].astype(jnp.float32) * inv_freq  # [B, T, D/2]
  cos, sin = jnp.cos(ang)[:, :, None, :], jnp.sin(ang)[:, :, None, :]
  x1, x2 = x[..., 0::2], x[..., 1::2]
  return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)


def attention_mask(positions, segment_ids):
  """``[B, T, T]``: causal and within the segment (0 = padding attends to nothing)."""
  t = positions.shape[1]
  seg = segment_ids
  return jnp.tril(jnp.ones((t, t), bool))[None] & (seg[:, :, None] == seg[:, None, :]) & (seg[:, None, :] != 0)


def sliding_mask(mask, window: int):
  """``mask`` restricted to keys less than ``window`` positions back (query i, key j: i - j < window)."""
  t = mask.shape[-1]
  i = jnp.arange(t)
  return mask & ((i[:, None] - i[None, :]) < window)[None]


def chunk_mask(mask, chunk: int):
  """``mask`` restricted to keys in the query's chunk of ``chunk`` token indices (i // chunk == j // chunk)."""
  i = jnp.arange(mask.shape[-1]) // chunk
  return mask & (i[:, None] == i[None, :])[None]


def temperature(positions, attn_scale: float, floor_scale: float):
  """Llama 4's NoPE query scale ``[B, T]``: log(floor((pos + 1) / floor_scale) + 1) * attn_scale + 1."""
  pos = positions.astype(jnp.float32)
  return jnp.log(jnp.floor((pos + 1.0) / np.float32(floor_scale)) + 1.0) * np.float32(attn_scale) + 1.0


def softcap(x, cap):
  return x if cap is None else jnp.tanh(x / np.float32(cap)) * np.float32(cap)


_ACTIVATIONS = {"silu": jax.nn.silu, "gelu_tanh": lambda x: jax.nn.gelu(x, approximate=True)}


def is_moe_layer(shape: DecoderShape, layer: int) -> bool:
  """Whether ``layer`` has routed experts (MoE models from ``moe.first_dense`` on; ``moe.layers`` when given)."""
  m = shape.moe
  return m is not None and layer >= m.first_dense and (m.layers is None or layer in m.layers)


def attention_names(shape: DecoderShape) -> tuple[str, ...]:
  """The attention linears' leaf names (under ``self_attn``), in forward order."""
  if shape.mla is None:
    return ("q_proj", "k_proj", "v_proj", "o_proj")
  q = ("q_a_proj", "q_b_proj") if shape.mla.q_lora_rank else ("q_proj",)
  return q + ("kv_a_proj_with_mqa", "kv_b_proj", "o_proj")


def layer_names(shape: DecoderShape, layer: int) -> list[str]:
  """Every linear of ``layer`` (HF names, no ``.weight``), the router excluded, in forward order."""
  p = f"model.layers.{layer}."
  out = [p + f"self_attn.{n}" for n in attention_names(shape)]
  dense = ("gate_proj", "up_proj", "down_proj")
  if not is_moe_layer(shape, layer):
    return out + [p + f"{shape.mlp_block}.{n}" for n in dense]
  m = shape.moe
  out += [f"{p}{m.block}.experts.{e}.{n}" for e in range(m.num_experts) for n in m.expert_linears]
  return out + ([f"{p}{m.block}.{m.shared_name}.{n}" for n in dense] if m.shared_experts else [])


def layer_kind(shape: DecoderShape, layer: int) -> int:
  """The first layer of ``layer``'s kind (same attention window, RoPE or NoPE, dense or MoE): what
  ``decoder_layer(like=)`` takes so layers of one kind share a compiled function."""
  def kind(i):
    return (i in shape.sliding_layers, is_moe_layer(shape, i), i in shape.nope_layers)
  return next(i for i in range(shape.num_layers) if kind(i) == kind(layer))


def decoder_layer(w: dict, shape: DecoderShape, layer: int, h, positions, mask, amax: dict, act=None,
                  served: frozenset = frozenset(), like: int | None = None):
  """One decoder layer (module docstring) on ``h [B, T, E]``; records input amaxes into ``amax``.

  ``like``: the layer whose kind (sliding window, RoPE or NoPE, dense or MoE) this one has (default ``layer``): the
  export's calibration runs every layer's weights renamed to layer 0 through one compiled function per kind."""
  b, t, _ = h.shape
  p = f"model.layers.{layer}."
  kind = layer if like is None else like
  sliding = kind in shape.sliding_layers
  nope = kind in shape.nope_layers
  one = 1.0 if shape.norm_plus_one else 0.0

  def norm(x, name):
    return rms_norm(x, w[name] + one, shape.rms_norm_eps)

  def linear(name, x, routed=None):
    a = jnp.max(jnp.abs(x), axis=-1)
    amax[name] = jnp.max(a if routed is None else jnp.where(routed, a, 0.0))
    y = (act(x) if act is not None and name in served else x) @ w[name + ".weight"].T
    return y + w[name + ".bias"] if name + ".bias" in w else y

  nh, nkv, hd = shape.num_heads, shape.num_kv_heads, shape.head_dim
  x = h if shape.post_norms else norm(h, p + "input_layernorm.weight")
  if shape.mla is not None:
    q, k, v, scale = _mla_qkv(shape.mla, shape.rope_theta, p + "self_attn.", x, positions, linear, norm)
  else:
    q, k, v = (linear(p + f"self_attn.{n}_proj", x) for n in "qkv")
    if shape.qk_norm and shape.qk_norm_full:
      q, k = norm(q, p + "self_attn.q_norm.weight"), norm(k, p + "self_attn.k_norm.weight")
    q, k, v = q.reshape(b, t, nh, hd), k.reshape(b, t, nkv, hd), v.reshape(b, t, nkv, hd)
    if shape.qk_norm and not shape.qk_norm_full:
      q = norm(q, p + "self_attn.q_norm.weight")
      k = norm(k, p + "self_attn.k_norm.weight")
    theta = shape.local_rope_theta if sliding and shape.local_rope_theta is not None else shape.rope_theta
    factor = 1.0 if sliding else shape.rope_linear_factor
    if nope:  # Llama 4's NoPE layers: no rotation, no q/k norm; the query's temperature
      if shape.attn_temperature is not None:
        q = q * temperature(positions, *shape.attn_temperature)[:, :, None, None]
    elif shape.rope_interleaved:
      inv = (1.0 / (theta ** (jnp.arange(0, hd, 2, dtype=jnp.float32) / hd)) if shape.rope_llama3 is None
             else llama3_inv_freq(hd, theta, shape.rope_llama3))
      # (the output's [even | odd] order differs from HF's interleaved one by the same permutation of q and k:
      # their dot product and the L2 norm below are unchanged)
      q, k = rope_interleaved(q, positions, inv), rope_interleaved(k, positions, inv)
    else:
      inv = None if shape.rope_yarn is None else yarn_inv_freq(hd, theta, shape.rope_yarn)
      q, k = (rope(y, positions, theta, factor, inv, shape.rope_attention_factor) for y in (q, k))
    if shape.qk_l2_norm and not nope:
      q, k = rms_norm(q, 1.0, shape.rms_norm_eps), rms_norm(k, 1.0, shape.rms_norm_eps)
    k, v = jnp.repeat(k, nh // nkv, axis=2), jnp.repeat(v, nh // nkv, axis=2)
    scale = np.float32(1.0 / np.sqrt(hd) if shape.attn_scale is None else shape.attn_scale)
  scores = softcap(jnp.einsum("bqhd,bkhd->bhqk", q, k) * scale, shape.attn_softcap)
  m = sliding_mask(mask, shape.sliding_window) if sliding else mask
  m = chunk_mask(m, shape.attention_chunk_size) if shape.attention_chunk_size and not nope else m
  scores = jnp.where(m[:, None], scores, jnp.finfo(jnp.float32).min)
  o = jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(scores, axis=-1), v).reshape(b, t, -1)
  a = linear(p + "self_attn.o_proj", o)
  if shape.sandwich_norms:
    h = h + norm(a, p + "post_attention_layernorm.weight")
    x = norm(h, p + "pre_feedforward_layernorm.weight")
  elif shape.post_norms:
    h = h + norm(a, p + "post_attention_layernorm.weight")
    x = h
  else:
    h = h + a
    x = norm(h, p + "post_attention_layernorm.weight")
  def mlp(prefix):
    gate, up = linear(prefix + "gate_proj", x), linear(prefix + "up_proj", x)
    return linear(prefix + "down_proj", _ACTIVATIONS[shape.activation](gate) * up)

  if not is_moe_layer(shape, kind):
    y = mlp(f"{p}{shape.mlp_block}.")
    post = shape.sandwich_norms or shape.post_norms
    return h + (norm(y, p + "post_feedforward_layernorm.weight") if post else y)
  m = shape.moe
  router = f"{p}{m.block}.{m.router}"
  top_w, top_e = _route(m, x @ w[router + ".weight"].T, w.get(router + ".e_score_correction_bias"))
  onehot = jax.nn.one_hot(top_e, m.num_experts, dtype=jnp.float32)  # [B, T, K, E]
  combine = jnp.einsum("btk,btke->bte", top_w, onehot)
  routed = jnp.sum(onehot, axis=2) > 0  # [B, T, E]
  on_input = m.scoring == "sigmoid_input"  # Llama 4: the weight scales the expert's input, outputs summed
  out = jnp.zeros_like(h)
  g_name, u_name, d_name = m.expert_linears
  for e in range(m.num_experts):
    pe = f"{p}{m.block}.experts.{e}."
    r = routed[..., e]
    xe = x * combine[..., e:e + 1] if on_input else x
    y = linear(pe + d_name, jax.nn.silu(linear(pe + g_name, xe, r)) * linear(pe + u_name, xe, r), r)
    out = out + (r[..., None] if on_input else combine[..., e:e + 1]) * y
  if m.shared_experts:
    out = out + mlp(f"{p}{m.block}.{m.shared_name}.")
  return h + out


def _route(m: MoeShape, logits, bias):
  """``(weights, experts)`` ``[B, T, K]`` of router ``logits [B, T, E]`` (module docstring)."""
  if m.scoring == "softmax":
    top_w, top_e = jax.lax.top_k(logits, m.top_k)
    return jax.nn.softmax(top_w, axis=-1), top_e
  if m.scoring == "sigmoid_input":
    top_w, top_e = jax.lax.top_k(logits, m.top_k)
    return jax.nn.sigmoid(top_w), top_e
  s = jax.nn.sigmoid(logits)
  choice = s + bias
  groups = choice.reshape(*choice.shape[:-1], m.n_group, m.num_experts // m.n_group)
  group_score = jnp.sum(jax.lax.top_k(groups, 2)[0], axis=-1)  # [B, T, G]
  _, best = jax.lax.top_k(group_score, m.topk_group)
  keep = jnp.sum(jax.nn.one_hot(best, m.n_group, dtype=jnp.float32), axis=-2) > 0  # [B, T, G]
  keep = jnp.repeat(keep, m.num_experts // m.n_group, axis=-1)
  _, top_e = jax.lax.top_k(jnp.where(keep, choice, -jnp.inf), m.top_k)
  top_w = jnp.take_along_axis(s, top_e, axis=-1)
  top_w = top_w / (jnp.sum(top_w, axis=-1, keepdims=True) + np.float32(1e-20))
  return top_w * np.float32(m.routed_scaling_factor), top_e


def _mla_qkv(a: MlaShape, theta: float, p: str, x, positions, linear, norm):
  """``(q, k, v [B, T, H, .], softmax scale)`` of multi-head latent attention (module docstring)."""
  b, t, _ = x.shape
  d = a.qk_nope_head_dim + a.qk_rope_head_dim
  if a.q_lora_rank:
    q = linear(p + "q_b_proj", norm(linear(p + "q_a_proj", x), p + "q_a_layernorm.weight"))
  else:
    q = linear(p + "q_proj", x)
  q = q.reshape(b, t, -1, d)
  nh = q.shape[2]
  ckv = linear(p + "kv_a_proj_with_mqa", x)
  c, k_pe = ckv[..., :a.kv_lora_rank], ckv[..., a.kv_lora_rank:]
  kv = linear(p + "kv_b_proj", norm(c, p + "kv_a_layernorm.weight")).reshape(b, t, nh, -1)
  k_nope, v = kv[..., :a.qk_nope_head_dim], kv[..., a.qk_nope_head_dim:]
  inv = yarn_inv_freq(a.qk_rope_head_dim, theta, a.yarn)
  q_pe = rope_interleaved(q[..., a.qk_nope_head_dim:], positions, inv)
  k_pe = jnp.broadcast_to(rope_interleaved(k_pe[:, :, None, :], positions, inv), (b, t, nh, a.qk_rope_head_dim))
  q = jnp.concatenate([q[..., :a.qk_nope_head_dim], q_pe], axis=-1)
  k = jnp.concatenate([k_nope, k_pe], axis=-1)
  y = a.yarn
  mscale = 0.1 * y.mscale * math.log(y.factor) + 1.0 if y.factor > 1 else 1.0
  return q, k, v, np.float32(d ** -0.5 * mscale * mscale)


def decoder_forward(weights: dict, shape: DecoderShape, tokens, positions=None, segment_ids=None, act=None,
                    served: frozenset = frozenset()):
  """``(logits [B, T, V], {linear name: amax of its input})`` in fp32 (module docstring).

  ``weights``: HF state-dict names -> ``[out, in]`` arrays (``lm_head.weight`` absent = tied embeddings).
  ``segment_ids``: packed sequences attend within their segment only (0 = padding); None = one segment.
  """
  w = {k: jnp.asarray(v, jnp.float32) for k, v in weights.items()}
  tokens = jnp.asarray(tokens)
  b, t = tokens.shape
  positions = jnp.broadcast_to(jnp.arange(t), (b, t)) if positions is None else jnp.asarray(positions)
  seg = jnp.ones((b, t), jnp.int32) if segment_ids is None else jnp.asarray(segment_ids)
  mask = attention_mask(positions, seg)
  amax: dict = {}
  h = embed(w["model.embed_tokens.weight"], tokens, shape)
  for i in range(shape.num_layers):
    h = decoder_layer(w, shape, i, h, positions, mask, amax, act, served)
  h = rms_norm(h, w["model.norm.weight"] + (1.0 if shape.norm_plus_one else 0.0), shape.rms_norm_eps)
  head = w.get("lm_head.weight", w["model.embed_tokens.weight"])
  return softcap(h @ head.T, shape.final_softcap), amax


def embed(table, tokens, shape: DecoderShape):
  """``table[tokens]``, times ``sqrt(hidden)`` (fp32, as transformers' scaled embedding of an fp32 model)
  when ``shape.scale_embeddings``."""
  h = jnp.asarray(table, jnp.float32)[tokens]
  return h * np.float32(np.sqrt(h.shape[-1])) if shape.scale_embeddings else h
