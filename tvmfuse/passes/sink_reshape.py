"""Move reshapes below elementwise ops so a GEMM meets its epilogue (layout folding, part 1).

torch.export writes ``Linear`` on a 3-D input as reshape → matmul → reshape → add(bias/residual).
The reshape between the matmul and the add stops FuseOps from fusing the epilogue (a GEMM only
takes elementwise consumers). Rewrites, for elementwise ``op``:

    op(reshape(a, s))            → reshape(op(a), s)
    op(reshape(a, s), b)         → reshape(op(a, b), s)            b broadcasts on the last axis only
    op(reshape(a, s), c)         → reshape(op(a, reshape(c, a.shape)), s)   c.shape == s
    op(reshape(a, s), reshape(c, s)) → reshape(op(a, c), s)         a.shape == c.shape

each only when ``op``'s result has shape ``s`` (a binary op that broadcasts two reshapes against
each other, ``arange(n)`` as (1, n) minus (n, 1), keeps its reshapes).

    reshape(reshape(a, s1), s2)  → reshape(a, s2);   reshape(a, a.shape) → a

The moved reshape ends up after the fused kernel, where RewriteDataflowReshape makes it a view;
reshapes that meet on the way (HF GPT-2's tanh-GELU hops between 2-D and 3-D) cancel out.
Sits before LegalizeOps, after the norm patterns (which match on the un-reshaped forms).
"""

from __future__ import annotations

import tvm
import tvm_ffi
from tvm import relax
from tvm.relax.dpl import is_op, is_tuple_get_item, rewrite_call, wildcard
from tvm.relax.transform.remove_redundant_reshape import RemoveRedundantReshape

from ..relax_shapes import known_shape, same_dim, same_shape
from ._util import rewrite_functions, shape_expr, split_bounds, without_large_constants

UNARY = ["relax.nn.relu", "relax.nn.gelu", "relax.nn.gelu_tanh", "relax.nn.silu", "relax.sigmoid",
         "relax.tanh", "relax.exp", "relax.erf", "relax.negative", "relax.astype", "relax.sqrt",
         "relax.rsqrt", "relax.abs", "relax.square", "relax.log"]
# TVM's matcher tries add and multiply both ways round; the side of the reshape is checked only
# where the result depends on it
COMMUTATIVE = ("relax.add", "relax.multiply", "relax.maximum", "relax.minimum")
BINARY = ["relax.add", "relax.subtract", "relax.multiply", "relax.divide", "relax.power",
          "relax.maximum", "relax.minimum"]


def _same_last_axis(a_shape: list, s: list) -> bool:
    return bool(a_shape) and bool(s) and same_dim(a_shape[-1], s[-1])


def last_axis_broadcast(b_shape: list, n) -> bool:
    return b_shape == [] or ((same_dim(b_shape[-1], 1) or same_dim(b_shape[-1], n))
                             and all(same_dim(d, 1) for d in b_shape[:-1]))


def _is_call(expr: relax.Expr, op: str) -> bool:
    return isinstance(expr, relax.Call) and expr.op.same_as(tvm.ir.Op.get(op))


def _is(arg: relax.Expr, value: relax.Expr, table: dict) -> bool:
    """``arg`` is ``value`` or a var bound to it."""
    return arg.same_as(value) or (arg in table and table[arg].same_as(value))


def _bindings(func: relax.Function) -> dict:
    """var → bound value over the function's blocks (to look through dataflow vars)."""
    table = {}
    for block in func.body.blocks:
        for binding in block.bindings:
            table[binding.var] = binding.value
    return table


def _gemm_rooted(expr: relax.Expr, table: dict, depth: int = 4) -> bool:
    """True for a matmul, or an elementwise chain over one (what FuseOps makes a GEMM epilogue)."""
    expr = table.get(expr, expr)
    if _is_call(expr, "relax.matmul"):
        return True
    if depth == 0 or not isinstance(expr, relax.Call) or not isinstance(expr.op, tvm.ir.Op):
        return False
    if expr.op.name not in BINARY + UNARY:
        return False
    return any(_gemm_rooted(arg, table, depth - 1) for arg in expr.args)


