"""Transformer MLP block (``models/mlp_block.py``) at prefill: y = x + W2·GELU(W1·LN(x) + b1) + b2.

Shapes: x (batch, seq, hidden) → y (same); cuda: batch 1, seq 2048 tokens, hidden 4096,
ffn 4·4096; cpu smoke: batch 1, seq 16, hidden 64, ffn 256. The module is built in the bench
dtype (``module.half()``), so its weights are embedded in that dtype.
FLOPs = 4·T·hidden·ffn with T = batch·seq (fc1 and fc2, 2·T·hidden·ffn each; the LayerNorm,
GELU, biases and residual are O(T·ffn) and not counted).
Baselines: the same module in torch eager and under torch.compile.
"""

from __future__ import annotations

import argparse
from typing import Any

import common

SIZES = {  # batch, seq, hidden, ffn
    "cuda": {"batch": 1, "seq": 2048, "hidden": 4096, "ffn": 4 * 4096},
    "cpu": {"batch": 1, "seq": 16, "hidden": 64, "ffn": 256},
}


def flops(batch: int, seq: int, hidden: int, ffn: int) -> float:
    """4·T·hidden·ffn, T = batch·seq: the two projections."""
    return 4.0 * batch * seq * hidden * ffn


def workload(args: argparse.Namespace) -> common.Workload:
    """The MLP block workload at the shapes of ``args.device``."""
    from models import mlp_block

    size = SIZES[args.device]
    return common.model_workload("mlp_block", mlp_block.build, size, args.dtype, flops(**size))


def run(args: argparse.Namespace) -> list[dict[str, Any]]:
    """Benchmark the workload; one row."""
    return [common.bench(workload(args), args)]


if __name__ == "__main__":
    raise SystemExit(common.main(run, __doc__))
