"""ONNX ``Reduce*`` with the ``axes`` input a runtime tensor (of static length ``L``).

The reduced set is known only at run time, so the output shape is too. With ``data`` of static
shape ``n`` (rank ``r``)::

    mask[k] = k ∈ {a mod r : a ∈ axes}            (run time; distinct, in range, or the call fails)
    o[k]    = 1 if mask[k] else n[k]              keepdims shape: symbolic dims o_k
    out[i]  = post(reduce_{j_k < n_k - o_k + 1} pre(data[i_0 + j_0, …, i_{r-1} + j_{r-1}]))

one kernel whatever the axes (an unreduced axis has one reduction step, a reduced one ``n_k``
steps from ``i_k = 0``). ``keepdims=0`` reshapes to the ``r - L`` unreduced dims (in order).
``pre`` / ``reducer`` / ``post`` per op: Sum, SumSquare (x²), L1 (|x|), L2 (√Σx²), LogSum
(log Σ), LogSumExp (m + log Σ exp(x − m), m the max), Mean (Σ / Π(n_k − o_k + 1)), Max / Min
(bool as uint8), Prod. The reducers are the ones TIR's GPU schedules recognise (max / min start
from the dtype's finite extreme; a group of only ∓inf is set back to ∓inf by counting them). An
empty reduced set gives the identity (0, 1, ∓inf; LogSum / LogSumExp −inf) as ONNX does.
``axes`` of static length 0 is the ONNX "reduce everything" (or identity with
``noop_with_empty_axes=1``): TVM's converter takes it as an empty constant. Constant axes keep
TVM's converters.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
from tvm import relax, te, tirx

from ...relax_shapes import static_shape
from .runtime_values import (
    Fallback,
    Handler,
    axes_mask,
    dims_tensor,
    int64,
    kept_dims,
    static_length,
    symbolic_dims,
)

_PRE: dict[str, Callable[[tirx.PrimExpr], tirx.PrimExpr]] = {
    "ReduceSumSquare": lambda v: v * v, "ReduceL2": lambda v: v * v, "ReduceL1": tirx.abs}
_POST: dict[str, Callable[[tirx.PrimExpr], tirx.PrimExpr]] = {
    "ReduceL2": tirx.sqrt, "ReduceLogSum": tirx.log}
OPS = ("ReduceL1", "ReduceL2", "ReduceLogSum", "ReduceLogSumExp", "ReduceMax", "ReduceMean",
       "ReduceMin", "ReduceProd", "ReduceSum", "ReduceSumSquare")


def _extreme(dtype: str, low: bool) -> tirx.PrimExpr:
    """−inf / +inf for floats, the dtype's min / max otherwise."""
    dtype = str(dtype)
    if dtype.startswith(("float", "bfloat")):
        return tirx.const(-np.inf if low else np.inf, dtype)
    return tirx.min_value(dtype) if low else tirx.max_value(dtype)


def _reducer(op: str):
    """The TE reducer of ``op``: those TIR's GPU schedules match (sum, product, and max / min
    with the dtype's finite extreme as identity; ±inf is restored below)."""
    if op in ("ReduceMax", "ReduceLogSumExp"):
        return te.max
    if op == "ReduceMin":
        return te.min
    if op == "ReduceProd":
        return te.comm_reducer(lambda a, b: a * b, lambda t: tirx.const(1, t), name="prod")
    return te.sum


def _onnx_identity(op: str, dtype: str) -> tirx.PrimExpr:
    """ONNX's value of ``op`` over an empty set: 0, 1, −inf (max), +inf (min)."""
    if op in ("ReduceMax", "ReduceLogSumExp", "ReduceMin"):
        return _extreme(dtype, low=op != "ReduceMin")
    return tirx.const(1 if op == "ReduceProd" else 0, dtype)


