"""A five-op elementwise chain: y = gelu(x · a + b) · c + d (mul, add, gelu, mul, add).

Shapes: x, d (M, N) full tensors (the input and a residual), a, b, c (N) per-channel vectors
(a scale, a bias, a gate) → y (M, N); cuda: M = 16384, N = 4096 (64 Mi elements), cpu smoke: 64×128.
Bytes = (3·M·N + 3·N) · itemsize (read x and d, write y, read a, b and c once); memory-bound floor =
bytes / 4.21e12 B/s (achievable H200 HBM bandwidth), reported as ``floor_ms``.
Baselines: torch eager (one kernel per op) and torch.compile (one fused kernel).

``--variant NAME`` builds with one of ``tvmfuse.rules.elementwise.VARIANTS`` (default: the
rule's default). ``--variants A,B,...`` (cuda) instead prints, per variant, the kernel time
(torch.profiler device time of one call, mean over ``--iters`` calls; and CUDA events around
``--iters`` back-to-back calls ÷ iters), TB/s and % of the floor, rel err vs fp32 torch and the
largest difference to the first variant's output, then torch eager / torch.compile per call.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from typing import Any

import common
import torch
import torch.nn.functional as F
from torch import nn

from tvmfuse.options import Options, use_options
from tvmfuse.rules import elementwise as ew_rule

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


def kernel_us(fn, inputs: tuple[torch.Tensor, ...], iters: int) -> tuple[float, float]:
    """``(profiler µs, events µs)`` of one call: summed CUDA kernel device time per call under
    torch.profiler, and CUDA events around ``iters`` back-to-back calls ÷ ``iters``."""
    for _ in range(5):
        fn(*inputs)
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(iters):
            fn(*inputs)
        torch.cuda.synchronize()
    prof_us = sum(ev.device_time for ev in prof.events()
                  if ev.device_type == torch.autograd.DeviceType.CUDA) / iters
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        fn(*inputs)
    end.record()
    torch.cuda.synchronize()
    return prof_us, start.elapsed_time(end) * 1e3 / iters


def compare_variants(args: argparse.Namespace, names: list[str], rounds: int = 2) -> None:
    """The table described in the module docstring; each variant is timed ``rounds`` times,
    interleaved with the others (the spread shows the noise)."""
    wl = workload(args)
    inputs = tuple(t.cuda() for t in wl.inputs)
    ref = common.reference_output(wl.module, inputs)
    floor_us = wl.bytes / common.H200_HBM_BYTES_PER_S * 1e6
    fns, outs = {}, {}
    with tempfile.TemporaryDirectory() as tmp:
        for name in names:
            with use_options(Options(elementwise_variant=name)):
                fns[name], _ = common.compile_and_load(wl.module, wl.inputs, args.target, tmp, name)
            outs[name] = fns[name](*inputs)
        times: dict[str, list[tuple[float, float]]] = {name: [] for name in names}
        for _ in range(rounds):
            for name in names:
                times[name].append(kernel_us(fns[name], inputs, args.iters))
    first = outs[names[0]].float()
    print(f"elementwise {wl.shape} {args.dtype}: floor {floor_us:.1f} us (bytes / 4.21 TB/s)")
    print(f"{'variant':<14} {'kernel us':>22} {'events us':>22} {'TB/s':>6} {'%floor':>7} "
          f"{'rel_err':>8} {'max|d| vs ' + names[0]:>16}")
    for name in names:
        prof = [t[0] for t in times[name]]
        events = [t[1] for t in times[name]]
        best = min(prof) or min(events)  # no profiler kernel records: use the events
        diff = float((outs[name].float() - first).abs().max())
        print(f"{name:<14} {' '.join(f'{t:7.1f}' for t in prof):>22} "
              f"{' '.join(f'{t:7.1f}' for t in events):>22} {wl.bytes / best / 1e6:6.2f} "
              f"{100 * floor_us / best:6.1f}% {common.rel_err(outs[name], ref):8.1e} {diff:16.3g}")
    base = common.baselines(wl.module, inputs, use_compile=not args.no_compile,
                            warmup=args.warmup, iters=args.iters)
    print("torch per call (CUDA events, median):",
          {k: v for k, v in base.items() if k.endswith("_ms")}, base.get("errors", ""))


def _variant_args() -> argparse.Namespace:
    """``--variant`` / ``--variants`` taken off ``sys.argv`` (the rest goes to ``common.main``)."""
    ap = argparse.ArgumentParser(add_help=False)
    ap.add_argument("--variant", choices=list(ew_rule.VARIANTS))
    ap.add_argument("--variants", help="comma-separated names from elementwise.VARIANTS")
    known, rest = ap.parse_known_args()
    sys.argv = [sys.argv[0], *rest]
    return known


if __name__ == "__main__":
    chosen = _variant_args()
    if chosen.variants:
        opts = common.resolve(common.parser(__doc__).parse_args())
        compare_variants(opts, chosen.variants.split(","))
        raise SystemExit(0)
    variant = Options(elementwise_variant=chosen.variant) if chosen.variant else None
    with use_options(variant):
        code = common.main(run, __doc__)
    raise SystemExit(code)
