"""The pattern corpus: the same computations spelled the ways users and exporters write them.

Each :class:`Formulation` builds a small torch module and example inputs (random, never zero).
``tests/test_pattern_corpus.py`` compiles every one through the public pipeline and checks the
kernel count, one attention op per attention, no S×S tensor after ``finalize`` and the numerics
against torch; ``tools/corpus_table.py`` prints the README's table (tvmfuse vs stock TVM).

Shapes: attention q/k/v (B=1, H=2, S=24, D=16) in (B, H, S, D) unless the name says BSHD;
in the GQA cases both query heads share one KV head. S = 24 is the only dimension of 24
anywhere, so an S×S tensor is recognisable.
Norm and GEMM cases: x (1, 24, 64) → Linear(64 → 96). ``frontend``: ``torch`` (torch.export),
``onnx-dynamo`` / ``onnx-legacy`` (the same module through ``torch.onnx.export``);
``dtype``: the ``tvmfuse.compile`` dtype (``float16`` converts an fp32 module).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

B, H, HKV, S, D = 1, 2, 2, 24, 16
HIDDEN, OUT = 64, 96
HEAD_DIM = 16  # QKNorm's heads
VOCAB = 128  # EmbedResidual's table
HALF = torch.float16


@dataclass(frozen=True)
class Formulation:
    """One spelling: ``build() -> (module, inputs)``; ``kind`` groups the README table."""

    name: str
    kind: str  # attention | norm | gemm_epilogue | elementwise
    build: Callable[[], tuple[nn.Module, tuple[torch.Tensor, ...]]]
    attention: int = 0  # attention ops the computation holds (fused into R.nn.attention)
    left: str | None = None  # an attention deliberately left unfused: words of its recorded reason
    frontend: str = "torch"
    dtype: str | None = None


def _rand(*shape: int, dtype: torch.dtype = HALF, seed: int = 0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=gen).to(dtype)


def _qkv(dtype: torch.dtype = HALF, hkv: int = H, bshd: bool = False) -> tuple[torch.Tensor, ...]:
    shapes = [(B, H, S, D), (B, hkv, S, D), (B, hkv, S, D)]
    if bshd:
        shapes = [(b, s, h, d) for b, h, s, d in shapes]
    return tuple(_rand(*shape, dtype=dtype, seed=i) for i, shape in enumerate(shapes))


def _causal_bool(s: int = S) -> torch.Tensor:
    return torch.ones(s, s, dtype=torch.bool).triu(1)


def _alibi_slopes(heads: int = H) -> torch.Tensor:
    return 2.0 ** (-8.0 * torch.arange(1, heads + 1) / heads)


# --- attention ------------------------------------------------------------------------------------


class MaskedFill(nn.Module):
    """``masked_fill(triu(1) bool buffer, fill)`` on the scores, fp32 softmax, cast back."""

    def __init__(self, fill: float | None = None, scale: str = "scores") -> None:
        super().__init__()
        self.register_buffer("mask", _causal_bool(), persistent=False)
        self.fill, self.scale = fill, scale

    def forward(self, q, k, v):
        if self.scale == "q":
            s = (q * D**-0.5) @ k.transpose(-1, -2)
        elif self.scale == "split":
            s = (q * D**-0.25) @ (k * D**-0.25).transpose(-1, -2)
        elif self.scale == "div":
            s = (q @ k.transpose(-1, -2)) / math.sqrt(q.shape[-1])
        else:
            s = (q @ k.transpose(-1, -2)) * D**-0.5
        fill = torch.finfo(s.dtype).min if self.fill is None else self.fill
        s = s.masked_fill(self.mask, fill)
        return torch.softmax(s.float(), -1).to(q.dtype) @ v


class AdditiveCausal(nn.Module):
    """``s + triu(full(-inf), 1)`` from a buffer (HF's older eager path)."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("bias", torch.full((S, S), float("-inf")).triu(1), persistent=False)

    def forward(self, q, k, v):
        s = torch.matmul(q, k.transpose(2, 3)) * D**-0.5 + self.bias.to(q.dtype)
        return torch.matmul(torch.softmax(s, dim=-1, dtype=torch.float32).to(q.dtype), v)


class WhereTril(nn.Module):
    """``where(tril bool buffer, s, -inf)``, softmax over the explicit last dim (3)."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("keep", torch.tril(torch.ones(S, S, dtype=torch.bool)), persistent=False)

    def forward(self, q, k, v):
        s = torch.matmul(q, k.transpose(-2, -1)) * D**-0.5
        s = torch.where(self.keep, s, torch.tensor(float("-inf"), dtype=s.dtype))
        return torch.matmul(torch.softmax(s.float(), dim=3).to(q.dtype), v)


class PaddingMask(nn.Module):
    """Non-causal, additive padding mask from an input: ``(1 - m)[:, None, None, :] · finfo.min``."""

    def forward(self, q, k, v, attention_mask):
        bias = (1.0 - attention_mask[:, None, None, :].to(q.dtype)) * torch.finfo(q.dtype).min
        s = q @ k.transpose(-1, -2) * D**-0.5 + bias
        return torch.softmax(s.float(), -1).to(q.dtype) @ v


class Einsum(nn.Module):
    """Both products as ``torch.einsum``, causal by masked_fill."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("mask", _causal_bool(), persistent=False)

    def forward(self, q, k, v):
        s = torch.einsum("bhqd,bhkd->bhqk", q, k) * D**-0.5
        p = torch.softmax(s.masked_fill(self.mask, float("-inf")).float(), -1).to(q.dtype)
        return torch.einsum("bhqk,bhkd->bhqd", p, v)


class Baddbmm(nn.Module):
    """3-D heads-folded form: ``baddbmm(causal bias, q, kᵀ, alpha=scale)`` then ``bmm``."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("bias", torch.full((S, S), float("-inf")).triu(1), persistent=False)

    def forward(self, q, k, v):
        q3, k3, v3 = (t.reshape(B * H, S, D) for t in (q, k, v))
        s = torch.baddbmm(self.bias.to(q.dtype).expand(B * H, S, S), q3, k3.transpose(1, 2), alpha=D**-0.5)
        p = torch.softmax(s.float(), -1).to(q.dtype)
        return torch.bmm(p, v3).reshape(B, H, S, D)


class BaddbmmAlibi(nn.Module):
    """Bloom's form: ``baddbmm(alibi, q3, k3ᵀ, alpha=scale)`` with a per-head (B·H, 1, S) ALiBi
    bias (slope_h · key position), viewed 4-D, causal by masked_fill(finfo.min), then ``bmm``."""

    def __init__(self) -> None:
        super().__init__()
        slopes = _alibi_slopes()
        alibi = slopes[:, None, None] * torch.arange(S)[None, None, :]
        self.register_buffer("alibi", alibi.repeat(B, 1, 1), persistent=False)
        self.register_buffer("mask", _causal_bool(), persistent=False)

    def forward(self, q, k, v):
        q3, k3, v3 = (t.reshape(B * H, S, D) for t in (q, k, v))
        s = torch.baddbmm(self.alibi.to(q.dtype), q3, k3.transpose(1, 2), alpha=D**-0.5)
        s = s.view(B, H, S, S).masked_fill(self.mask, torch.finfo(q.dtype).min)
        p = torch.softmax(s.float(), -1).to(q.dtype)
        return torch.bmm(p.view(B * H, S, S), v3).reshape(B, H, S, D)


class ClampedHeadsFolded(nn.Module):
    """XGLM's (the BART family's) form on (B, S, H·D) projections: heads folded for ``bmm``, the
    scores viewed 4-D for an additive finfo.min causal mask, clamped by ``torch.max(s,
    finfo.min)`` (the fp16 add may overflow to -inf), back to 3-D for a softmax in fp32."""

    def __init__(self, s: int = S, heads: int = H) -> None:
        super().__init__()
        self.heads = heads
        mask = torch.zeros(s, s).masked_fill(_causal_bool(s), torch.finfo(HALF).min)
        self.register_buffer("mask", mask[None, None], persistent=False)

    def forward(self, q, k, v):
        b, s, e = q.shape
        h, d = self.heads, e // self.heads

        def fold(t: torch.Tensor) -> torch.Tensor:
            return t.view(b, s, h, d).transpose(1, 2).reshape(b * h, s, d)

        w = torch.bmm(fold(q * d**-0.5), fold(k).transpose(1, 2))
        w = w.view(b, h, s, s) + self.mask.to(w.dtype)
        # XGLM's fp32 0-d floor (float64 for a float64 reference run)
        w = torch.max(w, torch.full((), torch.finfo(w.dtype).min,
                                    dtype=torch.promote_types(w.dtype, torch.float32)))
        p = F.softmax(w.view(b * h, s, s), dim=-1, dtype=torch.float32).to(q.dtype)
        return torch.bmm(p, fold(v)).view(b, h, s, d)


def _projections(dtype: torch.dtype = HALF) -> tuple[torch.Tensor, ...]:
    return tuple(t.reshape(B, S, H * D) for t in _qkv(dtype, bshd=True))


class Fp32Alibi(nn.Module):
    """MPT's form: fp16 ``q·kᵀ · scale`` plus an fp32 ALiBi bias (slope_h · key position, built
    in fp32 as MPT builds it each call), so the scores are fp32; causal by masked_fill with
    ``finfo(float16).min``, softmax of the fp32 scores."""

    def __init__(self, s: int = S, heads: int = H) -> None:
        super().__init__()
        alibi = _alibi_slopes(heads)[:, None, None] * torch.arange(s)[None, None, :]
        self.register_buffer("alibi", alibi, persistent=False)
        self.register_buffer("mask", _causal_bool(s), persistent=False)

    def forward(self, q, k, v):
        w = torch.matmul(q, k.transpose(-1, -2)) * q.shape[-1] ** -0.5 + self.alibi.float()
        w = w.masked_fill(self.mask, torch.finfo(q.dtype).min)
        return torch.matmul(torch.softmax(w.float(), -1).to(v.dtype), v)


class Differential(nn.Module):
    """DiffLlama's differential attention written once: one causal softmax read by two P·V
    products, each over half the value heads tiled back to all (``v.repeat(1, 2, 1, 1)``),
    combined as ``o1 - λ·o2``."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("mask", _causal_bool(), persistent=False)

    def forward(self, q, k, v):
        s = (q @ k.transpose(-1, -2)) * D**-0.5
        p = torch.softmax(s.masked_fill(self.mask, float("-inf")).float(), -1).to(q.dtype)
        v1, v2 = (x.repeat(1, 2, 1, 1) for x in v.chunk(2, dim=1))
        return p @ v1 - 0.8 * (p @ v2)


