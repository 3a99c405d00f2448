"""Tuned against default: ``tvmfuse.tune`` on a benchmark workload, then both libraries timed.

Workloads: bench_gemm's cases (``--case bias_relu``: Y = ReLU(X·Wᵀ + b); cuda ``--shape``
default 4096x4096x4096, cpu 64³). Steps: tune into
``--db`` (``--trials`` per task; tuning wall time recorded), compile without and with the
database, check both against the fp32 torch reference, time both (median of ``--iters``).
Rows: one per tuned task (``default_ms`` / ``tuned_ms`` as measured by the tuner, ``speedup``,
``used``) and one ``end_to_end`` row (``tvmfuse_ms`` = with the database, ``baselines.default_ms``
= without it). ``--out`` writes the results JSON.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path
from typing import Any

import bench_gemm
import common
import torch


def run(args: argparse.Namespace) -> list[dict[str, Any]]:
    """Tune, compile both ways, check and time; the rows described in the module docstring."""
    import tvmfuse
    from tvmfuse.tune import tune

    shape = bench_gemm.SHAPES["cpu"][0] if args.device == "cpu" else tuple(
        int(v) for v in args.shape.split("x"))
    wl = bench_gemm.workload(args.case, shape, args.dtype)
    db = Path(args.db)
    if args.target != "cpu":  # paid once per process; timed because it dominates short runs
        from tvmfuse.tune import lazy_tensor_intrin

        lazy_tensor_intrin()
        t0 = time.perf_counter()
        import tvm.s_tir.tensor_intrin.cuda  # noqa: F401
        print(f"import tvm.s_tir.tensor_intrin.cuda: {time.perf_counter() - t0:.1f} s", flush=True)
    t0 = time.perf_counter()
    report = tune(wl.module, wl.inputs, db=db, target=args.target, trials=args.trials,
                  min_gflop=args.min_gflop, min_mb=args.min_mb, gpus=args.gpus)
    tune_s = time.perf_counter() - t0
    print(report.table(), flush=True)
    rows: list[dict[str, Any]] = []
    for r in report.results:
        rows.append({"workload": f"{wl.name}/{r.name}", "shape": wl.shape, "dtype": wl.dtype,
                     "target": args.target, "pattern": r.pattern, "trials": r.trials,
                     "default_ms": r.default_ms, "tuned_ms": r.tuned_ms, "speedup": r.speedup,
                     "used": "tuned" if r.use_tuned else "default", "task_s": round(r.seconds, 1),
                     "resumed": r.resumed})
    device = "cpu" if args.target == "cpu" else "cuda"
    fns = {}
    for name, tdb in (("default", None), ("tuned", db)):  # compile before .to(device) moves wl.module
        lib = tvmfuse.compile(wl.module, wl.inputs, target=args.target, tuning_db=tdb)
        fns[name] = tvmfuse.load(lib.export(Path(args.workdir) / f"{name}.so"), device=device)
        if lib.tuning:
            print(f"tuned kernels: {lib.tuning['kernels']}", flush=True)
    inputs = tuple(x.to(device).contiguous() for x in wl.inputs)
    ref = common.reference_output(wl.module.to(device), inputs)
    times: dict[str, float | None] = {}
    errs: dict[str, float | None] = {}
    for name, fn in fns.items():
        errs[name] = common.rel_err(fn(*inputs), ref)
        times[name] = common.time_ms(lambda fn=fn: fn(*inputs), args.warmup, args.iters, device)
        print(f"{name}: {times[name]:.4f} ms, rel_err {errs[name]:.2e}", flush=True)
    tol = common.TOLERANCE[wl.dtype]
    notes = [f"{k} INCORRECT (rel_err > {tol:g})" for k, e in errs.items() if not e <= tol]
    rows.append({"workload": f"{wl.name}/end_to_end", "shape": wl.shape, "dtype": wl.dtype,
                 "target": args.target, "tvmfuse_ms": times["tuned"],
                 "baselines": {"default_ms": times["default"]}, "rel_err": errs["tuned"],
                 "default_rel_err": errs["default"], "trials": args.trials,
                 "tune_wall_s": round(tune_s, 1), "gpus": args.gpus,
                 "notes": "; ".join(notes)})
    del ref
    torch.cuda.empty_cache() if device == "cuda" else None
    return rows


def main() -> int:
    p = common.parser(__doc__)
    p.add_argument("--case", choices=list(bench_gemm.CASES), default="bias_relu")
    p.add_argument("--shape", default="4096x4096x4096", help="MxNxK on cuda")
    p.add_argument("--db", required=True, help="tuning database directory (resumed if present)")
    p.add_argument("--trials", type=int, default=32)
    p.add_argument("--min-gflop", type=float, default=0.1)
    p.add_argument("--min-mb", type=float, default=8.0)
    p.add_argument("--gpus", type=int, default=None, help="measure through a local RPC tracker")
    args = common.resolve(p.parse_args())
    rows = run(args)
    if args.out:
        print(f"wrote {common.write_results(args.out, rows, common.command_line())}")
    for r in rows:
        print(r)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
