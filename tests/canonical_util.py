"""Helpers for the canonicalisation pass tests: run a pass under TVM's immutable-module check."""

from __future__ import annotations

import numpy as np
import tvm
from tvm import relax

from tests.relax_util import random_inputs, run_llvm


def apply(pass_: tvm.transform.Pass, mod: tvm.IRModule) -> tvm.IRModule:
    """``pass_(mod)``; TVM raises if the pass modifies ``mod`` in place."""
    with tvm.transform.PassContext(config={"testing.immutable_module": True}):
        return pass_(mod)


def errors_vs_float64(before: tvm.IRModule, after: tvm.IRModule, reference) -> tuple[float, float]:
    """Relative errors of ``before`` and ``after`` (built for llvm) against ``reference(*arrays)``
    computed in float64, on the same random inputs."""
    arrays = random_inputs(before)
    ref = reference(*[a.astype(np.float64) for a in arrays])
    errs = []
    for mod in (before, after):
        out = run_llvm(mod, *arrays).astype(np.float64)
        errs.append(float(np.linalg.norm(out - ref) / np.linalg.norm(ref)))
    return errs[0], errs[1]


def run_outputs(mod: tvm.IRModule, *arrays: np.ndarray) -> list[np.ndarray]:
    """Every output of ``main`` (a tuple) built for llvm with TVM's legalisation, on ``arrays``."""
    exe = tvm.compile(relax.transform.LegalizeOps()(mod), target="llvm")
    vm = relax.VirtualMachine(exe, tvm.cpu())
    return [out.numpy() for out in vm["main"](*[tvm.runtime.tensor(a) for a in arrays])]
