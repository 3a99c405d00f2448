"""The README's pattern-corpus table: formulation → sm90 kernels, tvmfuse vs TVM's stock pipeline.

    python tools/corpus_table.py [--only NAME,NAME] [--json OUT.json]

Every formulation of ``models/corpus.py`` is imported as the corpus test imports it (torch.export,
or the ONNX export of the same module) and lowered for sm90 (static; no GPU needed). Prints a
Markdown table; ``--json`` also writes the rows.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # `models` lives at the repository root

from models.corpus import FORMULATIONS, Formulation, materialise  # noqa: E402
from tvmfuse.frontend import import_model  # noqa: E402
from tvmfuse.report import analyze, stock_kernel_count  # noqa: E402
from tvmfuse.targets import get_target  # noqa: E402


def row(f: Formulation, workdir: Path) -> dict:
    """tvmfuse and stock sm90 launch counts, and attention ops fused, for one formulation."""
    module, inputs, onnx_path = materialise(f, workdir)
    imported = import_model(onnx_path) if onnx_path else import_model(module, inputs)
    spec = get_target("sm90")
    report = analyze(imported.mod, spec, f.dtype, stock=False)
    stock = stock_kernel_count(imported.mod, spec) if f.dtype is None else None
    return {"name": f.name, "kind": f.kind, "frontend": f.frontend, "dtype": f.dtype or "model",
            "tvmfuse": report["fused_kernel_count"], "stock": stock,
            "attention_kernels": sum(k["pattern"] == "attention" for k in report["kernels"])}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--only", help="comma-separated formulation names")
    p.add_argument("--json", help="write the rows here")
    args = p.parse_args()
    wanted = set(args.only.split(",")) if args.only else None
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for f in FORMULATIONS:
            if wanted is None or f.name in wanted:
                rows.append(row(f, Path(tmp)))
                print(rows[-1], file=sys.stderr, flush=True)
    print("| formulation | frontend | kernels (tvmfuse) | kernels (stock TVM) |")
    print("|---|---|---|---|")
    for r in rows:
        stock = "–" if r["stock"] is None else r["stock"]
        print(f"| `{r['name']}` | {r['frontend']}{'' if r['dtype'] == 'model' else ', ' + r['dtype']} "
              f"| {r['tvmfuse']} | {stock} |")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