class SoftCapped(nn.Module):
    """Gemma-2's logit soft-capping: ``tanh(s / cap) · cap`` on the scaled scores (in the module's
    dtype), then the causal mask and an fp32 softmax cast back; a cap of 2 bends most scores."""

    def __init__(self, cap: float = 2.0) -> None:
        super().__init__()
        self.cap = cap
        self.register_buffer("mask", _causal_bool(), persistent=False)

    def forward(self, q, k, v):
        s = torch.tanh((q @ k.transpose(-1, -2)) * D**-0.5 / self.cap) * self.cap
        p = torch.softmax(s.masked_fill(self.mask, float("-inf")).float(), -1).to(q.dtype)
        return p @ v


class LatentRope(nn.Module):
    """DeepSeek's multi-head latent attention written out: each head's q·k spans its own D dims
    and D/4 RoPE dims whose key part one head shares with all (``k_pe`` expanded), the values
    keep D, so q and k are wider than v (20 vs 16; not 24, the corpus keeps 24 for S); masked_fill
    causal, fp32 softmax cast back."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("mask", _causal_bool(), persistent=False)

    def forward(self, q, k, v):
        r = D // 4
        q_pe, k_pe = q[..., :r] * 0.5, k[:, :1, :, D - r:].expand(-1, q.shape[1], -1, -1)
        s = torch.cat([q, q_pe], -1) @ torch.cat([k, k_pe], -1).transpose(-1, -2) * (D + r) ** -0.5
        p = torch.softmax(s.masked_fill(self.mask, float("-inf")).float(), -1).to(q.dtype)
        return p @ v


class RelativeBias(nn.Module):
    """T5's form: unscaled ``q·kᵀ + bias`` with a learned per-head bias of the relative position
    (``table[h, j - i + S - 1]``, a (1, H, S, S) term varying along queries and keys), fp32
    softmax cast back."""

    def __init__(self) -> None:
        super().__init__()
        self.table = nn.Parameter(torch.randn(H, 2 * S - 1) * 0.5)
        pos = torch.arange(S)
        self.register_buffer("rel", pos[None, :] - pos[:, None] + S - 1, persistent=False)

    def forward(self, q, k, v):
        bias = self.table[:, self.rel].unsqueeze(0).to(q.dtype)
        s = q @ k.transpose(-1, -2) + bias
        return torch.softmax(s.float(), -1).to(q.dtype) @ v


class PaddingBitwiseAnd(nn.Module):
    """transformers 5's bidirectional mask: ``full(True) & (q_idx >= 0) & pad[b, kv_idx]`` with
    bool ``&``, applied by ``where(mask, 0, -inf)``."""

    def forward(self, q, k, v, attention_mask):
        q_idx = torch.arange(S)[None, None, :, None]
        kv_idx = torch.arange(S)[None, None, None, :]
        pad = attention_mask.bool()[torch.arange(B)[:, None, None, None], kv_idx]
        keep = torch.ones((), dtype=torch.bool) & (q_idx >= 0) & pad
        bias = torch.where(keep, 0.0, float("-inf")).to(q.dtype)
        s = q @ k.transpose(-1, -2) * D**-0.5 + bias
        return torch.softmax(s.float(), -1).to(q.dtype) @ v


class DropoutEval(MaskedFill):
    """Item 1's form with ``F.dropout(p, 0.1, self.training)`` (eval: identity)."""

    def forward(self, q, k, v):
        s = (q @ k.transpose(-1, -2)) * D**-0.5
        p = torch.softmax(s.masked_fill(self.mask, float("-inf")).float(), -1).to(q.dtype)
        return F.dropout(p, 0.1, self.training) @ v


