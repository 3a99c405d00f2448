"""Which GPU kernel of a compiled model is wrong: every fused kernel against its own llvm build.

    python3 tools/device/bisect_kernels.py MODEL [--target sm90] [--dtype float16] [--input ...]

The pipeline runs once for ``--target``; the fused PrimFuncs are taken after ``fuse_tir`` (before
any schedule: plain TIR, built for llvm as the reference) and after ``schedule`` (what the GPU
runs). Each kernel whose signature is unchanged by scheduling (the wgmma and GEMV kernels, which
drop statistics parameters, are listed as skipped) runs on the GPU and on the CPU with the same
random inputs (floats N(0, 1); integers in 1..3: no zero divisor); every buffer is compared after the call,
``‖gpu − cpu‖ / ‖cpu‖`` in float64. The worst kernels are printed first with their rule.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile

import numpy as np

sys.path.insert(0, os.getcwd())
os.environ.setdefault("TVM_CUDA_COMPILE_MODE", "nvcc")

import tvm  # noqa: E402
import tvm.support.nvcc  # noqa: E402,F401  (registers the nvcc compile callback)


def _static_shape(buf) -> tuple[int, ...] | None:
    try:
        return tuple(int(d) for d in buf.shape)
    except TypeError:
        return None


def _random(shape: tuple[int, ...], dtype: str, rng: np.random.Generator) -> np.ndarray:
    if dtype.startswith(("int", "uint")):
        return rng.integers(1, 4, shape).astype(dtype)
    if dtype == "bool":
        return rng.integers(0, 2, shape).astype(bool)
    return rng.standard_normal(shape).astype("float32").astype(dtype)


def compare(name: str, plain: tvm.tirx.PrimFunc, scheduled: tvm.tirx.PrimFunc, gpu_target,
            seed: int = 0) -> str:
    """One line: the kernel's worst buffer error (GPU vs llvm), or why it was skipped."""
    bufs = [b for b in plain.params if hasattr(b, "shape")]  # 0.27: the parameters are buffers
    sbufs = [b for b in scheduled.params if hasattr(b, "shape")]
    shapes = [_static_shape(b) for b in bufs]
    if len(bufs) != len(plain.params) or any(s is None for s in shapes):
        return f"skip {name}: scalar or symbolic parameters"
    if [(_static_shape(b), str(b.dtype)) for b in sbufs] != [(s, str(b.dtype)) for s, b in
                                                               zip(shapes, bufs)]:
        return f"skip {name}: scheduling changed the signature"
    rng = np.random.default_rng(seed)
    arrays = [_random(s, str(b.dtype), rng) for s, b in zip(shapes, bufs)]
    cpu = tvm.compile(tvm.IRModule({"main": plain.with_attr("global_symbol", "main")}), target="llvm")
    # the packed compiler library cannot launch kernels: export, load with the runtime (nvcc fatbin)
    path = os.path.join(tempfile.mkdtemp(prefix="bisect-"), f"{name}.so")
    tvm.compile(tvm.IRModule({"main": scheduled.with_attr("global_symbol", "main")}),
                target=gpu_target).export_library(path)
    gpu = tvm.runtime.load_module(path)
    cpu_args = [tvm.runtime.tensor(a) for a in arrays]
    dev = tvm.cuda()
    gpu_args = [tvm.runtime.tensor(a, dev) for a in arrays]
    cpu(*cpu_args)
    gpu(*gpu_args)
    worst = 0.0
    for c, g in zip(cpu_args, gpu_args):
        c64, g64 = c.numpy().astype("float64"), g.numpy().astype("float64")
        denom = np.linalg.norm(c64) or 1.0
        worst = max(worst, float(np.linalg.norm(np.nan_to_num(g64 - c64, nan=1e30)) / denom))
    rule = scheduled.attrs.get("tvmfuse.rule", "-") if scheduled.attrs is not None else "-"
    return f"{worst:.2e} {name} rule={rule}"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("model")
    p.add_argument("--target", default="sm90")
    p.add_argument("--dtype")
    p.add_argument("--input", action="append", default=[])
    args = p.parse_args()

    from tvmfuse.frontend import import_model, input_overrides
    from tvmfuse.pipeline import lower
    from tvmfuse.targets import get_target
    from tvmfuse.tvm_setup import codegen_scope

    spec = get_target(args.target)
    seen: dict[str, tvm.IRModule] = {}
    imported = import_model(args.model, None, input_overrides(args.input), {})
    lower(imported.mod, spec, args.dtype, on_stage=lambda name, mod: seen.__setitem__(name, mod))
    plain, scheduled = seen["reshape_to_view"], seen["schedule"]
    lines = []
    with codegen_scope():
        for gv, func in scheduled.functions.items():
            if not isinstance(func, tvm.tirx.PrimFunc) or gv.name_hint not in [
                    g.name_hint for g in plain.functions]:
                continue
            try:
                lines.append(compare(gv.name_hint, plain[gv.name_hint], func, spec.tvm_target()))
            except Exception as err:  # noqa: BLE001 - report and go on
                lines.append(f"error {gv.name_hint}: {type(err).__name__}: {str(err)[-200:]}")
    for line in sorted(lines, key=lambda s: -float(s.split()[0]) if s[0].isdigit() else 0):
        print(line, flush=True)


if __name__ == "__main__":
    main()
