"""ONNX ``CenterCropPad`` (opset 18): crop or zero-pad each axis of ``axes`` to ``shape``, centred.

Per axis of length ``n`` and target ``s`` (constant or a runtime tensor: symbolic dims bound at
run time; a negative target fails the call), as the ONNX reference does::

    out[i] = x[i + o]   (0 where outside x)    o = (n - s) // 2 if s < n, -((s - n) // 2) if s > n

one kernel (``Pad``'s constant mode with ``begin = -o``).
"""

from __future__ import annotations

from tvm import relax
from tvm.relax.frontend.onnx import onnx_frontend as stock

from .pad import pad_kernel
from .runtime_values import all_of, as_int64, dims_tensor, int64, spread, static_length, symbolic_dims


class CenterCropPad(stock.OnnxOpConverter):
    """``CenterCropPad(input_data, shape)`` with the ``axes`` attribute (see the module docstring)."""

    @classmethod
    def _impl_v18(cls, bb, inputs, attr, params):
        data, shape = inputs[0], inputs[1]
        rank = data.ty.ndim
        axes = [a % rank for a in attr.get("axes", range(rank))]
        if rank < 1 or static_length(shape) != len(axes) or len(set(axes)) != len(axes):
            raise ValueError(f"CenterCropPad: shape {shape.ty} must give one length per axis of "
                             f"{axes} (data {data.ty})")
        dims = dims_tensor(data)
        target = bb.normalize(spread(as_int64(bb.normalize(shape)), axes, rank, dims))
        crop = relax.op.floor_divide(relax.op.subtract(dims, target), int64(2))
        pad = relax.op.floor_divide(relax.op.subtract(target, dims), int64(2))
        offset = relax.op.where(relax.op.less(target, dims), crop, relax.op.negative(pad))
        ok = bb.normalize(all_of(relax.op.greater_equal(target, int64(0))))
        both = relax.op.concat([relax.op.negative(offset), target], axis=0)
        syms = symbolic_dims(bb, both, 2 * rank, "center", ok)
        fill = relax.const([0], str(data.ty.dtype))
        return pad_kernel(bb, data, fill, syms[:rank], syms[rank:])
