"""Spelled-out attention → one ``R.nn.attention`` (BSNH layout), or left alone with a reason.

Exporters write attention as separate ops; this pass finds

    O = P · V,   P = softmax(S, axis=-1) [→ where(isnan(P), 0, P) | where(all(S == -inf), 0, P)]
                 [→ astype],
    S = (Q · Kᵀ) [· c | / c] [+ mask | where(cond, ·, fill)] ...   (any order of scale and mask)
        [→ c · tanh(S / c) before the masks: logit soft-capping, the call's ``softcap``]

and rewrites ``O`` (heads-major, (B, H, Sq, D)) into
``permute_dims(R.nn.attention(q, k, v, bias?, scale, causal_mask, window_size?), [0, 2, 1, 3])``
where
q (B, Sq, Hq, D), k/v (B, Skv, Hkv, D) are taken from *before* the exporters' layout ops:

* permutes of Q, Kᵀ and V are composed and folded into the BSNH operand (usually the
  (B, S, H, D) reshape of a projection; a permute is emitted only where RoPE ran heads-major);
* scalar scales on Q, K or S (multiply/divide by a constant) multiply into ``scale``;
* GQA/MQA repetition of K/V heads (expand_dims → broadcast_to → reshape, ``R.repeat``, or a
  broadcast of one KV head) becomes ``Hkv < Hq``; it must be interleaved (query head h reads KV
  head h // group), a tiled repetition (h % Hkv) is left alone;
* torch.export's batched 3-D form (reshape to (B·H, S, D) around each matmul) is looked through;
* an exact fp16/bf16 → fp32 upcast of Q, K and V (torch's CPU decomposition of
  ``F.scaled_dot_product_attention`` on half inputs: fp32 products and softmax, a cast back at the
  end) is peeled off: the attention op runs on the half operands (the kernels keep S, softmax and
  accumulators in fp32; P·V takes P in the half dtype, as torch's own GPU kernels do), and the
  result's fp32 → half cast and the exporter's permutes collapse into at most one permute.

Masks are accepted only when the equivalence is proved:

* a mask that depends on constants only (triu/tril, arange comparisons, where, full(-inf), a
  constant matrix, ...) is evaluated at compile time and checked entry by entry: every visible
  entry is exactly 0, every masked one is -inf or <= -2^100 (fp16: -2^10; exp underflows to
  exactly 0 beside any visible score above -2^99), every query row sees at least one key, and the visible set
  is exactly ``tril(k=0)`` (TopLeft) or ``tril(k=Skv-Sq)`` (BottomRight) or everything, or a
  sliding-window band of one of them, ``tril(k=off) & triu(k=off-w+1)``, which becomes
  ``window_size=w`` (each query sees its last w keys; BottomRight preferred when both fit). On
  a CUDA target with ``Options(gpu_window_attention=False)`` the band stays unfused with its reason
  (``attention_lower.gpu_window_gate``);
* values narrower than q and k (multi-head latent attention) are the kernels' ``v_head_dim``; on
  a CUDA target only with ``Options(gpu_mla_attention=True)`` (``attention_lower.gpu_value_dim_gate``);
* a mask that depends on model inputs becomes the additive ``bias`` when it is constant along the
  query axis (a padding mask, (B|1, H|1, 1, Skv)); ``where(and(C, P), a, b)`` with a constant
  all-true C (HF's broadcast padding mask) is reduced to ``where(P, a, b)`` first;
* HF SDPA's ``where(isnan(P), 0, P)`` is dropped when no row can be fully masked (no data-dependent
  mask, or one whose values are provably finite), i.e. when P never holds NaN for finite inputs;
* torch's ``_safe_softmax`` guard ``where(all(S == -inf, -1), 0, softmax(S))`` (torch.export of
  ``F.scaled_dot_product_attention``) is dropped: with no -inf data-dependent mask no row is fully
  masked (the guard never fires); otherwise a row whose scores are all -inf yields 0 in every
  attention kernel (contract in ``tvmfuse.rules.attention``), which is what the guard computes.

Anything else stays as it was; every candidate's outcome is recorded in the module attribute
:data:`DECISIONS_ATTR` (``tvmfuse report`` lists the ones left alone). Existing ``R.nn.attention``
calls are already one op and are recorded as such. Sits after ``FuseDecomposedNorms`` (it needs
``R.nn.softmax``) and before mixed precision and LegalizeOps.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np
import tvm
from tvm import relax
from tvm.relax.dpl import is_op, rewrite_call, wildcard

from ..attrs import causal_attr
from ._util import last_axis_only, scalar_value, shape_expr, static_shape, without_large_constants
from .attention_lower import gpu_value_dim_gate, gpu_window_gate
from .constant_values import ConstantValues, function_bindings

DECISIONS_ATTR = "tvmfuse.attention_decisions"
_BSHD = "BSHD"  # attention operand layout; labels: B batch, H heads, Q/K query/key positions, D dim


class _Reject(Exception):
    """The candidate cannot be rewritten; the message is the recorded reason."""


def _op(expr: relax.Expr) -> str | None:
    if isinstance(expr, relax.Call) and isinstance(expr.op, tvm.ir.Op):
        return expr.op.name
    return None


def _is_scalar_const(expr: relax.Expr) -> bool:
    return scalar_value(expr) is not None


def _upcast(src: relax.Expr, cast: relax.Expr) -> bool:
    """``cast`` = ``astype(src, float32)`` with ``src`` float16/bfloat16: exact, value-preserving."""
    return str(src.ty.dtype) in ("float16", "bfloat16") and str(cast.ty.dtype) == "float32"


def _masked_floor(dtype: str) -> float:
    """A masked score must be -inf or at most this: -2^100 (fp32/bf16), -2^10 (fp16).

    exp(masked - m) is then exactly 0 beside any visible score m above -2^99 (fp16: -900).
    """
    return -(2.0**10) if dtype == "float16" else -(2.0**100)


@dataclass
class _Operand:
    """A BSHD operand: ``expr`` (BSHD after ``axes``), KV-head repetition factor, folded scale."""

    expr: relax.Expr
    axes: list[int]
    group: int = 1
    scale: float = 1.0
    upcast: str | None = None  # the half dtype an exact fp32 upcast was peeled off, if any

    def bshd(self) -> relax.Expr:
        return self.expr if self.axes == [0, 1, 2, 3] else relax.op.permute_dims(self.expr, self.axes)


@dataclass
class _Masks:
    """What the score chain adds: constant visibility (ANDed), data-dependent biases, guards."""

    visible: np.ndarray | None = None  # bool (Sq, Skv) or None for "all visible"
    biases: list[relax.Expr] = field(default_factory=list)
    finite_biases: bool = True
    # some bias may hold a masking value (data-dependent masks): with a constant visibility mask
    # too, a row could be masked whole by the data, where torch and the kernel differ
    masking_biases: bool = False


class _Function:
    """Binding table, use counts and constant evaluation for one Relax function."""

    def __init__(self, func: relax.Function) -> None:
        self.table = function_bindings(func)
        self.var_of: dict[relax.Expr, relax.Var] = {v: k for k, v in self.table.items()}
        self.readers: dict[relax.Var, list[relax.Expr]] = {}
        self.params = set(func.params)
        # readers: the bindings (and the function result) that read each var; uses: how many
        for value in [*self.table.values(), func.body.body]:
            for var in relax.analysis.free_vars(value):
                self.readers.setdefault(var, []).append(value)
        self.uses: dict[relax.Var, int] = {var: len(r) for var, r in self.readers.items()}
        self._constants = ConstantValues(self.table)
        # fp16/bf16 products spelled matmul(a, b, out_dtype=float32) → astype(·, half): the matmuls
        self.accumulated = {self.table[x] for x in (self._accumulated(v) for v in self.table.values())
                            if x is not None}

    def _accumulated(self, cast: relax.Expr) -> relax.Var | None:
        """``x`` when ``cast`` = ``astype(x, h)``, x = ``matmul(a, b, out_dtype=float32)`` on h inputs.

        That is one h-precision product with fp32 accumulation (torch's own half matmul); ``x`` must
        have no other user.
        """
        if _op(cast) != "relax.astype" or not isinstance(cast.args[0], relax.Var):
            return None
        x = cast.args[0]
        mm = self.table.get(x)
        if _op(mm) != "relax.matmul" or self.uses.get(x, 0) != 1 or str(x.ty.dtype) != "float32":
            return None
        half = str(cast.ty.dtype)
        if half not in ("float16", "bfloat16") or any(str(a.ty.dtype) != half for a in mm.args):
            return None
        return x

    def const(self, expr: relax.Expr) -> relax.Expr:
        """``expr`` as a constant when it is one element computed from constants only, else ``expr``.

        Exporters bind scalars to variables (-inf) or compute them (ONNX: the SDPA scale as
        ``sqrt(1 / sqrt(d))``); such a scalar is evaluated once.
        """
        value = self.value(expr)
        if isinstance(value, tvm.ir.expr.Constant):
            return value
        shape = static_shape(expr)
        if shape is None or math.prod(shape) != 1:
            return expr
        arr = self.constant(expr)
        return expr if arr is None else relax.const(arr, str(expr.ty.dtype))

    def value(self, expr: relax.Expr) -> relax.Expr:
        """Look through variable bindings to the bound expression."""
        while isinstance(expr, relax.Var) and expr in self.table:
            expr = self.table[expr]
        return expr

    def call(self, expr: relax.Expr, *ops: str) -> relax.Call | None:
        value = self.value(expr)
        return value if _op(value) in ops else None

    def single_use(self, expr: relax.Expr) -> bool:
        return not isinstance(expr, relax.Var) or self.uses.get(expr, 0) <= 1

    def only_left_operand(self, var: relax.Expr) -> bool:
        """Every reader of ``var`` is a ``matmul(var, ·)``: probabilities shared by several P·V
        products (DiffLlama's two value halves over one softmax), each then its own attention."""
        if not isinstance(var, relax.Var):
            return False
        return all(_op(v) == "relax.matmul" and v.args[0].same_as(var) and not v.args[1].same_as(var)
                   for v in self.readers.get(var, [None]))

    def constant(self, expr: relax.Expr) -> np.ndarray | None:
        """The value of ``expr`` when it depends on constants only (built and run on llvm)."""
        return self._constants.value(expr)


# ops between Q·Kᵀ and the softmax that the score walk passes through (scales, masks, casts)
_SCORE_PATH = ("relax.add", "relax.multiply", "relax.divide", "relax.where", "relax.astype",
               "relax.subtract", "relax.maximum", "relax.tanh")


class _Matcher:
    """Matches one attention candidate anchored at the P·V product."""

    def __init__(self, fn: _Function) -> None:
        self.fn = fn
        self.score_extra_uses = 0
        self.rounded: str | None = None  # the fp32 → half rounding of the scores the kernel skips
        self.fp16_product = False  # Q·Kᵀ of fp16 operands: masks are judged by fp16's floor

    # --- 3-D (B·H, S, D) batched form of torch.export --------------------------------------------

    def _unbatch(self, expr: relax.Expr, want: list[int] | None = None) -> relax.Expr | None:
        """The 4-D tensor a (B·H, a, b) operand was reshaped from (through a same-shape broadcast)."""
        call = self.fn.call(expr, "relax.reshape")
        if call is None:
            return None
        src = call.args[0]
        bc = self.fn.call(src, "relax.broadcast_to")
        if bc is not None and static_shape(bc.args[0]) == static_shape(src):
            src = bc.args[0]
        s4, s3 = static_shape(src), static_shape(expr)
        if s4 is None or s3 is None or len(s4) != 4 or len(s3) != 3:
            return None
        if s4[0] * s4[1] != s3[0] or s4[2:] != s3[1:] or (want is not None and s4[:2] != want):
            return None
        return src

    def _product(self, expr: relax.Expr) -> relax.Call | None:
        """The matmul computing ``expr``: itself, or the fp32-accumulating one a cast rounds to half."""
        mm = self.fn.call(expr, "relax.matmul")
        if mm is not None:
            return mm
        cast = self.fn.call(expr, "relax.astype")
        if cast is None:
            return None
        mm = self.fn.call(cast.args[0], "relax.matmul")
        return mm if mm is not None and mm in self.fn.accumulated else None

    def matmul4(self, expr: relax.Expr) -> tuple[relax.Expr, relax.Expr] | None:
        """``(lhs, rhs)`` 4-D operands of a 4-D product ``expr`` (directly or via the 3-D form).

        A half product accumulated in fp32 and rounded (``astype(matmul(.., out_dtype=float32))``)
        counts as the product: the attention kernels accumulate in fp32 too.
        """
        shape = static_shape(expr)
        if shape is None or len(shape) != 4:
            return None
        mm = self._product(expr)
        if mm is not None:
            a, b = mm.args
            if len(static_shape(a) or []) == 4 and len(static_shape(b) or []) == 4:
                return a, b
            return None
        rs = self.fn.call(expr, "relax.reshape")
        if rs is None:
            return None
        mm = self._product(rs.args[0])
        s3 = static_shape(rs.args[0])
        if mm is None or s3 is None or len(s3) != 3 or shape[0] * shape[1] != s3[0]:
            return None
        if not self.fn.single_use(rs.args[0]):
            return None
        a, b = (self._unbatch(x, shape[:2]) for x in mm.args)
        if a is None or b is None:
            return None
        return a, b

    # --- operands -------------------------------------------------------------------------------

    def operand(self, expr: relax.Expr, labels: str, what: str, fold_scale: bool) -> _Operand:
        """Peel permutes, scalar scales and KV-head repetition off a 4-D operand of ``labels``."""
        labels, group, scale = list(labels), 1, 1.0
        upcast = None
        fn = self.fn
        while True:
            value = fn.value(expr)
            op = _op(value)
            shape = static_shape(expr)
            if op == "relax.permute_dims":
                axes = [int(a) for a in value.attrs.axes] if value.attrs.axes is not None else [3, 2, 1, 0]
                inner = [""] * 4
                for i, a in enumerate(axes):
                    inner[a] = labels[i]
                labels, expr = inner, value.args[0]
            elif fold_scale and op in ("relax.multiply", "relax.divide") and any(
                    _is_scalar_const(fn.const(a)) for a in value.args):
                args = [fn.const(a) for a in value.args]
                x, c = (args[1], args[0]) if _is_scalar_const(args[0]) else args
                if op == "relax.divide" and x is args[1]:
                    break  # c / x is no scale
                if static_shape(x) != shape or str(x.ty.dtype) != str(value.ty.dtype):
                    break
                c = scalar_value(c)
                scale = scale * c if op == "relax.multiply" else scale / c
                expr = x
            elif op == "relax.broadcast_to" and static_shape(value.args[0]) == shape:
                expr = value.args[0]
            elif op == "relax.astype" and _upcast(value.args[0], value):
                upcast = str(value.args[0].ty.dtype)
                expr = value.args[0]
            elif op == "relax.broadcast_to" and len(static_shape(value.args[0]) or []) == 4:
                # MQA: one KV head broadcast to every query head
                src = static_shape(value.args[0])
                diff = [i for i in range(4) if src[i] != shape[i]]
                if len(diff) != 1 or src[diff[0]] != 1 or labels[diff[0]] != "H":
                    break
                group *= shape[diff[0]]
                expr = value.args[0]
            elif op == "relax.repeat" and labels[int(value.attrs.axis) % 4] == "H":
                group *= int(value.attrs.repeats)
                expr = value.args[0]
            elif op == "relax.reshape":
                found = self._through_reshape(value, shape, labels)
                if found is None:
                    break
                expr, labels, n = found
                group *= n
            else:
                # anything else (a tile of heads: head h reads h % Hkv, no h // group) is the
                # operand as it is, materialised by the pack
                break
        axes = [labels.index(c) for c in ("B", labels_pos(labels), "H", "D")]
        return _Operand(expr, axes, group, scale, upcast)

    def _through_reshape(self, value: relax.Call, shape: list[int] | None, labels: list[str]):
        """A 4-D ``reshape`` that is a view of a 4-D tensor, possibly with KV-head repetition.

        Looks through reshape chains and the 3-D (B·H, a, b) round trip of torch/ONNX exports,
        including a transpose of the last two axes there. Returns (source, labels, group) or None.
        """
        if shape is None or len(shape) != 4:
            return None
        labels = list(labels)
        src = value.args[0]
        while True:
            inner = self.fn.value(src)
            s = static_shape(src)
            if _op(inner) == "relax.reshape":
                src = inner.args[0]
            elif (_op(inner) == "relax.permute_dims" and s is not None and len(s) == 3
                  and s[0] == shape[0] * shape[1] and inner.attrs.axes is not None
                  and int(inner.attrs.axes[0]) == 0):
                axes = [int(a) for a in inner.attrs.axes]
                new = [labels[0], labels[1], "", ""]
                new[1 + axes[1]], new[1 + axes[2]] = labels[2], labels[3]
                labels, src = new, inner.args[0]
                shape = shape[:2] + static_shape(src)[1:]
            elif (_op(inner) == "relax.permute_dims" and s is not None and len(s) == 5
                  and inner.attrs.axes is not None
                  and [int(a) for a in inner.attrs.axes] == [0, 1, 2, 4, 3] and s[-2:] == shape[-2:]):
                # Kᵀ of repeated KV heads as the dynamo ONNX exporter writes it (GPTBigCode):
                # broadcast_to (B, Hkv, n, S, D) → a 5-D swap of the last two axes → reshape; the
                # swap commutes with the leading axes the reshape merges
                labels = labels[:2] + [labels[3], labels[2]]
                src, shape = inner.args[0], shape[:2] + [shape[3], shape[2]]
            else:
                break
        if static_shape(src) == shape:
            return src, labels, 1
        rep = self._repeat_kv(src, shape)
        if rep is None:
            return None
        axis, n, base, moved = rep
        labels = [labels[i] for i in moved]
        if labels[axis] != "H":
            raise _Reject("key/value repetition along a non-head axis")
        return base, labels, n

    def _repeat_kv(self, wide_expr: relax.Expr, shape: list[int]):
        """``broadcast_to(expand_dims(x, e), ..n..)`` viewed as ``shape`` = merge(e-1, e), up to moved
        size-1 axes (a transpose next to a length-1 axis collapses into the reshape: decode's Kᵀ)
        → (e-1, n, x, the axis of ``shape`` each merged axis went to)."""
        bc = self.fn.call(wide_expr, "relax.broadcast_to")
        if bc is None:
            return None
        ex = self.fn.call(bc.args[0], "relax.expand_dims")
        if ex is None or len(ex.attrs.axis) != 1:
            return None
        src = static_shape(ex.args[0])
        wide = static_shape(wide_expr)
        if src is None or wide is None or len(src) != 4 or len(wide) != 5:
            return None
        e = int(ex.attrs.axis[0]) % 5
        n = wide[e]
        if e == 0 or wide[:e] + wide[e + 1:] != src:
            return None
        merged = src[: e - 1] + [src[e - 1] * n] + src[e:]
        moved = _unit_axes_moved(merged, shape)
        if moved is not None:
            return e - 1, n, ex.args[0], moved
        if e < 4 and src[:e] + [n * src[e]] + src[e + 1:] == shape:
            raise _Reject("key/value heads repeated by tiling (head h reads KV head h % Hkv); the "
                          "attention op groups query heads as h // group")
        return None

    # --- the score chain ------------------------------------------------------------------------

    def _leads_to_scores(self, expr: relax.Expr, depth: int = 8) -> bool:
        if self.matmul4(expr) is not None:
            return True
        value = self.fn.value(expr)
        op = _op(value)
        if depth == 0 or op not in _SCORE_PATH:
            return False
        return any(self._leads_to_scores(a, depth - 1) for a in value.args)

    def _blocker(self, expr: relax.Expr, depth: int = 8) -> str | None:
        """The first op on the way from ``expr`` back to the scores that is neither a scale nor a
        mask (what stops :meth:`_leads_to_scores`), None when none is found."""
        value = self.fn.value(expr)
        op = _op(value)
        if depth == 0 or op is None or self.matmul4(expr) is not None:
            return None
        if op not in _SCORE_PATH:
            return op
        found = [self._blocker(a, depth - 1) for a in value.args if isinstance(a, relax.Expr)]
        return next((f for f in found if f not in (None, "relax.full", "relax.arange")), None)

    def _no_scores_reason(self, args: list) -> str:
        """Why neither operand of an add before the softmax is the scores."""
        blockers = [b for b in (self._blocker(a) for a in args) if b is not None]
        if blockers:
            return (f"neither operand of the add before the softmax reaches a 4-D Q·Kᵀ through "
                    f"scales and masks ({blockers[0].removeprefix('relax.')} is in the way; "
                    "e.g. a heads-folded (B·H, S, S) product with a per-head bias, as ALiBi)")
        return "neither operand of the add before the softmax reaches a 4-D Q·Kᵀ"

    def scores(self, expr: relax.Expr, dtype: str):
        """Walk softmax's input back to Q·Kᵀ: returns (q·kᵀ operands, scale factor, masks).

        A ``c_out · tanh(c_in · S)`` on the way (logit soft-capping: Gemma-2's ``S / cap → tanh →
        · cap``) sets ``self.softcap = c_out`` and the factor ``c_out · c_in``: the spec's
        ``softcap · tanh(scale · S / softcap)``. Masks must come after the tanh."""
        fn = self.fn
        factor = 1.0
        self.softcap = None
        terms: list[tuple[relax.Expr, float]] = []
        fills: list[tuple[relax.Expr, float, bool, str]] = []  # (cond, fill·factor, visible-when-true)
        clamps: list[tuple[float, str]] = []  # maximum(s, c): (c·factor, dtype)
        extra = self.score_extra_uses  # uses of softmax's input by a guard matched in probabilities
        while True:
            mm = self.matmul4(expr)
            if mm is not None:
                break
            if isinstance(expr, relax.Var) and fn.uses.get(expr, 0) > 1 + extra:
                raise _Reject("an intermediate score tensor has other users (it would stay in HBM)")
            extra = 0
            value = fn.value(expr)
            op = _op(value)
            args = [fn.const(a) for a in value.args] if isinstance(value, relax.Call) else []
            if op in ("relax.multiply", "relax.divide") and any(_is_scalar_const(a) for a in args):
                x, c = (args[1], args[0]) if _is_scalar_const(args[0]) else args
                if op == "relax.divide" and x is args[1]:
                    raise _Reject("scores divide a constant (c / S is no scale)")
                c = scalar_value(c)
                factor = factor * c if op == "relax.multiply" else factor / c
                expr = x
            elif op == "relax.tanh":
                if self.softcap is not None:
                    raise _Reject("two tanh between QKᵀ and softmax")
                if factor <= 0:
                    raise _Reject(f"tanh(scores) scaled by {factor} <= 0 is no soft cap")
                self.softcap = factor
                expr = args[0]
            elif op in ("relax.add", "relax.where", "relax.maximum") and self.softcap is not None:
                raise _Reject(f"a mask inside the soft cap's tanh ({op.removeprefix('relax.')} "
                              "before the tanh): the kernels mask after it")
            elif op == "relax.add":
                lead = [self._leads_to_scores(a) for a in args]
                if lead.count(True) == 2:
                    raise _Reject("cannot tell the scores from the mask in an add (both sides "
                                  "come from a 4-D Q·Kᵀ)")
                if lead.count(True) == 0:
                    raise _Reject(self._no_scores_reason(args))
                chain, mask = (args[0], args[1]) if lead[0] else (args[1], args[0])
                terms.append((mask, factor, dtype))
                expr = chain
            elif op == "relax.where":
                cond, a, b = args
                if _is_scalar_const(b) and self._leads_to_scores(a):
                    fills.append((cond, scalar_value(b) * factor, True, dtype))
                    expr = a
                elif _is_scalar_const(a) and self._leads_to_scores(b):
                    fills.append((cond, scalar_value(a) * factor, False, dtype))
                    expr = b
                else:
                    raise _Reject("where() between QKᵀ and softmax does not fill with a constant")
            elif op == "relax.maximum" and any(_is_scalar_const(a) for a in args) and factor > 0:
                # XGLM / the BART family: ``max(s + mask, finfo.min)`` keeps masked scores finite
                x, c = (args[1], args[0]) if _is_scalar_const(args[0]) else args
                clamps.append((scalar_value(c) * factor, dtype))
                expr = x
            elif op == "relax.astype" and str(value.ty.dtype) == "float32":
                expr = args[0]  # upcast before softmax; the kernel accumulates in fp32 anyway
                dtype = str(expr.ty.dtype)  # masks before it apply to (and are judged in) this dtype
            elif (op == "relax.astype" and str(value.ty.dtype) in ("float16", "bfloat16")
                  and str(args[0].ty.dtype) == "float32"):
                # fp32 scores rounded to half (baddbmm's half result): the kernel keeps them in fp32
                self.rounded = f"float32->{value.ty.dtype}"
                expr, dtype = args[0], "float32"
            else:
                name = op or type(value).__name__
                raise _Reject(f"{name} between QKᵀ and softmax is not a scale or a mask")
        if factor <= 0:
            raise _Reject(f"scores scaled by {factor} <= 0 (a mask would change meaning)")
        self.fp16_product = str(mm[0].ty.dtype) == "float16"
        masks = self.masks(terms, fills, static_shape(expr))
        for c, dt in clamps:  # identity on visible scores, masked ones stay masked: dropped
            if not (c == -math.inf or c <= self._floor(dt)):
                raise _Reject(f"maximum(scores, {c}) clamps more than masked scores")
            if masks.masking_biases:
                raise _Reject("maximum(scores, c) with a data-dependent mask: fully masked rows "
                              "(uniform after the clamp) would differ")
        return mm, factor, masks

    def _floor(self, dtype: str) -> float:
        """The masking floor for scores of ``dtype``. Those of an fp16 Q·Kᵀ by fp16's even when
        upcast to fp32 (MPT adds its fp32 ALiBi, XGLM clamps in fp32): such models write
        ``finfo(float16).min`` as their mask value."""
        return _masked_floor("float16" if self.fp16_product else dtype)

    # --- masks ----------------------------------------------------------------------------------

    def _visible(self, arr: np.ndarray, shape: list[int], dtype: str, what: str) -> np.ndarray:
        """Bool (Sq, Skv) visibility of an additive constant mask (0 visible, ≤ floor masked)."""
        if arr.ndim > 4:
            raise _Reject(f"{what} has rank {arr.ndim} > 4")
        arr = np.broadcast_to(arr.reshape((1,) * (4 - arr.ndim) + arr.shape), shape)
        vis = arr == 0
        masked = arr <= self._floor(dtype)
        if not np.all(vis | masked):
            i = np.argwhere(~(vis | masked))[0]
            raise _Reject(f"{what} holds {arr[tuple(i)]!r} at {tuple(int(x) for x in i)}: neither 0 "
                          "nor a masking value (a general bias, not a causal mask)")
        flat = vis.reshape(-1, *shape[2:])
        if not np.all(flat == flat[:1]):
            raise _Reject(f"{what} differs across batch/heads: not a causal mask")
        return flat[0]

    def _constant_bias(self, arr: np.ndarray, shape: list[int], dtype: str) -> bool:
        """A constant term that is no mask but a bias, (B|1, H|1, Sq|1, Skv) with finite values
        other than 0: ALiBi with the positions known at export (per key), T5's relative position
        bias (per query and key). The kernel adds it as it adds a padding bias. Masks (0 and
        masking values only) are judged as masks."""
        if arr.ndim > 4 or not np.all(np.isfinite(arr)):
            return False
        a4 = arr.reshape((1,) * (4 - arr.ndim) + arr.shape)
        if a4.shape[2] not in (1, shape[2]) or a4.shape[3] != shape[3] \
                or a4.shape[0] not in (1, shape[0]) or a4.shape[1] not in (1, shape[1]):
            return False
        return not np.all((a4 == 0) | (a4 <= self._floor(dtype)))

    def _bool_visible(self, arr: np.ndarray, shape: list[int], what: str) -> np.ndarray:
        arr = np.broadcast_to(arr.reshape((1,) * (4 - arr.ndim) + arr.shape), shape).astype(bool)
        flat = arr.reshape(-1, *shape[2:])
        if not np.all(flat == flat[:1]):
            raise _Reject(f"{what} differs across batch/heads: not a causal mask")
        return flat[0]

    def _padding(self, expr: relax.Expr, shape: list[int], what: str,
                 rows: bool = False) -> relax.Expr | None:
        """``expr`` as a 4-D (B|1, H|1, 1, Skv) tensor, or None if it varies along queries;
        ``rows``: (B|1, H|1, Sq|1, Skv), a constant bias that may."""
        s = static_shape(expr)
        if s is None or len(s) > 4:
            return None
        s4 = [1] * (4 - len(s)) + s
        if s4[2] not in ((1, shape[2]) if rows else (1,)) or s4[3] != shape[3] \
                or s4[0] not in (1, shape[0]) or s4[1] not in (1, shape[1]):
            return None
        return expr if len(s) == 4 else relax.op.reshape(expr, shape_expr(s4))

    def _conjuncts(self, cond: relax.Expr) -> list[relax.Expr]:
        """The terms of ``a & b & …`` (``logical_and``, or ``bitwise_and`` of bools: transformers 5
        builds bidirectional and padding masks with it), through broadcasts."""
        call = self.fn.call(cond, "relax.logical_and")
        if call is None and str(getattr(cond.ty, "dtype", "")) == "bool":
            call = self.fn.call(cond, "relax.bitwise_and")
        if call is None:
            bc = self.fn.call(cond, "relax.broadcast_to")
            return self._conjuncts(bc.args[0]) if bc is not None else [cond]
        return self._conjuncts(call.args[0]) + self._conjuncts(call.args[1])

    def _split_padding_where(self, mask: relax.Expr, shape: list[int], factor: float, dtype: str):
        """``where(and(C, P), a, b)`` with constant all-true C → bias ``where(P, a, b)`` (also
        through a cast of the where: its two constants are cast alike)."""
        cast = self.fn.call(mask, "relax.astype")
        call = self.fn.call(cast.args[0] if cast is not None else mask, "relax.where")
        if call is None or not all(_is_scalar_const(self.fn.const(x)) for x in call.args[1:]):
            return None
        data, visible = [], None
        for c in self._conjuncts(call.args[0]):
            arr = self.fn.constant(c)
            if arr is None:
                data.append(c)
            else:
                v = self._bool_visible(arr, [shape[0], shape[1], shape[2], shape[3]], "mask condition")
                visible = v if visible is None else visible & v
        if visible is not None and not visible.all():
            raise _Reject("a constant (causal) mask combined with a data-dependent one: rows whose "
                          "visible keys are all masked by the data would differ")
        pads = [self._padding(c, shape, "mask condition") for c in data]
        if not data or any(p is None for p in pads):
            return None
        cond = pads[0]
        for p in pads[1:]:
            cond = relax.op.logical_and(cond, p)
        a, b = (relax.const(scalar_value(self.fn.const(x)) * factor, dtype) for x in call.args[1:])
        return relax.op.where(cond, a, b)

    def masks(self, terms, fills, shape: list[int]) -> _Masks:
        """Visibility and biases of the masks; each comes with the dtype of the scores it applies to."""
        out = _Masks()

        def see(vis: np.ndarray) -> None:
            out.visible = vis if out.visible is None else out.visible & vis

        for mask, factor, dtype in terms:
            if str(mask.ty.dtype) != dtype:
                raise _Reject(f"mask dtype {mask.ty.dtype} differs from the scores' {dtype}")
            arr = self.fn.constant(mask)
            if arr is not None and not self._constant_bias(arr, shape, dtype):
                see(self._visible(arr * factor, shape, dtype, "constant mask"))
                continue
            bias = self._padding(mask, shape, "mask", rows=arr is not None)
            if arr is not None:  # a constant bias (ALiBi, T5): finite, masking only if it says so
                if factor != 1.0:
                    bias = relax.op.multiply(bias, relax.const(factor, dtype))
                out.masking_biases |= bool(np.any(arr * factor <= self._floor(dtype)))
                out.biases.append(bias)
                continue
            out.masking_biases = True
            if bias is None:
                bias = self._split_padding_where(mask, shape, factor, dtype)
                if bias is None:
                    raise _Reject(f"data-dependent mask of shape {static_shape(mask)} varies along the "
                                  "query axis: neither causal nor a padding mask")
                out.finite_biases = out.finite_biases and self._finite(bias)
                out.biases.append(bias)
                continue
            if factor != 1.0:
                bias = relax.op.multiply(bias, relax.const(factor, dtype))
            out.finite_biases = out.finite_biases and self._finite(mask)
            out.biases.append(bias)
        for cond, fill, when, dtype in fills:
            if not (fill == -math.inf or fill <= self._floor(dtype)):
                raise _Reject(f"masked_fill value {fill} (after scaling) is not a masking value")
            arr = self.fn.constant(cond)
            if arr is not None:
                vis = self._bool_visible(arr, shape, "mask condition")
                see(vis if when else ~vis)
                continue
            pad = self._padding(cond, shape, "mask condition")
            if pad is None:
                raise _Reject("data-dependent masked_fill condition varies along the query axis")
            if fill != -math.inf and not (dtype == "float32" and fill <= -(2.0**100)):
                raise _Reject("data-dependent masked_fill with a finite fill: fully masked rows "
                              "would differ from an additive bias")
            zero, neg = relax.const(0.0, dtype), relax.const(fill, dtype)
            out.masking_biases = True
            out.biases.append(relax.op.where(pad, zero, neg) if when else relax.op.where(pad, neg, zero))
            out.finite_biases = out.finite_biases and fill != -math.inf
        if out.visible is not None and out.masking_biases:
            raise _Reject("a constant (causal) mask combined with a data-dependent one: rows whose "
                          "visible keys are all masked by the data would differ")
        return out

    def _finite(self, expr: relax.Expr) -> bool:
        call = self.fn.call(expr, "relax.where")
        if call is not None:
            return all(self._finite(x) for x in call.args[1:])
        arr = self.fn.constant(expr) if isinstance(expr, tvm.ir.expr.Constant) else None
        return arr is not None and bool(np.isfinite(arr).all())

    # --- the whole candidate --------------------------------------------------------------------

    def probabilities(self, expr: relax.Expr):
        """P back to softmax: (softmax call, guard) or None if P is no softmax.

        ``guard``: None, ``"isnan"`` (HF SDPA's ``where(isnan(P), 0, P)``) or ``"safe_softmax"``
        (torch's ``where(all(S == -inf, -1), 0, softmax(S))``). Every tensor on the way must have
        this one use (the guard's where and isnan / full_like share P; its equal shares S).
        """
        guard, p_uses = None, 1
        fn = self.fn
        shared = fn.only_left_operand(expr)  # P itself may feed several P·V products
        while True:
            value = fn.value(expr)
            op = _op(value)
            if op == "relax.nn.softmax":
                if isinstance(expr, relax.Var) and fn.uses.get(expr, 0) > p_uses and not shared:
                    raise _Reject("the attention probabilities have other users (e.g. output_attentions)")
                return value, guard
            if not (fn.single_use(expr) or shared):
                raise _Reject("the attention probabilities have other users (e.g. output_attentions)")
            shared = False
            if op == "relax.astype":
                expr = value.args[0]
            elif op == "relax.where" and guard is None:
                cond, a, b = value.args
                isnan = fn.call(cond, "relax.isnan")
                if isnan is not None and scalar_value(a) == 0.0 and fn.value(isnan.args[0]).same_as(
                        fn.value(b)):
                    guard, p_uses, expr = "isnan", 2, b
                    continue
                softmax = fn.call(b, "relax.nn.softmax")
                if softmax is None:
                    return None
                zeros = self._zeros_like(a, b)
                if zeros is None or not self._all_masked_rows(cond, softmax):
                    raise _Reject("where() on the probabilities is neither HF's IsNaN guard nor "
                                  "torch's _safe_softmax guard (0 where a whole score row is -inf)")
                guard, p_uses, expr = "safe_softmax", 1 + zeros, b
            elif op == "relax.strided_slice" and fn.call(value.args[0], "relax.nn.softmax") is not None:
                raise _Reject("the softmax runs over the scores and more columns that are sliced "
                              "off after it (attention sinks, GPT-OSS): no attention kernel "
                              "takes sinks yet")
            else:
                return None

    def _zeros_like(self, zeros: relax.Expr, p: relax.Expr) -> int | None:
        """Uses of ``p`` that ``zeros`` adds when it is all zeros (``full_like(p, 0)``: 1), else None."""
        if scalar_value(zeros) == 0.0:
            return 0
        call = self.fn.call(zeros, "relax.full_like", "relax.zeros_like")
        if call is None or not self.fn.single_use(zeros) or not call.args[0].same_as(p):
            return None
        if _op(call) == "relax.full_like" and scalar_value(call.args[1]) != 0.0:
            return None
        if static_shape(zeros) != static_shape(p) or str(zeros.ty.dtype) != str(p.ty.dtype):
            return None
        return 1

    def _all_masked_rows(self, cond: relax.Expr, softmax: relax.Call) -> bool:
        """``cond`` = ``all(S == -inf, axis=-1, keepdims=True)`` for the softmax input ``S``.

        torch.export writes ``all`` as ``not(any(not E))`` with ``any(x) = bool(max(int8(x)))``;
        ``bool(min(int8(E)))`` is accepted as well. Every step must be used only here.
        """
        fn = self.fn
        ndim = len(static_shape(softmax) or [])

        def single(e: relax.Expr, op: str) -> relax.Call | None:
            return fn.call(e, op) if fn.single_use(e) else None

        def reduce_row(e: relax.Expr, op: str) -> relax.Expr | None:
            """``[astype(bool)] op([astype] x, axis=-1, keepdims=True)`` → bool ``x``."""
            cast = single(e, "relax.astype")
            if cast is not None:
                e = cast.args[0]
            red = single(e, op)
            if red is None or not last_axis_only(red.attrs.axis, ndim) or not red.attrs.keepdims:
                return None
            x = red.args[0]
            cast = single(x, "relax.astype")
            x = cast.args[0] if cast is not None else x
            return x if str(x.ty.dtype) == "bool" else None

        if str(cond.ty.dtype) != "bool":
            return False
        outer = single(cond, "relax.logical_not")
        if outer is not None:  # not(any(not E))
            inner = reduce_row(outer.args[0], "relax.max")
            neg = single(inner, "relax.logical_not") if inner is not None else None
            eq_expr = neg.args[0] if neg is not None else None
        else:  # all(E) as a min
            eq_expr = reduce_row(cond, "relax.min")
        eq = single(eq_expr, "relax.equal") if eq_expr is not None else None
        if eq is None:
            return False
        a, b = eq.args
        s, c = (b, a) if scalar_value(a) is not None else (a, b)
        return scalar_value(c) == -math.inf and fn.value(s).same_as(fn.value(softmax.args[0]))

    def match(self, out: relax.Expr) -> relax.Expr | None:
        """The replacement of the P·V product ``out`` (BHSD), or None if it is no attention."""
        if out in self.fn.accumulated:
            return None  # matched at the cast that rounds it (the half product)
        mm = self.matmul4(out)
        if mm is None:
            return None
        p_expr, v_expr = mm
        found = self.probabilities(p_expr)
        if found is None:
            return None
        softmax, guard = found
        self.score_extra_uses = 1 if guard == "safe_softmax" else 0  # the guard's equal(S, -inf)
        self.rounded = None
        shape = static_shape(softmax)
        axis = int(softmax.attrs.axis)
        if axis not in (-1, len(shape) - 1):
            raise _Reject(f"softmax over axis {axis}, not the key axis")
        qk, factor, masks = self.scores(softmax.args[0], str(softmax.ty.dtype))
        q = self.operand(qk[0], "BHQD", "query", True)
        k = self.operand(qk[1], "BHDK", "key", True)
        v = self.operand(v_expr, "BHKD", "value", False)
        if q.group != 1:
            raise _Reject("query heads are repeated")
        if k.group != v.group:
            k, v = _common_group(k, v)
        qs, ks, vs = (static_shape(x.expr) for x in (q, k, v))
        qs, ks, vs = ([s[a] for a in x.axes] for s, x in ((qs, q), (ks, k), (vs, v)))
        if ks[:3] != vs[:3]:  # the head dims may differ (multi-head latent attention)
            raise _Reject(f"key shape {ks} and value shape {vs} differ (BSHD)")
        if why := gpu_value_dim_gate(ks[3] != vs[3]):
            raise _Reject(f"values {vs[3]} wide beside queries and keys {ks[3]} wide (multi-head "
                          f"latent attention): {why}")
        dtypes = {str(x.expr.ty.dtype) for x in (q, k, v)}
        if len(dtypes) != 1:
            raise _Reject(f"query/key/value dtypes differ: {sorted(dtypes)}")
        rows_ok = masks.visible is None or bool(masks.visible.any(axis=1).all())
        if not rows_ok:
            raise _Reject("the constant mask leaves query rows with no visible key")
        causal, window = _causal_kind(masks.visible, qs[1], ks[1])
        if why := gpu_window_gate(window):
            raise _Reject(f"a sliding-window band (each query sees its last {window} keys): {why}")
        may_mask_rows = bool(masks.biases) and not masks.finite_biases
        if guard == "isnan" and may_mask_rows:
            raise _Reject("IsNaN guard after a data-dependent mask that may be -inf: a fully masked "
                          "row would be NaN→0 here")
        info = {}
        if guard == "safe_softmax":
            # where(all(S == -inf), 0, softmax(S)): without a -inf bias every row has a finite score
            # (the constant mask leaves each row a key, checked above), so the guard never fires;
            # with one, a row whose scores are all -inf gives 0 in every attention kernel too.
            info["safe_softmax_guard"] = ("dropped: a fully masked row gives 0 (kernel contract)"
                                          if may_mask_rows else "dropped: no row can be fully masked")
        # only some upcast (ONNX's SDPA: fp16 Q·Kᵀ upcast before softmax, V upcast): all are half
        # operands now (the dtypes check above), the kernel's fp32 scores are the same or finer
        upcast = next((x.upcast for x in (q, k, v) if x.upcast is not None), None)
        if upcast is not None:
            # fp32 attention on exactly-upcast half operands runs on the half operands (fp32 scores
            # and softmax, as the kernels always do; P·V in the half dtype with fp32 accumulation)
            info["upcast"] = f"{upcast}->float32"
        if self.rounded is not None:
            info["scores_rounding"] = f"dropped: {self.rounded} (the kernel's scores stay fp32)"
        bias = None
        for b in masks.biases:
            bias = b if bias is None else relax.op.add(bias, b)
        scale = factor * q.scale * k.scale
        attn = relax.op.nn.attention(q.bshd(), k.bshd(), v.bshd(), bias, scale=scale,
                                     causal_mask=causal_attr(causal, self.softcap),
                                     window_size=window)
        if window is not None:
            info["window"] = str(window)
        if self.softcap is not None:
            info["softcap"] = repr(self.softcap)
        result = relax.op.permute_dims(attn, [0, 2, 1, 3])
        out_dtype = str(out.ty.dtype)
        if out_dtype != dtypes.pop():
            result = relax.op.astype(result, out_dtype)
        return result, {"causal": causal, "bias": "yes" if bias is not None else "no",
                        "group": str(k.group), "scale": repr(scale),
                        "isnan_guard": str(guard == "isnan"), **info}


def _common_group(k: _Operand, v: _Operand) -> tuple[_Operand, _Operand]:
    """K and V with one KV-head repetition factor: the more repeated operand's extra factor m is
    materialised (``repeat(x, m)`` on its head axis; query head h reads head h // g of either).

    The dynamo ONNX export of DiffLlama's ``v.repeat(1, 2, 1, 1)`` of a one-head half is a
    broadcast over heads: values repeated 4x beside keys repeated 2x.
    """
    lo, hi = sorted((k, v), key=lambda x: x.group)
    if hi.group % lo.group:
        raise _Reject(f"keys repeated {k.group}x but values {v.group}x")
    rep = relax.BlockBuilder().normalize(relax.op.repeat(hi.expr, hi.group // lo.group,
                                                         axis=hi.axes[2]))  # typed: shapes read
    wide = _Operand(rep, hi.axes, lo.group, hi.scale, hi.upcast)
    return (lo, wide) if lo is k else (wide, lo)


def labels_pos(labels: list[str]) -> str:
    """The position label of an operand: Q for queries, K for keys/values."""
    return "Q" if "Q" in labels else "K"


def _unit_axes_moved(src: list[int], dst: list[int]) -> list[int] | None:
    """Where each axis of ``src`` lands in ``dst`` when a reshape only moves size-1 axes (the other
    axes keep their order); None when the reshape does more than that."""
    if len(src) != len(dst) or [d for d in src if d != 1] != [d for d in dst if d != 1]:
        return None
    big = iter(i for i, d in enumerate(dst) if d != 1)
    unit = iter(i for i, d in enumerate(dst) if d == 1)
    return [next(unit) if d == 1 else next(big) for d in src]


def _causal_kind(visible: np.ndarray | None, sq: int, skv: int) -> tuple[str, int | None]:
    """``(causal_mask, window_size)`` of ``R.nn.attention`` equal to the constant mask ``visible``."""
    if visible is None or visible.all():
        return "none", None
    if visible.shape != (sq, skv):
        visible = np.broadcast_to(visible, (sq, skv))
    if np.array_equal(visible, np.tril(np.ones((sq, skv), bool), 0)):
        return "TopLeft", None
    if np.array_equal(visible, np.tril(np.ones((sq, skv), bool), skv - sq)):
        return "BottomRight", None
    band = _band_window(visible)
    if band is not None:
        return band
    wrong = np.argwhere(visible != np.tril(np.ones((sq, skv), bool), 0))[0]
    raise _Reject(f"constant mask is not causal: entry {tuple(int(x) for x in wrong)} is "
                  f"{'visible' if visible[tuple(wrong)] else 'masked'}")


def _band_window(visible: np.ndarray) -> tuple[str, int] | None:
    """``(causal kind, w)`` when ``visible`` is a causal band ``off - w < j - i <= off`` (the
    meaning of ``R.nn.attention``'s ``window_size``, kernels/attention/spec.py), else None.

    BottomRight is tried first (TVM's CUTLASS codegen takes windows only with it; the same as
    TopLeft when Sq == Skv).
    """
    sq, skv = visible.shape
    ones = np.ones((sq, skv), bool)
    window = int(visible.sum(axis=1).max())  # rows not clipped by key 0 or Skv see exactly w keys
    for kind, offset in (("BottomRight", skv - sq), ("TopLeft", 0)):
        band = np.tril(ones, offset) & np.triu(ones, offset - window + 1)
        if window > 0 and np.array_equal(visible, band):
            return kind, window
    return None


def _rewrite(func: relax.Function, decisions: dict[str, dict[str, str]]) -> relax.Function:
    fn = _Function(func)
    matcher = _Matcher(fn)
    mm = is_op("relax.matmul")(wildcard(), wildcard())
    pattern = is_op("relax.reshape")(mm, wildcard()) | is_op("relax.astype")(mm) | mm

    def rewriter(expr: relax.Expr, _m) -> relax.Expr:
        var = fn.var_of.get(expr)
        name = str(var.name) if var is not None else "?"
        try:
            found = matcher.match(expr)
        except _Reject as why:
            decisions.setdefault(name, {"binding": name, "status": "left", "reason": str(why)})
            return expr
        if found is None:
            return expr
        result, info = found
        decisions.setdefault(name, {"binding": name, "status": "fused", **info})
        return result

    func = rewrite_call(pattern, rewriter, func)
    return _collapse_views(func)


_VIEW_DTYPES = ("float16", "bfloat16")


def _view_of_attention(fn: _Function, expr: relax.Expr) -> relax.Expr | None:
    """``expr`` as at most one permute of an attention call, or None.

    Looks down a chain of ≥ 2 ops of ``permute_dims``, no-op ``reshape`` and the exact round trip
    ``astype(astype(x, float32), half)`` of a half-precision result (the BHSD result of the rewrite
    meets the exporter's permutes and the fp32 → half cast that ended the upcast graph).
    """
    if _op(expr) not in ("relax.permute_dims", "relax.astype", "relax.reshape") or not isinstance(
            expr.ty, relax.TensorType):
        return None
    total, steps, dtypes = [0, 1, 2, 3], 0, [str(expr.ty.dtype)]
    e = expr
    while True:
        value = fn.value(e)
        op = _op(value)
        if op in ("relax.nn.attention", "relax.nn.attention_bias"):
            break
        if op == "relax.permute_dims" and len(static_shape(e) or []) == 4:
            axes = [int(a) for a in value.attrs.axes] if value.attrs.axes is not None else [3, 2, 1, 0]
            total = [axes[t] for t in total]
        elif op == "relax.astype":
            dtypes.append(str(value.args[0].ty.dtype))
        elif not (op == "relax.reshape" and static_shape(value.args[0]) == static_shape(e)):
            return None
        e = value.args[0]
        steps += 1
    base = str(e.ty.dtype)
    if len(dtypes) > 1 and not (base in _VIEW_DTYPES and dtypes[0] == base
                                and set(dtypes) <= {base, "float32"}):
        return None
    if steps < 2:
        return None
    return e if total == [0, 1, 2, 3] else relax.op.permute_dims(e, total)


def _collapse_views(func: relax.Function) -> relax.Function:
    """Replace every layout/cast chain on an attention result by one permute (or none)."""
    fn = _Function(func)
    bb = relax.BlockBuilder()
    blocks, changed = [], False
    for block in func.body.blocks:
        bindings = []
        for binding in block.bindings:
            if isinstance(binding, relax.VarBinding) and isinstance(binding.value, relax.Call):
                view = _view_of_attention(fn, binding.value)
                if view is not None:
                    binding = relax.VarBinding(binding.var, bb.normalize(view))
                    changed = True
            bindings.append(binding)
        blocks.append(relax.DataflowBlock(bindings) if isinstance(block, relax.DataflowBlock)
                      else relax.BindingBlock(bindings))
    if not changed:
        return func
    body = relax.SeqExpr(blocks, func.body.body)
    func = relax.Function(func.params, body, func.ret_ty, func.is_pure, func.attrs, func.span)
    func = relax.transform.CanonicalizeBindings()(tvm.IRModule({"f": func}))["f"]  # y = x aliases
    return relax.analysis.remove_all_unused(func)


def _existing(func: relax.Function, decisions: dict[str, dict[str, str]]) -> None:
    for block in func.body.blocks:
        for binding in block.bindings:
            if _op(binding.value) in ("relax.nn.attention", "relax.nn.attention_bias"):
                name = str(binding.var.name)
                decisions.setdefault(name, {"binding": name, "status": "existing",
                                            "reason": "already one R.nn.attention op"})


@tvm.transform.module_pass(opt_level=0, name="tvmfuse.FuseAttention")
class FuseAttention:
    """Q·Kᵀ → scale → mask → softmax → P·V (with layout ops and KV repetition) → ``R.nn.attention``.

    Records every candidate in the module attribute ``tvmfuse.attention_decisions``: a list of
    ``{"binding", "status": fused|left|existing, "reason" | "causal", "bias", "group", "scale"}``.
    """

    def transform_module(self, mod: tvm.IRModule, _ctx) -> tvm.IRModule:
        decisions: dict[str, dict[str, str]] = {}
        updates = {}
        for gv, func in mod.functions.items():
            if isinstance(func, relax.Function):
                _existing(func, decisions)
                # masks are read by value, the weights only by their type
                rewrite = without_large_constants(lambda f: _rewrite(f, decisions), weights_only=True)
                updates[gv] = rewrite(func)
        mod = mod.clone()  # assigned into below: not the caller's module
        for gv, func in updates.items():
            mod[gv] = func
        return mod.with_attr(DECISIONS_ATTR, list(decisions.values()))


def attention_decisions(mod: tvm.IRModule) -> list[dict[str, str]]:
    """The decisions :class:`FuseAttention` recorded on ``mod`` (empty if it did not run)."""
    if mod.attrs is None or DECISIONS_ATTR not in mod.attrs:
        return []
    return [{str(k): str(v) for k, v in d.items()} for d in mod.attrs[DECISIONS_ATTR]]
