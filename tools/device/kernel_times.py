"""Per-kernel GPU time of tvmfuse-compiled benchmark workloads (torch.profiler / CUPTI).

Usage (on the GPU machine): python tools/device/kernel_times.py softmax rmsnorm [--iters 50]
For each named bench workload (tools/bench/bench_<name>.py) it compiles the module with tvmfuse,
runs it ``--iters`` times under the profiler and prints every CUDA kernel's mean device time and
the achieved rate (bytes or FLOPs of the workload ÷ the summed kernel time of one call).
``--anchor compile`` profiles the same module under ``torch.compile`` too (``eager``: plain torch),
so the kernels can be compared one by one; ``--variant NAME=FIELD:VALUE`` profiles a build with
those ``tvmfuse.Options`` fields after the default one.
"""

from __future__ import annotations

import argparse
import importlib
import sys
import tempfile
from collections import defaultdict
from pathlib import Path

import torch

BENCH = Path(__file__).resolve().parents[1] / "bench"
sys.path.insert(0, str(BENCH))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("names", nargs="+")
    ap.add_argument("--iters", type=int, default=50)
    ap.add_argument("--dtype", default="float16")
    ap.add_argument("--target", default="sm90")
    ap.add_argument("--anchor", choices=["none", "eager", "compile"], default="none")
    ap.add_argument("--variant", action="append", default=[], metavar="NAME=FIELD:VALUE[,...]",
                    help="also profile a build with these tvmfuse.Options fields (repeatable)")
    opts = ap.parse_args()
    import common

    from tvmfuse.options import Options

    variants = [("tvmfuse", None)] + [(n, Options(**f)) for n, f in map(common.parse_variant, opts.variant)]

    args = argparse.Namespace(device="cuda", dtype=opts.dtype, target=opts.target)
    for name in opts.names:
        wl = importlib.import_module(f"bench_{name}").workload(args)
        inputs = tuple(t.cuda() for t in wl.inputs)
        for label, options in variants:
            with tempfile.TemporaryDirectory() as tmp:
                fn, _ = common.compile_and_load(wl.module, tuple(wl.inputs), opts.target, tmp, name,
                                                options)
                report(f"{name} {label}", fn, inputs, wl, opts.iters)
        if opts.anchor != "none":
            module = wl.module.cuda()
            anchor = torch.compile(module) if opts.anchor == "compile" else module
            with torch.no_grad():
                report(f"{name} torch {opts.anchor}", anchor, inputs, wl, opts.iters)


def report(label: str, fn, inputs: tuple, wl, iters: int) -> None:
    """Profile ``iters`` calls of ``fn``; print each kernel's mean time per call and the rate."""
    for _ in range(5):
        fn(*inputs)
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(iters):
            fn(*inputs)
        torch.cuda.synchronize()
    per_kernel: dict[str, list[float]] = defaultdict(lambda: [0.0, 0])
    for ev in prof.events():
        if ev.device_type == torch.autograd.DeviceType.CUDA:
            per_kernel[ev.name][0] += ev.device_time / iters  # µs per call
            per_kernel[ev.name][1] += 1
    total_us = sum(us for us, _ in per_kernel.values())
    rate = ""
    if wl.bytes:
        rate = f"{wl.bytes / (total_us * 1e-6) / 1e12:.2f} TB/s"
    elif wl.flops:
        rate = f"{wl.flops / (total_us * 1e-6) / 1e12:.1f} TFLOP/s"
    print(f"{label} {wl.shape}: kernels {total_us:.1f} µs per call, {rate}")
    for kname, (us, n) in sorted(per_kernel.items(), key=lambda kv: -kv[1][0]):
        print(f"    {us:9.1f} µs  x{n // iters:<3d} {kname[:110]}")
    print_gaps(label, prof, iters)


def print_gaps(label: str, prof, iters: int) -> None:
    """Where the GPU idles: the profiled loop's span (first kernel start to last kernel end) per
    call against the kernels' busy time, and the widest gaps between consecutive kernels (each
    with the kernel before and after it)."""
    evs = sorted((ev.time_range.start, ev.time_range.end, ev.name) for ev in prof.events()
                 if ev.device_type == torch.autograd.DeviceType.CUDA)
    if len(evs) < 2:
        return
    span = (evs[-1][1] - evs[0][0]) / iters
    busy = sum(e - s for s, e, _ in evs) / iters
    gaps = sorted(((b[0] - a[1], a[2], b[2]) for a, b in zip(evs, evs[1:])), reverse=True)
    mean_gap = (span - busy) * iters / (len(evs) - 1)
    print(f"{label}: span {span:.1f} µs per call, kernels busy {busy:.1f}, idle {span - busy:.1f} "
          f"({len(evs) / iters:.0f} launches a call, mean gap {mean_gap:.2f} µs)")
    for gap, before, after in gaps[:8]:
        print(f"    gap {gap:8.1f} µs  after {before[:50]}  before {after[:50]}")

if __name__ == "__main__":
    main()
