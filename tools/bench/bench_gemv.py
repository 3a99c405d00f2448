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

Config sweep (``--configs``): each row is timed for every listed config of the kernel
(``ENGINE:ROWS:WARPS:UNROLL``, e.g. ``mma:16:8:4``; the ring engine ``ring:ROWS:WARPS:UNROLL:STAGES``,
e.g. ``ring:16:4:8:3``; or ``auto`` for :func:`pick_config`'s); the
kernels are built beforehand in ``--jobs`` processes. Besides the per-call CUDA-event time (which
includes the host's launch cost: for an 8 µs kernel most of it), every row records the kernel's
own duration from the profiler (``kernel_us``), the figure a CUDA-graph replay sees.

    python3 tools/bench/bench_gemv.py --shapes 7b --ms 8 --configs auto,mma:16:8:4,mma:8:8:4 --jobs 16

``--stats``: the kernel RMS-normalises x with statistics it computes in its loop, as the decode's
QKV and gate/up GEMVs do (``y = rstd · x·Wᵀ``; ``auto`` is then pick_config's ``row_stats``
choice); the reference normalises in fp32, cuBLAS stays a plain ``F.linear``.
"""

from __future__ import annotations

import argparse
import math
import sys
from typing import Any

import common  # tools/bench/common.py (puts the repository root on sys.path)
import torch
import torch.nn.functional as F

SHAPES = [(4096, 12288), (4096, 4096), (4096, 22016), (11008, 4096)]  # K × N
SHAPE_SETS = {"7b": SHAPES,  # the 4-layer LM of the LLM issue (hidden 2048, 16 q / 4 kv, FFN 5632)
              "lm4": [(2048, 3072), (2048, 2048), (2048, 11264), (5632, 2048)]}
MS = [1, 4, 16, 64]
COPY_TBPS = 4.21
ROTATE_BYTES = 200e6  # weight copies cycled per timing loop (> 4 × the 50 MB L2)


def parse_config(spec: str, problem: Any, simt_max_m: int, sms: int, stats: bool = False):
    """``auto`` (pick_config's choice) or ``ENGINE:ROWS:WARPS:UNROLL``, either with an optional
    ``+pfBYTES`` (L2 prefetch of each block's weight rows) → (GemvConfig, prefetch bytes)."""
    from tvmfuse.kernels.gemm.gemv import GemvConfig, pick_config

    spec, _, pf = spec.partition("+pf")
    prefetch = int(pf or 0)
    if spec == "auto":
        return pick_config(problem, sms, simt_max_m, row_stats=stats), prefetch
    engine, rows, warps, unroll, *stages = spec.split(":")
    if engine not in ("mma", "simt", "ring") or len(stages) != (engine == "ring"):
        raise ValueError(f"config {spec!r}: ENGINE:ROWS:WARPS:UNROLL (ring: also :STAGES)")
    cfg = GemvConfig(rows=int(rows), warps=int(warps), unroll=int(unroll), mma=engine != "simt",
                     stages=int(stages[0]) if stages else 0)
    return cfg, prefetch


RMS_EPS = 1e-5


def build_kernel(m: int, n: int, k: int, dtype: str, target: str, cfg: Any, prefetch: int,
                 path: str, stats: bool = False) -> str:
    """Build tvmfuse's GEMV kernel for (M, N, K) with ``cfg`` into the library ``path``
    (run in a worker process; returns ``path``)."""
    import os
    import shutil

    import tvm

    if shutil.which("nvcc"):  # compile the CUDA module here, with nvcc (else TVM's nvrtc)
        os.environ.setdefault("TVM_CUDA_COMPILE_MODE", "nvcc")
    import tvm.support.nvcc  # noqa: F401  (registers the CUDA compile callback)

    from tvmfuse.kernels.gemm.gemv import GemvProblem, standalone
    from tvmfuse.targets import get_target

    problem = GemvProblem(m, n, k, dtype, dtype)
    func = standalone(problem, cfg, prefetch, RMS_EPS if stats else None)
    rt = tvm.compile(tvm.IRModule({"main": func}),
                     target=get_target(target).tvm_target())
    rt.export_library(path)
    return path


def load_kernel(path: str):
    """callable(x, w, y) of a library :func:`build_kernel` wrote."""
    import tvm

    func = tvm.runtime.load_module(path)["main"]

    def call(x, w, y):
        try:
            func(x, w, y)  # torch tensors through DLPack
        except TypeError:
            func(*(tvm.runtime.from_dlpack(t) for t in (x, w, y)))

    return call


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


def run_row(m: int, k: int, n: int, args: argparse.Namespace,
            kernels: dict[str, tuple[str, Any]]) -> dict[str, Any]:
    """One shape: cuBLAS and each built kernel (``kernels``: config spec → (library, config))."""
    tdt = {"float16": torch.float16, "bfloat16": torch.bfloat16}[args.dtype]
    wbytes = n * k * 2
    copies = max(2, math.ceil(ROTATE_BYTES / wbytes))
    gen = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(m, k, device="cuda", dtype=tdt, generator=gen)
    weights = [(torch.randn(n, k, device="cuda", dtype=tdt, generator=gen) / k ** 0.5)
               for _ in range(copies)]
    y = torch.empty(m, n, device="cuda", dtype=tdt)
    row: dict[str, Any] = {"workload": "gemv", "shape": f"M={m} K={k} N={n}", "dtype": args.dtype,
                           "weight_copies": copies, "rms_stats": args.stats}
    xf = x.float()
    if args.stats:
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + RMS_EPS)
    ref = F.linear(xf, weights[0].float())
    cublas_ms = _time(lambda w: F.linear(x, w), weights, args.iters, args.warmup)
    cublas_us = common.kernel_us(lambda i: F.linear(x, weights[i % copies]), args.iters)
    row["baselines"] = {"cublas_ms": round(cublas_ms, 5),
                        "cublas_tbps": round(wbytes / cublas_ms / 1e9, 3),
                        "cublas_kernel_us": round(cublas_us, 2)}
    row["configs"] = []
    for spec, (path, (cfg, prefetch)) in kernels.items():
        r: dict[str, Any] = {"spec": spec}
        try:
            if isinstance(path, BaseException):
                raise path
            r["config"] = cfg.tag + (f" pf={prefetch}" if prefetch else "")
            kernel = load_kernel(path)
            y.zero_()
            kernel(x, weights[0], y)
            torch.cuda.synchronize()
            r["rel_err"] = float((y.float() - ref).norm() / ref.norm())
            def run(w, kernel=kernel):
                kernel(x, w, y)

            ms = _time(run, weights, args.iters, args.warmup)
            us = common.kernel_us(lambda i: run(weights[i % copies]), args.iters)
            r["tvmfuse_ms"] = round(ms, 5)
            r["kernel_us"] = round(us, 2)
            r["kernel_tbps"] = round(wbytes / us / 1e6, 3)
            r["fraction_of_copy"] = round(wbytes / us / 1e6 / COPY_TBPS, 3)
            r["vs_cublas_kernel"] = round(cublas_us / us, 3)
            if r["rel_err"] > 1e-2:
                r["status"] = "INCORRECT"
        except Exception as err:  # noqa: BLE001 - a failed build is a row, the table goes on
            r["error"] = f"{type(err).__name__}: {str(err).strip().splitlines()[-1][:300]}"
        row["configs"].append(r)
    ok = [r for r in row["configs"] if "kernel_us" in r and not r.get("status")]
    if ok:
        row["best"] = min(ok, key=lambda r: r["kernel_us"])["spec"]
    return row


def build_all(jobs: list[tuple[int, int, int]], specs: list[str], args: argparse.Namespace,
              workdir: str) -> dict[tuple[int, int, int], dict[str, tuple[Any, Any]]]:
    """Every (M, K, N) × config built in ``args.jobs`` processes: {(m, k, n): {spec: (path or
    the build's exception, config)}}; configs the kernel cannot take are left out."""
    import concurrent.futures as cf
    import multiprocessing as mp
    import os

    from tvmfuse.kernels.gemm.gemv import GemvProblem, RowStats, check

    sms = torch.cuda.get_device_properties(0).multi_processor_count
    out: dict[tuple[int, int, int], dict[str, tuple[Any, Any]]] = {}
    futures = {}
    with cf.ProcessPoolExecutor(args.jobs, mp_context=mp.get_context("spawn")) as pool:
        for m, k, n in jobs:
            problem = GemvProblem(m, n, k, args.dtype, args.dtype)
            out[(m, k, n)] = {}
            seen = set()
            for spec in specs:
                cfg, prefetch = parse_config(spec, problem, args.simt_max_m, sms, args.stats)
                stats = RowStats(False, RMS_EPS) if args.stats else None
                if (cfg, prefetch) in seen or check(problem, cfg, stats) is not None:
                    continue
                seen.add((cfg, prefetch))
                path = os.path.join(workdir, f"gemv_{m}_{k}_{n}_{len(futures)}.so")
                fut = pool.submit(build_kernel, m, n, k, args.dtype, args.target, cfg, prefetch, path,
                                  args.stats)
                futures[fut] = (m, k, n, spec, (cfg, prefetch))
        for fut in cf.as_completed(futures):
            m, k, n, spec, built = futures[fut]  # built: (GemvConfig, prefetch bytes)
            try:
                out[(m, k, n)][spec] = (fut.result(), built)
            except Exception as err:  # noqa: BLE001 - recorded in the row
                out[(m, k, n)][spec] = (err, built)
    return {key: dict(sorted(v.items(), key=lambda kv: specs.index(kv[0]))) for key, v in out.items()}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--target", choices=["sm90", "sm80"], default="sm90")
    p.add_argument("--dtype", choices=["float16", "bfloat16"], default="float16")
    p.add_argument("--iters", type=int, default=100)
    p.add_argument("--warmup", type=int, default=20)
    p.add_argument("--quick", action="store_true", help="M = 1, 16 on two shapes, 20 iterations")
    p.add_argument("--ms", help=f"comma-separated M values (default {','.join(map(str, MS))})")
    p.add_argument("--shapes", choices=sorted(SHAPE_SETS), default="7b", help="weight shapes")
    p.add_argument("--configs", default="auto",
                   help="comma-separated kernel configs: auto or ENGINE:ROWS:WARPS:UNROLL")
    p.add_argument("--jobs", type=int, default=8, help="build processes")
    p.add_argument("--simt-max-m", type=int, default=4,
                   help="M up to which the CUDA-core engine runs (0: the mma engine for every M)")
    p.add_argument("--stats", action="store_true",
                   help="x RMS-normalised with in-loop statistics (the decode's QKV, gate/up)")
    p.add_argument("--out", help="results JSON (rows appended)")
    args = p.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("needs a CUDA GPU")
    ms, shapes = (MS, SHAPE_SETS[args.shapes])
    if args.quick:
        ms, shapes, args.iters, args.warmup = [1, 16], shapes[:2], 20, 5
    if args.ms:
        ms = [int(v) for v in args.ms.split(",")]
    specs = args.configs.split(",")
    import tempfile

    with tempfile.TemporaryDirectory() as workdir:
        built = build_all([(m, k, n) for k, n in shapes for m in ms], specs, args, workdir)
        rows = []
        print(f"{'M':>3} {'K':>6} {'N':>6} {'kernel us':>10} {'TB/s':>6} {'copy%':>6} {'cuBLAS us':>10} "
              f"{'per call ms':>11} {'rel err':>8}  config")
        for k, n in shapes:
            for m in ms:
                r = run_row(m, k, n, args, built[(m, k, n)])
                rows.append(r)
                b = r["baselines"]
                for c in r["configs"]:
                    if "kernel_us" not in c:
                        print(f"{m:>3} {k:>6} {n:>6} {'error':>10}  {c['spec']}: {c.get('error')}")
                        continue
                    print(f"{m:>3} {k:>6} {n:>6} {c['kernel_us']:>10.2f} {c['kernel_tbps']:>6.2f} "
                          f"{100 * c['fraction_of_copy']:>5.0f}% {b['cublas_kernel_us']:>10.2f} "
                          f"{c['tvmfuse_ms']:>11.4f} {c['rel_err']:>8.1e}  {c['spec']} ({c['config']})"
                          f"{'  INCORRECT' if c.get('status') else ''}"
                          f"{'  *' if c['spec'] == r.get('best') else ''}", flush=True)
    if args.out:
        path = common.write_results(args.out, rows, common.command_line(), append=True)
        print(f"appended {len(rows)} rows to {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
