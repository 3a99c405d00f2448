"""Tuned against default: ``tvmfuse.tune`` on benchmark workloads, then both libraries timed.

Workloads (``--workloads``, comma-separated ``CASE:SHAPE:DTYPE``):

* bench_gemm's cases (``bias_relu``, ``bias_gelu``, ``swiglu``, ``residual``), SHAPE ``MxNxK``:
  Y = epilogue(X·Wᵀ + b); cpu: 64³;
* ``attn_causal`` / ``attn_full``, SHAPE ``BxSqxSkvxHqxHkvxD``: bench_attention's SDPA module
  (BSNH tensors) through the model pipeline;
* ``llama_lm``, SHAPE ``lm4``: bench_llama_lm's 4-layer LM prefill (its GEMMs' tile configs and
  the attention's; ``--min-mb`` high keeps the norms out).

Default (cuda): ``bias_relu:4096x4096x4096:float16``. Per workload: tune into ``--db``/NAME
(``--trials`` per task; tuning wall time recorded), compile without and with that database, check
both against the reference, time both (median of ``--iters``). Rows: one per tuned task
(``default_ms`` / ``tuned_ms`` as measured by the tuner, ``speedup``, ``used``, the space searched
and the config chosen) and one ``end_to_end`` row (``tvmfuse_ms`` = with the database,
``baselines.default_ms`` = without it). ``--out`` writes the results JSON.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path
from typing import Any

import bench_gemm
import common
import torch


def workload(case: str, shape: str, dtype: str, device: str) -> common.Workload:
    """A bench_gemm case at ``MxNxK``, an attention case at ``BxSqxSkvxHqxHkvxD`` or the LM."""
    if case == "llama_lm":
        import bench_llama_lm

        return bench_llama_lm.workload(argparse.Namespace(device=device, dtype=dtype))
    if case in ("attn_causal", "attn_full"):
        import bench_attention

        b, sq, skv, hq, hkv, d = (int(v) for v in shape.split("x"))
        causal = case == "attn_causal"
        return common.Workload(
            name=f"{case}_B{b}_S{sq}_H{hq}", module=bench_attention.SDPA(causal, hq != hkv),
            inputs=common.random_inputs([(b, sq, hq, d), (b, skv, hkv, d), (b, skv, hkv, d)],
                                        common.DTYPES[dtype]),
            shape=f"B={b} Sq={sq} Skv={skv} Hq={hq} Hkv={hkv} D={d}" + (" causal" if causal else ""),
            dtype=dtype, flops=4.0 * b * hq * sq * skv * d / (2 if causal else 1))
    dims = bench_gemm.SHAPES["cpu"][0] if device == "cpu" else tuple(int(v) for v in shape.split("x"))
    return bench_gemm.workload(case, dims, dtype)


def run_one(args: argparse.Namespace, wl: common.Workload, db: Path) -> list[dict[str, Any]]:
    """Tune one workload into ``db``, compile both ways, check and time (rows as documented)."""
    import tvmfuse
    from tvmfuse.tune import tune

    t0 = time.perf_counter()
    report = tune(wl.module, wl.inputs, db=db, target=args.target, trials=args.trials,
                  min_gflop=args.min_gflop, min_mb=args.min_mb, gpus=args.gpus)
    tune_s = time.perf_counter() - t0
    print(report.table(), flush=True)
    rows: list[dict[str, Any]] = []
    for r in report.results:
        rows.append({"workload": f"{wl.name}/{r.name}", "shape": wl.shape, "dtype": wl.dtype,
                     "target": args.target, "pattern": r.pattern, "space": r.space,
                     "trials": r.trials, "default_ms": r.default_ms, "tuned_ms": r.tuned_ms,
                     "speedup": r.speedup, "used": "tuned" if r.use_tuned else "default",
                     "config": r.config, "task_s": round(r.seconds, 1), "resumed": r.resumed})
    device = "cpu" if args.target == "cpu" else "cuda"
    fns = {}
    for name, tdb in (("default", None), ("tuned", db)):  # compile before .to(device) moves wl.module
        lib = tvmfuse.compile(wl.module, wl.inputs, target=args.target, tuning_db=tdb)
        fns[name] = tvmfuse.load(lib.export(Path(args.workdir) / f"{wl.name}_{name}.so"), device=device)
        if lib.tuning:
            print(f"tuned kernels: {lib.tuning['kernels']}", flush=True)
    inputs = tuple(x.to(device).contiguous() for x in wl.inputs)
    ref = common.reference_output(wl.module.to(device), inputs)
    times: dict[str, float | None] = {}
    errs: dict[str, float | None] = {}
    for name, fn in fns.items():
        errs[name] = common.rel_err(fn(*inputs), ref)
        times[name] = common.time_ms(lambda fn=fn: fn(*inputs), args.warmup, args.iters, device)
        print(f"{wl.name} {name}: {times[name]:.4f} ms, rel_err {errs[name]:.2e}", flush=True)
    tol = common.TOLERANCE[wl.dtype]
    notes = [f"{k} INCORRECT (rel_err > {tol:g})" for k, e in errs.items() if not e <= tol]
    rows.append({"workload": f"{wl.name}/end_to_end", "shape": wl.shape, "dtype": wl.dtype,
                 "target": args.target, "tvmfuse_ms": times["tuned"],
                 "baselines": {"default_ms": times["default"]}, "rel_err": errs["tuned"],
                 "default_rel_err": errs["default"], "trials": args.trials,
                 "tune_wall_s": round(tune_s, 1), "gpus": args.gpus, "db": str(db),
                 "notes": "; ".join(notes)})
    del ref, fns
    torch.cuda.empty_cache() if device == "cuda" else None
    return rows


def run(args: argparse.Namespace) -> list[dict[str, Any]]:
    """Every workload of ``--workloads``, each tuned into its own database under ``--db``."""
    if args.target != "cpu":  # paid once per process; timed because it dominates short runs
        from tvmfuse.tune import lazy_tensor_intrin

        lazy_tensor_intrin()
        t0 = time.perf_counter()
        import tvm.s_tir.tensor_intrin.cuda  # noqa: F401
        print(f"import tvm.s_tir.tensor_intrin.cuda: {time.perf_counter() - t0:.1f} s", flush=True)
    rows: list[dict[str, Any]] = []
    for item in args.workloads.split(","):
        parts = item.split(":")
        cases = [*bench_gemm.CASES, "attn_causal", "attn_full", "llama_lm"]
        if len(parts) != 3 or parts[0] not in cases or parts[2] not in common.DTYPES:
            raise SystemExit(f"--workloads: {item!r} is not CASE:SHAPE:DTYPE with CASE in {cases} "
                             f"and DTYPE in {list(common.DTYPES)}")
        case, shape, dtype = parts
        wl = workload(case, shape, dtype, args.device)
        short = {"float16": "fp16", "bfloat16": "bf16", "float32": "fp32"}.get(dtype, dtype)
        rows += run_one(args, wl, Path(args.db) / f"{case}_{shape}_{short}")
    return rows


def main() -> int:
    p = common.parser(__doc__)
    p.add_argument("--workloads", default="bias_relu:4096x4096x4096:float16",
                   help="CASE:SHAPE:DTYPE,... (see the module docstring)")
    p.add_argument("--db", required=True,
                   help="parent directory: one database per workload (resumed if present)")
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
