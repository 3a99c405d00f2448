"""ONNX ``GatherND`` with constant indices: the indices stay a constant.

TVM 0.27 maps negative indices to ``idx + extent`` with ``where`` over the run-time shape, also
when the indices are an initializer, so the graph holds a computed index tensor and
:class:`~tvmfuse.passes.canonical.ConstantGatherND` cannot read it. torch.onnx's dynamo exporter
writes transformers' padding mask ``mask[batch_idx, kv_idx]`` this way (a constant index grid).
Here constant indices on static axes are wrapped in numpy; an out-of-range constant, run-time
indices, symbolic axes and ``batch_dims`` ≠ 0 take TVM's path.
"""

from __future__ import annotations

import numpy as np
from tvm import relax, tirx
from tvm.relax.frontend.onnx import onnx_frontend as stock

from ._common import constant


class GatherND(stock.GatherND):
    """``GatherND`` whose constant indices are wrapped at import time."""

    @classmethod
    def _impl_v13(cls, bb, inputs, attr, params):
        data, indices = inputs[0], inputs[1]
        values = constant(indices, params)
        dims = list(getattr(data.ty, "shape", None) or [])
        if (values is None or attr.get("batch_dims", 0) != 0 or values.ndim == 0
                or values.dtype.kind != "i" or not 1 <= values.shape[-1] <= len(dims)):
            return super()._impl_v13(bb, inputs, attr, params)
        lead = dims[: values.shape[-1]]
        if not all(isinstance(d, tirx.IntImm) for d in lead):
            return super()._impl_v13(bb, inputs, attr, params)
        sizes = np.asarray([int(d) for d in lead], values.dtype)
        if ((values < -sizes) | (values >= sizes)).any():  # out of range: TVM's path, as stock
            return super()._impl_v13(bb, inputs, attr, params)
        wrapped = np.where(values < 0, values + sizes, values)
        return relax.op.gather_nd(data, relax.const(wrapped.astype("int64"), "int64"))
