"""Device probe for the sm90a TIRx GEMM: correctness against torch and TFLOP/s next to cuBLAS.

Run on the H200 from the repository root: ``python tools/device/sm90_gemm_probe.py``; the session-5
cluster / ping-pong A/B set: ``--cluster build DIR`` then ``--cluster run DIR 0`` (see cluster_main);
a tile sweep of given shapes (the default config against 128×256 / 128×192 / 128×128 / 256×128
tiles): ``--sweep 2048x3072x2048,2048x2048x2048`` (see sweep_main); ``--tiles 176:5:2,160:6:1`` adds
128×BN tiles (BN:stages:cluster_m) to each shape's sweep; ``--profile`` adds each kernel's own
duration (torch profiler) next to the back-to-back event times.
Prints one line per case: shape, layout, dtype, tile, rel err vs fp32 torch, ms, TFLOP/s.
"""

from __future__ import annotations

import os
import sys
import time
import traceback

sys.path.insert(0, os.getcwd())
sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "bench"))
os.environ.setdefault("TVM_CUDA_COMPILE_MODE", "nvcc")

import torch  # noqa: E402
import tvm  # noqa: E402
import tvm.support.nvcc  # noqa: E402,F401  (registers the nvcc compile callback)

from tvmfuse.kernels.gemm.sm90 import (  # noqa: E402
    GemmConfig,
    GemmProblem,
    standalone,
)

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


def build(m, n, k, dtype, layout, cfg, row_stats=None):
    """The standalone kernel built for sm_90a (a runtime module)."""
    p = GemmProblem(m, n, k, dtype, dtype, layout)
    return tvm.compile(tvm.IRModule({"main": standalone(p, cfg, row_stats)}), target=TARGET,
                       tir_pipeline="tirx")


def _build_to(job) -> str:
    """Pool worker: build case ``i`` and export it to ``DIR/case{i}.so`` (the path or the error)."""
    i, args, out_dir = job
    m, n, k, dtype, layout, cfg, _time_it, *rs = args
    try:
        path = os.path.join(out_dir, f"case{i}.so")
        build(m, n, k, dtype, layout, cfg, *rs).export_library(path)
        return path
    except Exception:
        return "FAILED " + traceback.format_exc()[-400:]


def case(m, n, k, dtype, layout, cfg, time_it=True, row_stats=None, lib=None):
    t0 = time.time()
    lib = lib or build(m, n, k, dtype, layout, cfg, row_stats)
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
    if row_stats is not None:  # C = rstd * (A·B - mean) (LayerNorm) or rstd * A·B (RMSNorm)
        x = a.double()
        mean = x.mean(1, keepdim=True) if row_stats.centered else torch.zeros_like(x[:, :1])
        var = x.var(1, unbiased=False, keepdim=True) if row_stats.centered else (x * x).mean(1, True)
        rstd = torch.rsqrt(var + row_stats.eps)
        ref = (rstd * (ref.double() - mean)).float()
    err = float((c.float() - ref).norm() / ref.norm())
    tag = (f"{f'bm{cfg.bm}' if cfg.bm != 128 else ''}"
           f"bn{cfg.bn}s{cfg.stages}{'P' if cfg.persistent else ''}{'V' if cfg.vector_store else ''}"
           f"{f'C{cfg.cluster_m}' if cfg.cluster_m > 1 else ''}{'W' if cfg.warp_release else ''}"
           f"{f'g{cfg.group_m}' if cfg.group_m != 8 else ''}"
           f"{f'sm{cfg.num_sms}' if cfg.num_sms != 132 else ''}"
           f"{'+stats' if row_stats else ''}")
    del build_s
    line = f"{m}x{n}x{k} {layout} {dtype[:4]} {tag} err {err:.1e}"
    if time_it:
        ms = events_ms(lambda: lib(ta, tb, tc))
        cub = events_ms(lambda: torch.mm(a, w.t()))
        fl = 2.0 * m * n * k
        line += f" {ms:.4f}ms {fl / ms / 1e9:.0f}TF | mm {cub:.4f}ms {fl / cub / 1e9:.0f}TF"
        if "--profile" in sys.argv:  # the kernels' own durations, without the launch gaps
            from common import kernel_us  # tools/bench

            line += (f" | kernel {kernel_us(lambda i: lib(ta, tb, tc), 20):.1f}us"
                     f" mm kernel {kernel_us(lambda i: torch.mm(a, w.t()), 20):.1f}us")
    print(line, flush=True)


