"""Run every tvmfuse benchmark in one process (one torch / TVM import) and write one results file.

    python3 tools/bench/run_all.py [--only gemm,layernorm] [--out bench.json] [--budget-s 480]
    python3 tools/bench/run_all.py --device cpu --no-compile      # CPU smoke run, tiny shapes

Workloads, in this order: layernorm, rmsnorm, softmax, elementwise, gemm, norm_linear,
attention, mlp, decoder, attention_forms, llama_lm, onnx_decoder, hf_prefill.
Results go to --out or to tools/bench/results/<gpu>_<target>_<UTC time>.json, rewritten after each
workload so a run killed half-way keeps what it measured. A workload that raises is recorded with
``ERROR: …`` in its notes and the others still run; the exit status is 1 when any did. The last
lines printed are a compact table (speedup = baseline ms / tvmfuse ms).
"""

from __future__ import annotations

import argparse
import datetime as dt
import gc
import json
import re
import sys
import time
import traceback
from pathlib import Path
from types import ModuleType
from typing import Any

import bench_attention
import bench_attention_forms
import bench_decoder
import bench_elementwise
import bench_gemm
import bench_hf_prefill
import bench_layernorm
import bench_llama_lm
import bench_mlp
import bench_norm_linear
import bench_onnx_decoder
import bench_rmsnorm
import bench_softmax
import common
import torch

WORKLOADS: dict[str, ModuleType] = {
    "layernorm": bench_layernorm,
    "rmsnorm": bench_rmsnorm,
    "softmax": bench_softmax,
    "elementwise": bench_elementwise,
    "gemm": bench_gemm,
    "norm_linear": bench_norm_linear,
    "attention": bench_attention,
    "mlp": bench_mlp,
    "decoder": bench_decoder,
    "attention_forms": bench_attention_forms,
    "llama_lm": bench_llama_lm,
    "onnx_decoder": bench_onnx_decoder,
    "hf_prefill": bench_hf_prefill,
}


def select(only: str | None) -> list[str]:
    """The workload names of ``--only`` (comma-separated), in run order; all when empty."""
    if not only:
        return list(WORKLOADS)
    wanted = {w.strip() for w in only.split(",") if w.strip()}
    unknown = wanted - WORKLOADS.keys()
    if unknown:
        raise SystemExit(f"--only: unknown workload(s) {sorted(unknown)}; choose from "
                         f"{','.join(WORKLOADS)}")
    return [name for name in WORKLOADS if name in wanted]


def default_out(target: str) -> Path:
    """``tools/bench/results/<gpu>_<target>_<UTC time>.json``."""
    stamp = dt.datetime.now(dt.timezone.utc).strftime("%Y%m%dT%H%M%SZ")
    gpu = re.sub(r"[^a-z0-9]+", "-", common.gpu_name().lower()).strip("-")
    return Path(__file__).resolve().parent / "results" / f"{gpu}_{target}_{stamp}.json"


def failed_row(name: str, args: argparse.Namespace, notes: str) -> dict[str, Any]:
    """A row for a workload that produced none (it raised, or was skipped)."""
    return {"workload": name, "shape": "", "dtype": args.dtype, "target": args.target,
            "tvmfuse_ms": None, "baselines": {}, "rel_err": None, "notes": notes}


def release(device: str) -> None:
    """Drop the last workload's tensors, compiled graphs and cached GPU memory."""
    gc.collect()
    torch._dynamo.reset()
    if device == "cuda":
        torch.cuda.empty_cache()


def main() -> int:
    p = common.parser(__doc__)
    p.add_argument("--only", help=f"comma-separated subset of {','.join(WORKLOADS)}")
    p.add_argument("--budget-s", type=float,
                   help="do not start a workload after this many seconds (it is recorded as "
                        "skipped)")
    args = common.resolve(p.parse_args())
    names = select(args.only)
    out = Path(args.out) if args.out else default_out(args.target)
    command = common.command_line()
    print(f"gpu: {common.gpu_name()}  versions: {json.dumps(common.versions())}", flush=True)
    start = time.perf_counter()
    rows: list[dict[str, Any]] = []
    errors = 0
    for name in names:
        elapsed = time.perf_counter() - start
        if args.budget_s is not None and elapsed > args.budget_s:
            rows.append(failed_row(name, args, f"skipped: {elapsed:.0f} s > --budget-s"))
            continue
        print(f"=== {name} (t={elapsed:.0f}s)", flush=True)
        try:
            rows += WORKLOADS[name].run(args)
        except Exception as err:  # one workload failing must not lose the others
            traceback.print_exc()
            errors += 1
            rows.append(failed_row(name, args, f"ERROR: {common.short_error(err)}"))
        finally:
            release(args.device)
        common.write_results(out, rows, command)
    for row in rows:
        print(json.dumps(row))
    print(f"results: {out}  ({time.perf_counter() - start:.0f} s)")
    print(common.format_table(rows), flush=True)
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())
