"""A Llama-style causal LM written the way a user writes one in fp16 (no transformers import).

    h_0 = embed(ids)
    h_{l+1} = layer_l(h_l)                                         l = 0 .. n_layers - 1
    logits = lm_head(RMSNorm(h_L))

    layer(x):  n = RMSNorm(x);  q, k, v = split(qkv_proj(n))        one fused QKV weight
               q, k = RoPE(q), RoPE(k)                              cos/sin tables from buffers
               k, v = repeat_interleave(k|v, n_heads / n_kv_heads, dim=1)    GQA
               h = x + o_proj(SDPA(q, k, v, is_causal=True))
               y = h + down(silu(gate(RMSNorm(h))) * up(RMSNorm(h)))

    RMSNorm(x) = (x.float() * rsqrt(mean(x.float()², -1) + eps)).to(x.dtype) * w   (transformers' form)

Shapes: ids (batch, seq) int64 → logits (batch, seq, vocab). head_dim = hidden / n_heads; q is
(batch, n_heads, seq, head_dim), k and v (batch, n_kv_heads, seq, head_dim) before the repeat.
The patterns issue's workload is ``build(**LM_2048)`` in float16: vocab 8192, hidden 2048,
16 query / 4 KV heads, FFN 5632, 4 layers, 1×2048 tokens.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

LM_2048 = {"vocab": 8192, "hidden": 2048, "n_layers": 4, "n_heads": 16, "n_kv_heads": 4, "ffn": 5632,
           "batch": 1, "seq": 2048}


class RMSNorm(nn.Module):
    """``(x.float() * rsqrt(mean(x.float()², -1) + eps)).to(x.dtype) * weight``."""

    def __init__(self, hidden: int, eps: float = 1e-5) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        v = x.float().pow(2).mean(-1, keepdim=True)
        return (x.float() * torch.rsqrt(v + self.eps)).to(x.dtype) * self.weight


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    """``[x1, x2] -> [-x2, x1]`` on the last dimension."""
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


class Layer(nn.Module):
    """Pre-norm decoder layer with a fused QKV projection, RoPE, GQA by repeat_interleave, SDPA."""

    def __init__(self, hidden: int, n_heads: int, n_kv_heads: int, ffn: int) -> None:
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = n_heads, n_kv_heads, hidden // n_heads
        self.attn_norm = RMSNorm(hidden)
        self.qkv_proj = nn.Linear(hidden, (n_heads + 2 * n_kv_heads) * self.head_dim, bias=False)
        self.o_proj = nn.Linear(hidden, hidden, bias=False)
        self.mlp_norm = RMSNorm(hidden)
        self.gate = nn.Linear(hidden, ffn, bias=False)
        self.up = nn.Linear(hidden, ffn, bias=False)
        self.down = nn.Linear(ffn, hidden, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        d = self.head_dim
        qkv = self.qkv_proj(self.attn_norm(x))
        q, k, v = qkv.split([self.n_heads * d, self.n_kv_heads * d, self.n_kv_heads * d], dim=-1)
        q = q.view(b, s, self.n_heads, d).transpose(1, 2)
        k = k.view(b, s, self.n_kv_heads, d).transpose(1, 2)
        v = v.view(b, s, self.n_kv_heads, d).transpose(1, 2)
        q = q * cos + rotate_half(q) * sin
        k = k * cos + rotate_half(k) * sin
        rep = self.n_heads // self.n_kv_heads
        k = k.repeat_interleave(rep, dim=1)
        v = v.repeat_interleave(rep, dim=1)
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        h = x + self.o_proj(o.transpose(1, 2).reshape(b, s, -1))
        n = self.mlp_norm(h)
        return h + self.down(F.silu(self.gate(n)) * self.up(n))


class LlamaLM(nn.Module):
    """ids (batch, seq) → logits (batch, seq, vocab); RoPE tables are buffers of ``max_seq`` rows."""

    def __init__(self, vocab: int, hidden: int, n_layers: int, n_heads: int, n_kv_heads: int, ffn: int,
                 max_seq: int, theta: float = 10000.0) -> None:
        super().__init__()
        d = hidden // n_heads
        self.embed = nn.Embedding(vocab, hidden)
        self.layers = nn.ModuleList(Layer(hidden, n_heads, n_kv_heads, ffn) for _ in range(n_layers))
        self.norm = RMSNorm(hidden)
        self.lm_head = nn.Linear(hidden, vocab, bias=False)
        inv_freq = 1.0 / theta ** (torch.arange(0, d, 2).float() / d)
        freqs = torch.outer(torch.arange(max_seq).float(), inv_freq)
        emb = torch.cat((freqs, freqs), dim=-1)
        self.register_buffer("cos", emb.cos(), persistent=False)
        self.register_buffer("sin", emb.sin(), persistent=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        s = ids.shape[1]
        h = self.embed(ids)
        cos, sin = self.cos[:s].to(h.dtype), self.sin[:s].to(h.dtype)
        for layer in self.layers:
            h = layer(h, cos, sin)
        return self.lm_head(self.norm(h))


def build(vocab: int = 256, hidden: int = 128, n_layers: int = 2, n_heads: int = 4, n_kv_heads: int = 2,
          ffn: int = 344, batch: int = 1, seq: int = 32, dtype: torch.dtype = torch.float16,
          seed: int = 0) -> tuple[nn.Module, tuple[torch.Tensor]]:
    """A randomly initialised ``LlamaLM`` in ``dtype`` and random token ids of (batch, seq)."""
    torch.manual_seed(seed)
    module = LlamaLM(vocab, hidden, n_layers, n_heads, n_kv_heads, ffn, max_seq=seq)
    with torch.no_grad():
        for norm in [m for m in module.modules() if isinstance(m, RMSNorm)]:
            norm.weight.normal_(1.0, 0.1)  # not all ones: a dropped norm weight would show
        for lin in [m for m in module.modules() if isinstance(m, nn.Linear)]:
            lin.weight.normal_(0.0, lin.in_features**-0.5)
    module = module.to(dtype).eval()
    return module, (torch.randint(0, vocab, (batch, seq)),)


def small() -> tuple[nn.Module, tuple[torch.Tensor]]:
    """2 layers, hidden 128, 4 / 2 heads, vocab 256, 32 tokens, fp16."""
    return build()


def lm_2048() -> tuple[nn.Module, tuple[torch.Tensor]]:
    """The patterns issue's 4-layer fp16 LM at 1×2048 tokens."""
    return build(**LM_2048)
