"""Reference forward of a decoder-only LM in Hugging Face's layout and order of operations (pure JAX, fp32).

One forward for every exported family (``integration/export_arch.py``), shaped by :class:`DecoderShape`:

    h        = embed_tokens[tokens]
    per layer i:
      x      = rms_norm(h) * input_layernorm                                      (weight w: w * x/rms)
      q,k,v  = x @ W{q,k,v}^T (+ b{q,k,v} when attention_bias)        heads [B, T, H, D]
      q,k    = rms_norm_D(q) * q_norm, rms_norm_D(k) * k_norm                     (qk_norm: Qwen3)
      q,k    = rope(q), rope(k)        HF's rotate_half: halves layout, theta ** (-2j / D)
      o      = softmax(q k^T / sqrt(D), causal, within segment) v                 (GQA: k, v repeated)
      h      = h + o @ Wo^T
      x      = rms_norm(h) * post_attention_layernorm
      dense: h = h + down(silu(gate(x)) * up(x))
      MoE:   r = x @ router^T;  (w, e) = top_k(r);  w = softmax(w)               (Mixtral; = Qwen3-MoE's
             softmax -> top_k -> renormalize); h = h + sum_k w_k * down_e(silu(gate_e(x)) * up_e(x))
    logits   = (rms_norm(h) * norm) @ lm_head^T    (lm_head absent: tied to embed_tokens)

The amax dict is what a ModelOpt ``max`` calibration records: ``max |input|`` of every linear, an expert's
over the tokens routed to it only (0 when none was). ``act`` is applied to the inputs of the linears
named in ``served`` (serving modes). MoE experts are computed densely (every expert on every token, then
combined with the routing weights): exact, and fine at calibration/eval sizes.
"""

from __future__ import annotations

import dataclasses

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


def rms_norm(x, w, eps):
  var = jnp.mean(x * x, axis=-1, keepdims=True)
  return w * (x * jax.lax.rsqrt(var + eps))


def rope(x, positions, theta):
  """HF's default RoPE on ``[B, T, H, D]``: ``x * cos + rotate_half(x) * sin``, halves layout."""
  d = x.shape[-1]
  inv_freq = 1.0 / (theta ** (jnp.arange(0, d, 2, dtype=jnp.float32) / d))
  freqs = positions[..., None].astype(jnp.float32) * inv_freq  # [B, T, D/2]
  emb = jnp.concatenate([freqs, freqs], axis=-1)[:, :, None, :]
  x1, x2 = x[..., : d // 2], x[..., d // 2 :]
  return x * jnp.cos(emb) + jnp.concatenate([-x2, x1], axis=-1) * jnp.sin(emb)


def attention_mask(positions, segment_ids):
  """``[B, T, T]``: causal and within the segment (0 = padding attends to nothing)."""
  t = positions.shape[1]
  seg = segment_ids
  return jnp.tril(jnp.ones((t, t), bool))[None] & (seg[:, :, None] == seg[:, None, :]) & (seg[:, None, :] != 0)


def layer_names(shape: DecoderShape, layer: int) -> list[str]:
  """Every linear of ``layer`` (HF names, no ``.weight``), the router excluded, in forward order."""
  p = f"model.layers.{layer}."
  out = [p + f"self_attn.{n}" for n in ("q_proj", "k_proj", "v_proj", "o_proj")]
  if shape.moe is None:
    return out + [p + f"mlp.{n}" for n in ("gate_proj", "up_proj", "down_proj")]
  m = shape.moe
  return out + [f"{p}{m.block}.experts.{e}.{n}" for e in range(m.num_experts) for n in m.expert_linears]


def decoder_layer(w: dict, shape: DecoderShape, layer: int, h, positions, mask, amax: dict, act=None,
                  served: frozenset = frozenset()):
  """One decoder layer (module docstring) on ``h [B, T, E]``; records input amaxes into ``amax``."""
  b, t, _ = h.shape
  p = f"model.layers.{layer}."

  def linear(name, x, routed=None):
    a = jnp.max(jnp.abs(x), axis=-1)
    amax[name] = jnp.max(a if routed is None else jnp.where(routed, a, 0.0))
    y = (act(x) if act is not None and name in served else x) @ w[name + ".weight"].T
    return y + w[name + ".bias"] if name + ".bias" in w else y

  nh, nkv, hd = shape.num_heads, shape.num_kv_heads, shape.head_dim
  x = rms_norm(h, w[p + "input_layernorm.weight"], shape.rms_norm_eps)
  q = linear(p + "self_attn.q_proj", x).reshape(b, t, nh, hd)
  k = linear(p + "self_attn.k_proj", x).reshape(b, t, nkv, hd)
  v = linear(p + "self_attn.v_proj", x).reshape(b, t, nkv, hd)
  if shape.qk_norm:
    q = rms_norm(q, w[p + "self_attn.q_norm.weight"], shape.rms_norm_eps)
    k = rms_norm(k, w[p + "self_attn.k_norm.weight"], shape.rms_norm_eps)
  q, k = rope(q, positions, shape.rope_theta), rope(k, positions, shape.rope_theta)
  k, v = jnp.repeat(k, nh // nkv, axis=2), jnp.repeat(v, nh // nkv, axis=2)
  scores = jnp.einsum("bqhd,bkhd->bhqk", q, k) / np.float32(np.sqrt(hd))
  scores = jnp.where(mask[:, None], scores, jnp.finfo(jnp.float32).min)
  o = jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(scores, axis=-1), v).reshape(b, t, nh * hd)
  h = h + linear(p + "self_attn.o_proj", o)
  x = rms_norm(h, w[p + "post_attention_layernorm.weight"], shape.rms_norm_eps)
  if shape.moe is None:
    gate, up = linear(p + "mlp.gate_proj", x), linear(p + "mlp.up_proj", x)
    return h + linear(p + "mlp.down_proj", jax.nn.silu(gate) * up)
  m = shape.moe
  logits = x @ w[f"{p}{m.block}.gate.weight"].T  # [B, T, E]
  top_w, top_e = jax.lax.top_k(logits, m.top_k)
  top_w = jax.nn.softmax(top_w, axis=-1)
  onehot = jax.nn.one_hot(top_e, m.num_experts, dtype=jnp.float32)  # [B, T, K, E]
  combine = jnp.einsum("btk,btke->bte", top_w, onehot)
  routed = jnp.sum(onehot, axis=2) > 0  # [B, T, E]
  out = jnp.zeros_like(h)
  g_name, u_name, d_name = m.expert_linears
  for e in range(m.num_experts):
    pe = f"{p}{m.block}.experts.{e}."
    r = routed[..., e]
    y = linear(pe + d_name, jax.nn.silu(linear(pe + g_name, x, r)) * linear(pe + u_name, x, r), r)
    out = out + combine[..., e:e + 1] * y
  return h + out


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
  h = w["model.embed_tokens.weight"][tokens]
  for i in range(shape.num_layers):
    h = decoder_layer(w, shape, i, h, positions, mask, amax, act, served)
  h = rms_norm(h, w["model.norm.weight"], shape.rms_norm_eps)
  head = w.get("lm_head.weight", w["model.embed_tokens.weight"])
  return h @ head.T, amax
