"""LayerNorm over the last dimension: y = (x − mean) / sqrt(var + 1e-5) · weight + bias.

Shapes: x (M, N), weight (N), bias (N) → y (M, N); cuda: M = 8192, N = 4096, cpu smoke: 64×128.
Bytes = (2·M·N + 2·N) · itemsize (read x, write y, read weight and bias); memory-bound floor =
bytes / 4.21e12 B/s (achievable H200 HBM bandwidth), reported as ``floor_ms``.
Baselines: torch eager ``F.layer_norm`` and torch.compile of it.
"""

from __future__ import annotations

import argparse
from typing import Any

import common
import torch
import torch.nn.functional as F
from torch import nn

SIZES = {"cuda": (8192, 4096), "cpu": (64, 128)}  # (M, N)
EPS = 1e-5


class LayerNorm(nn.Module):
    """``F.layer_norm(x, (N,), weight, bias)``: x (M, N) → (M, N)."""

    def forward(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
        return F.layer_norm(x, (x.shape[-1],), weight, bias, EPS)


def workload(args: argparse.Namespace) -> common.Workload:
    """The LayerNorm workload at the shapes of ``args.device``."""
    m, n = SIZES[args.device]
    dtype = common.DTYPES[args.dtype]
    return common.Workload(
        name="layernorm",
        module=LayerNorm(),
        inputs=common.random_inputs([(m, n), (n,), (n,)], dtype),
        shape=f"M={m} N={n}",
        dtype=args.dtype,
        bytes=float((2 * m * n + 2 * n) * dtype.itemsize),
    )


def run(args: argparse.Namespace) -> list[dict[str, Any]]:
    """Benchmark the workload; one row."""
    return [common.bench(workload(args), args)]


if __name__ == "__main__":
    raise SystemExit(common.main(run, __doc__))
