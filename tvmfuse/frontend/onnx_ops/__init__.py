"""ONNX converters tvmfuse adds to or replaces in TVM 0.27's ``from_onnx``, one op per file.

:data:`OVERRIDES` maps op type → converter class; ``onnx_fixes.converters()`` installs them.
:data:`RUNTIME_INPUTS` maps op type → (its shape-like inputs, the converter used when one of them
is a runtime tensor: symbolic dims bound at run time, :mod:`.runtime_values`).
"""

from __future__ import annotations

from .affine_grid import affine_grid_runtime_size
from .bitcast import BitCast
from .constant_of_shape import constant_of_shape_runtime
from .cumsum import cumsum_runtime_axis
from .elementwise import BitShift, Dropout, IsInf, Mod
from .expand import Expand
from .layer_norm import LayerNormalization
from .losses import NegativeLogLikelihoodLoss, SoftmaxCrossEntropyLoss
from .onehot import onehot_runtime_depth
from .pad import pad_runtime
from .range import range_runtime
from .reduce import RUNTIME as REDUCE
from .refusals import refusals
from .reshape import reshape_runtime_shape
from .resize import resize_runtime
from .runtime_values import Handler
from .split import split_runtime_sizes
from .topk import topk_runtime_k

OVERRIDES: dict[str, type] = {"BitCast": BitCast, "BitShift": BitShift, "Dropout": Dropout, "Expand": Expand,
                              "IsInf": IsInf,
                              "LayerNormalization": LayerNormalization, "Mod": Mod,
                              "NegativeLogLikelihoodLoss": NegativeLogLikelihoodLoss,
                              "SoftmaxCrossEntropyLoss": SoftmaxCrossEntropyLoss}

# op → (indices of shape-like inputs, converter used when one of them is a runtime tensor);
# onnx_fixes wraps its own or TVM's converter of the op with it (runtime_values.with_runtime_inputs)
RUNTIME_INPUTS: dict[str, tuple[tuple[int, ...], Handler]] = {
    "AffineGrid": ((1,), affine_grid_runtime_size), "ConstantOfShape": ((0,), constant_of_shape_runtime),
    "CumSum": ((1,), cumsum_runtime_axis),
    "OneHot": ((1,), onehot_runtime_depth), "Pad": ((1, 2, 3), pad_runtime),
    "Range": ((0, 1, 2), range_runtime),
    "Reshape": ((1,), reshape_runtime_shape), "Resize": ((2, 3), resize_runtime),
    "Split": ((1,), split_runtime_sizes), "TopK": ((1,), topk_runtime_k), **REDUCE,
}

__all__ = ["OVERRIDES", "RUNTIME_INPUTS", "refusals"]
