"""Benchmark two source trees of tvmfuse in one device call and compare them row by row.

    python3 tools/bench/ab_trees.py --base .base --only layernorm,gemm,attention --out ab.json

``--base`` is a checkout of the older tree (e.g. ``git archive <commit> tvmfuse tools models |
tar -x -C .base``); the new tree is the working directory. Each tree runs its own
``tools/bench/run_all.py`` in a subprocess with its own ``tvmfuse`` on ``PYTHONPATH`` (so the
two never share a process or a compiled kernel), the base first, then the new tree, then the
base again for the workloads named by ``--repeat-base`` (drift check). The result file holds both
runs' rows and, per row, ``ratio = new_ms / base_ms``; the summary gives the geometric mean and
the worst row (the structure issue's bar: geomean within 2 %, no row more than 5 % slower).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent


def run_tree(tree: Path, only: str, out: Path, extra: list[str]) -> list[dict]:
    """Run ``tree``'s run_all.py on the workloads ``only``; its rows."""
    env = dict(os.environ)
    paths = env.get("PYTHONPATH", "").split(os.pathsep)
    site = [p for p in paths if p and Path(p).resolve() != HERE.parents[1]]
    env["PYTHONPATH"] = os.pathsep.join(site + [str(tree.resolve())])
    script = (tree / "tools/bench/run_all.py").resolve()
    cmd = [sys.executable, str(script), "--only", only, "--out", str(out), *extra]
    print(f"== {tree}: {' '.join(cmd)}", flush=True)
    subprocess.run(cmd, env=env, cwd=tree, check=False)
    return json.loads(out.read_text())["rows"] if out.exists() else []


def key(row: dict) -> tuple[str, str, str]:
    return row["workload"], row["shape"], row.get("dtype", "")


def compare(base: list[dict], new: list[dict]) -> tuple[list[dict], dict]:
    """Per-row ``new_ms / base_ms`` for rows both runs measured, and the summary."""
    base_ms = {key(r): r["tvmfuse_ms"] for r in base if r.get("tvmfuse_ms")}
    rows = []
    for r in new:
        b = base_ms.get(key(r))
        if b and r.get("tvmfuse_ms"):
            rows.append({"workload": r["workload"], "shape": r["shape"], "dtype": r.get("dtype"),
                         "base_ms": b, "new_ms": r["tvmfuse_ms"], "ratio": r["tvmfuse_ms"] / b,
                         "new_rel_err": r.get("rel_err")})
    ratios = [r["ratio"] for r in rows]
    summary = {"rows_compared": len(rows),
               "geomean_ratio": math.exp(sum(map(math.log, ratios)) / len(ratios)) if ratios else None,
               "worst": max(rows, key=lambda r: r["ratio"]) if rows else None,
               "missing_in_new": sorted(" ".join(k) for k in set(base_ms) - {key(r) for r in new})}
    return rows, summary


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--base", required=True, help="the older tree (holds tvmfuse/ and tools/)")
    p.add_argument("--only", required=True, help="run_all.py workloads, comma-separated")
    p.add_argument("--out", required=True, help="comparison JSON")
    p.add_argument("--repeat-base", default="", help="workloads to time on the base tree again at the end")
    args, extra = p.parse_known_args()
    out = Path(args.out)
    work = out.parent / (out.stem + "_runs")
    work.mkdir(parents=True, exist_ok=True)
    start = time.time()
    base = run_tree(Path(args.base), args.only, work / "base.json", extra)
    new = run_tree(Path("."), args.only, work / "new.json", extra)
    again = (run_tree(Path(args.base), args.repeat_base, work / "base2.json", extra)
             if args.repeat_base else [])
    rows, summary = compare(base, new)
    drift = compare(base, again)[0] if again else []
    meta = json.loads((work / "new.json").read_text()) if (work / "new.json").exists() else {}
    result = {k: meta.get(k) for k in ("date", "gpu", "versions")}
    result.update(command=" ".join(sys.argv), seconds=round(time.time() - start), summary=summary,
                  rows=rows, base_drift=drift, base_rows=base, new_rows=new)
    out.write_text(json.dumps(result, indent=1))
    for r in rows:
        print(f"{r['workload']:32s} {r['shape']:48s} {r['dtype']:9s} base {r['base_ms']:.4f}"
              f"  new {r['new_ms']:.4f}  x{r['ratio']:.3f}")
    print(json.dumps(summary, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
