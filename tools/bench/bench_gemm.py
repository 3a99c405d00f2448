"""GEMM with fused epilogues: Y = epilogue(X·Wᵀ [+ b]).

Cases (``--cases``, default all):

* ``bias_gelu``:  Y = GELU(X·Wᵀ + b)                 (exact erf GELU)
* ``bias_relu``:  Y = ReLU(X·Wᵀ + b)
* ``swiglu``:     Y = SiLU(X·Wgᵀ) ⊙ (X·Wuᵀ)           (two GEMMs, the gate in the epilogue)
* ``residual``:   Y = X·Wᵀ + b + R

Shapes X (M, K), W (N, K), b (N), R (M, N) → Y (M, N); cuda: (M, N, K) = 4096³ and
8192 × 8192 × 4096 (``--shapes``), cpu smoke: 64³. FLOPs = 2·M·N·K per GEMM (the epilogue's
M·N element operations are not counted). Baselines: torch eager (F.linear + the epilogue), its
torch.compile, and ``cublas_ms`` = the bare GEMM(s) ``torch.mm(X, Wᵀ)`` without the epilogue —
the ratio to it says whether the fused epilogue is free.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable
from typing import Any

import common
import torch
import torch.nn.functional as F
from torch import nn

SHAPES = {"cuda": [(4096, 4096, 4096), (8192, 8192, 4096)], "cpu": [(64, 64, 64)]}  # (M, N, K)


class BiasGelu(nn.Module):
    """``gelu(x @ w.T + b)``."""

    def forward(self, x: torch.Tensor, w: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return F.gelu(F.linear(x, w, b))


class BiasRelu(nn.Module):
    """``relu(x @ w.T + b)``."""

    def forward(self, x: torch.Tensor, w: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return torch.relu(F.linear(x, w, b))


class SwiGLU(nn.Module):
    """``silu(x @ wg.T) * (x @ wu.T)``."""

    def forward(self, x: torch.Tensor, wg: torch.Tensor, wu: torch.Tensor) -> torch.Tensor:
        return F.silu(F.linear(x, wg)) * F.linear(x, wu)


class Residual(nn.Module):
    """``x @ w.T + b + r``."""

    def forward(self, x: torch.Tensor, w: torch.Tensor, b: torch.Tensor,
                r: torch.Tensor) -> torch.Tensor:
        return F.linear(x, w, b) + r


def _mm(*inputs: torch.Tensor) -> torch.Tensor:
    """The bare GEMM ``x @ w.T`` (cuBLAS on CUDA); further inputs are ignored."""
    return torch.mm(inputs[0], inputs[1].t())


def _mm2(x: torch.Tensor, wg: torch.Tensor, wu: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """SwiGLU's two bare GEMMs."""
    return torch.mm(x, wg.t()), torch.mm(x, wu.t())


# name → (module, input shapes from (m, n, k), GEMM count, bare-GEMM baseline)
CASES: dict[str, tuple[type[nn.Module], Callable[[int, int, int], list], int, Callable]] = {
    "bias_gelu": (BiasGelu, lambda m, n, k: [(m, k), (n, k), (n,)], 1, _mm),
    "bias_relu": (BiasRelu, lambda m, n, k: [(m, k), (n, k), (n,)], 1, _mm),
    "swiglu": (SwiGLU, lambda m, n, k: [(m, k), (n, k), (n, k)], 2, _mm2),
    "residual": (Residual, lambda m, n, k: [(m, k), (n, k), (n,), (m, n)], 1, _mm),
}


def workload(case: str, shape: tuple[int, int, int], dtype: str) -> common.Workload:
    """One fused GEMM case at (M, N, K)."""
    module, shapes, gemms, bare = CASES[case]
    m, n, k = shape
    inputs = list(common.random_inputs(shapes(m, n, k), common.DTYPES[dtype]))
    for i in range(1, 1 + gemms):  # weights scaled by 1/√K: outputs of order 1 in fp16/bf16
        inputs[i] = (inputs[i].float() / k ** 0.5).to(common.DTYPES[dtype])
    return common.Workload(
        name=f"gemm_{case}",
        module=module(),
        inputs=tuple(inputs),
        shape=f"M={m} N={n} K={k}",
        dtype=dtype,
        flops=2.0 * m * n * k * gemms,
        extra={"cublas_ms": bare},
    )


def run(args: argparse.Namespace) -> list[dict[str, Any]]:
    """Benchmark every selected case at every selected shape; one row each."""
    cases = [c for c in (getattr(args, "cases", None) or ",".join(CASES)).split(",") if c]
    unknown = set(cases) - CASES.keys()
    if unknown:
        raise SystemExit(f"--cases: unknown {sorted(unknown)}; choose from {','.join(CASES)}")
    shapes = SHAPES[args.device]
    if getattr(args, "shapes", None) and args.device == "cuda":
        shapes = [tuple(int(v) for v in s.split("x")) for s in args.shapes.split(",")]
    return [common.bench(workload(c, s, args.dtype), args) for s in shapes for c in cases]


def add_options(p: argparse.ArgumentParser) -> argparse.ArgumentParser:
    p.add_argument("--cases", help=f"comma-separated subset of {','.join(CASES)}")
    p.add_argument("--shapes", help="comma-separated MxNxK (cuda), default 4096x4096x4096,"
                                    "8192x8192x4096")
    return p


def main() -> int:
    """common.main's CLI plus ``--cases`` / ``--shapes``."""
    args = common.resolve(add_options(common.parser(__doc__)).parse_args())
    rows = run(args)
    print(json.dumps({"gpu": common.gpu_name(), "versions": common.versions(), "rows": rows},
                     indent=1))
    print(common.format_table(rows))
    if args.out:
        path = common.write_results(args.out, rows, common.command_line(), append=True)
        print(f"appended {len(rows)} row(s) to {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
