"""A/B on the GPU: the fp32 MLP block with the LayerNorm statistics in their own kernel (old,
``Options(simt_in_loop_stats=False)``) against the fc1 GEMM computing them (new).

    y = x + W2 · GELU(W1 · LayerNorm(x) + b1) + b2,  x (1, seq, hidden) fp32, ffn = 4·hidden

Per variant: rel err against float64 torch, median ms of one forward
(CUDA events, tools/bench/common.time_stats), and torch eager fp32 in the same run.
Usage: python tools/device/simt_stats_ab.py [--sizes 2048x1024,2048x4096] [--target sm90]
"""

from __future__ import annotations

import argparse
import copy
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tools" / "bench"))

import common  # noqa: E402
import torch  # noqa: E402

import tvmfuse  # noqa: E402
from models import mlp_block  # noqa: E402
from tests.conftest import rel_err  # noqa: E402
from tvmfuse.options import Options  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--sizes", default="2048x1024,2048x4096", help="SEQxHIDDEN,...")
    ap.add_argument("--target", default="sm90")
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--budget-s", type=float, default=1e9, help="skip sizes after this many s")
    args = ap.parse_args()
    t0 = time.time()
    for size in args.sizes.split(","):
        if time.time() - t0 > args.budget_s:
            print(f"{size}: skipped (time budget)")
            continue
        seq, hidden = (int(v) for v in size.split("x"))
        module, (x,) = mlp_block.build(batch=1, seq=seq, hidden=hidden)
        xg = x.cuda()
        with torch.no_grad():  # .double() / .cuda() convert a module in place: copies
            ref = copy.deepcopy(module).double().cuda()(xg.double())
            eager = copy.deepcopy(module).cuda()
            eager_ms, _ = common.time_stats(lambda m=eager, a=xg: m(a), iters=args.iters,
                                            device="cuda")
            del eager
        flops = 4.0 * seq * hidden * 4 * hidden
        print(f"mlp fp32 seq {seq} hidden {hidden} ffn {4 * hidden}: torch eager {eager_ms:.3f} ms "
              f"({flops / eager_ms / 1e9:.1f} TFLOP/s)")
        for enabled in (False, True):
            tc = time.time()
            lib = tvmfuse.compile(module, (x,), target=args.target,
                                  options=Options(simt_in_loop_stats=enabled))
            path = lib.export(Path("/tmp") / f"simt_ab_{enabled}.so")
            run = tvmfuse.load(path, device="cuda")
            err = rel_err(run(xg), ref)
            ms, wall = common.time_stats(lambda f=run, a=xg: f(a), iters=args.iters, device="cuda")
            name = "new (stats in fc1)" if enabled else "old (stats kernel)"
            print(f"  {name:<20} {ms:.3f} ms (wall {wall:.3f})  "
                  f"{flops / ms / 1e9:.1f} TFLOP/s  rel_err {err:.2e}  "
                  f"compile {time.time() - tc:.0f} s", flush=True)


if __name__ == "__main__":
    main()
