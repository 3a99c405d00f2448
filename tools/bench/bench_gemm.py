"""GEMM with bias and ReLU epilogue: Y = ReLU(X·Wᵀ + b).

Shapes: X (M, K), W (N, K), b (N) → Y (M, N); cuda: M = N = K = 4096, cpu smoke: 64.
FLOPs = 2·M·N·K (the epilogue's M·N adds and maxes are not counted).
Baselines: torch eager (F.linear + relu = addmm + relu), torch.compile of it, and cublas_ms =
plain ``torch.mm(X, Wᵀ)`` without the epilogue.
"""

from __future__ import annotations

import argparse
from typing import Any

import common
import torch
import torch.nn.functional as F
from torch import nn

SIZES = {"cuda": (4096, 4096, 4096), "cpu": (64, 64, 64)}  # (M, N, K)


class LinearReLU(nn.Module):
    """``relu(x @ w.T + b)``: x (M, K), w (N, K), b (N) → (M, N)."""

    def forward(self, x: torch.Tensor, w: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return torch.relu(F.linear(x, w, b))


def cublas_mm(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """The bare GEMM ``x @ w.T`` (cuBLAS on CUDA); ``b`` is ignored."""
    return torch.mm(x, w.t())


def workload(args: argparse.Namespace) -> common.Workload:
    """The GEMM + bias + ReLU workload at the shapes of ``args.device``."""
    m, n, k = SIZES[args.device]
    return common.Workload(
        name="gemm_bias_relu",
        module=LinearReLU(),
        inputs=common.random_inputs([(m, k), (n, k), (n,)], common.DTYPES[args.dtype]),
        shape=f"M={m} N={n} K={k}",
        dtype=args.dtype,
        flops=2.0 * m * n * k,
        extra={"cublas_ms": cublas_mm},
    )


def run(args: argparse.Namespace) -> list[dict[str, Any]]:
    """Benchmark the workload; one row."""
    return [common.bench(workload(args), args)]


if __name__ == "__main__":
    raise SystemExit(common.main(run, __doc__))
