"""ONNX converters tvmfuse adds to or replaces in TVM 0.27's ``from_onnx``, one op per file.

:data:`OVERRIDES` maps op type → converter class; ``onnx_fixes.converters()`` installs them.
"""

from __future__ import annotations

from .attention import Attention
from .bitcast import BitCast
from .causal_conv import CausalConvWithState
from .elementwise import BitShift, Dropout, IsInf, Mod
from .expand import Expand
from .layer_norm import LayerNormalization
from .linear_attention import LinearAttention
from .losses import NegativeLogLikelihoodLoss, SoftmaxCrossEntropyLoss
from .refusals import refusals
from .rms_norm import RMSNormalization
from .rotary_embedding import RotaryEmbedding
from .swiglu import SwiGLU
from .swish import Swish
from .tensor_scatter import TensorScatter

OVERRIDES: dict[str, type] = {
    "Attention": Attention, "BitCast": BitCast, "BitShift": BitShift,
    "CausalConvWithState": CausalConvWithState, "Dropout": Dropout, "Expand": Expand, "IsInf": IsInf,
    "LayerNormalization": LayerNormalization, "LinearAttention": LinearAttention, "Mod": Mod,
    "NegativeLogLikelihoodLoss": NegativeLogLikelihoodLoss,
    "RMSNormalization": RMSNormalization, "RotaryEmbedding": RotaryEmbedding,
    "SoftmaxCrossEntropyLoss": SoftmaxCrossEntropyLoss, "SwiGLU": SwiGLU, "Swish": Swish,
    "TensorScatter": TensorScatter}

__all__ = ["OVERRIDES", "refusals"]
