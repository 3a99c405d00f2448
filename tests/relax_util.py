"""Helpers for pass tests: run a Relax module on the CPU (llvm) and compare two modules."""

from __future__ import annotations

import numpy as np
import tvm
from tvm import relax


def fresh(mod: tvm.IRModule) -> tvm.IRModule:
    """An independent deep copy of ``mod`` (through JSON): nothing done to it reaches ``mod``."""
    return tvm.ir.load_json(tvm.ir.save_json(mod))


def apply_pass(pass_: tvm.transform.Pass, before: tvm.IRModule) -> tvm.IRModule:
    """``pass_`` on a fresh copy of ``before``: the test's Before module stays as written, so
    "left unchanged" and Before-vs-after numerics compare against the module the test built
    (the conftest's ``testing.immutable_module`` check separately fails a pass that writes into
    its input)."""
    return pass_(fresh(before))


def run_llvm(mod: tvm.IRModule, *arrays: np.ndarray) -> np.ndarray:
    """Build ``mod`` for llvm with TVM's default pipeline and run ``main`` on ``arrays``."""
    from tvmfuse.passes.legalize_fixes import legalize_overrides

    mod = relax.transform.LegalizeOps(legalize_overrides())(mod)
    ex = tvm.compile(mod, target="llvm")
    vm = relax.VirtualMachine(ex, tvm.cpu())
    return vm["main"](*[tvm.runtime.tensor(a) for a in arrays]).numpy()


def random_inputs(mod: tvm.IRModule, seed: int = 0, sizes: dict[str, int] | None = None
                  ) -> list[np.ndarray]:
    """Random normal arrays (never zeros) for ``main``'s parameters; a symbolic dim takes its
    value from ``sizes`` (default 7)."""
    rng = np.random.default_rng(seed)

    def dim(d) -> int:
        return int(d) if isinstance(d, tvm.tirx.IntImm) else (sizes or {}).get(str(d), 7)

    return [rng.standard_normal([dim(d) for d in p.ty.shape.values]).astype(str(p.ty.dtype))
            for p in mod["main"].params]


def assert_same_numerics(before: tvm.IRModule, after: tvm.IRModule, rtol: float = 1e-5) -> None:
    """``after`` computes what ``before`` does, on random inputs: ‖Δ‖/‖ref‖ ≤ rtol."""
    arrays = random_inputs(before)
    ref, out = run_llvm(before, *arrays), run_llvm(after, *arrays)
    err = np.linalg.norm(out.astype(np.float64) - ref) / np.linalg.norm(ref)
    assert err <= rtol, f"relative error {err:.3e} > {rtol}"
