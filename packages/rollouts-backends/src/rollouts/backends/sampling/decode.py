"""A lean decode step for Llama-family decoders (Llama, Qwen2): the sampler's fast path.

Legend: B rows being sampled, T cache capacity (prompt + max_new_tokens), H query heads,
G key/value heads, D head dim, E hidden size.

One new token per row per step is overhead-bound on small models: transformers' forward spends
most of its time in module calls, config lookups, mask construction and growing its cache with
`torch.cat`. `FastDecoder` runs the same arithmetic as the HF modules (RMSNorm in float32,
rotary from the model's own `rotary_emb`, SDPA with grouped KV heads, SwiGLU) from the modules'
weights, writing keys and values into preallocated buffers. Where it departs from the modules'
order of calls, the products stay the same: q/k/v and gate/up each run as one matmul over their
weights stacked (once per generate call: the columns are the separate projections' dot products),
and rotary runs on the q and k heads together, rotate_half(x) * sin as x.roll(D/2) times sin
with its first half negated (negation is exact). The prefill still goes
through the HF model; its cache is copied in once. Models whose math or rounding would differ
(extra norms, sliding windows, other activations, attention other than SDPA) are refused by
`fast_decoder`, and the caller falls back to the HF forward.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from rollouts.backends.train.attention import SDPA_IMPLEMENTATIONS
from rollouts.backends.train.components import model_attr

__all__ = ["FastDecoder", "fast_decoder"]

_ARCHITECTURES = ("LlamaForCausalLM", "Qwen2ForCausalLM")
"""Model classes whose decoder layer is exactly: RMSNorm, q/k/v(+bias) with rotary, SDPA, o_proj,
RMSNorm, SwiGLU MLP. Others fall back to the HF forward."""


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    # As the HF RMSNorm: statistics in float32, the weight applied in the input dtype.
    dtype = x.dtype
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x32.to(dtype)


def _signed_sin(sin: torch.Tensor) -> torch.Tensor:
    """sin with its first half negated: x.roll(D/2) * signed_sin is HF's rotate_half(x) * sin, exactly."""
    half = sin.shape[-1] // 2
    return torch.cat((-sin[..., :half], sin[..., half:]), dim=-1)


def _stacked(*projections: torch.nn.Linear) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The projections' weights (and biases, if any has one) stacked along the output dimension."""
    weight = torch.cat([p.weight.detach() for p in projections])
    if all(p.bias is None for p in projections):
        return weight, None
    biases = [p.bias.detach() if p.bias is not None else p.weight.new_zeros(p.out_features) for p in projections]
    return weight, torch.cat(biases)


def fast_decoder(model: torch.nn.Module, total_length: int) -> FastDecoder | None:
    """A FastDecoder for `model`, or None when its architecture is not one the fast path reproduces."""
    if type(model).__name__ not in _ARCHITECTURES:
        return None
    config = model_attr(model, "config")
    if getattr(config, "hidden_act", None) != "silu":
        return None
    if getattr(config, "_attn_implementation", "sdpa") not in SDPA_IMPLEMENTATIONS:
        return None  # eager (probabilities cast to the model dtype before @ V) or flash kernels round differently
    if any(hasattr(p, "device_mesh") for p in model.parameters()):
        return None  # FSDP-sharded weights: the HF forward gathers them
    body = getattr(model, "model", None)
    if body is None or not hasattr(body, "rotary_emb") or not hasattr(model, "lm_head"):
        return None
    for layer in body.layers:
        attn = layer.self_attn
        if getattr(attn, "sliding_window", None) is not None and attn.sliding_window < total_length:
            return None
        if hasattr(attn, "q_norm") or hasattr(attn, "k_norm"):
            return None
    return FastDecoder(model)


