"""RMSNorm over the last dimension, written out the Hugging Face way (LlamaRMSNorm):

    h = x.float();  y = w · (h · rsqrt(mean(h², −1) + 1e-6)).to(x.dtype)

Shapes: x (M, N), w (N) → y (M, N); cuda: M = 8192, N = 4096, cpu smoke: 64×128.
Bytes = (2·M·N + N) · itemsize (read x, write y, read w); memory-bound floor = bytes / 4.21e12 B/s
(achievable H200 HBM bandwidth), reported as ``floor_ms``. The spelled-out form reaches tvmfuse as
cast / power / mean / add / rsqrt / multiply ops; whether they end up in one kernel is up to the
pipeline's pattern passes (the ``row_norm`` schedule rule handles the fused kernel either way).
Baselines: torch eager of the same module and torch.compile of it.
"""

from __future__ import annotations

import argparse
from typing import Any

import common
import torch
from torch import nn

SIZES = {"cuda": (8192, 4096), "cpu": (64, 128)}  # (M, N)
EPS = 1e-6


class RMSNorm(nn.Module):
    """``w · (x · rsqrt(mean(x², −1) + eps))`` in float32, cast back: x (M, N), w (N) → (M, N)."""

    def forward(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        h = x.to(torch.float32)
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + EPS)
        return weight * h.to(x.dtype)


def workload(args: argparse.Namespace) -> common.Workload:
    """The RMSNorm workload at the shapes of ``args.device``."""
    m, n = SIZES[args.device]
    dtype = common.DTYPES[args.dtype]
    return common.Workload(
        name="rmsnorm",
        module=RMSNorm(),
        inputs=common.random_inputs([(m, n), (n,)], dtype),
        shape=f"M={m} N={n}",
        dtype=args.dtype,
        bytes=float((2 * m * n + n) * dtype.itemsize),
    )


def run(args: argparse.Namespace) -> list[dict[str, Any]]:
    """Benchmark the workload; one row."""
    return [common.bench(workload(args), args)]


if __name__ == "__main__":
    raise SystemExit(common.main(run, __doc__))
