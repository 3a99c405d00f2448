"""Device probe for the sm90a TIRx GEMM: correctness against torch and TFLOP/s next to cuBLAS.

Run on the H200 from the repository root: ``python tools/device/sm90_gemm_probe.py``.
Prints one line per case: shape, layout, dtype, tile, rel err vs fp32 torch, ms, TFLOP/s.
"""

from __future__ import annotations

import os
import sys
import time
import traceback

sys.path.insert(0, os.getcwd())
os.environ.setdefault("TVM_CUDA_COMPILE_MODE", "nvcc")

import torch  # noqa: E402
import tvm  # noqa: E402
import tvm.support.nvcc  # noqa: E402,F401  (registers the nvcc compile callback)

from tvmfuse.schedules.hopper.kernel import GemmConfig, GemmProblem, standalone  # noqa: E402

TARGET = tvm.target.Target({"kind": "cuda", "arch": "sm_90a"}, host="llvm")
DT = {"float16": torch.float16, "bfloat16": torch.bfloat16}


def events_ms(fn, iters: int = 30, warmup: int = 5) -> float:
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / iters


def case(m, n, k, dtype, layout, cfg, time_it=True):
    p = GemmProblem(m, n, k, dtype, dtype, layout)
    t0 = time.time()
    lib = tvm.compile(tvm.IRModule({"main": standalone(p, cfg)}), target=TARGET, tir_pipeline="tirx")
    build_s = time.time() - t0
    g = torch.Generator(device="cuda").manual_seed(0)
    a = torch.randn(m, k, device="cuda", dtype=DT[dtype], generator=g)
    w = torch.randn(n, k, device="cuda", dtype=DT[dtype], generator=g)
    b = w if layout == "nt" else w.t().contiguous()
    c = torch.empty(m, n, device="cuda", dtype=DT[dtype])
    ta, tb, tc = (tvm.runtime.from_dlpack(x) for x in (a, b, c))
    lib(ta, tb, tc)
    torch.cuda.synchronize()
    ref = a.float() @ w.float().t()
    err = float((c.float() - ref).norm() / ref.norm())
    tag = f"bn{cfg.bn}s{cfg.stages}{'P' if cfg.persistent else ''}{'V' if cfg.vector_store else ''}"
    del build_s
    line = f"{m}x{n}x{k} {layout} {dtype[:4]} {tag} err {err:.1e}"
    if time_it:
        ms = events_ms(lambda: lib(ta, tb, tc))
        cub = events_ms(lambda: torch.mm(a, w.t()))
        fl = 2.0 * m * n * k
        line += f" {ms:.4f}ms {fl / ms / 1e9:.0f}TF | mm {cub:.4f}ms {fl / cub / 1e9:.0f}TF"
    print(line, flush=True)


def main() -> None:
    print(torch.cuda.get_device_name(), tvm.__version__, flush=True)
    base = GemmConfig()
    v1 = GemmConfig(persistent=False, vector_store=False)
    cases = [
        (4096, 4096, 4096, "float16", "nt", base, True),
        (4096, 4096, 4096, "float16", "nt", v1, True),
        (4096, 4096, 4096, "float16", "nn", base, True),
        (4096, 4096, 4096, "bfloat16", "nt", base, True),
        (8192, 8192, 4096, "float16", "nt", base, True),
        (8192, 8192, 4096, "bfloat16", "nt", base, True),
        (4096, 4096, 4096, "float16", "nt", GemmConfig(bn=128, stages=6), True),
        (4096, 4096, 4096, "float16", "nt", GemmConfig(stages=3), True),
        (4096, 4096, 4096, "float16", "nt", GemmConfig(group_m=16), True),
        (2047, 4096, 4096, "float16", "nt", base, False),
        (300, 520, 1000, "float16", "nn", base, False),
        (16, 4096, 4096, "bfloat16", "nt", base, False),
    ]
    for args in cases:
        try:
            case(*args)
        except Exception:  # report and go on with the next case
            print("FAILED", args[:5], traceback.format_exc()[-600:], flush=True)


if __name__ == "__main__":
    main()
