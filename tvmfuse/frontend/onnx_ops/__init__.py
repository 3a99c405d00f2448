"""ONNX converters tvmfuse adds to or replaces in TVM 0.27's ``from_onnx``, one op per file.

:data:`OVERRIDES` maps op type → converter class; ``onnx_fixes.converters()`` installs them.
"""

from __future__ import annotations

from .attention import Attention
from .batch_norm import BatchNormalization
from .bitcast import BitCast
from .causal_conv import CausalConvWithState
from .celu import Celu, Elu
from .constant_of_shape import ConstantOfShape
from .conv_integer import ConvInteger
from .dft import DFT
from .elementwise import BitShift, Dropout, IsInf, Mod
from .expand import Expand
from .eye_like import EyeLike
from .layer_norm import LayerNormalization
from .linear_attention import LinearAttention
from .losses import NegativeLogLikelihoodLoss, SoftmaxCrossEntropyLoss
from .pow import Pow
from .qlinear_conv import QLinearConv
from .qlinear_matmul import QLinearMatMul
from .recurrent import GRU, LSTM, RNN
from .refusals import refusals
from .reverse_sequence import ReverseSequence
from .rms_norm import RMSNormalization
from .rotary_embedding import RotaryEmbedding
from .swiglu import SwiGLU
from .swish import Swish
from .tensor_scatter import TensorScatter
from .trilu import Trilu
from .windows import BlackmanWindow, HammingWindow, HannWindow

OVERRIDES: dict[str, type] = {
    "Attention": Attention, "BatchNormalization": BatchNormalization, "BitCast": BitCast,
    "BitShift": BitShift, "BlackmanWindow": BlackmanWindow, "CausalConvWithState": CausalConvWithState,
    "Celu": Celu, "ConstantOfShape": ConstantOfShape, "ConvInteger": ConvInteger, "DFT": DFT,
    "Dropout": Dropout, "Elu": Elu, "Expand": Expand, "EyeLike": EyeLike, "GRU": GRU,
    "HammingWindow": HammingWindow, "HannWindow": HannWindow, "IsInf": IsInf, "LSTM": LSTM,
    "LayerNormalization": LayerNormalization, "LinearAttention": LinearAttention, "Mod": Mod,
    "NegativeLogLikelihoodLoss": NegativeLogLikelihoodLoss, "Pow": Pow, "QLinearConv": QLinearConv,
    "QLinearMatMul": QLinearMatMul, "RMSNormalization": RMSNormalization, "RNN": RNN,
    "ReverseSequence": ReverseSequence, "RotaryEmbedding": RotaryEmbedding,
    "SoftmaxCrossEntropyLoss": SoftmaxCrossEntropyLoss, "SwiGLU": SwiGLU, "Swish": Swish,
    "TensorScatter": TensorScatter, "Trilu": Trilu,
}

__all__ = ["OVERRIDES", "refusals"]
