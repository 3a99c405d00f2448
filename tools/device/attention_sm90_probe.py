"""On the H200: build the sm90a flash-attention kernel variants, check them, time them next to SDPA.

Kernels are built in parallel worker processes (``tvm.compile`` with the tirx pipeline →
``export_library``) and loaded here. Correctness: ``‖out − ref‖ / ‖ref‖`` against float64
attention on the GPU (``attention_probe.reference``). Timing: CUDA events, median of ``--iters``,
SDPA (and optionally the sm80-style kernel) in the same run. One JSON line per case.

    python tools/device/attention_sm90_probe.py --check --time --configs 2,128,2 2,128,3
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import json
import math
import os
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1].parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "tools" / "device"))

from attention_probe import flops, run_case  # noqa: E402


def build(spec_kw: dict, cfg: tuple | None, path: str, kind: str) -> str:
    """Worker: build one kernel to ``path``; returns an error string or ''."""
    os.environ.setdefault("TVM_CUDA_COMPILE_MODE", "nvcc")
    try:
        import tvm

        from tvmfuse.schedules.attention_spec import AttentionSpec

        spec = AttentionSpec(**spec_kw)
        if kind == "sm80":
            from tvmfuse.schedules.flash_attention import flash_attention_primfunc

            target = tvm.target.Target({"kind": "cuda", "arch": "sm_90"}, host={"kind": "llvm"})
            lib = tvm.compile(tvm.IRModule({"main": flash_attention_primfunc(spec, target)}),
                              target=target)
        else:
            from tvmfuse.schedules.flash_attention_sm90 import (
                Sm90FlashConfig,
                flash_attention_sm90_primfunc,
            )

            target = tvm.target.Target({"kind": "cuda", "arch": "sm_90a"}, host={"kind": "llvm"})
            c = Sm90FlashConfig(*cfg) if cfg else None
            f = flash_attention_sm90_primfunc(spec, target, c, name="main")
            lib = tvm.compile(tvm.IRModule({"main": f}), target=target, tir_pipeline="tirx")
        lib.export_library(path)
        return ""
    except Exception as err:  # reported per case
        return f"{type(err).__name__}: {str(err)[-1500:]}"


def _s(b, sq, skv, hq, hkv, d, dt="float16", causal="none"):
    return dict(batch=b, q_len=sq, kv_len=skv, q_heads=hq, kv_heads=hkv, head_dim=d, dtype=dt,
                scale=1 / math.sqrt(d), causal=causal)


CHECKS = {
    "causal_d128_S1024": _s(1, 1024, 1024, 2, 2, 128, causal="TopLeft"),
    "mha_d128_S256": _s(2, 256, 256, 4, 4, 128),
    "causal_d128_ragged_gqa": _s(2, 300, 300, 8, 2, 128, causal="TopLeft"),
    "causal_d64_bf16_ragged": _s(1, 200, 200, 4, 2, 64, "bfloat16", "TopLeft"),
    "gqa_ragged_d64": _s(2, 77, 333, 8, 2, 64),
    "mqa_bottomright_bf16": _s(1, 100, 260, 8, 1, 128, "bfloat16", "BottomRight"),
    "sq_gt_skv_bottomright": _s(1, 150, 70, 2, 2, 64, causal="BottomRight"),
    "full_bf16_d128": _s(1, 512, 512, 4, 4, 128, "bfloat16"),
}
BENCH = {
    "causal_B4_S2048_H16_D128": _s(4, 2048, 2048, 16, 16, 128, causal="TopLeft"),
    "full_B4_S2048_H16_D128": _s(4, 2048, 2048, 16, 16, 128),
    "causal_B1_S8192_H32_D128": _s(1, 8192, 8192, 32, 32, 128, causal="TopLeft"),
    "full_B1_S8192_H32_D128": _s(1, 8192, 8192, 32, 32, 128),
    "causal_B1_S4096_GQA32q8kv_D128": _s(1, 4096, 4096, 32, 8, 128, causal="TopLeft"),
    "causal_B4_S2048_H16_D128_bf16": _s(4, 2048, 2048, 16, 16, 128, "bfloat16", "TopLeft"),
}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--check", action="store_true")
    ap.add_argument("--time", action="store_true")
    ap.add_argument("--iters", type=int, default=30)
    ap.add_argument("--configs", nargs="*", default=[],
                    help="'default' or consumers,block_n,stages[,producer_regs,consumer_regs,overlap,"
                         "pingpong,tma_store]")
    ap.add_argument("--check-configs", type=int, default=1, help="check the first N configs")
    ap.add_argument("--bench", nargs="*", default=list(BENCH))
    ap.add_argument("--sm80", action="store_true", help="also time the sm80-style kernel")
    ap.add_argument("--json", default=None)
    ap.add_argument("--workers", type=int, default=min(16, os.cpu_count() or 4))
    args = ap.parse_args()
    import torch

    cfgs = [None if c == "default" else tuple(int(x) for x in c.split(","))
            for c in args.configs] or [None]
    jobs = {}  # name -> (spec_kw, cfg, kind)
    if args.check:
        for cfg in cfgs[:args.check_configs]:
            for name, kw in CHECKS.items():
                jobs[f"check/{name}/{cfg}"] = (kw, cfg, "sm90")
    if args.time:
        for name in args.bench:
            for cfg in cfgs:
                jobs[f"time/{name}/{cfg}"] = (BENCH[name], cfg, "sm90")
            if args.sm80 and name.endswith("B4_S2048_H16_D128"):
                jobs[f"time/{name}/sm80"] = (BENCH[name], None, "sm80")
    tmp = tempfile.mkdtemp()
    t0 = time.time()
    paths = {n: os.path.join(tmp, f"k{i}.so") for i, n in enumerate(jobs)}
    with cf.ProcessPoolExecutor(args.workers, mp_context=__import__("multiprocessing")
                                .get_context("spawn")) as ex:
        futs = {n: ex.submit(build, kw, cfg, paths[n], kind)
                for n, (kw, cfg, kind) in jobs.items()}
        errors = {n: f.result() for n, f in futs.items()}
    print(f"built {len(jobs)} kernels in {time.time() - t0:.1f}s", flush=True)
    from tvmfuse.schedules.attention_spec import AttentionSpec

    rows, sdpa_done = [], {}
    for name, (kw, cfg, kind) in jobs.items():
        spec = AttentionSpec(**kw)
        row = {"name": name, "cfg": cfg, "kind": kind}
        timed = name.startswith("time/")
        bench = name.split("/")[1]
        if errors[name]:
            row["error"] = errors[name]
        else:
            try:
                row.update(run_case(paths[name], spec, args.iters, "S8192" not in name, timed,
                                    timed and bench not in sdpa_done))
            except Exception as err:
                row["error"] = f"{type(err).__name__}: {str(err)[-800:]}"
        if "sdpa_ms" in row:
            sdpa_done[bench] = row["sdpa_ms"]
        if "ms" in row:
            row["tflops"] = flops(spec) / row["ms"] / 1e9
            if bench in sdpa_done:
                row["sdpa_ms"] = sdpa_done[bench]
                row["vs_sdpa"] = sdpa_done[bench] / row["ms"]
        rows.append(row)
        print(json.dumps(row), flush=True)
        torch.cuda.synchronize()
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