def _sink(func: relax.Function) -> relax.Function:
    table: dict = {}
    a, b, shape = wildcard(), wildcard(), wildcard()
    reshaped = is_op("relax.reshape")(a, shape)
    unary = None
    for name in UNARY:
        pat = is_op(name)(reshaped)
        unary = pat if unary is None else unary | pat
    binary = None
    for name in BINARY:
        pat = is_op(name)(reshaped, b) | is_op(name)(b, reshaped)
        binary = pat if binary is None else binary | pat

    def rewrite_unary(expr, m):
        inner = m[a]
        new = relax.Call(expr.op, [inner], expr.attrs)
        return relax.op.reshape(new, m[reshaped].args[1])

    def rewrite_binary(expr, m):
        inner, other, target = m[a], m[b], m[reshaped]
        if expr.op.name in COMMUTATIVE:
            # either order computes the same: an operand the match returns as it stands in the
            # call (a parameter, a constant) keeps its place, else the reshape's operand goes first
            other_first = expr.args[0].same_as(other)
        else:  # subtract, divide, power: the side the reshape stands on, looked through its var
            other_first = not _is(expr.args[0], target, table)
            if other_first and not _is(expr.args[1], target, table):
                return expr  # rewritten earlier in this round (not in ``table``): the next round

        def ordered(x, y):  # x: the reshaped operand's replacement, y: the other's
            return [y, x] if other_first else [x, y]
        # shapes with symbolic dims (--dynamic) compare structurally
        a_shape, s, o_shape = known_shape(inner), known_shape(target), known_shape(other)
        if any(x is None for x in (a_shape, s, o_shape)) or str(inner.ty.dtype) != str(other.ty.dtype):
            return expr
        if not same_shape(known_shape(expr), s):
            return expr  # the op broadcasts beyond the reshape's shape: moving it changes the result
        if _is_call(other, "relax.reshape"):
            source = other.args[0]
            same = same_shape(o_shape, s) and same_shape(known_shape(source), a_shape)
            if same and str(source.ty.dtype) == str(inner.ty.dtype):
                # both sides reshaped from one shape: the op runs on the originals
                return relax.op.reshape(relax.Call(expr.op, ordered(inner, source), expr.attrs),
                                        target.args[1])
            return expr  # different origins: moving one reshape would move it back and forth
        if same_shape(o_shape, s):
            # Full-shape operand: only for a GEMM(-epilogue) output meeting a non-GEMM tensor; the reverse
            # match on the reshape this creates would otherwise move it back and forth.
            if not _gemm_rooted(inner, table) or _gemm_rooted(other, table):
                return expr
            other_new = relax.op.reshape(other, shape_expr(a_shape))
        elif _same_last_axis(a_shape, s) and len(o_shape) <= len(a_shape) and last_axis_broadcast(
                o_shape, s[-1]):
            other_new = other if len(o_shape) <= 1 else relax.op.reshape(other, shape_expr([o_shape[-1]]))
        else:
            return expr
        return relax.op.reshape(relax.Call(expr.op, ordered(inner, other_new), expr.attrs),
                                target.args[1])

    # a slice along the last axis of a reshape that keeps that axis: the slice goes first (a gate/up
    # GEMM's halves, HF Phi-3's ``gate_up.chunk(2, -1)``, then meet PairGemm in the GEMM's 2-D form)
    sliced = is_op("relax.strided_slice")(reshaped, wildcard(), wildcard(), wildcard(), wildcard())
    split = is_op("relax.split")(reshaped)
    piece = is_tuple_get_item(split)

    def last_axis(m, axis: int) -> int | None:
        """The source's last axis when ``axis`` is the reshape's last and the reshape keeps it."""
        source, r_shape = m[a], known_shape(m[reshaped])
        a_shape = known_shape(source)
        if a_shape is None or r_shape is None or not _same_last_axis(a_shape, r_shape):
            return None
        if axis % len(r_shape) != len(r_shape) - 1 or not _gemm_rooted(source, table):
            return None
        return len(a_shape) - 1

    def rewrite_slice(expr, m):
        axes = [int(x) for x in expr.args[1].fields]
        last = last_axis(m, axes[0]) if len(axes) == 1 else None
        if last is None or known_shape(expr) is None:
            return expr
        inner = relax.op.strided_slice(m[a], [last], *expr.args[2:],
                                       assume_inbound=expr.attrs.assume_inbound)
        return relax.op.reshape(inner, shape_expr(known_shape(expr)))

    def rewrite_piece(expr, m):
        call = m[split]
        last = last_axis(m, int(call.attrs.axis))
        bounds = split_bounds(call)  # the piece as [begin, end) of the source's last axis
        if last is None or bounds is None or known_shape(expr) is None:
            return expr
        begin, end = bounds[expr.index], bounds[expr.index + 1]
        inner = relax.op.strided_slice(m[a], [last], [begin], [end], assume_inbound=True)
        return relax.op.reshape(inner, shape_expr(known_shape(expr)))

    inner_reshape = is_op("relax.reshape")(a, wildcard())
    outer_reshape = is_op("relax.reshape")(inner_reshape, shape) | is_op("relax.reshape")(a, shape)

    def rewrite_collapse(expr, m):
        source = m[inner_reshape].args[0] if inner_reshape in m else m[a]
        if same_shape(known_shape(source), known_shape(expr)):
            return source  # the reshapes cancel: same shape as the original tensor
        if inner_reshape in m:
            return relax.op.reshape(source, m[shape])
        return expr

    for _ in range(16):  # each round moves every reshape one op further down
        table.clear()
        table.update(_bindings(func))
        new = rewrite_call(binary, rewrite_binary, rewrite_call(unary, rewrite_unary, func))
        new = rewrite_call(piece, rewrite_piece, rewrite_call(sliced, rewrite_slice, new))
        new = rewrite_call(outer_reshape, rewrite_collapse, new)
        if tvm_ffi.structural_equal(new, func):
            break
        func = new
    return func


