"""Attention as users write it: one small torch module per formulation (tests/test_pass_attention_forms.py).

Every module takes q, k, v in (B, H, S, D) (``Bshd`` takes (B, S, H, D), the GQA ones K/V with
``KVH`` heads) and returns the attention output; built in fp16 unless a test says otherwise.
S ≠ D and H·S·S > any other tensor: an (S, S) allocation can only be the scores.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from models.corpus import ClampedHeadsFolded, Fp32Alibi

B, H, KVH, S, D = 2, 4, 2, 24, 16
WINDOW = 6  # sliding-window band: key j visible from query i when i - WINDOW < j <= i


def _causal_true_masked(s: int = S) -> torch.Tensor:
    return torch.ones(s, s, dtype=torch.bool).triu(1)


class HandWritten(nn.Module):
    """Issue 13 item 1: fp16 scores, bool triu buffer, softmax of an fp32 upcast, cast back."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("mask", _causal_true_masked(), persistent=False)

    def forward(self, q, k, v):
        scale = 1.0 / math.sqrt(q.shape[-1])
        s = (q @ k.transpose(-1, -2)) * scale
        s = s.masked_fill(self.mask, float("-inf"))
        p = torch.softmax(s.float(), -1).to(q.dtype)
        return p @ v


class TrilBuffer(nn.Module):
    """nanoGPT: ``masked_fill(bias[:, :, :T, :T] == 0, -inf)`` with a float tril buffer, ``F.softmax``."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("bias", torch.tril(torch.ones(S, S)).view(1, 1, S, S), persistent=False)

    def forward(self, q, k, v):
        t = q.shape[2]
        att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(k.size(-1)))
        att = att.masked_fill(self.bias[:, :, :t, :t] == 0, float("-inf"))
        return F.softmax(att, dim=-1) @ v


class WhereMask(nn.Module):
    """``torch.where(tril, s, finfo.min)`` with a bool tril buffer; softmax over dim 3 (the last)."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("keep", torch.ones(S, S, dtype=torch.bool).tril(), persistent=False)

    def forward(self, q, k, v):
        s = torch.matmul(q, k.transpose(2, 3)) / math.sqrt(q.shape[-1])
        s = torch.where(self.keep, s, torch.finfo(s.dtype).min)
        return torch.matmul(torch.softmax(s, dim=3), v)


class AdditiveMask(nn.Module):
    """``s + full(fill).triu(1)`` (buffer, module dtype), softmax in fp32 (``dtype=``), ``type_as``."""

    def __init__(self, fill: float | str) -> None:
        super().__init__()
        self.fill = fill

    def forward(self, q, k, v):
        fill = torch.finfo(q.dtype).min if self.fill == "finfo.min" else self.fill
        mask = torch.full((S, S), fill, dtype=q.dtype).triu(1)
        s = q @ k.transpose(-1, -2) * D**-0.5 + mask
        return F.softmax(s, dim=-1, dtype=torch.float32).type_as(q) @ v


class SoftCapped(nn.Module):
    """Gemma-2's eager attention: ``s · scaling``, then ``/ cap → tanh → · cap`` (logit
    soft-capping, in the module's dtype), then the additive causal mask, fp32 softmax, cast back.
    ``cap`` = 2 with the forms' unit-normal inputs: most scores are bent (Gemma-2's 50 bends only
    large ones)."""

    def __init__(self, cap: float = 2.0) -> None:
        super().__init__()
        self.cap = cap
        self.register_buffer("mask", torch.full((S, S), float("-inf")).triu(1), persistent=False)

    def forward(self, q, k, v):
        s = torch.matmul(q, k.transpose(2, 3)) * D**-0.5
        s = torch.tanh(s / self.cap) * self.cap
        s = s + self.mask.to(s.dtype)
        return F.softmax(s, dim=-1, dtype=torch.float32).to(q.dtype) @ v