class GQA(nn.Module):
    """KV heads repeated by ``repeat_interleave`` or HF's expand + reshape (``repeat_kv``)."""

    def __init__(self, how: str) -> None:
        super().__init__()
        self.how = how
        self.register_buffer("mask", _causal_bool(), persistent=False)

    def forward(self, q, k, v):
        rep = q.shape[1] // k.shape[1]
        if self.how == "repeat_interleave":
            k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
        else:
            b, hkv, s, d = k.shape
            k = k[:, :, None].expand(b, hkv, rep, s, d).reshape(b, hkv * rep, s, d)
            v = v[:, :, None].expand(b, hkv, rep, s, d).reshape(b, hkv * rep, s, d)
        s = (q @ k.transpose(-1, -2)) * D**-0.5
        return torch.softmax(s.masked_fill(self.mask, float("-inf")).float(), -1).to(q.dtype) @ v


class BSHD(MaskedFill):
    """Item 1's form on (B, S, H, D) inputs, transposed in and out."""

    def forward(self, q, k, v):
        return super().forward(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)).transpose(1, 2)


class SlidingWindow(nn.Module):
    """Causal band of width 8: key j visible to query i iff 0 <= i - j < 8 (bool buffer)."""

    def __init__(self) -> None:
        super().__init__()
        i = torch.arange(S)
        d = i[:, None] - i[None, :]
        self.register_buffer("mask", (d < 0) | (d >= 8), persistent=False)

    def forward(self, q, k, v):
        s = (q @ k.transpose(-1, -2)) * D**-0.5
        return torch.softmax(s.masked_fill(self.mask, float("-inf")).float(), -1).to(q.dtype) @ v


