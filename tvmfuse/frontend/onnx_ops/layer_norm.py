"""ONNX ``LayerNormalization`` (opset 17) with its optional ``Mean`` and ``InvStdDev`` outputs.

Over the axes ``[axis, rank)``, in ``stash_type`` (float32)::

    Mean = mean(X)          InvStdDev = 1 / sqrt(mean((X - Mean)²) + epsilon)
    Y = cast((X - Mean) · InvStdDev, T) · Scale + B

``Mean`` and ``InvStdDev`` keep the reduced axes as 1 (shape ``X.shape[:axis] + (1,)*k``). With
one output this is ``R.nn.layer_norm`` (what the norm passes match); TVM 0.27 returns two scalar
zeros for the other outputs, a silent wrong answer this converter replaces.
"""

from __future__ import annotations

from tvm import relax
from tvm.relax.frontend.onnx import onnx_frontend as stock

_STASH_FLOAT = 1  # TensorProto.FLOAT


class LayerNormalization(stock.LayerNormalization):
    """``Y`` through TVM's converter; with ``Mean`` / ``InvStdDev`` asked for, all three here."""

    @classmethod
    def _impl_v17(cls, bb, inputs, attr, params):
        if attr["tvm_custom"]["num_outputs"] == 1:
            return super()._impl_v17(bb, inputs, attr, params)[0]
        if attr.get("stash_type", _STASH_FLOAT) != _STASH_FLOAT:
            raise ValueError(f"LayerNormalization stash_type={attr['stash_type']} (only float)")
        x, scale, bias = inputs[0], inputs[1], inputs[2] if len(inputs) > 2 else None
        ndim, dtype = x.ty.ndim, str(x.ty.dtype)
        axis = attr.get("axis", -1)
        axes = list(range(axis % ndim, ndim))
        x32 = x if dtype == "float32" else relax.op.astype(x, "float32")
        mean = bb.normalize(relax.op.mean(x32, axes, keepdims=True))
        centred = bb.normalize(relax.op.subtract(x32, mean))
        var = relax.op.mean(relax.op.multiply(centred, centred), axes, keepdims=True)
        eps = relax.const(attr.get("epsilon", 1e-5), "float32")
        inv = bb.normalize(relax.op.rsqrt(relax.op.add(var, eps)))
        normed = relax.op.multiply(centred, inv)
        if dtype != "float32":
            normed = relax.op.astype(normed, dtype)
        y = relax.op.multiply(normed, scale)
        if bias is not None:
            y = relax.op.add(y, bias)
        return relax.Tuple([bb.normalize(y), mean, inv])
