"""ONNX converters tvmfuse adds to or replaces in TVM 0.27's ``from_onnx``, one op per file.

:data:`OVERRIDES` maps op type → converter class; ``onnx_fixes.converters()`` installs them.
"""

from __future__ import annotations

from .batch_norm import BatchNormalization
from .bitcast import BitCast
from .celu import Celu, Elu
from .constant_of_shape import ConstantOfShape
from .conv_integer import ConvInteger
from .dft import DFT
from .elementwise import BitShift, Dropout, IsInf, Mod
from .expand import Expand
from .eye_like import EyeLike
from .layer_norm import LayerNormalization
from .losses import NegativeLogLikelihoodLoss, SoftmaxCrossEntropyLoss
from .pow import Pow
from .qlinear_conv import QLinearConv
from .qlinear_matmul import QLinearMatMul
from .recurrent import GRU, LSTM, RNN
from .refusals import refusals
from .reverse_sequence import ReverseSequence
from .trilu import Trilu
from .windows import BlackmanWindow, HammingWindow, HannWindow

OVERRIDES: dict[str, type] = {
    "BatchNormalization": BatchNormalization, "BitCast": BitCast, "BitShift": BitShift,
    "BlackmanWindow": BlackmanWindow, "Celu": Celu, "ConstantOfShape": ConstantOfShape,
    "ConvInteger": ConvInteger, "DFT": DFT, "Dropout": Dropout, "Elu": Elu, "Expand": Expand,
    "EyeLike": EyeLike, "GRU": GRU, "HammingWindow": HammingWindow, "HannWindow": HannWindow,
    "IsInf": IsInf, "LSTM": LSTM, "LayerNormalization": LayerNormalization, "Mod": Mod,
    "NegativeLogLikelihoodLoss": NegativeLogLikelihoodLoss, "Pow": Pow, "QLinearConv": QLinearConv,
    "QLinearMatMul": QLinearMatMul, "RNN": RNN, "ReverseSequence": ReverseSequence,
    "SoftmaxCrossEntropyLoss": SoftmaxCrossEntropyLoss, "Trilu": Trilu
}

__all__ = ["OVERRIDES", "refusals"]
