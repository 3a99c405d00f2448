"""Causal self-attention: O = softmax(Q·Kᵀ/√D + causal mask)·V.

Shapes: q, k, v (B, H, S, D) → O (B, H, S, D); cuda: B=4, H=16, S=2048, D=128; cpu smoke:
B=1, H=2, S=64, D=32. tvmfuse compiles ``F.scaled_dot_product_attention(q, k, v, is_causal=True)``.
FLOPs = 4·B·H·S²·D halved for causality = 2·B·H·S²·D.
Baselines: sdpa_ms = the SDPA module in eager torch (flash attention on CUDA); torch_eager_ms =
naive attention (matmul, mask, fp32 softmax, matmul); torch_compile_ms = torch.compile of the
naive version. The float32 naive version is the correctness reference.
A tvmfuse call slower than 50 ms is timed with 10 iterations (see the row's notes).
"""

from __future__ import annotations

import argparse
from typing import Any

import common
import torch
import torch.nn.functional as F
from torch import nn

SIZES = {"cuda": (4, 16, 2048, 128), "cpu": (1, 2, 64, 32)}  # (B, H, S, D)


class SDPA(nn.Module):
    """``F.scaled_dot_product_attention(q, k, v, is_causal=True)`` on (B, H, S, D) inputs."""

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)


class NaiveAttention(nn.Module):
    """``softmax(q·kᵀ/√D, masked above the diagonal)·v``, softmax in float32."""

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        s = q.shape[-2]
        scores = torch.matmul(q, k.transpose(-2, -1)) * q.shape[-1] ** -0.5
        mask = torch.ones(s, s, dtype=torch.bool, device=q.device).triu(1)
        scores = scores.masked_fill(mask, float("-inf"))
        return torch.matmul(torch.softmax(scores.float(), dim=-1).to(q.dtype), v)


def workload(args: argparse.Namespace) -> common.Workload:
    """The causal attention workload at the shapes of ``args.device``."""
    b, h, s, d = SIZES[args.device]
    sdpa = SDPA()
    return common.Workload(
        name="attention_causal",
        module=sdpa,
        inputs=common.random_inputs([(b, h, s, d)] * 3, common.DTYPES[args.dtype]),
        shape=f"B={b} H={h} S={s} D={d}",
        dtype=args.dtype,
        flops=2.0 * b * h * s * s * d,
        eager=NaiveAttention(),
        extra={"sdpa_ms": sdpa},
    )


def run(args: argparse.Namespace) -> list[dict[str, Any]]:
    """Benchmark the workload; one row."""
    return [common.bench(workload(args), args)]


if __name__ == "__main__":
    raise SystemExit(common.main(run, __doc__))
