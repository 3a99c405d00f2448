"""GEMM with fused epilogues: Y = epilogue(X·Wᵀ [+ b]).

Cases (``--cases``, default all):

* ``bias_gelu``:  Y = GELU(X·Wᵀ + b)                 (exact erf GELU)
* ``bias_relu``:  Y = ReLU(X·Wᵀ + b)
* ``swiglu``:     Y = SiLU(X·Wgᵀ) ⊙ (X·Wuᵀ)           (two GEMMs, the gate in the epilogue)
* ``residual``:   Y = X·Wᵀ + b + R

Shapes X (M, K), W (N, K), b (N), R (M, N) → Y (M, N), W and b module parameters (constants, as in a
model; the inputs are X and R); cuda: (M, N, K) = 4096³ and
8192 × 8192 × 4096 (``--shapes``), cpu smoke: 64³. FLOPs = 2·M·N·K per GEMM (the epilogue's
M·N element operations are not counted). Baselines: torch eager (F.linear + the epilogue), its
torch.compile, and ``cublas_ms`` = the bare GEMM(s) ``torch.mm(X, Wᵀ)`` without the epilogue —
the ratio to it says whether the fused epilogue is free.
"""

from __future__ import annotations

import argparse
import json
from typing import Any

import common
import torch
import torch.nn.functional as F
from torch import nn

SHAPES = {"cuda": [(4096, 4096, 4096), (8192, 8192, 4096)], "cpu": [(64, 64, 64)]}  # (M, N, K)


class FusedLinear(nn.Module):
    """``epilogue(x @ w.T + b)`` with w (N, K), b (N) module parameters (constants to tvmfuse,
    as in a model); ``swiglu`` holds a second weight for the up projection."""

    def __init__(self, case: str, n: int, k: int) -> None:
        super().__init__()
        self.case = case
        self.w = nn.Parameter(torch.randn(n, k) / k ** 0.5)
        second = torch.randn(n, k) / k ** 0.5 if case == "swiglu" else torch.randn(n)
        self.b = nn.Parameter(second)  # the bias, or swiglu's up-projection weight

    def forward(self, x: torch.Tensor, *rest: torch.Tensor) -> torch.Tensor:
        if self.case == "swiglu":
            return F.silu(F.linear(x, self.w)) * F.linear(x, self.b)
        y = F.linear(x, self.w, self.b)
        if self.case == "bias_gelu":
            return F.gelu(y)
        if self.case == "bias_relu":
            return torch.relu(y)
        return y + rest[0]  # residual


CASES = {"bias_gelu": 1, "bias_relu": 1, "swiglu": 2, "residual": 1}  # name → GEMMs per call


def workload(case: str, shape: tuple[int, int, int], dtype: str) -> common.Workload:
    """One fused GEMM case at (M, N, K)."""
    m, n, k = shape
    torch.manual_seed(0)
    module = FusedLinear(case, n, k).to(common.DTYPES[dtype]).eval()
    shapes = [(m, k), (m, n)] if case == "residual" else [(m, k)]

    def cublas(x: torch.Tensor, *_: torch.Tensor):
        """The bare GEMM(s) ``x @ w.T`` (cuBLAS), no epilogue."""
        if case == "swiglu":
            return torch.mm(x, module.w.t()), torch.mm(x, module.b.t())
        return torch.mm(x, module.w.t())

    return common.Workload(
        name=f"gemm_{case}",
        module=module,
        inputs=common.random_inputs(shapes, common.DTYPES[dtype]),
        shape=f"M={m} N={n} K={k}",
        dtype=dtype,
        flops=2.0 * m * n * k * CASES[case],
        extra={"cublas_ms": cublas},
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
