"""Converters that replace TVM 0.27's in ``from_exported_program`` where its dtypes differ from torch's.

Matrix products: 0.27 converts ``mm``/``matmul``/``bmm``/``addmm`` with ``out_dtype="float32"``
whatever the inputs are: an fp16 model then returns fp32 where torch returns fp16, and ``addmm``
with an fp16 bias fails ("Binary operators must have the same datatype"). Here products accumulate
in fp32 and the result is cast back to the input dtype, as torch does.

Convolutions (``conv1d/2d/3d``, ``conv_transpose1d/2d``, ``convolution``): 0.27 convolves with
``out_dtype="float32"`` and adds the bias in its own dtype, so every fp16 ``Conv2d`` with a bias
fails to import ("Binary operators must have the same datatype": a ViT's patch embedding, any fp16
CNN) and one without returns fp32. Here the bias is added in fp32 and the result cast back.

``any`` / ``all``: 0.27 has no ``any.default`` (no dim: transformers' T5 clamps fp16 activations
with ``torch.isinf(h).any()``) and no ``all``, and its ``any.dim`` takes ``max`` of a non-bool
input, which is a number, not whether one is nonzero. Here both reduce ``x != 0`` in int8 and
return bool, over the given dims or all of them.

``cat``: torch skips 1-D empty operands (shape ``(0,)``) whatever the others' rank; transformers'
``DynamicCache`` starts every layer's K and V as such a tensor and concatenates the first step's
onto it (a T5 / encoder-decoder forward with ``use_cache`` on). 0.27 refuses the ranks ("Concat
expects all input tensors to have same ndim"). Here they are dropped first.

``cumsum``: 0.27 keeps the input dtype when no ``dtype`` is given; torch sums bool and integer
inputs in int64. A bool cumsum (transformers' packed-sequence check in ``create_causal_mask``:
``(position_diff != 1).cumsum(-1)``) then adds bools, which LLVM codegen refuses
(``Check failed: (t.MatchesCode(DLDataTypeCode::kDLFloat))``); an int32 one returns int32.

``view`` / ``reshape``: 0.27 skips a reshape to the input's own shape by comparing the shapes with
``==``; with a symbolic dim on one side (``compile_lm``'s sequence length: transformers'
GPTBigCode does ``query.view(*input_shape, -1, head_dim)``) that comparison is a symbolic
expression and the import fails ("Cannot use and / or / not operator to Expr"). Here dims compare
structurally.

``clamp`` with scalar bounds: torch promotes an integer tensor clamped by a float bound to float
(``x.clamp(min=-1.5)`` on int64 is float32, -1.5 where x < -1.5); 0.27 keeps the integer dtype
and its clip truncates. Here x is cast to the result dtype torch.export recorded first. With tensor
bounds (``clamp.Tensor``), 0.27 compares x with the bounds in their own dtypes: T5's fp16 clamp by
a 0-d fp32 ``torch.where`` failed ("Binary operators must have the same datatype"). Here bounds
are cast to torch's result dtype too.

``empty`` / ``empty_permuted`` with a symbolic size (``compile_lm``'s sequence length: the inverse
permutation of transformers' MoE layers) failed: 0.27 passes the size's fx nodes on as they are.
Here they are the symbolic dims they stand for.

``div`` (``.Tensor``, ``.Scalar`` and their ``_mode`` forms): 0.27 makes a Python scalar an int32 /
float32 constant whatever the tensor's dtype (transformers' MoE ``perm // top_k`` on int64 failed:
"Binary operators must have the same datatype") and divides integers without rounding mode as
integers.
Here both operands take torch's result dtype (true division of integers is a float division),
``floor`` floors and ``trunc`` rounds toward zero in integers as in floats.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import tvm_ffi
from tvm import relax, tirx

_ACCUMULATE = {"float16": "float32", "bfloat16": "float32", "float32": "float32"}


def accumulate_dtype(dtype: str) -> str:
    """The dtype a product of ``dtype`` operands accumulates in (fp32 for half types, as torch)."""
    return _ACCUMULATE.get(dtype, dtype)


def _product(with_bias: bool) -> Callable:
    def convert(node, importer) -> relax.Var:
        bb, env = importer.block_builder, importer.env
        if with_bias:
            bias, a, b = (env[arg] for arg in node.args[:3])
            alpha, beta = node.kwargs.get("alpha", 1), node.kwargs.get("beta", 1)
        else:
            (a, b), bias, alpha, beta = (env[arg] for arg in node.args[:2]), None, 1, 0
        dtype = str(a.ty.dtype)
        acc = accumulate_dtype(dtype)
        res = bb.emit(relax.op.matmul(a, b, out_dtype=acc))
        if alpha != 1:
            res = bb.emit(relax.op.multiply(res, relax.const(alpha, acc)))
        if bias is not None and beta != 0:
            bias = bias if str(bias.ty.dtype) == acc else bb.emit(relax.op.astype(bias, acc))
            if beta != 1:
                bias = bb.emit(relax.op.multiply(bias, relax.const(beta, acc)))
            res = bb.emit(relax.op.add(res, bias))
        if acc != dtype:
            res = bb.emit(relax.op.astype(res, dtype))
        return res

    return convert


# (transposed, input rank) → the 0.27 importer's convolution builder
_CONV_IMPL = {(False, 3): "_conv1d_impl", (False, 4): "_conv2d_impl", (False, 5): "_conv3d_impl",
              (True, 3): "_conv_transpose1d_impl", (True, 4): "_conv_transpose2d_impl"}


def _conv(signature: str) -> Callable:
    """A convolution converter for one aten signature: "conv" (``convNd``), "transpose"
    (``conv_transposeNd``) or "convolution" (``convolution``, transposed or not)."""

    def convert(node, importer) -> relax.Var:
        args = importer.retrieve_args(node)

        def arg(i: int, default):
            return args[i] if len(args) > i else default

        x, weight, bias, stride, padding = args[0], args[1], arg(2, None), arg(3, 1), arg(4, 0)
        if signature == "convolution":
            dilation, transposed, output_padding, groups = arg(5, 1), arg(6, False), arg(7, 0), arg(8, 1)
        elif signature == "transpose":
            output_padding, groups, dilation, transposed = arg(5, 0), arg(6, 1), arg(7, 1), True
        else:
            dilation, groups, transposed, output_padding = arg(5, 1), arg(6, 1), False, 0
        ndim = len(importer.shape_of(x))
        impl = _CONV_IMPL.get((bool(transposed), ndim))
        if impl is None:
            raise ValueError(f"{node.target}: unsupported convolution of a rank-{ndim} input "
                             f"(transposed={bool(transposed)})")
        extra = {"output_padding": output_padding} if transposed else {}
        bb = importer.block_builder
        out = getattr(importer, impl)(x, weight, bias=None, strides=stride, padding=padding,
                                      dilation=dilation, groups=groups, **extra)
        acc, dtype = str(out.ty.dtype), str(x.ty.dtype)
        if not importer._is_no_bias(bias):
            if str(bias.ty.dtype) != acc:
                bias = bb.emit(relax.op.astype(bias, acc))
            bias = relax.op.reshape(bias, (1, -1) + (1,) * (ndim - 2))
            out = bb.emit(relax.op.add(out, bias))
        return out if acc == dtype else bb.emit(relax.op.astype(out, dtype))

    return convert


def _any_all(reduce: Callable) -> Callable:
    """``aten.any`` / ``aten.all`` (``reduce``: ``relax.op.max`` / ``min``) over ``dim`` or all."""

    def convert(node, importer) -> relax.Var:
        x = importer.env[node.args[0]]
        dim = node.args[1] if len(node.args) > 1 else node.kwargs.get("dim")
        keepdim = node.args[2] if len(node.args) > 2 else node.kwargs.get("keepdim", False)
        bb = importer.block_builder
        if str(x.ty.dtype) != "bool":
            x = bb.emit(relax.op.not_equal(x, relax.const(0, str(x.ty.dtype))))
        flags = bb.emit(relax.op.astype(x, "int8"))
        axis = [dim] if isinstance(dim, int) else (list(dim) if dim is not None else None)
        return bb.emit(relax.op.astype(reduce(flags, axis, keepdims=bool(keepdim)), "bool"))

    return convert


def _cat(node, importer) -> relax.Var:
    """``aten.cat(tensors, dim=0)`` without torch's skipped legacy empty operands of shape (0,)."""
    args = importer.retrieve_args(node)
    dim = args[1] if len(node.args) > 1 else node.kwargs.get("dim", 0)
    tensors = list(args[0])

    def legacy_empty(t) -> bool:
        shape = importer.shape_of(t)
        return shape is not None and len(shape) == 1 and isinstance(shape[0], tirx.IntImm) \
            and int(shape[0]) == 0

    kept = [t for t in tensors if not legacy_empty(t)]
    if kept and len(kept) < len(tensors) and any(len(importer.shape_of(t)) > 1 for t in kept):
        tensors = kept
    if len(tensors) == 1:
        return tensors[0]
    return importer.block_builder.emit(relax.op.concat(tensors, axis=dim))


