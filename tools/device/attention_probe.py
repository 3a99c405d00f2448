"""On the H200: build the flash / decode kernels, check them against float64 torch, time them.

Kernels are built in parallel worker processes (``tvm.compile`` → ``export_library``) and loaded
here. Correctness: ``‖out − ref‖ / ‖ref‖`` against float64 attention on the GPU. Timing: CUDA
events, median of ``--iters``. Prints one line per case; ``--json`` writes them.

    python tools/device/attention_probe.py --check --time --configs 4,1,64,2 8,1,64,2
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import json
import math
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))


def build(spec_kw: dict, cfg: tuple | None, arch: str, path: str, kind: str = "flash") -> str:
    """Worker: build one kernel to ``path`` (a shared library); returns an error string or ''."""
    os.environ.setdefault("TVM_CUDA_COMPILE_MODE", "nvcc")
    try:
        import tvm

        from tvmfuse.schedules.attention_spec import AttentionSpec

        spec = AttentionSpec(**spec_kw)
        target = tvm.target.Target({"kind": "cuda", "arch": arch}, host={"kind": "llvm"})
        if kind == "decode":
            from tvmfuse.schedules.flash_decode import DecodeConfig, flash_decode_primfunc

            f = flash_decode_primfunc(spec, target, DecodeConfig(*cfg) if cfg else None)
        else:
            from tvmfuse.schedules.flash_attention import FlashConfig, flash_attention_primfunc

            f = flash_attention_primfunc(spec, target, FlashConfig(*cfg) if cfg else None)
        lib = tvm.compile(tvm.IRModule({"main": f}), target=target)
        lib.export_library(path)
        return ""
    except Exception as err:  # reported per case
        return f"{type(err).__name__}: {str(err)[-1500:]}"


def reference(q, k, v, bias, spec):
    """float64 attention (BSNH) on the GPU; rows that see no key are 0."""
    import torch

    q, k, v = (x.double().transpose(1, 2) for x in (q, k, v))  # B H S D
    k = k.repeat_interleave(spec.group, dim=1)
    v = v.repeat_interleave(spec.group, dim=1)
    s = q @ k.transpose(-1, -2) * spec.scale
    if bias is not None:
        s = s + bias.double()
    if spec.causal != "none":
        off = 0 if spec.causal == "TopLeft" else spec.kv_len - spec.q_len
        i = torch.arange(spec.q_len, device=q.device)[:, None]
        j = torch.arange(spec.kv_len, device=q.device)[None]
        s = s.masked_fill(j > i + off, float("-inf"))
    p = torch.softmax(s, -1).nan_to_num(0.0)
    return (p @ v).transpose(1, 2)


def make_inputs(spec, seed=0):
    import torch

    g = torch.Generator(device="cuda").manual_seed(seed)
    dt = getattr(torch, spec.dtype)
    q = torch.randn(spec.batch, spec.q_len, spec.q_heads, spec.head_dim, device="cuda",
                    generator=g).to(dt)
    k = torch.randn(spec.batch, spec.kv_len, spec.kv_heads, spec.head_dim, device="cuda",
                    generator=g).to(dt)
    v = torch.randn(spec.batch, spec.kv_len, spec.kv_heads, spec.head_dim, device="cuda",
                    generator=g).to(dt)
    bias = None
    if spec.bias_shape is not None:
        bias = torch.randn(spec.bias_shape, device="cuda", generator=g)
        if spec.bias_shape[1:3] == (1, 1):  # padding: last third of batch 0's keys masked
            bias[0, ..., -(spec.kv_len // 3):] = -1e9
        bias = bias.to(getattr(torch, spec.bias_dtype))
    return q, k, v, bias


def run_case(lib_path, spec, iters, check, timing, sdpa):
    import torch
    import tvm

    lib = tvm.runtime.load_module(lib_path)
    f = lib["main"]
    q, k, v, bias = make_inputs(spec)
    out = torch.empty_like(q)
    args = [tvm.runtime.from_dlpack(x) for x in (q, k, v)]
    if bias is not None:
        args.append(tvm.runtime.from_dlpack(bias))
    args.append(tvm.runtime.from_dlpack(out))
    f(*args)
    torch.cuda.synchronize()
    res = {}
    if check:
        ref = reference(q, k, v, bias, spec)
        res["rel_err"] = float((out.double() - ref).norm() / ref.norm())
        res["nan"] = bool(out.isnan().any())
    if timing:
        res["ms"] = time_ms(lambda: f(*args), iters)
        if sdpa:
            qt, kt, vt = (x.transpose(1, 2) for x in (q, k, v))
            causal = spec.causal != "none"
            gqa = spec.group > 1

            def sdpa_call():
                return torch.nn.functional.scaled_dot_product_attention(
                    qt, kt, vt, is_causal=causal, enable_gqa=gqa)

            res["sdpa_ms"] = time_ms(sdpa_call, iters)
    return res


def time_ms(fn, iters):
    import torch

    for _ in range(5):
        fn()
    torch.cuda.synchronize()
    ts = []
    for _ in range(iters):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        ts.append((a, b))
    torch.cuda.synchronize()
    return statistics.median(x.elapsed_time(y) for x, y in ts)


def flops(spec) -> float:
    f = 4.0 * spec.batch * spec.q_heads * spec.q_len * spec.kv_len * spec.head_dim
    return f / 2 if spec.causal != "none" else f


def check_cases():
    """Small shapes over every variant (spec kwargs)."""
    def s(b, sq, skv, hq, hkv, d, dt="float16", causal="none", bias=None):
        return dict(batch=b, q_len=sq, kv_len=skv, q_heads=hq, kv_heads=hkv, head_dim=d, dtype=dt,
                    scale=1 / math.sqrt(d), causal=causal, bias_shape=bias,
                    bias_dtype=None if bias is None else dt)

    return {
        "mha_d128": s(2, 256, 256, 4, 4, 128),
        "causal_d128_ragged": s(2, 200, 200, 4, 4, 128, causal="TopLeft"),
        "causal_d64_bf16": s(1, 300, 300, 4, 2, 64, "bfloat16", "TopLeft"),
        "gqa_ragged_d64": s(2, 77, 333, 8, 2, 64),
        "mqa_bottomright": s(1, 100, 260, 8, 1, 128, causal="BottomRight"),
        "padding_bias": s(2, 130, 130, 4, 4, 128, bias=(2, 1, 1, 130)),
        "full_bias_causal_bf16": s(1, 96, 96, 2, 2, 64, "bfloat16", "TopLeft", (1, 2, 96, 96)),
        "sq_gt_skv_bottomright": s(1, 150, 70, 2, 2, 64, causal="BottomRight"),
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--check", action="store_true")
    ap.add_argument("--time", action="store_true")
    ap.add_argument("--arch", default="sm_90")
    ap.add_argument("--iters", type=int, default=30)
    ap.add_argument("--configs", nargs="*", default=[], help="warps,m_tiles,block_n,stages")
    ap.add_argument("--decode-configs", nargs="*", default=None)
    ap.add_argument("--json", default=None)
    ap.add_argument("--workers", type=int, default=min(16, os.cpu_count() or 4))
    args = ap.parse_args()
    import torch

    jobs = {}  # name -> (spec_kw, cfg, kind)
    if args.check:
        for name, kw in check_cases().items():
            jobs[f"check/{name}"] = (kw, None, "flash")
    bench_specs = {
        "causal_B4_S2048_H16_D128": dict(batch=4, q_len=2048, kv_len=2048, q_heads=16,
                                         kv_heads=16, head_dim=128, dtype="float16",
                                         scale=128 ** -0.5, causal="TopLeft"),
        "full_B4_S2048_H16_D128": dict(batch=4, q_len=2048, kv_len=2048, q_heads=16, kv_heads=16,
                                       head_dim=128, dtype="float16", scale=128 ** -0.5),
    }
    if args.time:
        cfgs = [tuple(int(x) for x in c.split(",")) for c in args.configs] or [None]
        for name, kw in bench_specs.items():
            for cfg in cfgs:
                jobs[f"time/{name}/{cfg}"] = (kw, cfg, "flash")
    if args.decode_configs is not None:
        dkw = dict(batch=8, q_len=1, kv_len=8192, q_heads=32, kv_heads=8, head_dim=128,
                   dtype="float16", scale=128 ** -0.5)
        jobs["check/decode_small"] = (dict(dkw, batch=2, kv_len=1000), None, "decode")
        for c in args.decode_configs or [None]:
            cfg = tuple(int(x) for x in c.split(",")) if c else None
            jobs[f"time/decode_B8_KV8192/{cfg}"] = (dkw, cfg, "decode")
    tmp = tempfile.mkdtemp()
    t0 = time.time()
    paths = {n: os.path.join(tmp, f"k{i}.so") for i, n in enumerate(jobs)}
    with cf.ProcessPoolExecutor(args.workers) as ex:
        futs = {n: ex.submit(build, kw, cfg, args.arch, paths[n], kind)
                for n, (kw, cfg, kind) in jobs.items()}
        errors = {n: f.result() for n, f in futs.items()}
    print(f"built {len(jobs)} kernels in {time.time() - t0:.1f}s", flush=True)
    from tvmfuse.schedules.attention_spec import AttentionSpec

    rows = []
    for name, (kw, cfg, kind) in jobs.items():
        spec = AttentionSpec(**kw)
        row = {"name": name, "cfg": cfg}
        if errors[name]:
            row["error"] = errors[name]
        else:
            try:
                row.update(run_case(paths[name], spec, args.iters, True,
                                    name.startswith("time/"), name.startswith("time/")))
            except Exception as err:
                row["error"] = f"{type(err).__name__}: {str(err)[-800:]}"
        if "ms" in row:
            row["tflops"] = flops(spec) / row["ms"] / 1e9
            if kind == "decode":
                nbytes = 2 * spec.batch * spec.kv_len * spec.kv_heads * spec.head_dim * 2
                row["tbps"] = nbytes / row["ms"] / 1e9
        rows.append(row)
        print(json.dumps(row), flush=True)
        torch.cuda.synchronize()
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
