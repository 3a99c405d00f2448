"""Print `tvmfuse report` totals for the example models and the HF exports, and save them as JSON.

Usage: python tools/report_models.py [--target sm90] [--dtype float16]
                                     [--out tools/bench/results/report_models.json]
The HF ONNX files are made at random init by models/hf_models.py (cached in --hf-dir).
"""

from __future__ import annotations

import argparse
import json
import sys
from datetime import datetime, timezone
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from models import hf_models  # noqa: E402
from tvmfuse.frontend import import_model  # noqa: E402
from tvmfuse.report import analyze  # noqa: E402
from tvmfuse.targets import get_target  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--target", default="sm90")
    ap.add_argument("--dtype", choices=("float16", "bfloat16"), default=None,
                    help="mixed precision as in `tvmfuse compile --dtype` (default: the models' fp32)")
    ap.add_argument("--hf-dir", type=Path, default=Path("/tmp/tvmfuse-hf-onnx"))
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    args.hf_dir.mkdir(parents=True, exist_ok=True)
    models = {"mlp_block (torch)": "models.mlp_block:small",
              "decoder_layer (torch)": "models.decoder_layer:small"}
    for name, make in hf_models.MODELS.items():
        models[f"{name} (onnx, torchscript)"] = str(make(args.hf_dir, "torchscript"))
    rows = []
    print(f"{'model':<30} {'ops':>5} {'stock':>6} {'tvmfuse':>8} {'ratio':>6} {'MB unfused':>11} "
          f"{'MB fused':>9}")
    for name, model in models.items():
        report = analyze(import_model(model).mod, get_target(args.target), args.dtype)
        stock = report["stock_tvm_kernel_count"]
        ratio = report["fused_kernel_count"] / stock if stock else None
        rows.append({"model": name, **{k: report[k] for k in (
            "unfused_kernel_count", "stock_tvm_kernel_count", "fused_kernel_count",
            "hbm_bytes_unfused", "hbm_bytes_fused")}, "ratio_vs_stock": ratio,
            "not_fused": report["not_fused"], "kernels": report["kernels"]})
        print(f"{name:<30} {report['unfused_kernel_count']:>5} {stock!s:>6} "
              f"{report['fused_kernel_count']:>8} {ratio or float('nan'):>6.2f} "
              f"{report['hbm_bytes_unfused'] / 1e6:>11.3f} {report['hbm_bytes_fused'] / 1e6:>9.3f}")
    if args.out:
        args.out.write_text(json.dumps({
            "date": datetime.now(timezone.utc).isoformat(timespec="seconds"), "gpu": None,
            "target": args.target, "dtype": args.dtype or "float32", "command": " ".join(sys.argv),
            "note": "static analysis on the CPU machine (no timing); tiny configs", "rows": rows},
            indent=1))


if __name__ == "__main__":
    main()