def _cumsum(node, importer) -> relax.Var:
    """``aten.cumsum(x, dim, dtype=None)`` with torch's result dtype (int64 for bool/int inputs)."""
    x = importer.env[node.args[0]]
    dim = node.args[1] if len(node.args) > 1 else node.kwargs["dim"]
    val = node.meta.get("val")
    if val is not None:
        dtype = importer._convert_data_type(val.dtype)
    elif node.kwargs.get("dtype") is not None:
        dtype = importer._convert_data_type(node.kwargs["dtype"])
    else:
        dtype = "int64" if str(x.ty.dtype) == "bool" or "int" in str(x.ty.dtype) else None
    return importer.block_builder.emit(relax.op.cumsum(x, dim, dtype))


def _topk(node, importer) -> relax.Var:
    """``aten.topk(x, k, dim=-1, largest=True, sorted=True)``, ``sorted=False`` included: torch
    leaves that order unspecified, and the sorted order TVM computes is one it allows (TVM's
    converter refuses the flag; DeepSeek-V3's router asks for it)."""
    x = importer.env[node.args[0]]
    k = node.args[1] if len(node.args) > 1 else node.kwargs.get("k", 1)
    dim = node.args[2] if len(node.args) > 2 else node.kwargs.get("dim", -1)
    largest = node.args[3] if len(node.args) > 3 else node.kwargs.get("largest", True)
    return importer.block_builder.emit(
        relax.op.topk(x, k=k, axis=dim, largest=largest, ret_type="both", dtype="int64"))


