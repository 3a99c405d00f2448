"""ONNX converters tvmfuse adds to or replaces in TVM 0.27's ``from_onnx``, one op per file.

:data:`OVERRIDES` maps op type → converter class; ``onnx_fixes.converters()`` installs them.
:data:`RUNTIME_INPUTS` maps op type → (its shape-like inputs, the converter used when one of them
is a runtime tensor: symbolic dims bound at run time, :mod:`.runtime_values`).
"""

from __future__ import annotations

from .affine_grid import affine_grid_runtime_size
from .attention import Attention
from .batch_norm import BatchNormalization
from .bitcast import BitCast
from .blocked_quant import DequantizeLinear, QuantizeLinear
from .causal_conv import CausalConvWithState
from .celu import Celu, Elu
from .center_crop_pad import CenterCropPad
from .col2im import Col2Im
from .constant import Constant
from .constant_of_shape import ConstantOfShape
from .conv_integer import ConvInteger
from .conv_transpose import ConvTranspose
from .cumprod import CumProd
from .deform_conv import DeformConv
from .det import Det
from .dft import DFT
from .elementwise import BitShift, Dropout, IsInf, Mod
from .expand import Expand
from .eye_like import EyeLike
from .gather_nd import GatherND
from .layer_norm import LayerNormalization
from .linear_attention import LinearAttention
from .losses import NegativeLogLikelihoodLoss, SoftmaxCrossEntropyLoss
from .max_pool import MaxPool
from .mel_weight_matrix import MelWeightMatrix
from .non_max_suppression import NonMaxSuppression
from .onehot import onehot_runtime_depth
from .pad import pad_runtime
from .pow import Pow
from .qlinear_conv import QLinearConv
from .qlinear_matmul import QLinearMatMul
from .range import range_runtime
from .recurrent import GRU, LSTM, RNN
from .reduce import RUNTIME as REDUCE
from .refusals import refusals
from .reshape import reshape_runtime_shape
from .resize import resize_runtime
from .reverse_sequence import ReverseSequence
from .rms_norm import RMSNormalization
from .roi_align import RoiAlign
from .rotary_embedding import RotaryEmbedding
from .runtime_axis import cumprod_runtime_axis, cumsum_runtime_axis, dft_runtime_axis
from .runtime_values import Handler
from .space_to_depth import SpaceToDepth
from .split import split_runtime_sizes
from .stft import STFT
from .swiglu import SwiGLU
from .swish import Swish
from .tensor_scatter import TensorScatter
from .tfidf_vectorizer import TfIdfVectorizer
from .topk import topk_runtime_k
from .trilu import Trilu
from .upsample import Upsample
from .windows import BlackmanWindow, HammingWindow, HannWindow

OVERRIDES: dict[str, type] = {
    "Attention": Attention, "BatchNormalization": BatchNormalization, "BitCast": BitCast,
    "BitShift": BitShift, "BlackmanWindow": BlackmanWindow, "CausalConvWithState": CausalConvWithState,
    "Celu": Celu, "CenterCropPad": CenterCropPad, "Col2Im": Col2Im, "Constant": Constant,
    "ConstantOfShape": ConstantOfShape, "ConvInteger": ConvInteger, "ConvTranspose": ConvTranspose,
    "CumProd": CumProd, "DeformConv": DeformConv,
    "DequantizeLinear": DequantizeLinear, "Det": Det, "DFT": DFT, "Dropout": Dropout,
    "Elu": Elu, "Expand": Expand, "EyeLike": EyeLike, "GatherND": GatherND, "GRU": GRU,
    "HammingWindow": HammingWindow,
    "HannWindow": HannWindow, "IsInf": IsInf, "LayerNormalization": LayerNormalization,
    "LinearAttention": LinearAttention, "LSTM": LSTM, "MaxPool": MaxPool, "MelWeightMatrix": MelWeightMatrix,
    "Mod": Mod,
    "NegativeLogLikelihoodLoss": NegativeLogLikelihoodLoss, "NonMaxSuppression": NonMaxSuppression,
    "Pow": Pow, "QLinearConv": QLinearConv, "QLinearMatMul": QLinearMatMul,
    "QuantizeLinear": QuantizeLinear, "ReverseSequence": ReverseSequence,
    "RMSNormalization": RMSNormalization, "RNN": RNN,
    "RoiAlign": RoiAlign, "RotaryEmbedding": RotaryEmbedding,
    "SoftmaxCrossEntropyLoss": SoftmaxCrossEntropyLoss, "SpaceToDepth": SpaceToDepth, "STFT": STFT,
    "SwiGLU": SwiGLU,
    "Swish": Swish, "TensorScatter": TensorScatter, "TfIdfVectorizer": TfIdfVectorizer, "Trilu": Trilu,
    "Upsample": Upsample,
}

# op → (indices of shape-like inputs, converter used when one of them is a runtime tensor);
# onnx_fixes wraps its own or TVM's converter of the op with it (runtime_values.with_runtime_inputs)
RUNTIME_INPUTS: dict[str, tuple[tuple[int, ...], Handler]] = {
    "AffineGrid": ((1,), affine_grid_runtime_size), "CumProd": ((1,), cumprod_runtime_axis),
    "CumSum": ((1,), cumsum_runtime_axis), "DFT": ((2,), dft_runtime_axis),
    "OneHot": ((1,), onehot_runtime_depth), "Pad": ((1, 2, 3), pad_runtime),
    "Range": ((0, 1, 2), range_runtime),
    "Reshape": ((1,), reshape_runtime_shape), "Resize": ((2, 3), resize_runtime),
    "Split": ((1,), split_runtime_sizes), "TopK": ((1,), topk_runtime_k), **REDUCE,
}

__all__ = ["OVERRIDES", "RUNTIME_INPUTS", "refusals"]
