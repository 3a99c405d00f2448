"""Device probe for the sm80 tensor-core GEMM rule (``tvmfuse/rules/gemm_sm80.py``).

Run on the GPU machine from the repository root:
``python tools/device/sm80_gemm_probe.py [--quick] [--configs 128x128x32w64x64s4b1,...]
[--shapes 4096x4096x1024,...]``
(tiles as ``GemmConfig.tag``; one ending in ``b1`` has one ``__syncthreads`` per K tile:
``GemmConfig.one_barrier``; ``default`` = the tile the rule picks). A tile may carry module knobs
of gemm_sm80 after ``+``: ``pad0`` / ``pad4`` (``C_ROW_PAD``), ``lane4`` (``EPILOGUE_LANE_ELEMS``),
``regs1`` (``EPILOGUE_FROM_REGISTERS``), e.g. ``default+pad0``; ``--knobs regs1`` sets them for
every case, ``--no-time`` only builds and checks. Without ``--configs`` every case takes the
tile the rule picks.
``--shapes`` times the default tile at other M×N×K (fp16): the K sweep separates a block's fixed
cost (pipeline fill, epilogue) from its per-K-tile cost.

Builds ``relu(x · Wᵀ + b)`` (x (M, K), W (N, K) or (K, N), b (N); fp32 accumulation, output in the
input dtype) directly with the rule and TVM's CUDA build (sm_80 target: the H200 runs it as
sm_90 code), checks it against a float32 torch reference (‖out − ref‖ / ‖ref‖), and times it
with CUDA events next to ``torch.mm`` (cuBLAS, no epilogue) and eager ``relu(F.linear)``.
One line per case: shape, dtype, layout, tile, barriers in the K loop of the generated CUDA,
rel err, ms, TFLOP/s, ratio to cuBLAS.
"""

from __future__ import annotations

import argparse
import os
import re
import sys
import time
import traceback

sys.path.insert(0, os.getcwd())
os.environ.setdefault("TVM_CUDA_COMPILE_MODE", "nvcc")

import torch  # noqa: E402
import tvm  # noqa: E402
import tvm.support.nvcc  # noqa: E402,F401  (registers the nvcc compile callback)
from tvm import te, tirx  # noqa: E402

from tvmfuse.build.inspect import cuda_source, pipelined_loop  # noqa: E402
from tvmfuse.options import Options, use_options  # noqa: E402
from tvmfuse.rules.gemm_sm80 import (  # noqa: E402
    BUILD_CONFIG,
    TILE_ATTR,
    GemmConfig,
    GemmSM80,
)
from tvmfuse.tvm_setup import register_tvm_patches  # noqa: E402

# The sm80 schedule, built for the H200 (sm_90 SASS of the same code, as target "sm80" ships).
TARGET = tvm.target.Target({"kind": "cuda", "arch": "sm_90"}, host={"kind": "llvm"})
DT = {"float16": torch.float16, "bfloat16": torch.bfloat16}


def linear_relu(m: int, n: int, k: int, dtype: str, kn: bool, batch: int = 0) -> tirx.PrimFunc:
    """TE ``relu(x · W + b)`` in the form the pipeline's fused GEMMs have."""
    lead = (batch,) if batch else ()
    x = te.placeholder((*lead, m, k), dtype, name="x")
    w = te.placeholder((*lead, k, n) if kn else (*lead, n, k), dtype, name="w")
    b = te.placeholder((n,), dtype, name="b")
    r = te.reduce_axis((0, k), name="k")

    def mm(*idx):
        *lo, i, j = idx
        wv = w[(*lo, r, j)] if kn else w[(*lo, j, r)]
        return te.sum(x[(*lo, i, r)].astype("float32") * wv.astype("float32"), axis=r)

    acc = te.compute((*lead, m, n), mm, name="matmul")
    y = te.compute((*lead, m, n), lambda *i: te.max(acc[i] + b[i[-1]].astype("float32"),
                                                     tirx.const(0, "float32")).astype(dtype),
                   name="relu")
    return te.create_prim_func([x, w, b, y])


