"""LayerNorm feeding a Linear: Y = LayerNorm(X) · Wᵀ + b (the norm-prologue GEMM).

Shapes: X (M, K) → Y (M, N) with LayerNorm(K) (γ, β) and Linear(K → N) (W (N, K), b (N)) as
module parameters, so tvmfuse folds γ into W and applies the row statistics in the GEMM's
epilogue (``tvmfuse/passes/norm_gemm.py``); cuda: M = 8192, K = N = 4096, cpu smoke: 64 × 128 → 64.
FLOPs = 2·M·N·K (the norm's O(M·K) work is not counted).
Baselines: torch eager (F.layer_norm then F.linear), torch.compile of it, and ``cublas_ms`` =
the bare GEMM ``torch.mm(X, Wᵀ)`` — a fused norm + GEMM at that speed makes the norm free.
"""

from __future__ import annotations

import argparse
from typing import Any

import common
import torch
from torch import nn

SIZES = {"cuda": (8192, 4096, 4096), "cpu": (64, 128, 64)}  # (M, K, N)


class NormLinear(nn.Module):
    """``linear(layer_norm(x))``: x (M, K) → (M, N)."""

    def __init__(self, k: int, n: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(k)
        self.linear = nn.Linear(k, n)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(self.norm(x))


def workload(args: argparse.Namespace) -> common.Workload:
    """The LayerNorm + Linear workload at the shapes of ``args.device``."""
    m, k, n = SIZES[args.device]
    dtype = common.DTYPES[args.dtype]
    torch.manual_seed(0)
    module = NormLinear(k, n)
    with torch.no_grad():  # non-trivial γ, β so that folding them into W is exercised
        module.norm.weight.normal_(1.0, 0.1)
        module.norm.bias.normal_(0.0, 0.1)
    module = module.to(dtype).eval()
    weight = module.linear.weight

    def cublas_mm(x: torch.Tensor) -> torch.Tensor:
        return torch.mm(x, weight.to(x.device).t())

    return common.Workload(
        name="norm_linear",
        module=module,
        inputs=common.random_inputs([(m, k)], dtype),
        shape=f"M={m} K={k} N={n}",
        dtype=args.dtype,
        flops=2.0 * m * n * k,
        extra={"cublas_ms": cublas_mm},
    )


def run(args: argparse.Namespace) -> list[dict[str, Any]]:
    """Benchmark the workload; one row."""
    return [common.bench(workload(args), args)]


if __name__ == "__main__":
    raise SystemExit(common.main(run, __doc__))