class SDPA(nn.Module):
    """``F.scaled_dot_product_attention`` with ``is_causal`` / a bool buffer / a float input mask."""

    def __init__(self, mode: str = "causal", gqa: bool = False, bshd: bool = False) -> None:
        super().__init__()
        self.mode, self.gqa, self.bshd = mode, gqa, bshd
        self.register_buffer("keep", torch.tril(torch.ones(S, S, dtype=torch.bool)), persistent=False)

    def forward(self, q, k, v, mask=None):
        if self.bshd:
            q, k, v = (t.transpose(1, 2) for t in (q, k, v))
        if self.mode == "bool":
            o = F.scaled_dot_product_attention(q, k, v, attn_mask=self.keep)
        elif self.mode == "float":
            o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        else:
            o = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=self.gqa)
        return o.transpose(1, 2) if self.bshd else o


def _attn(module: nn.Module, dtype: torch.dtype = HALF, **qkv) -> Callable:
    return lambda: (module.to(dtype).eval(), _qkv(dtype, **qkv))


def _padding_inputs() -> tuple[torch.Tensor, ...]:
    mask = torch.ones(B, S, dtype=torch.int64)
    mask[:, -5:] = 0
    return (*_qkv(), mask)


def _float_mask_inputs() -> tuple[torch.Tensor, ...]:
    bias = torch.zeros(B, 1, 1, S, dtype=HALF)
    bias[..., -5:] = torch.finfo(HALF).min
    return (*_qkv(), bias)


class TorchMHA(nn.Module):
    """``nn.MultiheadAttention`` (no weights returned) + residual, or a whole
    ``nn.TransformerEncoderLayer`` (pre-LN, GELU): torch's own modules, sequence-first inside.
    ``batch_first=False`` (torch's default) reads x as (S, B, E)."""

    def __init__(self, layer: bool = False, batch_first: bool = True) -> None:
        super().__init__()
        heads = HIDDEN // D
        self.body = (nn.TransformerEncoderLayer(HIDDEN, heads, 2 * HIDDEN, batch_first=True,
                                                norm_first=True, activation="gelu") if layer
                     else nn.MultiheadAttention(HIDDEN, heads, batch_first=batch_first))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if isinstance(self.body, nn.MultiheadAttention):
            return self.body(x, x, x, need_weights=False)[0] + x
        return self.body(x)


