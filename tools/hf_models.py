"""Export the tiny Hugging Face test models (random init, no hub access) to ONNX.

    python tools/hf_models.py OUTDIR                       # gpt2, bert, llama, llama_sdpa .onnx
    python tools/hf_models.py OUTDIR --exporter dynamo     # <name>.dynamo.onnx
    python tools/hf_models.py OUTDIR --models llama bert

The models, shapes and exporter choice are those of models/hf_models.py (see its docstring); files
that already exist are reused.
"""

from __future__ import annotations

import argparse
import sys
from collections import Counter
from collections.abc import Sequence
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
if str(REPO_ROOT) not in sys.path:  # `models` lives at the repo root, next to tools/
    sys.path.insert(0, str(REPO_ROOT))

from models import hf_models  # noqa: E402


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python tools/hf_models.py", description="Export the tiny HF test models to ONNX."
    )
    parser.add_argument("outdir", type=Path, help="directory for the .onnx files")
    parser.add_argument(
        "--exporter", choices=("auto", "torchscript", "dynamo"), default="auto",
        help="auto: TorchScript exporter (opset 17), dynamo exporter (opset 18) if that fails",
    )
    parser.add_argument(
        "--models", nargs="+", choices=sorted(hf_models.MODELS), default=list(hf_models.MODELS),
        help="which models (default: all four)",
    )
    args = parser.parse_args(argv)

    import onnx

    for name in args.models:
        path = hf_models.MODELS[name](args.outdir, args.exporter)
        graph = onnx.load(str(path), load_external_data=False).graph
        ops = Counter(n.op_type for n in graph.node).most_common(6)
        top = ", ".join(f"{op} {count}" for op, count in ops)
        print(f"{path}: {hf_models.exporter_of(path)}, {len(graph.node)} nodes ({top}, ...)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
