"""Softmax over the last dimension: y = exp(x − max(x)) / Σ exp(x − max(x)).

Shapes: x (M, N) → y (M, N); cuda: M = 8192, N = 4096, cpu smoke: 64×128.
Bytes = 2·M·N · itemsize (read x, write y); memory-bound floor = bytes / 4.21e12 B/s (achievable
H200 HBM bandwidth), reported as ``floor_ms``.
Baselines: torch eager ``torch.softmax`` and torch.compile of it.
"""

from __future__ import annotations

import argparse
from typing import Any

import common
import torch
from torch import nn

SIZES = {"cuda": (8192, 4096), "cpu": (64, 128)}  # (M, N)


class Softmax(nn.Module):
    """``torch.softmax(x, dim=-1)``: x (M, N) → (M, N)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.softmax(x, dim=-1)


def workload(args: argparse.Namespace) -> common.Workload:
    """The softmax workload at the shapes of ``args.device``."""
    m, n = SIZES[args.device]
    dtype = common.DTYPES[args.dtype]
    return common.Workload(
        name="softmax",
        module=Softmax(),
        inputs=common.random_inputs([(m, n)], dtype),
        shape=f"M={m} N={n}",
        dtype=args.dtype,
        bytes=float(2 * m * n * dtype.itemsize),
    )


def run(args: argparse.Namespace) -> list[dict[str, Any]]:
    """Benchmark the workload; one row."""
    return [common.bench(workload(args), args)]


if __name__ == "__main__":
    raise SystemExit(common.main(run, __doc__))
