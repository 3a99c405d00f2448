"""ONNX ``CausalConvWithState`` (opset 27): a stateful causal depthwise 1-D convolution.

``input`` (B, C, L), ``weight`` (C, 1, k), ``bias`` (C,) optional, ``past_state`` (B, C, k − 1)
optional (zeros without)::

    padded        = concat(past_state, input, axis=2)                   (B, C, L + k − 1)
    output        = act(conv1d(padded, weight, groups=C) + bias)        (B, C, L)
    present_state = padded[:, :, L:]                                    (B, C, k − 1)

``act`` is identity, or SiLU for ``activation`` "silu" / "swish" (computed in fp32, as the ONNX
reference does). The convolution accumulates in fp32 and is cast to the input dtype. k = 1 has an
empty state (B, C, 0), which tvmfuse cannot return: refused.
"""

from __future__ import annotations

from tvm import relax
from tvm.relax.frontend.onnx import onnx_frontend as stock

from ...relax_shapes import shape_expr, static_shape
from .refusals import refuse
from .swish import swish


class CausalConvWithState(stock.OnnxOpConverter):
    """``CausalConvWithState`` → concat, grouped ``conv1d``, bias, optional SiLU, a slice."""

    @classmethod
    def _impl_v27(cls, bb, inputs, attr, params):
        x, weight = inputs[0], inputs[1]
        bias = inputs[2] if len(inputs) > 2 else None
        past = inputs[3] if len(inputs) > 3 else None
        shape, wshape = static_shape(x), static_shape(weight)
        if shape is None or wshape is None or len(shape) != 3 or len(wshape) != 3:
            raise ValueError(f"CausalConvWithState: input {x.ty} and weight {weight.ty} must be 3-D "
                             "of static shape")
        (b, c, length), k = shape, wshape[2]
        act = attr.get("activation", b"none")
        act = act.decode() if isinstance(act, bytes) else act
        if act not in ("none", "silu", "swish"):
            raise ValueError(f"CausalConvWithState: activation {act!r} is not none / silu / swish")
        if k < 2:
            refuse(attr, "CausalConvWithState with a kernel of size 1 (its present_state is empty, "
                         "(B, C, 0), and tvmfuse cannot return an empty tensor)")
        dtype = str(x.ty.dtype)
        if past is None:
            past = relax.op.zeros(shape_expr([b, c, k - 1]), dtype)
        padded = bb.normalize(relax.op.concat([past, x], axis=2))
        f32 = "float32"
        y = relax.op.nn.conv1d(relax.op.astype(padded, f32), relax.op.astype(weight, f32),
                               groups=c, out_dtype=f32)
        if bias is not None:
            y = relax.op.add(y, relax.op.reshape(relax.op.astype(bias, f32), shape_expr([1, c, 1])))
        if act != "none":
            y = swish(bb.normalize(y))
        y = relax.op.astype(y, dtype)
        present = relax.op.strided_slice(padded, [2], [length], [length + k - 1])
        return relax.Tuple([bb.normalize(y), bb.normalize(present)])
