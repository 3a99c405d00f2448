"""Per-kernel GPU time of tvmfuse-compiled benchmark workloads (torch.profiler / CUPTI).

Usage (on the GPU machine): python tools/device/kernel_times.py softmax rmsnorm [--iters 50]
For each named bench workload (tools/bench/bench_<name>.py) it compiles the module with tvmfuse,
runs it ``--iters`` times under the profiler and prints every CUDA kernel's mean device time and
the achieved rate (bytes or FLOPs of the workload ÷ the summed kernel time of one call).
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
    opts = ap.parse_args()
    import common

    args = argparse.Namespace(device="cuda", dtype=opts.dtype, target=opts.target)
    for name in opts.names:
        wl = importlib.import_module(f"bench_{name}").workload(args)
        inputs = tuple(t.cuda() for t in wl.inputs)
        with tempfile.TemporaryDirectory() as tmp:
            fn, _ = common.compile_and_load(wl.module, tuple(wl.inputs), opts.target, tmp, name)
            for _ in range(5):
                fn(*inputs)
            torch.cuda.synchronize()
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
                for _ in range(opts.iters):
                    fn(*inputs)
                torch.cuda.synchronize()
        per_kernel: dict[str, float] = defaultdict(float)
        for ev in prof.events():
            if ev.device_type == torch.autograd.DeviceType.CUDA:
                per_kernel[ev.name] += ev.device_time / opts.iters  # µs per call
        total_us = sum(per_kernel.values())
        rate = ""
        if wl.bytes:
            rate = f"{wl.bytes / (total_us * 1e-6) / 1e12:.2f} TB/s"
        elif wl.flops:
            rate = f"{wl.flops / (total_us * 1e-6) / 1e12:.1f} TFLOP/s"
        print(f"{name} {wl.shape} {opts.dtype}: kernels {total_us:.1f} µs per call, {rate}")
        for kname, us in sorted(per_kernel.items(), key=lambda kv: -kv[1]):
            print(f"    {us:9.1f} µs  {kname[:100]}")


if __name__ == "__main__":
    main()
