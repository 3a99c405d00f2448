"""Build libraries on this CPU machine for the runtime-only check on the GPU machine.

Writes ``DIR/{name}_{target}.so`` (and ``{name}_sm90_external.so`` + ``.safetensors``: weights
outside the library), ``DIR/{name}.in.npz`` (random inputs) and ``DIR/{name}.ref.npz``
(torch fp32 outputs on the CPU). Usage: ``python tools/device/make_artifacts.py .artifacts``.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import tvmfuse  # noqa: E402
from models import decoder_layer, mlp_block  # noqa: E402

MODELS = {"mlp_block": mlp_block.small, "decoder_layer": decoder_layer.small}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("out", type=Path)
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    manifest = []
    for name, factory in MODELS.items():
        module, example = factory()
        inputs = tuple(torch.randn_like(t) for t in example)
        with torch.no_grad():
            ref = module(*inputs)
        np.savez(args.out / f"{name}.in.npz", x=inputs[0].numpy())
        np.savez(args.out / f"{name}.ref.npz", output0=ref.numpy())
        # the last one keeps its weights in {name}_sm90_external.safetensors beside the .so
        for target, weights in (("sm80", "embedded"), ("sm90", "embedded"), ("sm90", "external")):
            lib = tvmfuse.compile(module, example, target=target, weights=weights)
            suffix = "_external" if weights == "external" else ""
            path = lib.export(args.out / f"{name}_{target}{suffix}.so")
            manifest.append({"model": name, "target": target, "weights": weights, "lib": path.name})
            print(f"built {path} ({path.stat().st_size} bytes)")
    (args.out / "manifest.json").write_text(json.dumps(manifest, indent=1))


if __name__ == "__main__":
    main()
