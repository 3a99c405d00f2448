"""``index_tensor`` with index grids computed from constants is a view, a broadcast or a ``take``.

    index_tensor(x, (I0, …, I(k-1)))     x: (d0, …, d(n-1)); the Ij broadcast to G, constant
      → reshape / broadcast_to of x     when the offsets below run over x's rows in order
      → take(reshape(x, (d0·…·d(k-1),) + x.shape[k:]), const flat, axis=0)   otherwise

    flat[g] = Σ_j Ij[g] · d(j+1)·…·d(k-1)       (negative entries counted from the end)

transformers 5 builds padding masks as ``attention_mask[batch_idx, kv_idx]`` with
``batch_idx = arange(B)[:, None, None, None]`` and ``kv_idx = arange(S)[None, None, None, :]``;
torch.export keeps the ``arange`` / ``unsqueeze`` chain, and TVM legalises ``index_tensor`` into
an opaque gather. The mask was then three kernels before the attention (cast, gather, where).
The grid's value is computed once on the CPU (:class:`~tvmfuse.passes.constant_values.
ConstantValues`); an index that reads a model input, a symbolic axis, an out-of-range constant
or a ``None`` (sliced) index leaves the op as it is.
"""

from __future__ import annotations

import numpy as np
import tvm
from tvm import relax
from tvm.relax.expr_functor import PyExprMutator, mutator

from ...relax_shapes import static_shape
from .._util import is_op
from ..constant_values import ConstantValues, function_bindings
from ._common import gather_rows, rewrite_relax_functions
from .constant_gather_nd import flat_indices


@mutator
class _Rewrite(PyExprMutator):
    def __init__(self, mod: tvm.IRModule, constants: ConstantValues) -> None:
        super().__init__(mod)
        self.constants = constants

    def visit_call_(self, call: relax.Call) -> relax.Expr:
        call = super().visit_call_(call)
        if not is_op(call, "relax.index_tensor") or not isinstance(call.args[1], relax.Tuple):
            return call
        x, indices = call.args[0], list(call.args[1].fields)
        shape, k = static_shape(x), len(indices)
        if shape is None or not 1 <= k <= len(shape):
            return call
        grids = [self.constants.value(i) for i in indices]
        if any(g is None or g.dtype.kind not in "iu" for g in grids):
            return call
        try:
            grid = np.stack(np.broadcast_arrays(*grids), axis=-1).astype(np.int64)
        except ValueError:  # the indices do not broadcast: TVM reports that, not this pass
            return call
        flat = flat_indices(grid, tuple(shape[:k]))
        return call if flat is None else gather_rows(x, flat, k)


@tvm.transform.module_pass(opt_level=0, name="tvmfuse.ConstantIndexTensor")
class ConstantIndexTensor:
    """``index_tensor`` on constant index grids → a view, a broadcast or ``take`` (see above)."""

    def transform_module(self, mod: tvm.IRModule, _ctx) -> tvm.IRModule:
        def rewrite(m: tvm.IRModule, func: relax.Function) -> relax.Function:
            return _Rewrite(m, ConstantValues(function_bindings(func))).visit_expr(func)

        return rewrite_relax_functions(mod, rewrite)