def parse_config(text: str) -> GemmConfig:
    """``128x128x32w64x64s4[r8][b1]`` → GemmConfig (``b1``: one barrier per K tile, i.e.
    ``one_barrier=True``; without it TVM's two)."""
    got = re.fullmatch(r"(\d+)x(\d+)x(\d+)w(\d+)x(\d+)s(\d+)(?:r(\d+))?(b1)?", text)
    if got is None:
        raise ValueError(f"bad tile {text!r}: want BMxBNxBKwWMxWNsS[rR][b1]")
    bm, bn, bk, wm, wn, stages = (int(v) for v in got.groups()[:6])
    return GemmConfig(bm, bn, bk, wm, wn, stages, int(got.group(7) or 8),
                      one_barrier=got.group(8) is not None)


# +padN, +laneN, +regsN → Options(X=N)
KNOBS = {"pad": "sm80_c_row_pad", "lane": "sm80_epilogue_lane_elems",
         "regs": "sm80_epilogue_from_registers"}


def parse_variant(text: str) -> tuple[GemmConfig | None, dict[str, int]]:
    """``TILE[+knob…]`` → (GemmConfig or None for ``default``, {Options field: value})."""
    tile, *knobs = text.split("+")
    values = {}
    for knob in knobs:
        got = re.fullmatch(r"([a-z]+)(\d+)", knob)
        if got is None or got.group(1) not in KNOBS:
            raise ValueError(f"bad knob {knob!r}: want one of {sorted(KNOBS)} and a number")
        values[KNOBS[got.group(1)]] = int(got.group(2))
    return (None if tile == "default" else parse_config(tile)), values


