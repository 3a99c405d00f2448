"""Decode attention over a KV cache (the split-KV kernel of ``compile_lm``), swept over its config.

    out[b, 0, h] = softmax_j(scale · q[b, 0, h] · K[b, h // G, j]) · V[b, h // G, j],
    j over the visible slots 0 .. p (p = ctx − 1), M ≥ ctx slots; K, V and q are rows of the
    layer's state (B, 2·Hkv·M + Hq, D) as ``compile_lm`` lays it out (``state_rows``).

Each ``DecodeConfig(unroll, splits, fused_combine, pipeline, cluster, threads, heads)`` of
``--unroll`` × ``--splits`` × ``--combine`` (``kernel``: a second kernel, ``fused``: in the partial kernel,
``cluster``: the chunks of a head row one thread-block cluster, combined through distributed
shared memory) × ``--pipeline`` (``off``; ``on``: a second register set, the next iteration's K/V
loads in flight) × ``--threads`` (per block) × ``--heads`` (query heads a block) is built
(``flash_decode_cache_primfunc``), exported and loaded (kernels built in-process cannot launch
on the device), checked against a float32 torch reference on random inputs and timed with CUDA
events; the anchor is torch's SDPA on the visible slice (GQA by ``enable_gqa``). Rate: TB/s over
the visible K/V bytes (2·B·Hkv·ctx·D·2), floor at 4.21 TB/s. Shapes (``--case``):
``lm4`` (B1, 16q/4kv, ctx 2048, M 2081: the 4-layer LM's layer), ``7b`` (B1, 32/32, ctx 1024, M 1057),
``7b_b8`` (the same at batch 8), ``long`` (B1, 32q/8kv, ctx 8192, M 8224), ``lm4_step`` (lm4
with 2064 visible slots, as its decode steps after a 2048-token prompt see 2049 … 2080).

    python3 tools/bench/bench_decode_cache.py --case lm4 --unroll 2,4 --splits 0,33,66,128
    python3 tools/bench/bench_decode_cache.py --case lm4 --case 7b_b8 --combine kernel,fused
    python3 tools/bench/bench_decode_cache.py --case 7b --case 7b_b8 --pipeline off,on
    python3 tools/bench/bench_decode_cache.py --case lm4 --combine kernel,cluster --threads 128,256
    python3 tools/bench/bench_decode_cache.py --build-only      # nvcc builds only (any machine)
    python3 tools/bench/bench_decode_cache.py --case lm4_step --combine cluster --threads 256 \
        --unroll 9 --trace

``--trace`` builds each config with ``DecodeConfig.trace`` and, instead of timing, launches it
alone ``--iters`` times (the K/V in L2 from the launch before, or ``cold``: a 256 MB write evicts
them first) and reports, over blocks and launches, the median and max cycles each stage took
(``TRACE_SLOTS``), the spread of the blocks' start times and the kernel's span in ns.
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import tempfile
from pathlib import Path
from typing import Any

import common
import torch
import torch.nn.functional as F

# name → (B, Hq, Hkv, D, ctx, M)
CASES = {"lm4": (1, 16, 4, 128, 2048, 2081), "7b": (1, 32, 32, 128, 1024, 1057),
         "7b_b8": (8, 32, 32, 128, 1024, 1057), "long": (1, 32, 8, 128, 8192, 8224),
         "lm4_step": (1, 16, 4, 128, 2064, 2081)}  # lm4 mid-generation: the 16th new token


def build(case: tuple[int, ...], cfg: Any, path: Path, target: str = "sm90") -> Path:
    """The cache kernel of ``case`` with the DecodeConfig ``cfg``, exported to ``path``."""
    import tvm

    from tvmfuse.kernels.attention.flash_decode import flash_decode_cache_primfunc
    from tvmfuse.kernels.attention.spec import AttentionSpec
    from tvmfuse.targets import get_target
    from tvmfuse.tvm_setup import codegen_scope

    b, hq, hkv, d, _ctx, m = case
    spec = AttentionSpec(b, 1, m, hq, hkv, d, "float16", d ** -0.5)
    prim = flash_decode_cache_primfunc(spec, config=cfg)
    with codegen_scope():
        lib = tvm.compile(tvm.IRModule({"main": prim.with_attr("global_symbol", "main")}),
                          target=get_target(target).tvm_target())
    lib.export_library(str(path))
    return path


def inputs(case: tuple[int, ...], path: Path, *extra: torch.Tensor) -> tuple[Any, list, dict]:
    """The exported kernel at ``path``, its arguments (state of random rows, offsets at ctx − 1,
    starts 0, zero counters, out, then ``extra``) as TVM tensors, and the torch tensors by name."""
    import tvm

    from tvmfuse.kernels.attention.flash_decode import state_rows, sync_shape
    from tvmfuse.kernels.attention.spec import AttentionSpec

    b, hq, hkv, d, ctx, m = case
    torch.manual_seed(0)
    state = torch.randn(b, state_rows(hkv, m, hq)[3], d, device="cuda", dtype=torch.float16)
    t = {"state": state,
         "offsets": torch.full((b,), ctx - 1, device="cuda", dtype=torch.int32),  # p = ctx − 1
         "starts": torch.zeros(b, device="cuda", dtype=torch.int32),
         "sync": torch.zeros(sync_shape(AttentionSpec(b, 1, m, hq, hkv, d, "float16", 1.0)),
                             device="cuda", dtype=torch.int32),
         "out": torch.empty(b, 1, hq, d, device="cuda", dtype=torch.float16)}
    targs = [tvm.runtime.from_dlpack(x) for x in (*t.values(), *extra)]
    return tvm.runtime.load_module(str(path)), targs, t


def row(name: str, case: tuple[int, ...], cfg: Any, path: Path,
        args: argparse.Namespace) -> dict[str, Any]:
    from tvmfuse.kernels.attention.flash_decode import state_rows

    b, hq, hkv, d, ctx, m = case
    lib, targs, t = inputs(case, path)
    k0, v0, q0, _ = state_rows(hkv, m, hq)
    state, out = t["state"], t["out"]
    q = state[:, q0:].view(b, 1, hq, d)
    kc, vc = (state[:, r0:r0 + hkv * m].view(b, hkv, m, d) for r0 in (k0, v0))
    lib["main"](*targs)
    qh = q.transpose(1, 2)  # (B, Hq, 1, D)
    k, v = kc[:, :, :ctx], vc[:, :, :ctx]
    ref = F.scaled_dot_product_attention(qh.float(), k.float(), v.float(), enable_gqa=hq != hkv)
    err = common.rel_err(out.transpose(1, 2), ref)
    ms = common.time_ms(lambda: lib["main"](*targs), args.warmup, args.iters, "cuda")
    sdpa = common.time_ms(lambda: F.scaled_dot_product_attention(qh, k, v, enable_gqa=hq != hkv),
                          args.warmup, args.iters, "cuda")
    kv_bytes = 2.0 * b * hkv * ctx * d * 2
    us = common.kernel_us(lambda i: lib["main"](*targs), args.iters)  # both kernels, no host gap
    return {"workload": f"decode_cache_{name}", "shape": f"B={b} Hq={hq} Hkv={hkv} D={d} ctx={ctx} M={m}",
            "config": dataclasses.asdict(cfg), "rel_err": err,
            "correct": err <= common.TOLERANCE["float16"], "tvmfuse_us": round(ms * 1e3, 2),
            "sdpa_us": round(sdpa * 1e3, 2), "tbps": round(kv_bytes / (ms * 1e9), 3),
            "kernel_us": round(us, 2), "kernel_tbps": round(kv_bytes / (us * 1e6), 3),
            "floor_us": round(kv_bytes / common.H200_HBM_BYTES_PER_S * 1e6, 2)}


def trace_row(name: str, case: tuple[int, ...], cfg: Any, path: Path,
              args: argparse.Namespace) -> dict[str, Any]:
    """Per-stage cycles of the traced kernel (module doc), K/V warm in L2 and cold."""
    import numpy as np

    from tvmfuse.device_props import device_properties
    from tvmfuse.kernels.attention.flash_decode import TRACE_SLOTS, trace_shape
    from tvmfuse.kernels.attention.spec import AttentionSpec

    b, hq, hkv, d, ctx, m = case
    spec = AttentionSpec(b, 1, m, hq, hkv, d, "float16", d ** -0.5)
    trace = torch.zeros(trace_shape(spec, cfg, device_properties(None).sms), device="cuda",
                        dtype=torch.uint64)
    lib, targs, _ = inputs(case, path, trace)
    evict = torch.empty(256 << 20, device="cuda", dtype=torch.uint8)
    result: dict[str, Any] = {"workload": f"decode_cache_trace_{name}", "config": dataclasses.asdict(cfg),
                              "shape": f"B={b} Hq={hq} Hkv={hkv} D={d} ctx={ctx} M={m}"}
    for mode in ("warm", "cold"):
        runs = []
        for i in range(args.warmup + args.iters):
            if mode == "cold":
                evict.fill_(i & 0xFF)
            trace.zero_()
            lib["main"](*targs)
            torch.cuda.synchronize()
            if i >= args.warmup:
                runs.append(trace.view(torch.int64).cpu().numpy().copy())
        t = np.stack(runs)  # (launches, blocks, slots)
        cyc = t[..., 2:-1].astype(np.float64)
        present = [j for j in range(cyc.shape[-1]) if (cyc[..., j] != 0).all()]
        stages = {}
        for prev, cur in zip(present, present[1:], strict=False):
            delta = cyc[..., cur] - cyc[..., prev]
            stages[TRACE_SLOTS[cur + 2]] = {"median": float(np.median(delta)), "max": float(delta.max())}
        start, end = t[..., 0].astype(np.float64), t[..., -1].astype(np.float64)
        result[mode] = {"stage_cycles": stages,
                        "start_spread_ns": float(np.median(start.max(1) - start.min(1))),
                        "span_ns": float(np.median(end.max(1) - start.min(1))),
                        "block_ns": float(np.median(end - start)),
                        "sms": int(len(np.unique(t[-1, :, 1])))}
    return result


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--case", choices=list(CASES), action="append")
    p.add_argument("--unroll", default="4", help="comma-separated DecodeConfig.unroll values")
    p.add_argument("--splits", default="0", help="comma-separated DecodeConfig.splits (0: default)")
    p.add_argument("--combine", default="kernel", help="comma-separated: kernel, fused, cluster")
    p.add_argument("--pipeline", default="off", help="comma-separated: off, on")
    p.add_argument("--threads", default="128", help="comma-separated DecodeConfig.threads values")
    p.add_argument("--heads", default="0", help="comma-separated DecodeConfig.heads values (0: all)")
    p.add_argument("--build-only", action="store_true", help="nvcc builds only (no GPU needed)")
    p.add_argument("--trace", action="store_true", help="per-stage cycles instead of timings (doc)")
    p.add_argument("--warmup", type=int, default=20)
    p.add_argument("--iters", type=int, default=200)
    p.add_argument("--out")
    args = p.parse_args()
    from tvmfuse.kernels.attention.flash_decode import DecodeConfig

    work = Path(tempfile.mkdtemp(prefix="decode-cache-"))
    rows = []
    for name in args.case or ["lm4"]:
        for unroll, splits, combine, pipe, threads, heads in itertools.product(
                [int(u) for u in args.unroll.split(",")], [int(s) for s in args.splits.split(",")],
                args.combine.split(","), args.pipeline.split(","),
                [int(t) for t in args.threads.split(",")], [int(h) for h in args.heads.split(",")]):
            cfg = DecodeConfig(unroll=unroll, splits=splits, fused_combine=combine == "fused",
                               pipeline=pipe == "on", cluster=combine == "cluster", threads=threads,
                               heads=heads, trace=args.trace)
            tag = f"{name}_{unroll}_{splits}_{combine}_{pipe}_{threads}_{heads}"
            path = build(CASES[name], cfg, work / f"{tag}.so")
            if args.build_only:
                print(f"built {tag}: {path}", flush=True)
                continue
            rows.append((trace_row if args.trace else row)(name, CASES[name], cfg, path, args))
            print(rows[-1], flush=True)
    if args.out and rows:
        common.write_results(args.out, rows, common.command_line(), append=True)


if __name__ == "__main__":
    main()
