"""A norm reading a slice of a wider tensor takes the slice into its kernel (Qwen3's q / k norms).

Qwen3 (also OLMo2, Gemma-3) normalises q and k after the projection. With one fused QKV GEMM::

    qkv = call_tir(fused_matmul…, …)                       # (T, (Hq + 2·Hkv)·D)
    q = call_tir(strided_slice, (qkv,));  q = call_tir(reshape, (q,))   # (B, S, Hq, D)
    qn = call_tir(rms_norm, (q, w))

FuseOps fuses an injective producer only along injective paths, and a norm (``op_pattern``
kOutEWiseFusable) takes elementwise consumers, never producers: each slice was a copy kernel of
its own, two a layer, writing what the norm reads back. On copies of the PrimFuncs, this pass
marks the slice chain broadcast and the norm a reduction, which FuseOps fuses; the ``row_norm``
rule then inlines the copies (``rules/row_norm.py`` ``inline_copies``) and reads
``qkv[t, a + h·D + d]`` with 16-byte vectors.

Taken when every link of the chain is data movement only (each block a plain copy) and read by
the next link alone, and not every reader of the norm is an elementwise or broadcast kernel
(those would fuse into the norm as kOutEWiseFusable, not into a reduction; beside an injective
reader, such as RoPE's slices after Gemma-3's norms, they do not fuse either way). Other
callers of the same PrimFuncs keep their marks. Runs after ``AnnotateTIROpPattern``, before ``FuseOps``.
"""

from __future__ import annotations

import re

import tvm
from tvm import relax, s_tir, tirx

from ..errors import TVM_ERRORS
from ._util import binding_users, call_tir_args, is_copy, op_pattern, rewrite_functions, with_call_tir_args
from .gather_pattern import INJECTIVE

BROADCAST, REDUCTION, OUT_ELEMWISE = 1, 3, 4  # AnnotateTIROpPattern's kinds
_NORM = re.compile(r"(rms_norm|layer_norm)\d*")  # the PrimFuncs LegalizeOps makes of R.nn norms


def _only_copies(func: tirx.PrimFunc) -> bool:
    try:
        sch = s_tir.Schedule(func)
        blocks = sch.get_child_blocks(sch.get_sblock("root"))
    except TVM_ERRORS:  # not block-structured: not a plain copy
        return False
    return bool(blocks) and all(is_copy(sch.get(b)) for b in blocks)


class _Marks:
    """The calls to re-mark (binding var → pattern) and the PrimFunc copies carrying the marks."""

    def __init__(self, mod: tvm.IRModule) -> None:
        self.mod = mod
        self.calls: dict = {}
        self.copies: dict = {}  # (GlobalVar, pattern) → GlobalVar of the re-marked copy
        self.sites: dict = {}  # GlobalVar → the binding vars calling it
        self.bound: dict = {}  # binding var → value, over every function

    def find(self, func: relax.Function) -> None:
        bound = {b.var: b.value for block in func.body.blocks
                 if isinstance(block, relax.DataflowBlock) for b in block.bindings}
        self.bound.update(bound)
        users = binding_users(func)
        for var, value in bound.items():
            if call_tir_args(value) is not None:
                self.sites.setdefault(value.args[0], []).append(var)
        for var, value in bound.items():
            args = call_tir_args(value)
            if args is None or not _NORM.fullmatch(value.args[0].name_hint) \
                    or op_pattern(self.mod[value.args[0]]) != OUT_ELEMWISE:
                continue
            readers = users.get(var, [])
            if readers and all(self._elementwise(bound.get(u)) for u in readers):
                continue  # elementwise readers alone fuse into the norm as it is
            chain, x = [], args[0]
            while (x in bound and call_tir_args(bound[x]) is not None and users.get(x) == [
                    chain[-1] if chain else var] and op_pattern(self.mod[bound[x].args[0]]) == INJECTIVE
                   and _only_copies(self.mod[bound[x].args[0]])):
                chain.append(x)
                x = call_tir_args(bound[x])[0]
            if chain:
                self.calls[var] = REDUCTION
                self.calls.update({c: BROADCAST for c in chain})

    def _elementwise(self, value: relax.Expr | None) -> bool:
        """A call_tir of an elementwise or broadcast PrimFunc."""
        if value is None or call_tir_args(value) is None:
            return False
        pattern = op_pattern(self.mod[value.args[0]])
        return pattern is not None and pattern <= BROADCAST

    def add_callees(self) -> tvm.IRModule:
        """The module with every re-marked PrimFunc: re-marked in place when every call of it
        gets the same mark, else a re-marked copy beside it."""
        bb = relax.BlockBuilder(self.mod.clone())  # not the caller's module
        for var, pattern in self.calls.items():
            gv = self.bound[var].args[0]
            if (gv, pattern) in self.copies:
                continue
            func = self.mod[gv].with_attr("op_pattern", pattern)
            if all(self.calls.get(v) == pattern for v in self.sites[gv]):
                bb.update_func(gv, func)
                self.copies[gv, pattern] = gv
            else:
                self.copies[gv, pattern] = bb.add_func(func, f"{gv.name_hint}_to_norm")
        return bb.get()

    def rewrite(self, func: relax.Function) -> relax.Function:
        blocks = []
        for block in func.body.blocks:
            if not isinstance(block, relax.DataflowBlock):
                blocks.append(block)
                continue
            out = []
            for b in block.bindings:
                if b.var in self.calls:
                    callee = self.copies[b.value.args[0], self.calls[b.var]]
                    b = relax.VarBinding(b.var, with_call_tir_args(
                        b.value, call_tir_args(b.value), callee))
                out.append(b)
            blocks.append(relax.DataflowBlock(out))
        return relax.BlockBuilder().normalize(relax.Function(
            func.params, relax.SeqExpr(blocks, func.body.body), func.ret_ty, func.is_pure,
            func.attrs))


@tvm.transform.module_pass(opt_level=0, name="tvmfuse.NormInputCopies")
class NormInputCopies:
    """Slice / reshape chains feeding a norm marked to fuse into it (module doc)."""

    def transform_module(self, mod: tvm.IRModule, _ctx) -> tvm.IRModule:
        marks = _Marks(mod)
        for func in mod.functions.values():
            if isinstance(func, relax.Function) and isinstance(func.body, relax.SeqExpr):
                marks.find(func)
        if not marks.calls:
            return mod
        return rewrite_functions(marks.add_callees(), marks.rewrite)