def median_events_ms(fn, iters: int = 30, warmup: int = 5) -> float:
    """Median of per-call event pairs (tools/bench/common.py's method; ``events_ms`` is the
    mean over back-to-back calls)."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    pairs = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
             for _ in range(iters)]
    for start, end in pairs:
        start.record()
        fn()
        end.record()
    torch.cuda.synchronize()
    times = sorted(start.elapsed_time(end) for start, end in pairs)
    return times[len(times) // 2]


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


def main_loop_barriers(source: str | None) -> int:
    """``__syncthreads()`` calls in the pipelined K loop of the kernel; -1 if there is none."""
    loop = pipelined_loop(source or "")
    return -1 if loop is None else loop.count("__syncthreads()")


_REFERENCE_MS: dict[tuple, tuple[float, ...]] = {}  # (m, n, k, dtype, batch) → cuBLAS, eager, …


def case(m, n, k, dtype="float16", kn=False, batch=0, cfg: GemmConfig | None = None,
         time_it=True, knobs: dict[str, int] | None = None) -> None:
    """One shape; ``cfg`` None: the tile the rule picks; ``knobs`` set :class:`Options` fields
    for this build only."""
    t0 = time.time()
    func = linear_relu(m, n, k, dtype, kn, batch)
    with use_options(Options(**(knobs or {}))):
        sch = GemmSM80(config=cfg).apply(func, TARGET, False)
    attrs = sch.mod["main"].attrs
    tag = str(attrs.get(TILE_ATTR, "-")) + "".join(f"+{k}={v}" for k, v in (knobs or {}).items())
    rule = attrs.get("tvmfuse.rule") or f"fallback({attrs.get('tvmfuse.fallback')})"
    register_tvm_patches()
    with tvm.transform.PassContext(opt_level=3, config=BUILD_CONFIG):
        lib = tvm.compile(sch.mod, target=TARGET)
    build_s = time.time() - t0
    g = torch.Generator(device="cuda").manual_seed(0)
    lead = (batch,) if batch else ()
    x = torch.randn(*lead, m, k, device="cuda", dtype=DT[dtype], generator=g)
    w = torch.randn(*lead, n, k, device="cuda", dtype=DT[dtype], generator=g)
    b = torch.randn(n, device="cuda", dtype=DT[dtype], generator=g)
    wk = w.transpose(-1, -2).contiguous() if kn else w
    y = torch.empty(*lead, m, n, device="cuda", dtype=DT[dtype])
    args = [tvm.runtime.from_dlpack(t) for t in (x, wk, b, y)]
    lib(*args)
    torch.cuda.synchronize()
    ref = torch.relu(x.float() @ w.float().transpose(-1, -2) + b.float())
    err = float((y.float() - ref).norm() / ref.norm())
    shape = f"{f'{batch}x' if batch else ''}{m}x{n}x{k}"
    try:
        bars = main_loop_barriers(cuda_source(lib))
    except Exception:  # noqa: BLE001 - the source may not be kept; the count is informative
        bars = -1
    line = (f"{shape:>18} {dtype[:4]} {'kn' if kn else 'nk'} {tag:<24} {rule:<12} bar/k {bars} "
            f"err {err:.1e}")
    if time_it:
        flops = 2.0 * max(batch, 1) * m * n * k
        ms = events_ms(lambda: lib(*args))
        med = median_events_ms(lambda: lib(*args))
        wt = w.transpose(-1, -2)
        key = (m, n, k, dtype, batch)
        if key not in _REFERENCE_MS:  # once per shape: more variants fit in one device run
            _REFERENCE_MS[key] = (events_ms(lambda: torch.matmul(x, wt)),
                                  events_ms(lambda: torch.relu(torch.matmul(x, wt) + b)),
                                  median_events_ms(lambda: torch.matmul(x, wt)))
        cub, eager, cub_med = _REFERENCE_MS[key]
        line += (f" | {ms:.4f} ms {flops / ms / 1e9:6.1f} TF/s | cuBLAS mm {cub:.4f} ms "
                 f"{flops / cub / 1e9:6.1f} TF/s | eager {eager:.3f} ms | x{cub / ms:.3f} of cuBLAS"
                 f" | median/call {med:.4f} ms, cuBLAS {cub_med:.4f}")
    print(line + f" (build {build_s:.0f}s)", flush=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--configs", default="", help="comma-separated tiles for 4096^3 fp16")
    p.add_argument("--quick", action="store_true", help="4096^3 fp16 default tile only")
    p.add_argument("--shapes", default="", help="comma-separated MxNxK, default tile, fp16")
    p.add_argument("--knobs", default="", help="knobs for every case, e.g. regs1+lane4")
    p.add_argument("--no-time", action="store_true", help="build and check only")
    args = p.parse_args()
    _, common = parse_variant("default+" + args.knobs) if args.knobs else (None, {})
    print("gpu", torch.cuda.get_device_name(0), "torch", torch.__version__, flush=True)
    runs = [dict(m=4096, n=4096, k=4096)]
    if not args.quick:
        runs += [
            dict(m=2047, n=4096, k=4096),
            dict(m=4096, n=4096, k=4096, dtype="bfloat16"),
            dict(m=4096, n=4096, k=4096, kn=True),
            dict(m=8192, n=8192, k=4096),
            dict(m=16, n=4096, k=4096),
            dict(m=8, n=4096, k=4096),
            dict(m=512, n=512, k=512, batch=8),
        ]
    for text in (c for c in args.configs.split(",") if c):
        cfg, knobs = parse_variant(text)
        runs.append(dict(m=4096, n=4096, k=4096, cfg=cfg, knobs=knobs))
    for text in (s for s in args.shapes.split(",") if s):
        m, n, k = (int(v) for v in text.split("x"))
        runs.append(dict(m=m, n=n, k=k))
    for kw in runs:
        kw["knobs"] = {**common, **kw.get("knobs", {})}
        kw["time_it"] = not args.no_time
        try:
            case(**kw)
        except Exception:  # noqa: BLE001 - one failing case must not hide the others
            print("FAILED", kw, traceback.format_exc()[-1500:], flush=True)


if __name__ == "__main__":
    main()
