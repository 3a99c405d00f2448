"""Weight-streaming GEMV / small-M GEMM: tvmfuse's kernel vs torch (cuBLAS) ``F.linear``.

    y (M, N) = x (M, K) · W (N, K)ᵀ        fp16 (or bf16), fp32 accumulation

Shapes are the Llama-2-7B decode GEMMs, written K×N (K = input features, N = output features):
4096×12288 (fused QKV), 4096×4096 (O), 4096×22016 (gate/up pair, 2 × 11008), 11008×4096 (down),
each at M = 1, 4, 16, 64. One weight matrix (≤ 180 MB) may fit the H200's 50 MB L2 at the small
shapes, so both kernels cycle through copies of W totalling ≥ 200 MB (each call reads a W that is
not in L2). Timed with CUDA events; reported as TB/s of weight read (N·K·2 bytes / time) and the
fraction of the copy bandwidth (4.21 TB/s, DESIGN.md). Before timing, each kernel's output is
compared with ``F.linear`` in fp32 on random inputs (rel err ‖y − ref‖ / ‖ref‖).

The tvmfuse kernel is the generator's (``kernels/gemm/gemv.py``) for the problem, with the config
:func:`pick_config` chooses (what the ``gemv`` rule uses), built with ``tvm.compile`` for the
target and called on the torch tensors (DLPack, no copies).

    python3 tools/bench/bench_gemv.py --out tools/bench/results/gemv.json [--quick] [--target sm80]
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from typing import Any

import common  # tools/bench/common.py (puts the repository root on sys.path)
import torch
import torch.nn.functional as F

SHAPES = [(4096, 12288), (4096, 4096), (4096, 22016), (11008, 4096)]  # K × N
MS = [1, 4, 16, 64]
COPY_TBPS = 4.21
ROTATE_BYTES = 200e6  # weight copies cycled per timing loop (> 4 × the 50 MB L2)


def _tvm_kernel(m: int, n: int, k: int, dtype: str, target: str, simt_max_m: int):
    """(callable(x, w, y), config tag) of tvmfuse's GEMV kernel for (M, N, K)."""
    import os
    import shutil

    import tvm

    if shutil.which("nvcc"):  # compile the CUDA module here, with nvcc (else TVM's nvrtc)
        os.environ.setdefault("TVM_CUDA_COMPILE_MODE", "nvcc")
    import tvm.support.nvcc  # noqa: F401  (registers the CUDA compile callback)

    from tvmfuse.kernels.gemm.gemv import GemvProblem, pick_config, standalone
    from tvmfuse.targets import get_target

    problem = GemvProblem(m, n, k, dtype, dtype)
    cfg = pick_config(problem, torch.cuda.get_device_properties(0).multi_processor_count, simt_max_m)
    rt = tvm.compile(tvm.IRModule({"main": standalone(problem, cfg)}),
                     target=get_target(target).tvm_target())
    func = rt["main"]

    def call(x, w, y):
        try:
            func(x, w, y)  # torch tensors through DLPack
        except TypeError:
            func(*(tvm.runtime.from_dlpack(t) for t in (x, w, y)))

    return call, cfg.tag


