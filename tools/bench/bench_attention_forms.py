"""Attention as users write it, through ``tvmfuse.compile``: the patterns issue's two forms.

``handwritten``: an fp16 module on (B, H, S, D) tensors doing
    s = (q @ kᵀ) · D^-0.5;  s = s.masked_fill(mask, -inf);  p = softmax(s.float(), -1).to(fp16);  o = p @ v
with ``mask`` a non-persistent bool buffer ``ones(S, S).triu(1)``;
``sdpa_bhsd``: ``F.scaled_dot_product_attention(q, k, v, is_causal=True)`` on (B, H, S, D) inputs.
cuda: B4·S2048·H16·D128 fp16; cpu smoke: B1·S64·H2·D32. FLOPs = 2·B·H·S²·D (causal half of 4·…).
Baseline: ``sdpa_ms`` = eager ``F.scaled_dot_product_attention(..., is_causal=True)`` on the same
tensors (the flash backend on the H200); torch_eager_ms is the module itself.
"""

from __future__ import annotations

import argparse
from typing import Any

import common
import torch
import torch.nn.functional as F
from torch import nn

SIZES = {"cuda": (4, 16, 2048, 128), "cpu": (1, 2, 64, 32)}  # (B, H, S, D)


class HandWritten(nn.Module):
    """Causal attention with a bool-buffer mask, the way the issue's user wrote it."""

    def __init__(self, seq: int) -> None:
        super().__init__()
        self.register_buffer("mask", torch.ones(seq, seq, dtype=torch.bool).triu(1), persistent=False)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        s = (q @ k.transpose(-1, -2)) * q.shape[-1] ** -0.5
        s = s.masked_fill(self.mask, float("-inf"))
        p = torch.softmax(s.float(), -1).to(q.dtype)
        return p @ v


class SdpaBHSD(nn.Module):
    """``F.scaled_dot_product_attention(q, k, v, is_causal=True)`` on (B, H, S, D) tensors."""

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)


def workloads(args: argparse.Namespace) -> list[common.Workload]:
    """Both forms at the shape of ``args.device``."""
    b, h, s, d = SIZES[args.device]
    dtype = common.DTYPES[args.dtype]
    inputs = common.random_inputs([(b, h, s, d)] * 3, dtype)
    sdpa = {"sdpa_ms": lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True)}
    shape = f"B={b} H={h} S={s} D={d} causal BHSD"
    flops = 2.0 * b * h * s * s * d
    return [common.Workload(name=f"attn_{name}", module=module.to(dtype).eval(), inputs=inputs, shape=shape,
                            dtype=args.dtype, flops=flops, extra=sdpa)
            for name, module in (("handwritten", HandWritten(s)), ("sdpa_bhsd", SdpaBHSD()))]


def run(args: argparse.Namespace) -> list[dict[str, Any]]:
    """Benchmark both forms; one row each."""
    return [common.bench(wl, args) for wl in workloads(args)]


if __name__ == "__main__":
    raise SystemExit(common.main(run, __doc__))
