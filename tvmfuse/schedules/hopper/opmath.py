"""Evaluate an analysed epilogue in fp32 and round once at the store (torch's "opmath").

The fused graph of a half-precision model computes its epilogue in fp16 / bf16 with a cast after
every op: ``(half)erf((float)((half)(acc + b) * half(0.707)))``. On the GEMM's fp32 accumulator
that is both slower (a conversion around each op) and less accurate than one fp32 chain:

    opmath(e) = Cast(out_dtype, e')    e' = e with every fp16 / bf16 / fp32 value computed in fp32

* fp16 / bf16 buffer loads become ``Cast("float32", load)``; float constants become fp32 constants;
* casts between those float types disappear; casts from or to other types (int, bool, fp64) stay,
  with their operand rewritten;
* integer and boolean sub-expressions (indices, masks) are left untouched.
"""

from __future__ import annotations

from tvm import tirx

from ..tir_util import BINARY_OPS, MATH_CALLS, Call, Load, Op, dtype_of
from .epilogue import NotHandled

_NARROW = ("float16", "bfloat16", "float32")  # float types computed in fp32
F32 = "float32"


def _narrow(dtype: str) -> bool:
    return dtype in _NARROW


def to_fp32(e: tirx.PrimExpr) -> tirx.PrimExpr:
    """``e`` with every fp16 / bf16 / fp32 value computed in fp32 (see the module docstring)."""
    if isinstance(e, tirx.Var):
        return tirx.Cast(F32, e) if dtype_of(e) in ("float16", "bfloat16") else e
    if isinstance(e, tirx.FloatImm):
        return tirx.FloatImm(F32, float(e.value)) if _narrow(dtype_of(e)) else e
    if isinstance(e, tirx.IntImm):
        return e
    if isinstance(e, Load):
        return tirx.Cast(F32, e) if dtype_of(e) in ("float16", "bfloat16") else e
    if isinstance(e, tirx.Cast):
        inner = to_fp32(e.value)
        if _narrow(dtype_of(e)):
            return inner if _narrow(dtype_of(e.value)) else tirx.Cast(F32, inner)
        return tirx.Cast(dtype_of(e), inner)
    if isinstance(e, BINARY_OPS):
        return type(e)(to_fp32(e.a), to_fp32(e.b))
    if isinstance(e, tirx.Select):
        return tirx.Select(to_fp32(e.condition), to_fp32(e.true_value), to_fp32(e.false_value))
    if isinstance(e, tirx.Not):
        return tirx.Not(to_fp32(e.a))
    if isinstance(e, Call) and isinstance(e.op, Op) and e.op.name in MATH_CALLS:
        ret = F32 if _narrow(dtype_of(e)) else dtype_of(e)
        return Call(e.op, [to_fp32(a) for a in e.args], ret_ty=ret)
    raise NotHandled(f"opmath: epilogue expression {type(e).__name__} unsupported: {e}")


def opmath(e: tirx.PrimExpr, out_dtype: str) -> tirx.PrimExpr:
    """The epilogue ``e`` (stored as ``out_dtype``) evaluated in fp32 and rounded once at the end.

    Expressions that are not floating point (an integer or boolean output) are returned as they are.
    """
    if not _narrow(dtype_of(e)):
        return e
    value = to_fp32(e)
    return value if out_dtype == F32 else tirx.Cast(out_dtype, value)


# erf(x) ≈ 1 − t·(a1 + t·(a2 + t·(a3 + t·(a4 + t·a5))))·exp(−x²), t = 1 / (1 + p·|x|), odd in x:
# Abramowitz & Stegun 7.1.26, |error| ≤ 1.5e-7 — far below a 16-bit output's rounding
_AS_P = 0.3275911
_AS_A = (0.254829592, -0.284496736, 1.421413741, -1.453152027, 1.061405429)


def _f32(v: float) -> tirx.FloatImm:
    return tirx.FloatImm(F32, v)


def _extern(name: str, *args: tirx.PrimExpr) -> tirx.PrimExpr:
    return tirx.call_pure_extern(F32, name, *args)


def _fast_erf(x: tirx.PrimExpr) -> tirx.PrimExpr:
    t = _extern("__fdividef", _f32(1.0), _f32(1.0) + _f32(_AS_P) * Call(Op.get("tirx.fabs"),
                                                                           [x], ret_ty=F32))
    poly = _f32(_AS_A[4])
    for a in reversed(_AS_A[:4]):
        poly = _f32(a) + t * poly
    y = _f32(1.0) - t * poly * _extern("__expf", _f32(0.0) - x * x)
    return tirx.Select(x < _f32(0.0), _f32(0.0) - y, y)


def fast_math16(e: tirx.PrimExpr) -> tirx.PrimExpr:
    """fp32 ``erf`` and ``sigmoid`` of an epilogue stored in fp16 / bf16, in cheaper forms whose
    error stays far below the output's rounding (|Δerf| ≤ 1.5e-7; ``__expf``, ``__fdividef``)."""
    if isinstance(e, Call) and isinstance(e.op, Op) and dtype_of(e) == F32:
        args = [fast_math16(a) for a in e.args]
        if e.op.name == "tirx.erf":
            return _fast_erf(args[0])
        if e.op.name == "tirx.sigmoid":  # 1 / (1 + exp(−x))
            return _extern("__fdividef", _f32(1.0),
                           _f32(1.0) + _extern("__expf", _f32(0.0) - args[0]))
        return Call(e.op, args, ret_ty=dtype_of(e))
    if isinstance(e, tirx.Cast):
        return tirx.Cast(dtype_of(e), fast_math16(e.value))
    if isinstance(e, BINARY_OPS):
        return type(e)(fast_math16(e.a), fast_math16(e.b))
    if isinstance(e, tirx.Select):
        return tirx.Select(fast_math16(e.condition), fast_math16(e.true_value),
                           fast_math16(e.false_value))
    if isinstance(e, tirx.Not):
        return tirx.Not(fast_math16(e.a))
    return e
