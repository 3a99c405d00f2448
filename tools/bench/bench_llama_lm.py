"""A 4-layer fp16 Llama-style LM (``models/llama_lm.py``) at prefill: ids (1, 2048) → logits.

cuda: vocab 8192, hidden 2048, 16 query / 4 KV heads (head dim 128), FFN 5632, 4 layers, 1×2048
tokens (the patterns issue's workload: RMSNorm as transformers writes it, RoPE from buffers, one
fused QKV weight, SDPA causal after repeat_interleave GQA); cpu smoke: the module's ``small`` size.

FLOPs, with T = batch·seq, d = hidden / n_heads, per layer:
    projections  2·T·hidden·d·(2·n_heads + 2·n_kv_heads)       (qkv, o)
    MLP          3 · 2·T·hidden·ffn                           (gate, up, down)
    attention    2·batch·n_heads·seq²·d                        (causal half of 4·…·seq²·d)
plus the LM head 2·T·hidden·vocab. Baselines: the same module in torch eager and torch.compile.
"""

from __future__ import annotations

import argparse
from typing import Any

import common

SIZES = {
    "cuda": {"vocab": 8192, "hidden": 2048, "n_layers": 4, "n_heads": 16, "n_kv_heads": 4, "ffn": 5632,
             "batch": 1, "seq": 2048},
    "cpu": {"vocab": 256, "hidden": 128, "n_layers": 2, "n_heads": 4, "n_kv_heads": 2, "ffn": 344,
            "batch": 1, "seq": 32},
}


def flops(vocab: int, hidden: int, n_layers: int, n_heads: int, n_kv_heads: int, ffn: int, batch: int,
          seq: int) -> float:
    """Matmul FLOPs of one forward pass (see the module docstring)."""
    tokens, d = batch * seq, hidden // n_heads
    layer = (2.0 * tokens * hidden * d * (2 * n_heads + 2 * n_kv_heads) + 3 * 2.0 * tokens * hidden * ffn
             + 2.0 * batch * n_heads * seq * seq * d)
    return n_layers * layer + 2.0 * tokens * hidden * vocab


def workload(args: argparse.Namespace) -> common.Workload:
    """The LM workload at the shapes of ``args.device``."""
    from models import llama_lm

    size = SIZES[args.device]
    return common.model_workload("llama_lm", llama_lm.build, size, args.dtype, flops(**size))


def run(args: argparse.Namespace) -> list[dict[str, Any]]:
    """Benchmark the workload; one row."""
    return [common.bench(workload(args), args)]


if __name__ == "__main__":
    raise SystemExit(common.main(run, __doc__))
