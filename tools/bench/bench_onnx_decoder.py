"""The decoder layer compiled from its ONNX export vs from torch, in one run (patterns issue item 4).

``models/decoder_layer.py`` in fp16 at the bench size (batch 1, seq 2048, hidden 4096, 32 / 8
heads, ffn 11008; cpu smoke: the small size) is compiled twice: ``decoder_torch`` from the module
(torch.export) and ``decoder_onnx`` from its ONNX export (``--exporter legacy|dynamo``), both for
sm90, each checked against the fp32 reference; the ratio of the two rows is the cost of the
ONNX route. FLOPs as in bench_decoder.py. Baselines: the module in torch eager (no torch.compile).
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

import bench_decoder
import common


def workloads(args: argparse.Namespace, exporter: str = "legacy") -> list[common.Workload]:
    """The torch and the ONNX route of the same decoder layer."""
    from models.export_onnx import export_onnx

    torch_wl = bench_decoder.workload(args)
    torch_wl.name = "decoder_torch"
    onnx_wl = bench_decoder.workload(args)
    onnx_wl.name = f"decoder_onnx_{exporter}"
    dynamo = exporter == "dynamo"

    def export(workdir: Path) -> str:
        return str(export_onnx(onnx_wl.module, onnx_wl.inputs, workdir / "decoder.onnx", dynamo=dynamo,
                               opset=18 if dynamo else 17))

    onnx_wl.export = export
    return [torch_wl, onnx_wl]


def run(args: argparse.Namespace) -> list[dict[str, Any]]:
    """Both routes; one row each."""
    args.no_compile = True
    return [common.bench(wl, args) for wl in workloads(args)]


if __name__ == "__main__":
    raise SystemExit(common.main(run, __doc__))
