"""On the GPU machine: run CPU-built libraries with runtime-only TVM and no nvcc on PATH.

Proves the AOT path: no compiler library, no nvcc, no NVRTC. Compares with the torch fp32
outputs made on the CPU machine and writes ``OUT/runtime_only.json``.
Usage: ``TVM_USE_RUNTIME_LIB=1 python tools/device/check_runtime_only.py .artifacts OUT``.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np


def main() -> int:
    art, out = Path(sys.argv[1]), Path(sys.argv[2])
    import tvm
    import tvm.base

    import tvmfuse

    report = {"runtime_only": bool(tvm.base._RUNTIME_ONLY), "nvcc_on_path": shutil.which("nvcc"),
              "compiler_lib_present": (Path(tvm.__file__).parent / "lib" /
                                       "libtvm_compiler.so").exists(), "rows": []}
    ok = report["runtime_only"] and report["nvcc_on_path"] is None
    for entry in json.loads((art / "manifest.json").read_text()):
        lib = art / entry["lib"]
        x = np.load(art / f"{entry['model']}.in.npz")["x"]
        ref = np.load(art / f"{entry['model']}.ref.npz")["output0"]
        row = dict(entry)
        try:
            model = tvmfuse.load(lib, device="cuda")
            y = model(x)
            row["rel_err_numpy"] = float(np.linalg.norm(y - ref) / np.linalg.norm(ref))
            import torch

            yt = model(torch.from_numpy(x).cuda())
            row["torch_out_device"] = str(yt.device)
            row["rel_err_torch"] = float(
                np.linalg.norm(yt.cpu().numpy() - ref) / np.linalg.norm(ref))
            row["ok"] = row["rel_err_numpy"] < 1e-4 and row["rel_err_torch"] < 1e-4
        except Exception as err:  # record and go on: one broken lib must not hide the others
            row["error"] = f"{type(err).__name__}: {err}"
            row["ok"] = False
        ok &= row["ok"]
        report["rows"].append(row)
        print(row)
    # The CLI too, in the same runtime-only process environment.
    first = report["rows"][0]["lib"]
    model_name = report["rows"][0]["model"]
    cli = subprocess.run([sys.executable, "-m", "tvmfuse.cli", "run", str(art / first),
                          "--inputs", str(art / f"{model_name}.in.npz"),
                          "--output", str(out / "cli_out.npz")], capture_output=True, text=True)
    report["cli"] = {"rc": cli.returncode, "stdout": cli.stdout, "stderr": cli.stderr[-2000:]}
    ok &= cli.returncode == 0
    report["ok"] = ok
    (out / "runtime_only.json").write_text(json.dumps(report, indent=1))
    print(json.dumps({k: v for k, v in report.items() if k != "rows"}, indent=1))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