class SlidingWindow(nn.Module):
    """A causal band of width ``WINDOW`` (Mistral's sliding window), spelled ``how``:

    ``masked_fill_bool``  bool buffer (True = masked), ``masked_fill(-inf)``
    ``tril_triu_float``   ``torch.ones(S, S).tril().triu(1 - w)`` float buffer, ``== 0`` filled
    ``where_finfo_min``   ``torch.where(keep, s, finfo.min)`` with a bool keep buffer
    ``additive``          ``s + zeros.masked_fill(~keep, -inf)`` (module dtype), fp32 softmax
    ``sdpa_bool``         ``F.scaled_dot_product_attention(attn_mask=keep)``
    ``sdpa_float``        ``F.scaled_dot_product_attention(attn_mask=0 / -inf float mask)``
    """

    def __init__(self, how: str = "masked_fill_bool") -> None:
        super().__init__()
        self.how = how
        keep = torch.ones(S, S, dtype=torch.bool).tril().triu(1 - WINDOW)
        self.register_buffer("keep", keep, persistent=False)
        self.register_buffer("band", torch.ones(S, S).tril().triu(1 - WINDOW), persistent=False)

    def forward(self, q, k, v):
        if self.how == "sdpa_bool":
            return F.scaled_dot_product_attention(q, k, v, attn_mask=self.keep)
        if self.how == "sdpa_float":
            mask = torch.zeros(S, S, dtype=q.dtype).masked_fill(~self.keep, float("-inf"))
            return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        s = (q @ k.transpose(-1, -2)) * D**-0.5
        if self.how == "masked_fill_bool":
            s = s.masked_fill(~self.keep, float("-inf"))
        elif self.how == "tril_triu_float":
            s = s.masked_fill(self.band == 0, float("-inf"))
        elif self.how == "where_finfo_min":
            s = torch.where(self.keep, s, torch.finfo(s.dtype).min)
        else:
            s = s + torch.zeros(S, S, dtype=q.dtype).masked_fill(~self.keep, float("-inf"))
            return F.softmax(s, dim=-1, dtype=torch.float32).type_as(q) @ v
        return torch.softmax(s, -1) @ v


WINDOW_FORMS = ("masked_fill_bool", "tril_triu_float", "where_finfo_min", "additive", "sdpa_bool",
                "sdpa_float")


class PaddingMask(nn.Module):
    """A key-padding mask from an input: ``keep`` (B, S) bool; ``-inf`` fill or additive finfo.min."""

    def __init__(self, additive: bool) -> None:
        super().__init__()
        self.additive = additive

    def forward(self, q, k, v, keep):
        s = q @ k.transpose(-1, -2) / math.sqrt(D)
        if self.additive:
            s = s + (1.0 - keep[:, None, None, :].to(q.dtype)) * torch.finfo(q.dtype).min
        else:
            s = s.masked_fill(~keep[:, None, None, :], float("-inf"))
        return torch.softmax(s.float(), dim=-1).to(q.dtype) @ v


class Einsum(nn.Module):
    """``torch.einsum`` for both products, causal mask from a bool buffer."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("mask", _causal_true_masked(), persistent=False)

    def forward(self, q, k, v):
        s = torch.einsum("bhqd,bhkd->bhqk", q, k) * D**-0.5
        p = torch.softmax(s.masked_fill(self.mask, float("-inf")), dim=-1)
        return torch.einsum("bhqk,bhkd->bhqd", p, v)


class Baddbmm(nn.Module):
    """GPT-NeoX's ``_attn``: 3-D (B·H, S, D) ``torch.baddbmm`` with ``alpha`` = scale, ``bmm`` for P·V."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("mask", _causal_true_masked(), persistent=False)

    def forward(self, q, k, v):
        b, h, s, d = q.shape
        q3, k3, v3 = (t.reshape(b * h, s, d) for t in (q, k, v))
        zeros = torch.zeros(b * h, s, s, dtype=q.dtype)
        scores = torch.baddbmm(zeros, q3, k3.transpose(1, 2), beta=1.0, alpha=d**-0.5)
        scores = scores.view(b, h, s, s).masked_fill(self.mask, torch.finfo(q.dtype).min)
        p = torch.softmax(scores, dim=-1).view(b * h, s, s)
        return torch.bmm(p, v3).view(b, h, s, d)


