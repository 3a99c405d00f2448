"""A five-op elementwise chain: y = gelu(x · a + b) · c + d (mul, add, gelu, mul, add).

Shapes: x, d (M, N) full tensors (the input and a residual), a, b, c (N) per-channel vectors
(a scale, a bias, a gate) → y (M, N); cuda: M = 16384, N = 4096 (64 Mi elements), cpu smoke: 64×128.
Bytes = (3·M·N + 3·N) · itemsize (read x and d, write y, read a, b and c once); memory-bound floor =
bytes / 4.21e12 B/s (achievable H200 HBM bandwidth), reported as ``floor_ms``.
Baselines: torch eager (one kernel per op) and torch.compile (one fused kernel).
"""

from __future__ import annotations

import argparse
from typing import Any

import common
import torch
import torch.nn.functional as F
from torch import nn

SIZES = {"cuda": (16384, 4096), "cpu": (64, 128)}  # (M, N)


class Chain(nn.Module):
    """``gelu(x · a + b) · c + d``: x, d (M, N); a, b, c (N) → (M, N)."""

    def forward(self, x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, c: torch.Tensor,
                d: torch.Tensor) -> torch.Tensor:
        return F.gelu(x * a + b) * c + d


def workload(args: argparse.Namespace) -> common.Workload:
    """The elementwise workload at the shapes of ``args.device``."""
    m, n = SIZES[args.device]
    dtype = common.DTYPES[args.dtype]
    return common.Workload(
        name="elementwise",
        module=Chain(),
        inputs=common.random_inputs([(m, n), (n,), (n,), (n,), (m, n)], dtype),
        shape=f"M={m} N={n}",
        dtype=args.dtype,
        bytes=float((3 * m * n + 3 * n) * dtype.itemsize),
    )


def run(args: argparse.Namespace) -> list[dict[str, Any]]:
    """Benchmark the workload; one row."""
    return [common.bench(workload(args), args)]


if __name__ == "__main__":
    raise SystemExit(common.main(run, __doc__))
