"""A Llama-style decoder layer, written out the way HF ``LlamaDecoderLayer`` (eager attention) is.

    h = x + o_proj(Attention(RoPE(q_proj(n1)), RoPE(k_proj(n1)), v_proj(n1)))   n1 = RMSNorm1(x)
    y = h + down_proj(silu(gate_proj(n2)) * up_proj(n2))                       n2 = RMSNorm2(h)

    RMSNorm(x)  = weight * (x * rsqrt(mean(x², -1) + eps))
    RoPE(t)     = t * cos + rotate_half(t) * sin,   rotate_half([t1, t2]) = [-t2, t1]
                  cos/sin of (position · inv_freq) concatenated twice, inv_freq = θ^(-2i/head_dim)
    Attention   = softmax(Q Kᵀ · head_dim^-0.5 + causal_mask) V,  causal_mask = -inf above diagonal,
                  K and V repeated n_heads / n_kv_heads times (grouped-query attention, repeat_kv).

Shapes: ``x``: (batch, seq, hidden) → ``y``: (batch, seq, hidden). head_dim = hidden / n_heads;
Q: (batch, n_heads, seq, head_dim); K, V: (batch, n_kv_heads, seq, head_dim) before repeat_kv;
gate/up: (hidden → ffn), down: (ffn → hidden). No projection has a bias.
"""

from __future__ import annotations

import torch
from torch import nn