class Dropout(nn.Module):
    """``nn.Dropout`` on the probabilities (identity in eval), causal additive -inf mask."""

    def __init__(self) -> None:
        super().__init__()
        self.drop = nn.Dropout(0.1)

    def forward(self, q, k, v):
        s = q @ k.transpose(-1, -2) * D**-0.5
        s = s + torch.full((S, S), float("-inf"), dtype=q.dtype).triu(1)
        p = F.dropout(self.drop(torch.softmax(s, -1)), 0.1, training=self.training)
        return p @ v


class ScaleOnQ(nn.Module):
    """Scale on q before the product (``q * d**-0.5``), no mask."""

    def forward(self, q, k, v):
        return torch.softmax((q * D**-0.5) @ k.transpose(-1, -2), -1) @ v


class SplitScale(nn.Module):
    """Scale split over q and k (``d**-0.25`` each), causal bool mask."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("mask", _causal_true_masked(), persistent=False)

    def forward(self, q, k, v):
        c = D**-0.25
        s = (q * c) @ (k * c).transpose(-1, -2)
        return torch.softmax(s.masked_fill(self.mask, float("-inf")).float(), -1).to(v.dtype) @ v


class Bshd(nn.Module):
    """Inputs in (B, S, H, D): transposed in, the output transposed back to (B, S, H, D)."""

    def forward(self, q, k, v):
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))
        s = q @ k.transpose(-1, -2) / math.sqrt(D)
        s = s + torch.full((S, S), float("-inf"), dtype=q.dtype).triu(1)
        return (torch.softmax(s, -1) @ v).transpose(1, 2)


class Gqa(nn.Module):
    """K/V with ``KVH`` heads repeated to ``H``: ``repeat_interleave`` or ``expand`` + ``reshape``."""

    def __init__(self, how: str) -> None:
        super().__init__()
        self.how = how
        self.register_buffer("mask", _causal_true_masked(), persistent=False)

    def _repeat(self, t: torch.Tensor) -> torch.Tensor:
        n = H // KVH
        if self.how == "repeat_interleave":
            return t.repeat_interleave(n, dim=1)
        b, kvh, s, d = t.shape
        return t[:, :, None].expand(b, kvh, n, s, d).reshape(b, kvh * n, s, d)

    def forward(self, q, k, v):
        k, v = self._repeat(k), self._repeat(v)
        s = (q @ k.transpose(-1, -2)) * D**-0.5
        return torch.softmax(s.masked_fill(self.mask, float("-inf")), -1) @ v


class Sdpa(nn.Module):
    """``F.scaled_dot_product_attention`` with ``is_causal``, a bool or float mask, or ``enable_gqa``."""

    def __init__(self, how: str) -> None:
        super().__init__()
        self.how = how
        self.register_buffer("keep", torch.ones(S, S, dtype=torch.bool).tril(), persistent=False)

    def forward(self, q, k, v):
        if self.how == "is_causal":
            return F.scaled_dot_product_attention(q, k, v, is_causal=True)
        if self.how == "bool_mask":
            return F.scaled_dot_product_attention(q, k, v, attn_mask=self.keep)
        if self.how == "float_mask":
            mask = torch.zeros(S, S, dtype=q.dtype).masked_fill(~self.keep, float("-inf"))
            return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)


class LatentRope(nn.Module):
    """DeepSeek's multi-head latent attention in prefill: each head's q·k runs over its own dims
    plus RoPE dims whose key part one head shares with all (``k_pe`` expanded over heads), and
    the values keep the head dim, so q and k are 1.5× as wide as v; SDPA with ``is_causal``."""

    def forward(self, q, k, v):
        r = q.shape[-1] // 2
        q_pe = q[..., :r] * 0.5
        k_pe = k[:, :1, :, r:].expand(-1, q.shape[1], -1, -1)
        return F.scaled_dot_product_attention(torch.cat([q, q_pe], -1), torch.cat([k, k_pe], -1),
                                              v, is_causal=True, scale=(1.5 * D) ** -0.5)


# name → (module factory, kv heads, layout, extra "keep" padding input, fused attention expected)
FORMS: dict[str, tuple] = {
    "hand_written": (HandWritten, H, "bhsd", False),
    "tril_buffer_nanogpt": (TrilBuffer, H, "bhsd", False),
    "where_finfo_min_dim3": (WhereMask, H, "bhsd", False),
    "additive_neg_inf": (lambda: AdditiveMask(float("-inf")), H, "bhsd", False),
    "additive_finfo_min": (lambda: AdditiveMask("finfo.min"), H, "bhsd", False),
    "additive_minus_1e4": (lambda: AdditiveMask(-1e4), H, "bhsd", False),
    "padding_masked_fill": (lambda: PaddingMask(additive=False), H, "bhsd", True),
    "padding_additive": (lambda: PaddingMask(additive=True), H, "bhsd", True),
    "dropout_eval": (Dropout, H, "bhsd", False),
    "scale_on_q": (ScaleOnQ, H, "bhsd", False),
    "scale_split": (SplitScale, H, "bhsd", False),
    "bshd_inputs": (Bshd, H, "bshd", False),
    "gqa_repeat_interleave": (lambda: Gqa("repeat_interleave"), KVH, "bhsd", False),
    "gqa_expand_reshape": (lambda: Gqa("expand"), KVH, "bhsd", False),
    "sdpa_is_causal": (lambda: Sdpa("is_causal"), H, "bhsd", False),
    "sdpa_bool_mask": (lambda: Sdpa("bool_mask"), H, "bhsd", False),
    "sdpa_float_mask": (lambda: Sdpa("float_mask"), H, "bhsd", False),
    "sdpa_enable_gqa": (lambda: Sdpa("gqa"), KVH, "bhsd", False),
    # torch.export writes einsum as 5-D expand_dims/permute views around the 3-D bmm
    # (CollapseViewChains), baddbmm's scores in 3-D (B·H, S, S) computed in fp32 and rounded to
    # fp16, reshaped to 4-D only before the mask (LiftFoldedBatch)
    "einsum": (Einsum, H, "bhsd", False),
    "baddbmm": (Baddbmm, H, "bhsd", False),
    # XGLM / the BART family (heads folded from (B, S, H·D) projections, max(s + mask, finfo.min));
    # MPT (an fp32 ALiBi bias on fp16 scores, masked_fill(finfo(float16).min)): models/corpus.py
    "clamped_heads_folded": (lambda: ClampedHeadsFolded(S, H), H, "proj", False),
    "alibi_fp32_bias": (lambda: Fp32Alibi(S, H), H, "bhsd", False),
    "soft_capped": (SoftCapped, H, "bhsd", False),  # Gemma-2: the kernels' softcap
    "latent_rope": (LatentRope, H, "bhsd", False),  # DeepSeek's MLA: v narrower than q and k
}


def build(name: str, dtype: torch.dtype = torch.float16, seed: int = 0, head_dim: int = D):
    """``(module, inputs)`` of form ``name`` in ``dtype`` (random normal q, k, v of ``head_dim``).

    The modules' scales use ``D`` whatever ``head_dim`` is (a scale is a scale).
    """
    factory, kvh, layout, padding = FORMS[name]
    g = torch.Generator().manual_seed(seed)

    def qkv(heads: int) -> torch.Tensor:
        shape = {"bhsd": (B, heads, S, head_dim), "bshd": (B, S, heads, head_dim),
                 "proj": (B, S, heads * head_dim)}[layout]
        return torch.randn(*shape, generator=g).to(dtype)

    inputs = [qkv(H), qkv(kvh), qkv(kvh)]
    if padding:  # batch row b keeps its first S - 3b keys
        keep = torch.ones(B, S, dtype=torch.bool)
        for b in range(B):
            keep[b, S - 3 * b:] = False
        inputs.append(keep)
    return factory().to(dtype).eval(), tuple(inputs)


def sliding_window(how: str = "masked_fill_bool", dtype: torch.dtype = torch.float16,
                   head_dim: int = D):
    """``(module, inputs)`` of the sliding-window form ``how`` (:data:`WINDOW_FORMS`)."""
    g = torch.Generator().manual_seed(0)
    return SlidingWindow(how).to(dtype).eval(), tuple(
        torch.randn(B, H, S, head_dim, generator=g).to(dtype) for _ in range(3))