def _same_dim(a, b) -> bool:
    """Two shape entries (ints or PrimExprs) are the same dim, compared without ``==`` on Exprs."""
    a, b = (int(d.value) if isinstance(d, tirx.IntImm) else d for d in (a, b))
    if isinstance(a, int) or isinstance(b, int):
        return isinstance(a, int) and isinstance(b, int) and a == b
    return bool(tvm_ffi.structural_equal(a, b))


def _reshape(node, importer) -> relax.Var:
    """``aten.view`` / ``aten.reshape``: the input itself when the shape does not change."""
    import torch

    args = importer.retrieve_args(node)
    x = args[0]
    dims = args[1] if isinstance(args[1], (torch.Size, tuple, list)) else args[1:]
    shape = importer.shape_of(x)
    if shape is not None and len(shape) == len(dims) and all(
            _same_dim(a, b) for a, b in zip(shape, dims)):
        return x
    return importer._emit_torch_reshape(x, dims)


def _clamp(node, importer) -> relax.Var:
    """``aten.clamp(x, min=None, max=None)`` with scalar bounds, in torch's result dtype."""
    x = importer.env[node.args[0]]
    lo = node.args[1] if len(node.args) > 1 else node.kwargs.get("min")
    hi = node.args[2] if len(node.args) > 2 else node.kwargs.get("max")
    val = node.meta.get("val")
    dtype = importer._convert_data_type(val.dtype) if val is not None else str(x.ty.dtype)
    bb = importer.block_builder
    if dtype != str(x.ty.dtype):
        x = bb.emit(relax.op.astype(x, dtype))
    return bb.emit(relax.op.clip(x, -math.inf if lo is None else lo, math.inf if hi is None else hi))