def cluster_cases() -> list:
    """Session 5, last call: a 256x128 tile of two consumer warpgroups with two 64-row chains each
    (the shape cuBLAS's nvjet kernel runs at 4096^3, per ncu) against the 128x256 default.
    Correctness cases untimed."""
    c2 = GemmConfig(cluster_m=2, warp_release=True)
    t2 = GemmConfig(bm=256, bn=128, wg_rows=128, cluster_m=2, warp_release=True)
    sq = (4096, 4096, 4096, "float16", "nt")
    return [
        (300, 520, 1000, "float16", "nn", t2, False),
        (2047, 4096, 4096, "bfloat16", "nt", t2, False),
        (*sq, c2, True), (*sq, t2, True),
        (*sq, GemmConfig(bm=256, bn=128, wg_rows=128, cluster_m=2, warp_release=True, stages=3), True),
        (8192, 8192, 4096, "float16", "nt", c2, True), (8192, 8192, 4096, "float16", "nt", t2, True),
        (*sq, c2, True),
    ]


def cluster_main(argv: list[str]) -> None:
    """``--cluster build DIR``: build every case in parallel; ``--cluster run DIR START``: run
    cases START.. from their libraries, printing ``DONE i`` after each (a caller restarts after
    the last DONE when a kernel hangs past its timeout)."""
    mode, out_dir = argv[0], argv[1]
    cases = cluster_cases()
    if mode == "build":
        import multiprocessing
        from concurrent.futures import ProcessPoolExecutor

        os.makedirs(out_dir, exist_ok=True)  # spawn: a forked child cannot initialise CUDA
        with ProcessPoolExecutor(max_workers=min(12, os.cpu_count() or 4),
                                 mp_context=multiprocessing.get_context("spawn")) as pool:
            jobs = [(i, a, out_dir) for i, a in enumerate(cases)]
            for i, res in enumerate(pool.map(_build_to, jobs)):
                print(i, res[:400], flush=True)
        return
    print(torch.cuda.get_device_name(), tvm.__version__, flush=True)
    for i in range(int(argv[2]), len(cases)):
        path = os.path.join(out_dir, f"case{i}.so")
        try:
            if not os.path.exists(path):
                raise FileNotFoundError(path)
            case(*cases[i], lib=tvm.runtime.load_module(path))
        except Exception:  # report and go on with the next case
            print("FAILED", i, cases[i][:6], traceback.format_exc()[-600:], flush=True)
        print("DONE", i, flush=True)


def sweep_configs(m: int, n: int, tiles: str = "") -> list[GemmConfig]:
    """The default tile for (m, n) first, then the alternatives the wave-count model weighs, then
    the ``tiles`` asked for (``BN:stages:cluster_m``, comma-separated; 128-row tiles)."""
    from tvmfuse.rules.gemm_sm90 import select_config

    pair = {"cluster_m": 2, "warp_release": True} if m > 128 else {}
    out = [select_config(m, n, 132)]
    extra = [GemmConfig(bn=bn, stages=st, cluster_m=cl, warp_release=cl > 1)
             for bn, st, cl in (map(int, t.split(":")) for t in tiles.split(",") if t)]
    for cfg in (GemmConfig(**pair), GemmConfig(bn=192, stages=5, **pair),
                GemmConfig(bn=128, stages=6, **pair),
                GemmConfig(bm=256, bn=128, wg_rows=128, **pair), GemmConfig(bn=192, stages=5), *extra):
        if cfg not in out:
            out.append(cfg)
    return out


def sweep_main(shapes: str, tiles: str = "", out_dir: str = "/tmp/gemm_sweep") -> None:
    """Build every (shape, config) of :func:`sweep_configs` in parallel, then time each (nt fp16)."""
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor

    cases = []
    for shape in shapes.split(","):
        m, n, k = (int(v) for v in shape.split("x"))
        cases += [(m, n, k, "float16", "nt", cfg, True) for cfg in sweep_configs(m, n, tiles)]
    os.makedirs(out_dir, exist_ok=True)
    with ProcessPoolExecutor(max_workers=min(14, os.cpu_count() or 4),
                             mp_context=multiprocessing.get_context("spawn")) as pool:
        paths = list(pool.map(_build_to, [(i, a, out_dir) for i, a in enumerate(cases)]))
    print(torch.cuda.get_device_name(), tvm.__version__, flush=True)
    for args, path in zip(cases, paths):
        try:
            if path.startswith("FAILED"):
                raise RuntimeError(path)
            case(*args, lib=tvm.runtime.load_module(path))
        except Exception:  # report and go on with the next case
            print("FAILED", args[:6], traceback.format_exc()[-400:], flush=True)


def main() -> None:
    if "--sweep" in sys.argv:
        tiles = sys.argv[sys.argv.index("--tiles") + 1] if "--tiles" in sys.argv else ""
        return sweep_main(sys.argv[sys.argv.index("--sweep") + 1], tiles)
    if "--cluster" in sys.argv:
        return cluster_main(sys.argv[sys.argv.index("--cluster") + 1:])
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
