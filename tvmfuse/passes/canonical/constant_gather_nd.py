"""``gather_nd`` with constant indices is a ``take`` of the flattened leading axes, or a reshape.

    gather_nd(x, const I)                        x: (d0, …, d(n-1)), I: (…, m), m ≤ n
      → reshape(x, I.shape[:-1] + x.shape[m:])    when flat(I) = 0, 1, …, d0·…·d(m-1) - 1
      → take(reshape(x, (d0·…·d(m-1),) + x.shape[m:]), const flat(I), axis=0)   otherwise

    flat(I)[…] = Σ_k I[…, k] · d(k+1)·…·d(m-1)      (negative entries counted from the end)

torch.onnx's dynamo exporter writes ``mask[batch_idx, kv_idx]`` (transformers' padding-mask
function, its index grids broadcast by vmap) as ``GatherND`` with a constant (B, 1, 1, S, 2) grid
that reads every element in order. TVM legalises ``gather_nd`` into a transpose of the indices
plus a gather: two blocks, so :class:`~tvmfuse.passes.gather_pattern.InjectiveGather` leaves it
opaque and the mask costs two kernels (BERT: 20 kernels, against 18 for the TorchScript export,
whose ``Gather`` is a ``take``). Here it is a view, or a ``take`` that fuses. Indices computed at
run time, ``batch_dims`` ≠ 0, symbolic shapes and out-of-range constants are left as they come.
"""

from __future__ import annotations

import numpy as np
import tvm
from tvm import relax
from tvm.ir.expr import Constant
from tvm.relax.expr_functor import PyExprMutator, mutator

from ...relax_shapes import static_shape
from .._util import is_op
from ._common import gather_rows, rewrite_relax_functions


def flat_indices(indices: np.ndarray, lead: tuple[int, ...]) -> np.ndarray | None:
    """Row-major offsets of the index tuples ``indices[…, :]`` into axes of sizes ``lead``.

    Negative entries count from the end; None when an entry is out of range.
    """
    sizes = np.asarray(lead, dtype=np.int64)
    if indices.shape[-1] != len(lead) or ((indices < -sizes) | (indices >= sizes)).any():
        return None
    wrapped = np.where(indices < 0, indices + sizes, indices).astype(np.int64)
    strides = np.cumprod((lead[1:] + (1,))[::-1])[::-1].astype(np.int64)
    return (wrapped * strides).sum(axis=-1)


@mutator
class _Rewrite(PyExprMutator):
    def visit_call_(self, call: relax.Call) -> relax.Expr:
        call = super().visit_call_(call)
        if not is_op(call, "relax.gather_nd") or int(call.attrs.batch_dims) != 0:
            return call
        x, index = call.args
        shape = static_shape(x)
        if shape is None or not (isinstance(index, Constant)
                                 and isinstance(index.value, tvm.runtime.Tensor)):
            return call
        values = index.value.numpy()
        m = values.shape[-1] if values.ndim else 0
        if values.dtype.kind != "i" or not 1 <= m <= len(shape):
            return call
        flat = flat_indices(values, tuple(shape[:m]))
        return call if flat is None else gather_rows(x, flat, m)


@tvm.transform.module_pass(opt_level=0, name="tvmfuse.ConstantGatherND")
class ConstantGatherND:
    """``gather_nd`` with constant indices → a reshape, or ``take`` of the flattened leading axes."""

    def transform_module(self, mod: tvm.IRModule, _ctx) -> tvm.IRModule:
        return rewrite_relax_functions(mod, lambda m, f: _Rewrite(m).visit_expr(f))