@tvm.transform.module_pass(opt_level=0, name="tvmfuse.SinkReshape")
class SinkReshape:
    """Reshapes move below elementwise consumers so FuseOps can give GEMMs their epilogues."""

    def transform_module(self, mod: tvm.IRModule, _ctx) -> tvm.IRModule:
        return rewrite_functions(mod, without_large_constants(_sink))  # weights not read


def drop_same_shape_broadcasts(func: relax.Function) -> relax.Function:
    """``broadcast_to(x, shape of x)`` → ``x`` (symbolic dims compared structurally)."""
    x = wildcard()

    def drop(expr, m):
        return m[x] if same_shape(known_shape(m[x]), known_shape(expr)) else expr

    return rewrite_call(is_op("relax.broadcast_to")(x, wildcard()), drop, func)


@tvm.transform.module_pass(opt_level=0, name="tvmfuse.RemoveRedundantReshape")
class RemoveRedundantReshapes:
    """Broadcasts of a tensor to its own shape dropped, then TVM's ``RemoveRedundantReshape``
    (views only), with the weights lifted (on a 7B-shaped layer TVM's pass spent ~2 s per
    function carrying the constants through its rewriter).

    A Linear on a (B, S, K) activation with B > 1 arrives as a broadcast of x to its own shape
    before the 3-D matmul; left in place it is a copy kernel (compile_lm's batch-8 decode: one a
    layer, between the attention and the O projection). Dropped here, after the attention and
    norm patterns: FuseAttention tells a mask from the scores by such broadcasts (GPT-2's
    ``where``, the decoder layer's additive mask)."""

    def transform_module(self, mod: tvm.IRModule, _ctx) -> tvm.IRModule:
        inner = RemoveRedundantReshape()

        def rewrite(gv, f):  # broadcasts first: the reshapes around one then meet and collapse
            return inner(tvm.IRModule({gv: drop_same_shape_broadcasts(f)}))[gv]

        out = mod.clone()  # assigned into below: not the caller's module
        for gv, func in mod.functions_items():
            if isinstance(func, relax.Function):
                out[gv] = without_large_constants(lambda f, gv=gv: rewrite(gv, f))(func)
        return out
