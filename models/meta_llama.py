"""A transformer block in the style of Meta's Llama reference code: complex RoPE.

    h = x + wo(attention(RoPE(wq(n)), RoPE(wk(n)), wv(n)))        n = RMSNorm(x)
    y = h + w2(silu(w1(t)) · w3(t))                               t = RMSNorm(h)

    RoPE(x) = view_as_real(view_as_complex(x.float() as (…, D/2, 2)) · freqs_cis).flatten(3)
              freqs_cis = polar(1, t·θ_i) a complex (2·S, D/2) buffer, θ_i = 10000^(−2i/D)

The attention is hand-written (``repeat_kv`` by expand + reshape, scores ``/ √D`` plus an additive
``-inf`` triu buffer, fp32 softmax ``type_as`` back), as that code writes it. Shapes: x (B, S, dim)
→ (B, S, dim); head_dim = dim / n_heads.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn


def freqs_cis(head_dim: int, end: int, theta: float = 10000.0) -> torch.Tensor:
    """e^{i·t·θ_j} for positions t < end and pairs j < head_dim / 2: complex (end, head_dim / 2)."""
    inv = 1.0 / (theta ** (torch.arange(0, head_dim, 2).float() / head_dim))
    angles = torch.outer(torch.arange(end).float(), inv)
    return torch.polar(torch.ones_like(angles), angles)


def rope(x: torch.Tensor, freqs: torch.Tensor) -> torch.Tensor:
    """x (B, S, H, D) rotated pairwise by ``freqs`` (S, D/2), in x's dtype."""
    z = torch.view_as_complex(x.float().reshape(*x.shape[:-1], -1, 2))
    return torch.view_as_real(z * freqs.view(1, x.shape[1], 1, -1)).flatten(3).type_as(x)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)).type_as(x) * self.weight


class Block(nn.Module):
    """One block (module docstring); ``seq`` is the longest sequence the buffers cover."""

    def __init__(self, dim: int = 256, n_heads: int = 4, n_kv_heads: int = 2, hidden: int = 512,
                 seq: int = 64) -> None:
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = n_heads, n_kv_heads, dim // n_heads
        self.wq = nn.Linear(dim, n_heads * self.head_dim, bias=False)
        self.wk = nn.Linear(dim, n_kv_heads * self.head_dim, bias=False)
        self.wv = nn.Linear(dim, n_kv_heads * self.head_dim, bias=False)
        self.wo = nn.Linear(n_heads * self.head_dim, dim, bias=False)
        self.w1 = nn.Linear(dim, hidden, bias=False)
        self.w2 = nn.Linear(hidden, dim, bias=False)
        self.w3 = nn.Linear(dim, hidden, bias=False)
        self.attention_norm, self.ffn_norm = RMSNorm(dim), RMSNorm(dim)
        self.register_buffer("freqs_cis", freqs_cis(self.head_dim, 2 * seq), persistent=False)
        self.register_buffer("mask", torch.full((seq, seq), float("-inf")).triu(1), persistent=False)

    def _repeat_kv(self, x: torch.Tensor) -> torch.Tensor:
        b, s, h, d = x.shape
        n = self.n_heads // self.n_kv_heads
        return x[:, :, :, None, :].expand(b, s, h, n, d).reshape(b, s, h * n, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        n = self.attention_norm(x)
        q = self.wq(n).view(b, s, self.n_heads, self.head_dim)
        k = self.wk(n).view(b, s, self.n_kv_heads, self.head_dim)
        v = self.wv(n).view(b, s, self.n_kv_heads, self.head_dim)
        freqs = self.freqs_cis[:s]
        q, k = rope(q, freqs), rope(k, freqs)
        q, k, v = q.transpose(1, 2), self._repeat_kv(k).transpose(1, 2), self._repeat_kv(v).transpose(1, 2)
        scores = torch.matmul(q, k.transpose(2, 3)) / math.sqrt(self.head_dim) + self.mask[:s, :s]
        p = F.softmax(scores.float(), dim=-1).type_as(q)
        h = x + self.wo(torch.matmul(p, v).transpose(1, 2).contiguous().view(b, s, -1))
        t = self.ffn_norm(h)
        return h + self.w2(F.silu(self.w1(t)) * self.w3(t))