# --- norms (+ the Linear that reads them) ---------------------------------------------------------


class NormLinear(nn.Module):
    """``Linear(norm(x))`` for a norm spelled by ``form``."""

    def __init__(self, form: str, residual: bool = False) -> None:
        super().__init__()
        self.form, self.residual, self.eps = form, residual, 1e-6
        self.weight = nn.Parameter(torch.randn(HIDDEN) * 0.1 + 1.0)
        self.bias = nn.Parameter(torch.randn(HIDDEN) * 0.1)
        self.norm = nn.RMSNorm(HIDDEN, eps=self.eps) if form == "nn_rmsnorm" else (
            nn.LayerNorm(HIDDEN) if form == "nn_layernorm" else None)
        if self.norm is not None:
            with torch.no_grad():
                self.norm.weight.normal_(1.0, 0.1)
        self.proj = nn.Linear(HIDDEN, OUT, bias=False)

    def normed(self, x: torch.Tensor) -> torch.Tensor:
        f, eps = self.form, self.eps
        if f == "llama":  # transformers LlamaRMSNorm
            h = x.to(torch.float32)
            h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
            return self.weight * h.to(x.dtype)
        if f == "issue":  # item 3's spelling
            v = x.float().pow(2).mean(-1, keepdim=True)
            return (x.float() * torch.rsqrt(v + eps)).to(x.dtype) * self.weight
        if f == "gemma":  # GemmaRMSNorm: (1 + w) in fp32, then cast
            h = x.float()
            h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
            return (h * (1.0 + self.weight.float())).type_as(x)
        if f == "t5":  # T5LayerNorm: RMS, cast to the weight's dtype, then multiply
            var = x.to(torch.float32).pow(2).mean(-1, keepdim=True)
            h = x * torch.rsqrt(var + eps)
            return self.weight * h.to(self.weight.dtype)
        if f == "cohere":  # CohereLayerNorm: LayerNorm without β on the fp32 upcast, w first
            h = x.to(torch.float32)
            mean = h.mean(-1, keepdim=True)
            var = (h - mean).pow(2).mean(-1, keepdim=True)
            h = (h - mean) * torch.rsqrt(var + eps)
            return (self.weight.to(torch.float32) * h).to(x.dtype)
        if f == "f_rms_norm":
            return F.rms_norm(x, (HIDDEN,), self.weight, eps)
        if f == "f_rms_norm_no_weight":  # NanoChat's norm
            return F.rms_norm(x, (HIDDEN,), eps=eps)
        if f == "llama_no_weight":  # LlamaRMSNorm's body without w
            h = x.to(torch.float32)
            return (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)
        if f == "layer_norm_no_weight":  # elementwise_affine=False written out, on the fp32 upcast
            h = x.float()
            mu = h.mean(-1, keepdim=True)
            var = ((h - mu) ** 2).mean(-1, keepdim=True)
            return ((h - mu) / torch.sqrt(var + eps)).to(x.dtype)
        if f == "f_layer_norm":
            return F.layer_norm(x, (HIDDEN,), self.weight, self.bias, eps)
        return self.norm(x)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.proj(self.normed(x))
        return y + x.repeat(1, 1, 2)[..., :OUT] if self.residual else y