def _time(fn, weights: list[torch.Tensor], iters: int, warmup: int) -> float:
    """Median ms of ``fn(w)`` over ``iters`` calls, W cycling through ``weights``."""
    for i in range(warmup):
        fn(weights[i % len(weights)])
    torch.cuda.synchronize()
    times = []
    for i in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn(weights[i % len(weights)])
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    times.sort()
    return times[len(times) // 2]


def run_row(m: int, k: int, n: int, args: argparse.Namespace) -> dict[str, Any]:
    tdt = {"float16": torch.float16, "bfloat16": torch.bfloat16}[args.dtype]
    wbytes = n * k * 2
    copies = max(2, math.ceil(ROTATE_BYTES / wbytes))
    gen = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(m, k, device="cuda", dtype=tdt, generator=gen)
    weights = [(torch.randn(n, k, device="cuda", dtype=tdt, generator=gen) / k ** 0.5)
               for _ in range(copies)]
    y = torch.empty(m, n, device="cuda", dtype=tdt)
    row: dict[str, Any] = {"workload": "gemv", "shape": f"M={m} K={k} N={n}", "dtype": args.dtype,
                           "weight_copies": copies}
    ref = F.linear(x.float(), weights[0].float())
    cublas_ms = _time(lambda w: F.linear(x, w), weights, args.iters, args.warmup)
    row["baselines"] = {"cublas_ms": round(cublas_ms, 5),
                        "cublas_tbps": round(wbytes / cublas_ms / 1e9, 3)}
    try:
        kernel, tag = _tvm_kernel(m, n, k, args.dtype, args.target, args.simt_max_m)
        row["config"] = tag
        kernel(x, weights[0], y)
        torch.cuda.synchronize()
        row["rel_err"] = float((y.float() - ref).norm() / ref.norm())
        ms = _time(lambda w: kernel(x, w, y), weights, args.iters, args.warmup)
        row["tvmfuse_ms"] = round(ms, 5)
        row["tvmfuse_tbps"] = round(wbytes / ms / 1e9, 3)
        row["fraction_of_copy"] = round(wbytes / ms / 1e9 / COPY_TBPS, 3)
        row["vs_cublas"] = round(cublas_ms / ms, 3)
        if row["rel_err"] > 1e-2:
            row["status"] = "INCORRECT"
    except Exception as err:  # noqa: BLE001 - a failed build is a row, the table goes on
        row["error"] = f"{type(err).__name__}: {str(err).strip().splitlines()[-1][:300]}"
    return row


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--target", choices=["sm90", "sm80"], default="sm90")
    p.add_argument("--dtype", choices=["float16", "bfloat16"], default="float16")
    p.add_argument("--iters", type=int, default=100)
    p.add_argument("--warmup", type=int, default=20)
    p.add_argument("--quick", action="store_true", help="M = 1, 16 on two shapes, 20 iterations")
    p.add_argument("--ms", help=f"comma-separated M values (default {','.join(map(str, MS))})")
    p.add_argument("--simt-max-m", type=int, default=4,
                   help="M up to which the CUDA-core engine runs (0: the mma engine for every M)")
    p.add_argument("--out", help="results JSON (rows appended)")
    args = p.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("needs a CUDA GPU")
    ms, shapes = (MS, SHAPES)
    if args.quick:
        ms, shapes, args.iters, args.warmup = [1, 16], SHAPES[:2], 20, 5
    if args.ms:
        ms = [int(v) for v in args.ms.split(",")]
    rows = []
    print(f"{'M':>3} {'K':>6} {'N':>6} {'tvmfuse ms':>11} {'TB/s':>6} {'copy%':>6} {'cuBLAS ms':>10} "
          f"{'TB/s':>6} {'rel err':>8}  config")
    for k, n in shapes:
        for m in ms:
            r = run_row(m, k, n, args)
            rows.append(r)
            b = r["baselines"]
            if "error" in r:
                print(f"{m:>3} {k:>6} {n:>6} {'error':>11} {'':>6} {'':>6} {b['cublas_ms']:>10.4f} "
                      f"{b['cublas_tbps']:>6.2f}  {r['error']}")
            else:
                print(f"{m:>3} {k:>6} {n:>6} {r['tvmfuse_ms']:>11.4f} {r['tvmfuse_tbps']:>6.2f} "
                      f"{100 * r['fraction_of_copy']:>5.0f}% {b['cublas_ms']:>10.4f} "
                      f"{b['cublas_tbps']:>6.2f} {r['rel_err']:>8.1e}  {r['config']}"
                      f"{'  INCORRECT' if r.get('status') else ''}", flush=True)
    print(json.dumps({"gpu": common.gpu_name(), "versions": common.versions(), "rows": rows}, indent=1))
    if args.out:
        path = common.write_results(args.out, rows, common.command_line(), append=True)
        print(f"appended {len(rows)} rows to {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
