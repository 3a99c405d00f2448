"""A/B of sm_90a GEMM kernel configs through the whole pipeline (tvmfuse.compile → export → load).

Each variant replaces :func:`tvmfuse.schedules.gemm_sm90.select_config` for outputs wider than 128
columns, then runs ``tools/bench/bench_gemm.py``'s workloads (CUDA events, eager and cuBLAS in the
same process). Run on the H200 from the repository root::

    python tools/device/sm90_config_ab.py --variants base,pp_c2 --cases bias_relu,bias_gelu \\
        --shapes 4096x4096x4096 --out ab.json
"""

from __future__ import annotations

import json
import os
import sys

sys.path.insert(0, os.getcwd())
sys.path.insert(0, os.path.join(os.getcwd(), "tools", "bench"))

import bench_gemm  # noqa: E402
import common  # noqa: E402

from tvmfuse.schedules import gemm_sm90  # noqa: E402
from tvmfuse.schedules.hopper.kernel import GemmConfig  # noqa: E402

VARIANTS = {
    "base": GemmConfig(),
    "warp_release": GemmConfig(warp_release=True),
    "c2": GemmConfig(cluster_m=2, warp_release=True),
    "pp": GemmConfig(bm=64, stages=5, pingpong=True, warp_release=True),
    "pp_c2": GemmConfig(bm=64, stages=5, pingpong=True, cluster_m=2, warp_release=True),
    # ping-pong on 128x128 tiles: two independent 64-row accumulator chains per warpgroup
    "pp128": GemmConfig(bn=128, stages=6, pingpong=True, warp_release=True),
    "pp128_c2": GemmConfig(bn=128, stages=6, pingpong=True, cluster_m=2, warp_release=True),
    # 256x128 tiles, two consumer warpgroups of 128 rows (two 64-row chains each), as cuBLAS
    "t2": GemmConfig(bm=256, bn=128, wg_rows=128, cluster_m=2, warp_release=True),
    # c2 with the per-element bounds tests kept on full tiles
    "c2_guarded": GemmConfig(cluster_m=2, warp_release=True, unguarded_full_tiles=False),
}


def main() -> int:
    p = bench_gemm.add_options(common.parser(__doc__))
    p.add_argument("--variants", default="base,pp_c2", help=f"comma-separated of {','.join(VARIANTS)}")
    args = common.resolve(p.parse_args())
    default = gemm_sm90.select_config
    rows = []
    for name in args.variants.split(","):
        cfg = VARIANTS[name]
        gemm_sm90.select_config = lambda m, n, cfg=cfg: cfg if n > 128 else default(m, n)
        for row in bench_gemm.run(args):
            row["variant"] = name
            row["config"] = {k: v for k, v in vars(cfg).items() if v != getattr(GemmConfig(), k)}
            rows.append(row)
            print(name, row.get("name"), row.get("tvmfuse_ms"), row.get("rel_err"),
                  row.get("baselines"), flush=True)
    gemm_sm90.select_config = default
    print(common.format_table(rows))
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"gpu": common.gpu_name(), "versions": common.versions(),
                       "command": common.command_line(), "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