def _in_result_dtype(node, importer, first: relax.Expr) -> tuple[str, Callable]:
    """torch's result dtype of ``node`` (``first``'s without a recorded value) and a function
    that casts an operand (a Relax tensor or a Python scalar) to it."""
    val = node.meta.get("val")
    dtype = importer._convert_data_type(val.dtype) if val is not None else str(first.ty.dtype)
    bb = importer.block_builder

    def as_dtype(v):
        if isinstance(v, relax.Expr):
            return v if str(v.ty.dtype) == dtype else bb.emit(relax.op.astype(v, dtype))
        return relax.const(v, dtype)

    return dtype, as_dtype


def _clamp_tensor(node, importer) -> relax.Var:
    """``aten.clamp.Tensor(x, min=None, max=None)``: x and tensor bounds in torch's result dtype."""
    args = importer.retrieve_args(node)
    x = args[0]
    lo = args[1] if len(args) > 1 else node.kwargs.get("min")
    hi = args[2] if len(args) > 2 else node.kwargs.get("max")
    bb = importer.block_builder
    _, as_dtype = _in_result_dtype(node, importer, x)
    x = as_dtype(x)
    if lo is not None:
        x = bb.emit(relax.op.maximum(x, as_dtype(lo)))
    if hi is not None:
        x = bb.emit(relax.op.minimum(x, as_dtype(hi)))
    return x


def _div_mode(node, importer) -> relax.Var:
    """``aten.div(a, b, rounding_mode=None | "floor" | "trunc")`` in torch's result dtype."""
    args = importer.retrieve_args(node)
    a, b = args[0], args[1]
    mode = args[2] if len(args) > 2 else node.kwargs.get("rounding_mode")
    bb = importer.block_builder
    dtype, as_dtype = _in_result_dtype(node, importer, a)
    a, b = as_dtype(a), as_dtype(b)
    if mode is None:
        return bb.emit(relax.op.divide(a, b))
    if mode == "floor":
        return bb.emit(relax.op.floor_divide(a, b))
    if mode != "trunc":
        raise ValueError(f"{node.name}: div rounding_mode {mode!r} (torch has None, floor, trunc)")
    if dtype.startswith(("int", "uint")):  # |a| // |b| with the sign of a·b
        q = bb.emit(relax.op.floor_divide(relax.op.abs(a), relax.op.abs(b)))
        return bb.emit(relax.op.multiply(q, relax.op.multiply(relax.op.sign(a), relax.op.sign(b))))
    return bb.emit(relax.op.trunc(relax.op.divide(a, b)))


def _empty(node, importer) -> relax.Var:
    """``aten.empty`` / ``empty_permuted(size, ...)`` as zeros; sizes may be symbolic (fx nodes)."""
    import torch

    shape = [importer.env[d] if isinstance(d, torch.fx.Node) else d for d in node.args[0]]
    dtype = importer._convert_data_type(node.kwargs.get("dtype") or torch.get_default_dtype(),
                                        importer.env)
    return importer.block_builder.emit(relax.op.zeros(shape, dtype))


def custom_convert_map() -> dict[str, Callable]:
    """Converter overrides for ``from_exported_program(custom_convert_map=...)``."""
    plain = _product(with_bias=False)
    return {"mm.default": plain, "matmul.default": plain, "bmm.default": plain,
            "addmm.default": _product(with_bias=True), "cumsum.default": _cumsum,
            "topk.default": _topk,
            "div.Tensor": _div_mode, "div.Scalar": _div_mode, "div.Tensor_mode": _div_mode,
            "div.Scalar_mode": _div_mode, "empty.default": _empty, "empty.memory_format": _empty,
            "empty_permuted.default": _empty,
            "view.default": _reshape, "reshape.default": _reshape, "clamp.default": _clamp,
            "clamp.Tensor": _clamp_tensor, "cat.default": _cat, "concat.default": _cat,
            "conv1d.default": _conv("conv"), "conv2d.default": _conv("conv"),
            "conv3d.default": _conv("conv"), "conv_transpose1d.default": _conv("transpose"),
            "conv_transpose2d.input": _conv("transpose"), "convolution.default": _conv("convolution"),
            "any.default": _any_all(relax.op.max), "any.dim": _any_all(relax.op.max),
            "any.dims": _any_all(relax.op.max), "all.default": _any_all(relax.op.min),
            "all.dim": _any_all(relax.op.min), "all.dims": _any_all(relax.op.min)}