class FastDecoder:
    """Static-cache decoding with the weights of an HF Llama-family model (q/k/v and gate/up stacked per call)."""

    def __init__(self, model: torch.nn.Module) -> None:
        self._model = model
        self._body: Any = model_attr(model, "model")  # the decoder stack of a *ForCausalLM
        config = model_attr(model, "config")
        self._num_heads: int = config.num_attention_heads
        self._num_kv_heads: int = getattr(config, "num_key_value_heads", None) or self._num_heads
        self._head_dim: int = getattr(config, "head_dim", None) or config.hidden_size // self._num_heads
        self._scaling = self._body.layers[0].self_attn.scaling
        # One matmul for q, k, v and one for gate, up: their weights side by side (copied once per
        # generate call, so a training step between calls is seen; the columns come out as from
        # the separate projections).
        self._qkv = [
            _stacked(layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj)
            for layer in self._body.layers
        ]
        self._gate_up = [_stacked(layer.mlp.gate_proj, layer.mlp.up_proj) for layer in self._body.layers]
        self._keys: list[torch.Tensor] = []
        self._values: list[torch.Tensor] = []
        self._mask_B_T: torch.Tensor | None = None
        self._length = 0

    def load_cache(self, cache: object, repeats: int, capacity: int, mask_B_L: torch.Tensor | None) -> None:
        """Copy a prefilled HF DynamicCache ([P, G, L, D] per layer) in, each prompt's entries
        repeated `repeats` times, into buffers with room for `capacity` positions.

        `mask_B_L` (1 = real token) marks left padding in the prompt part; None when there is none.
        """
        self._keys, self._values = [], []
        for layer in cache.layers:  # type: ignore[attr-defined]
            for source, target in ((layer.keys, self._keys), (layer.values, self._values)):
                rows, heads, length, dim = source.shape
                buffer = source.new_empty((rows * repeats, heads, capacity, dim))
                buffer[:, :, :length] = source.repeat_interleave(repeats, dim=0)
                target.append(buffer)
        self._length = length
        self._mask_B_T = None
        if mask_B_L is not None:
            self._mask_B_T = torch.ones((mask_B_L.shape[0], capacity), dtype=torch.bool, device=mask_B_L.device)
            self._mask_B_T[:, :length] = mask_B_L > 0

    def select_rows(self, rows: torch.Tensor) -> None:
        """Keep only `rows` (indices into the current rows) in the cache."""
        self._keys = [k.index_select(0, rows) for k in self._keys]
        self._values = [v.index_select(0, rows) for v in self._values]
        if self._mask_B_T is not None:
            self._mask_B_T = self._mask_B_T.index_select(0, rows)

    def step(self, tokens_B: torch.Tensor, positions_B: torch.Tensor) -> torch.Tensor:
        """Append one token per row at `positions_B` (rotary positions); returns [B, V] logits."""
        t = self._length
        if t >= self._keys[0].shape[2]:
            raise ValueError(f"decode cache is full ({t} positions): load_cache was given too small a capacity")
        body = self._body
        rows = tokens_B.shape[0]
        x_B_E = F.embedding(tokens_B, body.embed_tokens.weight)
        cos, sin = body.rotary_emb(x_B_E, positions_B[:, None])  # [B, 1, D] each, in x's dtype
        sin = _signed_sin(sin)
        mask = None if self._mask_B_T is None else self._mask_B_T[:, None, None, : t + 1]
        h, g, d = self._num_heads, self._num_kv_heads, self._head_dim
        layers = zip(body.layers, self._qkv, self._gate_up, self._keys, self._values, strict=True)
        for layer, (qkv_weight, qkv_bias), (gate_up_weight, gate_up_bias), keys, values in layers:
            attn, mlp = layer.self_attn, layer.mlp
            norm = layer.input_layernorm
            hidden = _rms_norm(x_B_E, norm.weight, norm.variance_epsilon)
            qkv = F.linear(hidden, qkv_weight, qkv_bias).view(rows, h + 2 * g, d)
            # Rotary on the q and k heads together: [B, H + G, D] against [B, 1, D]
            qk = qkv[:, : h + g]
            qk = qk * cos + qk.roll(d // 2, dims=-1) * sin
            keys[:, :, t] = qk[:, h:]
            values[:, :, t] = qkv[:, h + g :]
            out = F.scaled_dot_product_attention(
                qk[:, :h, None],
                keys[:, :, : t + 1],
                values[:, :, : t + 1],
                attn_mask=mask,
                scale=self._scaling,
                enable_gqa=g != h,
            )
            x_B_E = x_B_E + F.linear(out.reshape(rows, h * d), attn.o_proj.weight, attn.o_proj.bias)
            norm = layer.post_attention_layernorm
            hidden = _rms_norm(x_B_E, norm.weight, norm.variance_epsilon)
            gate, up = F.linear(hidden, gate_up_weight, gate_up_bias).chunk(2, dim=-1)
            x_B_E = x_B_E + F.linear(F.silu(gate) * up, mlp.down_proj.weight, mlp.down_proj.bias)
        self._length = t + 1
        norm = body.norm
        hidden = _rms_norm(x_B_E, norm.weight, norm.variance_epsilon)
        head = model_attr(self._model, "lm_head")
        return F.linear(hidden, head.weight, head.bias)