def _kernel(op: str, data: te.Tensor, out_dims: list[tirx.Var]) -> te.Tensor:
    """``out`` (keepdims shape ``out_dims``) = the reduction of ``data`` described above."""
    steps = [n - o + 1 for n, o in zip(data.shape, out_dims)]
    count = _product(steps)
    dtype = str(data.dtype)
    floating = dtype.startswith(("float", "bfloat"))

    def reduce(value: Callable, reducer, name: str) -> te.Tensor:
        def body(*i):
            j = [te.reduce_axis((0, s), f"j{k}") for k, s in enumerate(steps)]
            return reducer(value([a + b for a, b in zip(i, j)], i), axis=j)

        return te.compute(out_dims, body, name=name)

    def fold(value: Callable, reduction: str, name: str) -> te.Tensor:
        out = reduce(value, _reducer(reduction), name)
        identity = _onnx_identity(reduction, dtype)
        if floating and reduction in ("ReduceMax", "ReduceMin", "ReduceLogSumExp"):
            # every element ∓inf: the finite identity would win; ONNX answers ∓inf
            hits = reduce(lambda j, i: tirx.Cast("int64", value(j, i) == identity), te.sum, f"{name}_inf")
            inf = out
            out = te.compute(out_dims, lambda *i: tirx.Select(hits(*i) == count, identity, inf(*i)),
                             name=f"{name}_or_inf")
        if not any(isinstance(n, tirx.IntImm) and int(n) == 0 for n in data.shape):
            return out
        # an empty reduction runs no step, so not even the init: the identity is written here
        filled = out
        return te.compute(out_dims, lambda *i: tirx.Select(count == 0, identity, filled(*i)),
                          name=f"{name}_or_identity")

    if op == "ReduceLogSumExp":
        peak = fold(lambda j, i: data(*j), "ReduceMax", "peak")
        safe = lambda i: tirx.if_then_else(tirx.isinf(peak(*i)), tirx.const(0, dtype), peak(*i))  # noqa: E731
        total = fold(lambda j, i: tirx.exp(data(*j) - safe(i)), "ReduceSum", "total")
        return te.compute(out_dims, lambda *i: tirx.log(total(*i)) + safe(i), name="logsumexp")
    pre = _PRE.get(op, lambda v: v)
    red = fold(lambda j, i: pre(data(*j)), op, "reduced")
    if op == "ReduceMean":
        return te.compute(out_dims, lambda *i: red(*i) / tirx.Cast(dtype, count), name="mean")
    post = _POST.get(op)
    return red if post is None else te.compute(out_dims, lambda *i: post(red(*i)), name="post")


def _product(values: list[tirx.PrimExpr]) -> tirx.PrimExpr:
    out = values[0]
    for v in values[1:]:
        out = out * v
    return out


def reduce_runtime_axes(bb: relax.BlockBuilder, op: str, data: relax.Expr, axes: relax.Expr,
                        keepdims: bool) -> relax.Expr:
    """``op`` of ``data`` over the runtime ``axes`` (see the module docstring)."""
    shape = static_shape(data)
    length = static_length(axes)
    if shape is None or not shape or length is None:
        raise ValueError(f"{op}: runtime axes need data of static shape and rank >= 1 and axes of "
                         f"static length (data {data.ty}, axes {axes.ty})")
    rank = len(shape)
    mask, ok = axes_mask(bb, axes, length, rank)
    dims = dims_tensor(data)
    out = symbolic_dims(bb, relax.op.where(relax.op.greater(mask, int64(0)), int64(1), dims), rank,
                        "reduced", ok)
    boolean = str(data.ty.dtype) == "bool"
    source = relax.op.astype(data, "uint8") if boolean else data
    result = bb.emit_te(lambda x: _kernel(op, x, out), bb.normalize(source),
                        primfunc_name_hint=op.lower())  # not "<lambda>": a CUDA kernel name
    if boolean:
        result = bb.normalize(relax.op.astype(result, "bool"))
    if keepdims:
        return result
    kept = symbolic_dims(bb, kept_dims(dims, mask, rank, rank - length), rank - length, "kept")
    return relax.op.reshape(result, relax.ShapeExpr(kept))


def _convert(op: str) -> Handler:
    def convert(bb: relax.BlockBuilder, inputs: list, attr: dict, fallback: Fallback) -> relax.Expr:
        if static_length(inputs[1]) == 0:  # ONNX: reduce all (noop_with_empty_axes: nothing)
            return fallback([inputs[0], relax.const(np.zeros(0, "int64"), "int64")])
        return reduce_runtime_axes(bb, op, inputs[0], inputs[1], bool(attr.get("keepdims", 1)))

    return convert


# op → (the axes input, its converter): onnx_ops.RUNTIME_INPUTS
RUNTIME: dict[str, tuple[tuple[int, ...], Handler]] = {op: ((1,), _convert(op)) for op in OPS}
