"""Zero-size pieces leave the graph before anything is fused.

    split(x, [8], axis=3) : (x[..., :8], x[..., 8:8])      x: (B, S, H, 8)
      → (strided_slice(x, [3], [0], [8]), const(empty (B, S, H, 0)))
    concat([a, e], axis=3)                                 e: (B, S, H, 0)
      → a

ONNX's RotaryEmbedding (its function body, the ``_expanded`` tests) splits the head into a rotated
part and a pass-through part of ``head_size − rotary_dim`` elements, empty when the whole head
rotates, and concatenates the two again. Legalised, the empty piece is a loop nest of extent 0
inside the fused kernel, which the GPU schedule rules cannot bind (dlight divides by the extent).
Only static shapes are rewritten: a split whose pieces are all non-empty, or any symbolic piece
length, is left as it is. Any position in the canonical list; first, so nothing fuses an empty
piece.
"""

from __future__ import annotations

import numpy as np
import tvm
from tvm import relax
from tvm.relax.expr_functor import PyExprMutator, mutator

from ...relax_shapes import static_type_shape
from .._util import is_op, static_shape
from ._common import rewrite_relax_functions


def _empty(shape: list[int]) -> bool:
    return any(d == 0 for d in shape)


@mutator
class _DropEmpty(PyExprMutator):
    def __init__(self, mod: tvm.IRModule) -> None:
        super().__init__(mod)
        self.pieces: dict[relax.Var, list[relax.Expr]] = {}  # rewritten split → its pieces

    def visit_call_(self, call: relax.Call) -> relax.Expr:
        call = super().visit_call_(call)
        if is_op(call, "relax.split"):
            return self._split(call)
        if is_op(call, "relax.concat") and isinstance(call.args[0], relax.Tuple):
            new = self._concat(call)
            return call if isinstance(new, relax.Var) else new  # one operand left: see below
        return call

    def visit_var_binding_(self, binding: relax.VarBinding) -> None:
        value = binding.value
        if isinstance(value, relax.TupleGetItem) and value.tuple_value in self.pieces:
            piece = self.pieces[value.tuple_value][value.index]  # parts[i] is the piece itself
            if isinstance(piece, relax.Var) and isinstance(binding.var, relax.DataflowVar):
                self.set_var_remap(binding.var, piece)
            else:
                self.set_var_remap(binding.var, self.builder_.emit(piece, name_hint=binding.var.name))
            return
        if is_op(value, "relax.split"):
            new = self.visit_expr(value)
            if isinstance(new, relax.Tuple):
                self.pieces[binding.var] = list(new.fields)
                self.set_var_remap(binding.var, self.builder_.emit(new, name_hint=binding.var.name))
                return
        if (is_op(value, "relax.concat") and isinstance(value.args[0], relax.Tuple)
                and isinstance(binding.var, relax.DataflowVar)):
            new = self._concat(super().visit_call_(value))
            if isinstance(new, relax.Var):  # concat([a, empty]) is a itself
                self.set_var_remap(binding.var, new)
                return
        super().visit_var_binding_(binding)

    def _split(self, call: relax.Call) -> relax.Expr:
        x = call.args[0]
        shape = static_shape(x)
        pieces = [static_type_shape(f) for f in self.builder_.normalize(call).ty.fields]
        if shape is None or any(p is None for p in pieces) or not any(_empty(p) for p in pieces):
            return call
        axis = int(call.attrs.axis) % len(shape)
        dtype = str(x.ty.dtype)
        out, begin = [], 0
        for piece in pieces:
            end = begin + piece[axis]
            if _empty(piece):
                out.append(relax.const(np.empty(piece, dtype), dtype))
            else:
                out.append(self.builder_.emit(relax.op.strided_slice(x, [axis], [begin], [end])))
            begin = end
        return relax.Tuple(out)

    def _concat(self, call: relax.Call) -> relax.Expr:
        fields = list(call.args[0].fields)
        shapes = [static_shape(f) for f in fields]
        if any(s is None for s in shapes) or not any(_empty(s) for s in shapes):
            return call
        out_shape = static_shape(self.builder_.normalize(call))
        if out_shape is None or _empty(out_shape):
            return call
        kept = [f for f, s in zip(fields, shapes) if not _empty(s)]
        if len(kept) == 1:
            return kept[0]
        return relax.op.concat(relax.Tuple(kept), axis=call.attrs.axis)


@tvm.transform.module_pass(opt_level=0, name="tvmfuse.EmptyPieces")
class EmptyPieces:
    """Split pieces and concat operands of static size 0 → empty constants / dropped."""

    def transform_module(self, mod: tvm.IRModule, _ctx) -> tvm.IRModule:
        return rewrite_relax_functions(mod, lambda m, f: _DropEmpty(m).visit_expr(f))
