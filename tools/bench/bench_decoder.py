"""Llama-style decoder layer (``models/decoder_layer.py``) at prefill.

RMSNorm → Q/K/V projections → RoPE → causal grouped-query attention → O projection → residual →
RMSNorm → SwiGLU MLP (gate, up, down) → residual. Shapes: x (batch, seq, hidden) → y (same);
cuda: batch 1, seq 2048 tokens, hidden 4096, 32 query heads and 8 KV heads of head dim 128,
ffn 11008; cpu smoke: batch 1, seq 16, hidden 64, 4 / 2 heads, ffn 256. The module is built in the
bench dtype (``module.half()``).

FLOPs, with T = batch·seq, d = hidden / n_heads:
    projections  2·T·hidden·d·(2·n_heads + 2·n_kv_heads)      (q, o; k, v)
    MLP          3 · 2·T·hidden·ffn                          (gate, up, down)
    attention    2·batch·n_heads·seq²·d                       (Q·Kᵀ and P·V, 2·…·seq²·d each,
                                                              halved for the causal mask)
Norms, RoPE, softmax and residuals are O(T·hidden) or O(heads·seq²) and not counted.
Baselines: the same module in torch eager and under torch.compile.
"""

from __future__ import annotations

import argparse
from typing import Any

import common

SIZES = {
    "cuda": {"batch": 1, "seq": 2048, "hidden": 4096, "n_heads": 32, "n_kv_heads": 8,
             "ffn": 11008},
    "cpu": {"batch": 1, "seq": 16, "hidden": 64, "n_heads": 4, "n_kv_heads": 2, "ffn": 256},
}


def flops(batch: int, seq: int, hidden: int, n_heads: int, n_kv_heads: int, ffn: int) -> float:
    """Matmul FLOPs of one layer (see the module docstring); attention counted causal."""
    tokens, head_dim = batch * seq, hidden // n_heads
    projections = 2.0 * tokens * hidden * head_dim * (2 * n_heads + 2 * n_kv_heads)
    mlp = 3 * 2.0 * tokens * hidden * ffn
    attention = 2.0 * batch * n_heads * seq * seq * head_dim
    return projections + mlp + attention


def workload(args: argparse.Namespace) -> common.Workload:
    """The decoder layer workload at the shapes of ``args.device``."""
    from models import decoder_layer

    size = SIZES[args.device]
    return common.model_workload("decoder_layer", decoder_layer.build, size, args.dtype, flops(**size))


def run(args: argparse.Namespace) -> list[dict[str, Any]]:
    """Benchmark the workload; one row."""
    return [common.bench(workload(args), args)]


if __name__ == "__main__":
    raise SystemExit(common.main(run, __doc__))
