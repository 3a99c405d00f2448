"""Gathers (``take``, ``gather_elements``) are injective: re-annotate them so FuseOps fuses them.

``AnnotateTIROpPattern`` marks a PrimFunc opaque (``op_pattern`` 8) when a load index is not an
affine function of the loop variables. A gather's is data dependent::

    out[i, j, c] = table[idx[i, j], c]

so the embedding lookup stays a kernel of its own, and so does the index normalisation in front
of it (``where(ids < 0, ids + V, ids)``, what ONNX ``Gather`` imports as) and the position-
embedding add behind it. Yet every output element is written once from one point of each input:
the function is injective (``op_pattern`` 2), and FuseOps may fuse elementwise producers (the
index ``where``) and consumers (``+ wpe``) into it. The gathered table is read once per output
element either way.

Runs after ``AnnotateTIROpPattern`` and before ``FuseOps``. A PrimFunc qualifies when it is one
spatial block under the root that stores its single output at exactly the block variables and
reads only single points, at least one of them at an index loaded from another buffer.
"""

from __future__ import annotations

import tvm
from tvm import tirx

from ..errors import TVM_ERRORS

OPAQUE, INJECTIVE = 8, 2


def _has_load(expr) -> bool:
    """True when a BufferLoad occurs anywhere in the TIR expression ``expr``."""
    if isinstance(expr, tvm.ir.TensorLoad):  # 0.27: buffer loads are TensorLoad(source, indices)
        return True
    if isinstance(expr, tirx.Cast):
        return _has_load(expr.value)
    if isinstance(expr, tvm.ir.Call):
        return any(_has_load(a) for a in expr.args)
    if isinstance(expr, tirx.Select):
        return any(_has_load(e) for e in (expr.condition, expr.true_value, expr.false_value))
    operands = [getattr(expr, f, None) for f in ("a", "b")]
    return any(o is not None and _has_load(o) for o in operands)


def is_gather(func: tirx.PrimFunc) -> bool:
    """One spatial block writing ``out[v...]`` from point reads, one of them data-indexed."""
    from tvm import s_tir

    try:
        sch = s_tir.Schedule(func)
        children = sch.get_child_blocks(sch.get_sblock("root"))
    except TVM_ERRORS:  # TVM refuses a function that is not block-structured: not ours
        return False
    if len(children) != 1:
        return False
    block = sch.get(children[0])
    spatial = tirx.IterVar.DataPar
    if any(iv.iter_type != spatial for iv in block.iter_vars) or len(block.writes) != 1:
        return False
    store = block.body
    block_vars = [iv.var for iv in block.iter_vars]
    if not isinstance(store, tirx.BufferStore) or len(store.indices) != len(block_vars) or any(
            not (isinstance(i, tirx.Var) and i.same_as(v)) for i, v in zip(store.indices, block_vars)):
        return False
    data_indexed = False
    for region in block.reads:
        for rng in region.region:
            if not (isinstance(rng.extent, tirx.IntImm) and int(rng.extent) == 1):
                return False
            data_indexed = data_indexed or _has_load(rng.min)
    return data_indexed


@tvm.transform.module_pass(opt_level=0, name="tvmfuse.InjectiveGather")
class InjectiveGather:
    """Opaque-annotated gather PrimFuncs → ``op_pattern`` injective (see the module docstring)."""

    def transform_module(self, mod: tvm.IRModule, _ctx) -> tvm.IRModule:
        updates = {}
        for gvar, func in mod.functions.items():
            if not isinstance(func, tirx.PrimFunc) or func.attrs is None:
                continue
            attrs = func.attrs
            if "op_pattern" not in attrs or int(attrs["op_pattern"]) != OPAQUE:
                continue
            if "tirx.is_scheduled" in attrs or "tir.is_scheduled" in attrs:
                continue
            if is_gather(func):
                updates[gvar] = func.with_attr("op_pattern", INJECTIVE)
        if updates:
            mod = mod.clone()  # not the caller's module
            for gvar, func in updates.items():
                mod[gvar] = func
        return mod