class RMSNorm(nn.Module):
    """``weight * x * rsqrt(mean(x^2, -1) + eps)`` (HF LlamaRMSNorm)."""

    def __init__(self, hidden: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        input_dtype = x.dtype
        x = x.to(torch.float32)
        variance = x.pow(2).mean(-1, keepdim=True)
        x = x * torch.rsqrt(variance + self.eps)
        return self.weight * x.to(input_dtype)


class RotaryEmbedding(nn.Module):
    """cos/sin tables for positions ``position_ids`` (HF LlamaRotaryEmbedding, default rope)."""

    def __init__(self, head_dim: int, theta: float = 10000.0) -> None:
        super().__init__()
        inv_freq = 1.0 / (
            theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim)
        )
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def forward(
        self, x: torch.Tensor, position_ids: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        inv_freq = self.inv_freq[None, :, None].float().expand(position_ids.shape[0], -1, 1)
        positions = position_ids[:, None, :].float()
        freqs = (inv_freq @ positions).transpose(1, 2)  # (batch, seq, head_dim / 2)
        emb = torch.cat((freqs, freqs), dim=-1)  # (batch, seq, head_dim)
        return emb.cos().to(x.dtype), emb.sin().to(x.dtype)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    """``[x1, x2] -> [-x2, x1]`` on the last dimension."""
    x1 = x[..., : x.shape[-1] // 2]
    x2 = x[..., x.shape[-1] // 2 :]
    return torch.cat((-x2, x1), dim=-1)


def apply_rotary_pos_emb(q, k, cos, sin):
    """RoPE on q and k of shape (batch, heads, seq, head_dim); cos/sin are (batch, seq, head_dim)."""
    cos = cos.unsqueeze(1)
    sin = sin.unsqueeze(1)
    return q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin


def repeat_kv(x: torch.Tensor, n_rep: int) -> torch.Tensor:
    """(batch, kv_heads, seq, d) -> (batch, kv_heads * n_rep, seq, d) via expand + reshape."""
    batch, kv_heads, seq, head_dim = x.shape
    if n_rep == 1:
        return x
    x = x[:, :, None, :, :].expand(batch, kv_heads, n_rep, seq, head_dim)
    return x.reshape(batch, kv_heads * n_rep, seq, head_dim)


class Attention(nn.Module):
    """Causal grouped-query self-attention with RoPE (HF LlamaAttention, eager path)."""

    def __init__(self, hidden: int, n_heads: int, n_kv_heads: int) -> None:
        super().__init__()
        if hidden % n_heads or n_heads % n_kv_heads:
            raise ValueError(
                f"hidden ({hidden}) must divide by n_heads ({n_heads}) and n_heads by "
                f"n_kv_heads ({n_kv_heads})"
            )
        self.n_heads = n_heads
        self.n_kv_heads = n_kv_heads
        self.head_dim = hidden // n_heads
        self.scaling = self.head_dim**-0.5
        self.q_proj = nn.Linear(hidden, n_heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(hidden, n_kv_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(hidden, n_kv_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(n_heads * self.head_dim, hidden, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        batch, seq, _ = x.shape
        shape = (batch, seq, -1, self.head_dim)
        q = self.q_proj(x).view(shape).transpose(1, 2)
        k = self.k_proj(x).view(shape).transpose(1, 2)
        v = self.v_proj(x).view(shape).transpose(1, 2)
        q, k = apply_rotary_pos_emb(q, k, cos, sin)

        n_rep = self.n_heads // self.n_kv_heads
        k = repeat_kv(k, n_rep)
        v = repeat_kv(v, n_rep)

        scores = torch.matmul(q, k.transpose(2, 3)) * self.scaling
        # Additive causal mask: -inf above the diagonal, 0 on and below it.
        mask = torch.full((seq, seq), float("-inf"), dtype=scores.dtype, device=x.device)
        scores = scores + torch.triu(mask, diagonal=1)
        probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
        out = torch.matmul(probs, v)  # (batch, n_heads, seq, head_dim)
        out = out.transpose(1, 2).contiguous().reshape(batch, seq, -1)
        return self.o_proj(out)


class MLP(nn.Module):
    """SwiGLU: ``down(silu(gate(x)) * up(x))``."""

    def __init__(self, hidden: int, ffn: int) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(hidden, ffn, bias=False)
        self.up_proj = nn.Linear(hidden, ffn, bias=False)
        self.down_proj = nn.Linear(ffn, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(nn.functional.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    """Pre-norm Llama decoder layer: x (batch, seq, hidden) -> (batch, seq, hidden)."""

    def __init__(
        self,
        hidden: int,
        n_heads: int,
        n_kv_heads: int,
        ffn: int,
        rope_theta: float = 10000.0,
        eps: float = 1e-6,
    ) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(hidden, eps)
        self.self_attn = Attention(hidden, n_heads, n_kv_heads)
        self.post_attention_layernorm = RMSNorm(hidden, eps)
        self.mlp = MLP(hidden, ffn)
        self.rotary_emb = RotaryEmbedding(hidden // n_heads, rope_theta)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, seq, _ = x.shape
        position_ids = torch.arange(seq, device=x.device).unsqueeze(0).expand(batch, -1)
        cos, sin = self.rotary_emb(x, position_ids)

        h = x + self.self_attn(self.input_layernorm(x), cos, sin)
        return h + self.mlp(self.post_attention_layernorm(h))


def build(
    batch: int = 1,
    seq: int = 16,
    hidden: int = 64,
    n_heads: int = 4,
    n_kv_heads: int = 2,
    ffn: int | None = None,
    dtype: torch.dtype = torch.float32,
    seed: int = 0,
) -> tuple[nn.Module, tuple[torch.Tensor]]:
    """A randomly initialised ``DecoderLayer`` (``ffn`` defaults to 4·hidden) and a randn input."""
    torch.manual_seed(seed)
    module = DecoderLayer(hidden, n_heads, n_kv_heads, ffn if ffn is not None else 4 * hidden)
    with torch.no_grad():
        # RMSNorm weights start at 1; randomise them so a dropped scale would be caught.
        module.input_layernorm.weight.normal_(1.0, 0.1)
        module.post_attention_layernorm.weight.normal_(1.0, 0.1)
    module = module.to(dtype).eval()
    x = torch.randn(batch, seq, hidden, dtype=dtype)
    return module, (x,)


def small() -> tuple[nn.Module, tuple[torch.Tensor]]:
    """The default-size layer: x of shape (1, 16, 64), 4 heads, 2 KV heads, ffn 256."""
    return build()
