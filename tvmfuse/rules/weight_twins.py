"""A constant (K, N) weight whose (N, K) transpose the module already holds reads that copy.

A library with prefill and decode entry points (``compile_lm``) multiplies by every projection
weight twice: the decode GEMV streams W as (N, K) rows (:mod:`.gemv` passes the transpose of the
folded (K, N) constant), the prefill GEMMs read the folded (K, N) constant. Both would be lifted
into the weights file and uploaded: each projection held twice. The sm_90a wgmma kernels take B
either way (``build_kernel(b_transposed=True)``: W (N, K) K-major), so where the GEMV's (N, K)
constant exists, the prefill GEMM is given it instead and the (K, N) one dies.

``TransposedTwins(mod).of(c)`` → the module's constant equal to ``c.T`` (2-D, same dtype), or None.
Candidates are found by shape and dtype, then compared element for element (once per pair).
"""

from __future__ import annotations

import numpy as np
import tvm
from tvm import relax

from ..passes import weight_arrays
from ..passes._util import const_array


class TransposedTwins:
    """The 2-D tensor constants passed to ``call_tir`` (or ``call_tir_inplace``) anywhere in
    ``mod``, by (shape, dtype), and how many such arguments each one is (``uses``, by the
    constant's handle)."""

    def __init__(self, mod: tvm.IRModule) -> None:
        self.by_shape: dict[tuple, list] = {}
        self.uses: dict[int, int] = {}
        self.arrays: dict[int, np.ndarray] = {}
        self.found: dict[int, relax.Constant | None] = {}
        # call_tir_inplace too: the decode QKV GEMV that makes the cache append (.gemv_append)
        calls = (tvm.ir.Op.get("relax.call_tir"), tvm.ir.Op.get("relax.call_tir_inplace"))

        def visit(expr) -> None:
            if isinstance(expr, relax.Call) and any(expr.op.same_as(op) for op in calls):
                for arg in expr.args[1].fields:
                    ty = arg.ty if isinstance(arg, tvm.ir.expr.Constant) else None
                    if isinstance(ty, relax.TensorType) and ty.ndim == 2 and ty.shape is not None:
                        self.uses[hash(arg)] = self.uses.get(hash(arg), 0) + 1
                        if self.uses[hash(arg)] == 1:
                            shape = tuple(int(d) for d in ty.shape.values)
                            self.by_shape.setdefault((shape, str(ty.dtype)), []).append(arg)

        for func in mod.functions.values():
            if isinstance(func, relax.Function):
                relax.analysis.post_order_visit(func, visit)

    def _np(self, const) -> np.ndarray | None:
        key = hash(const)  # the object's handle: wrappers of one constant differ
        if key not in self.arrays:
            self.arrays[key] = const_array(const)
        return self.arrays[key]

    def of(self, const) -> relax.Constant | None:
        """The constant equal to ``const``'s transpose, None when the module has none."""
        if hash(const) in self.found:
            return self.found[hash(const)]
        w = self._np(const)
        twin = None
        if w is not None and w.ndim == 2:
            for cand in self.by_shape.get(((w.shape[1], w.shape[0]), str(w.dtype)), []):
                c = self._np(cand)
                if c is not None and c[0, 0] == w[0, 0] and weight_arrays.equal(c, w.T):
                    twin = cand
                    break
        self.found[hash(const)] = twin
        return twin
