"""ONNX converters tvmfuse adds to or replaces in TVM 0.27's ``from_onnx``, one op per file.

:data:`OVERRIDES` maps op type → converter class; ``onnx_fixes.converters()`` installs them.
"""

from __future__ import annotations

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
from .trilu import Trilu
from .windows import BlackmanWindow, HammingWindow, HannWindow

OVERRIDES: dict[str, type] = {"BlackmanWindow": BlackmanWindow, "HammingWindow": HammingWindow,
                              "HannWindow": HannWindow, "Celu": Celu, "Elu": Elu, "Pow": Pow,
                              "ConvInteger": ConvInteger, "DFT": DFT, "EyeLike": EyeLike, "Trilu": Trilu,
                              "QLinearConv": QLinearConv,
                              "QLinearMatMul": QLinearMatMul, "GRU": GRU, "LSTM": LSTM, "RNN": RNN,
                              "BitCast": BitCast, "BitShift": BitShift, "ConstantOfShape": ConstantOfShape,
                              "Dropout": Dropout, "Expand": Expand,
                              "IsInf": IsInf,
                              "LayerNormalization": LayerNormalization, "Mod": Mod,
                              "NegativeLogLikelihoodLoss": NegativeLogLikelihoodLoss,
                              "SoftmaxCrossEntropyLoss": SoftmaxCrossEntropyLoss}

__all__ = ["OVERRIDES", "refusals"]