class QKNorm(nn.Module):
    """Qwen3's attention inputs: one QKV Linear, then RMSNorm over each head of q and of k (the
    LlamaRMSNorm spelling, over the head dim), heads transposed; q, k, v flattened together."""

    def __init__(self) -> None:
        super().__init__()
        self.qkv = nn.Linear(HIDDEN, 3 * HIDDEN, bias=False)
        self.wq = nn.Parameter(torch.randn(HEAD_DIM) * 0.1 + 1.0)
        self.wk = nn.Parameter(torch.randn(HEAD_DIM) * 0.1 + 1.0)

    @staticmethod
    def _norm(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        h = x.to(torch.float32)
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6)
        return w * h.to(x.dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv(x).split(HIDDEN, dim=-1)
        heads = (*x.shape[:-1], HIDDEN // HEAD_DIM, HEAD_DIM)
        q = self._norm(q.view(heads), self.wq).transpose(1, 2)
        k = self._norm(k.view(heads), self.wk).transpose(1, 2)
        return torch.cat([q.flatten(), k.flatten(), v.view(heads).transpose(1, 2).flatten()])


class EmbedResidual(nn.Module):
    """A decoder's residual stream from its embedding: ``x = E[ids]``, ``h = x + W1·rms(x)``,
    ``W2·rms(h)`` (the LlamaRMSNorm spelling). In an fp32 module compiled with ``--dtype float16``
    the stream is half only if the gather is (passes/mixed_precision.py)."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, HIDDEN)
        self.norms = nn.ModuleList([NormLinear("llama") for _ in range(2)])
        self.norms[0].proj = nn.Linear(HIDDEN, HIDDEN, bias=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(ids)
        return self.norms[1](x + self.norms[0](x))


def _ids(dtype: torch.dtype = HALF) -> tuple[torch.Tensor]:
    return (torch.randint(0, VOCAB, (1, S), generator=torch.Generator().manual_seed(0)),)


def _x(dtype: torch.dtype = HALF) -> tuple[torch.Tensor]:
    return (_rand(1, S, HIDDEN, dtype=dtype),)


def _mod(module: nn.Module, dtype: torch.dtype = HALF, inputs: Callable = _x) -> Callable:
    return lambda: (module.to(dtype).eval(), inputs(dtype))


# --- GEMM epilogues and elementwise chains ----------------------------------------------------------


class LinearAct(nn.Module):
    """``act(Linear(x) [+ bias])``, or ``x' + Linear(x)`` (``residual``), or SwiGLU."""

    def __init__(self, act: str) -> None:
        super().__init__()
        self.act = act
        self.fc = nn.Linear(HIDDEN, HIDDEN if act == "residual" else OUT,
                            bias=act not in ("residual", "swiglu"))  # SwiGLU as Llama: no biases
        self.up = nn.Linear(HIDDEN, OUT, bias=False)
        self.down = nn.Linear(OUT, HIDDEN, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        a = self.act
        if a == "relu":
            return torch.relu(self.fc(x))
        if a == "gelu":
            return F.gelu(self.fc(x))
        if a == "gelu_tanh":
            return F.gelu(self.fc(x), approximate="tanh")
        if a == "silu":
            return F.silu(self.fc(x))
        if a == "residual":
            return x + self.fc(x)
        return self.down(F.silu(self.fc(x)) * self.up(x))  # swiglu


class GateUpMLP(nn.Module):
    """SwiGLU with one fused gate/up Linear (HF Phi-3, xformers' ``w12``): its output cut in two
    halves by ``chunk``, ``split`` or slicing, then ``down(up * silu(gate))``."""

    def __init__(self, cut: str) -> None:
        super().__init__()
        self.cut = cut
        self.gate_up = nn.Linear(HIDDEN, 2 * OUT, bias=False)
        self.down = nn.Linear(OUT, HIDDEN, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.gate_up(x)
        if self.cut == "chunk":
            gate, up = y.chunk(2, dim=-1)
        elif self.cut == "split":
            gate, up = torch.split(y, OUT, dim=-1)
        else:
            gate, up = y[..., :OUT], y[..., OUT:]
        return self.down(up * F.silu(gate))


class Chain(nn.Module):
    """Elementwise chains and a scaled softmax, on x (1, 24, 64)."""

    def __init__(self, form: str) -> None:
        super().__init__()
        self.form = form
        self.b = nn.Parameter(torch.randn(HIDDEN))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.form == "chain5":
            return torch.relu((x * 2.0 + self.b).sigmoid() * x - 0.5)
        if self.form == "softmax_scale":
            return torch.softmax(x * 0.125, -1)
        if self.form == "silu_mul":
            return F.silu(x) * (x + self.b)
        return F.dropout(F.gelu(x + self.b), 0.1, self.training)  # bias_gelu_dropout


def _f(name: str, kind: str, build: Callable, **kw) -> Formulation:
    return Formulation(name, kind, build, **kw)


FORMULATIONS: list[Formulation] = [
    # attention, fp16 modules on (B, H, S, D)
    _f("attn_masked_fill_triu_inf", "attention", _attn(MaskedFill(float("-inf"))), attention=1),
    _f("attn_masked_fill_finfo_min", "attention", _attn(MaskedFill()), attention=1),
    _f("attn_masked_fill_neg1e4", "attention", _attn(MaskedFill(-1e4)), attention=1),
    _f("attn_scale_on_q", "attention", _attn(MaskedFill(float("-inf"), "q")), attention=1),
    _f("attn_scale_split_qk", "attention", _attn(MaskedFill(float("-inf"), "split")), attention=1),
    _f("attn_scale_div_sqrt_d", "attention", _attn(MaskedFill(float("-inf"), "div")), attention=1),
    _f("attn_additive_triu_buffer", "attention", _attn(AdditiveCausal()), attention=1),
    _f("attn_where_tril_dim3", "attention", _attn(WhereTril()), attention=1),
    _f("attn_padding_mask_input", "attention", lambda: (PaddingMask().eval(), _padding_inputs()),
       attention=1),
    _f("attn_einsum", "attention", _attn(Einsum()), attention=1),
    _f("attn_baddbmm", "attention", _attn(Baddbmm()), attention=1),
    _f("attn_baddbmm_alibi", "attention", _attn(BaddbmmAlibi()), attention=1),
    _f("attn_clamped_heads_folded", "attention", lambda: (ClampedHeadsFolded().half().eval(),
                                                          _projections()), attention=1),
    _f("attn_alibi_fp32_bias", "attention", _attn(Fp32Alibi()), attention=1),
    _f("onnx_dynamo_attn_clamped_heads_folded", "attention",
       lambda: (ClampedHeadsFolded().half().eval(), _projections()), attention=1, frontend="onnx-dynamo"),
    _f("onnx_legacy_attn_clamped_heads_folded", "attention",
       lambda: (ClampedHeadsFolded().half().eval(), _projections()), attention=1, frontend="onnx-legacy"),
    _f("attn_relative_position_bias", "attention", _attn(RelativeBias()), attention=1),
    _f("attn_differential_shared_softmax", "attention", _attn(Differential()), attention=2),
    _f("attn_soft_capped", "attention", _attn(SoftCapped()), attention=1),
    _f("attn_latent_rope", "attention", _attn(LatentRope()), attention=1),
    _f("attn_padding_bitwise_and", "attention",
       lambda: (PaddingBitwiseAnd().eval(), _padding_inputs()), attention=1),
    _f("attn_dropout_eval", "attention", _attn(DropoutEval(float("-inf"))), attention=1),
    _f("attn_gqa_repeat_interleave", "attention", _attn(GQA("repeat_interleave"), hkv=HKV // 2),
       attention=1),
    _f("attn_gqa_expand_reshape", "attention", _attn(GQA("expand"), hkv=HKV // 2), attention=1),
    _f("attn_bshd_inputs", "attention", _attn(BSHD(float("-inf")), bshd=True), attention=1),
    _f("attn_sliding_window_band", "attention", _attn(SlidingWindow()), attention=1),
    _f("attn_fp32_module_as_fp16", "attention", _attn(MaskedFill(float("-inf")), torch.float32),
       attention=1, dtype="float16"),
    _f("attn_nn_multihead_attention", "attention", _mod(TorchMHA()), attention=1),
    _f("attn_nn_multihead_attention_seq_first", "attention", _mod(TorchMHA(batch_first=False)),
       attention=1),
    _f("attn_nn_transformer_encoder_layer", "attention", _mod(TorchMHA(layer=True)), attention=1),
    _f("sdpa_causal_bhsd", "attention", _attn(SDPA()), attention=1),
    _f("sdpa_causal_bshd", "attention", _attn(SDPA(bshd=True), bshd=True), attention=1),
    _f("sdpa_bool_mask", "attention", _attn(SDPA("bool")), attention=1),
    _f("sdpa_float_padding_mask", "attention", lambda: (SDPA("float").eval(), _float_mask_inputs()),
       attention=1),
    _f("sdpa_enable_gqa", "attention", _attn(SDPA(gqa=True), hkv=HKV // 2), attention=1),
    _f("onnx_dynamo_attn_masked_fill", "attention", _attn(MaskedFill(float("-inf"))), attention=1,
       frontend="onnx-dynamo"),
    _f("onnx_legacy_attn_masked_fill", "attention", _attn(MaskedFill(float("-inf"))), attention=1,
       frontend="onnx-legacy"),
    _f("onnx_dynamo_sdpa_causal", "attention", _attn(SDPA()), attention=1, frontend="onnx-dynamo"),
    _f("onnx_dynamo_attn_soft_capped", "attention", _attn(SoftCapped()), attention=1,
       frontend="onnx-dynamo"),
    # norms followed by a Linear
    _f("rmsnorm_llama_linear", "norm", _mod(NormLinear("llama"))),
    _f("rmsnorm_issue_form_linear", "norm", _mod(NormLinear("issue"))),
    _f("rmsnorm_gemma_linear", "norm", _mod(NormLinear("gemma"))),
    _f("rmsnorm_t5_linear", "norm", _mod(NormLinear("t5"))),
    _f("rmsnorm_functional_linear", "norm", _mod(NormLinear("f_rms_norm"))),
    _f("rmsnorm_module_linear", "norm", _mod(NormLinear("nn_rmsnorm"))),
    _f("rmsnorm_no_weight_functional_linear", "norm", _mod(NormLinear("f_rms_norm_no_weight"))),
    _f("rmsnorm_no_weight_llama_linear", "norm", _mod(NormLinear("llama_no_weight"))),
    _f("rmsnorm_residual_linear", "norm", _mod(NormLinear("issue", residual=True))),
    _f("layernorm_functional_linear", "norm", _mod(NormLinear("f_layer_norm"))),
    _f("layernorm_module_linear", "norm", _mod(NormLinear("nn_layernorm"))),
    _f("layernorm_fp32_linear", "norm", _mod(NormLinear("nn_layernorm"), torch.float32)),
    _f("layernorm_no_bias_upcast_linear", "norm", _mod(NormLinear("cohere"))),
    _f("layernorm_no_weight_upcast_linear", "norm", _mod(NormLinear("layer_norm_no_weight"))),
    _f("rmsnorm_per_head_qk", "norm", _mod(QKNorm())),
    _f("rmsnorm_fp32_module_as_fp16", "norm", _mod(NormLinear("llama"), torch.float32), dtype="float16"),
    _f("onnx_dynamo_rmsnorm_linear", "norm", _mod(NormLinear("llama")), frontend="onnx-dynamo"),
    _f("rmsnorm_embedding_residual", "norm", _mod(EmbedResidual(), inputs=_ids)),
    _f("rmsnorm_embedding_residual_fp32_as_fp16", "norm", _mod(EmbedResidual(), torch.float32, _ids),
       dtype="float16"),
    _f("onnx_dynamo_embedding_residual_as_fp16", "norm", _mod(EmbedResidual(), torch.float32, _ids),
       frontend="onnx-dynamo", dtype="float16"),
    _f("onnx_legacy_layernorm_linear", "norm", _mod(NormLinear("nn_layernorm")), frontend="onnx-legacy"),
    # GEMM epilogues
    _f("linear_bias_relu", "gemm_epilogue", _mod(LinearAct("relu"))),
    _f("linear_bias_gelu", "gemm_epilogue", _mod(LinearAct("gelu"))),
    _f("linear_bias_gelu_tanh", "gemm_epilogue", _mod(LinearAct("gelu_tanh"))),
    _f("linear_bias_silu", "gemm_epilogue", _mod(LinearAct("silu"))),
    _f("linear_residual", "gemm_epilogue", _mod(LinearAct("residual"))),
    _f("swiglu_mlp", "gemm_epilogue", _mod(LinearAct("swiglu"))),
    _f("swiglu_fused_gate_up_chunk", "gemm_epilogue", _mod(GateUpMLP("chunk"))),
    _f("swiglu_fused_gate_up_split", "gemm_epilogue", _mod(GateUpMLP("split"))),
    _f("swiglu_fused_gate_up_slices", "gemm_epilogue", _mod(GateUpMLP("slices"))),
    _f("onnx_dynamo_swiglu_fused_gate_up", "gemm_epilogue", _mod(GateUpMLP("chunk")),
       frontend="onnx-dynamo"),
    _f("onnx_legacy_swiglu_fused_gate_up", "gemm_epilogue", _mod(GateUpMLP("slices")),
       frontend="onnx-legacy"),
    _f("linear_bias_relu_fp32", "gemm_epilogue", _mod(LinearAct("relu"), torch.float32)),
    _f("onnx_dynamo_linear_bias_relu", "gemm_epilogue", _mod(LinearAct("relu")), frontend="onnx-dynamo"),
    _f("onnx_legacy_linear_bias_gelu", "gemm_epilogue", _mod(LinearAct("gelu")), frontend="onnx-legacy"),
    # elementwise chains
    _f("chain5", "elementwise", _mod(Chain("chain5"))),
    _f("softmax_scaled", "elementwise", _mod(Chain("softmax_scale"))),
    _f("silu_mul", "elementwise", _mod(Chain("silu_mul"))),
    _f("bias_gelu_dropout_eval", "elementwise", _mod(Chain("bias_gelu_dropout"))),
]

BY_NAME = {f.name: f for f in FORMULATIONS}


def materialise(f: Formulation, workdir: Path) -> tuple[nn.Module, tuple[torch.Tensor, ...], str | None]:
    """``(module, inputs, onnx_path)``: the ONNX export of the module for the onnx frontends
    (written into ``workdir``), else None (compile the module itself)."""
    module, inputs = f.build()
    if f.frontend == "torch":
        return module, inputs, None
    from models.export_onnx import export_onnx

    dynamo = f.frontend == "onnx-dynamo"
    path = export_onnx(module, inputs, workdir / f"{f.name}.onnx", dynamo=dynamo, opset=18 if dynamo else 17)
    return module, inputs, str(path)
