"""Decode: the attention kernel prefetches the next projections' weights into L2.

Per layer, ``compile_lm``'s decode step on sm_90 runs (PDL: each kernel launches while its
predecessor ends)::

    QKV GEMV → append → attention partial → combine → O GEMV → gate/up GEMV → down GEMV

The three attention kernels are latency-bound: on the 4-layer LM at ctx 2048 they take ~9 µs a
layer and read ~4 MB, while HBM could deliver ~38 MB in that time (4.21 TB/s). The GEMVs after
them are bandwidth-bound. So the attention call gets the weights of the GEMVs that follow it, up
to ``Options.decode_weight_prefetch_bytes`` in call order (the O projection, then part of the
gate/up pair), as extra parameters; its partial kernel bulk-prefetches them into L2 before its
PDL wait (:class:`~tvmfuse.kernels.attention.flash_decode.WeightPrefetch`), so the GEMVs read
those rows from L2::

    o = call_tir(cache_attention, (state, offsets, starts, sync))
      → o = call_tir(cache_attention_prefetch, (state, offsets, starts, sync, w_o, w_gate_up))

The weights are constants (read-only), so prefetching them early is safe. Applies to attention
calls whose kernel launches programmatically (the ``pdl`` flag compile_lm records with the
kernel) and is not folded with the append; the GEMVs are the ``gemv`` rule's kernels, their
weight the largest 2-D constant they read. Layers that share the attention PrimFunc and the
weights' shapes share the rebuilt kernel. After the ``gemv`` stage (which fixes the weights'
layouts), before scheduling.
"""

from __future__ import annotations

import json
import math

import tvm
from tvm import relax, tirx

from ..attrs import CACHE_ATTENTION_ATTR, PREFETCH_ONLY_ATTR, RULE_ATTR
from ..kernels.attention.flash_decode import DecodeConfig, WeightPrefetch, flash_decode_cache_primfunc
from ..kernels.attention.spec import AttentionSpec
from ..options import current_options
from .gemv import NAME as GEMV

NAME = "prefetch_decode_weights"
_CALL_TIR = "relax.call_tir"


def _callee(mod: tvm.IRModule, value: relax.Expr) -> tirx.PrimFunc | None:
    """The PrimFunc a ``call_tir`` binding calls (None: not such a call)."""
    if not (isinstance(value, relax.Call) and isinstance(value.op, tvm.ir.Op)
            and value.op.name == _CALL_TIR and isinstance(value.args[0], tvm.ir.GlobalVar)):
        return None
    func = mod[value.args[0]]
    return func if isinstance(func, tirx.PrimFunc) else None


def _attention_meta(mod: tvm.IRModule, value: relax.Expr) -> dict | None:
    """compile_lm's record of a decode cache attention call's kernel (spec, config, pdl)."""
    func = _callee(mod, value)
    if func is None or func.attrs is None or CACHE_ATTENTION_ATTR not in func.attrs:
        return None
    return json.loads(str(func.attrs[CACHE_ATTENTION_ATTR]))


def _shape(const: tvm.ir.expr.Constant) -> tuple[tuple[int, ...], str]:
    """(shape, dtype) of a constant tensor."""
    return tuple(int(x) for x in const.value.shape), str(const.value.dtype)


def _gemv_weight(mod: tvm.IRModule, value: relax.Expr) -> tvm.ir.expr.Constant | None:
    """The weight a ``gemv`` kernel call streams: its largest 2-D constant argument."""
    func = _callee(mod, value)
    if func is None or func.attrs is None or str(func.attrs.get(RULE_ATTR, "")) != GEMV:
        return None
    consts = [a for a in value.args[1].fields if isinstance(a, tvm.ir.expr.Constant)
              and isinstance(a.value, tvm.runtime.Tensor) and len(a.value.shape) == 2]
    return max(consts, key=lambda c: math.prod(_shape(c)[0]), default=None)


def plan(mod: tvm.IRModule, func: relax.Function, budget: int) -> dict:
    """Attention call → [(weight constant, rows)]: the weights of the GEMVs after it, in call order
    until the next attention call, ``budget`` bytes in all (the last one's leading rows)."""
    bindings = [b for block in func.body.blocks for b in block.bindings]
    out = {}
    for i, b in enumerate(bindings):
        meta = _attention_meta(mod, b.value)
        if meta is None or not meta.get("pdl"):
            continue
        take, left = [], budget
        for later in bindings[i + 1:]:
            if _attention_meta(mod, later.value) is not None:
                break
            w = _gemv_weight(mod, later.value)
            if w is None:
                continue
            shape, dtype = _shape(w)
            row_bytes = shape[1] * tvm.DataType(dtype).bits // 8
            if row_bytes % 16:  # bulk prefetches move multiples of 16 bytes from 16-byte addresses
                continue
            rows = min(shape[0], left // row_bytes)
            if rows == 0:
                break
            take.append((w, rows))
            left -= rows * row_bytes
        if take:
            out[b.value] = take
    return out


def _kernel(kfunc: tirx.PrimFunc, take: list) -> tirx.PrimFunc:
    """The attention kernel rebuilt to prefetch ``take``; parameters: the attention's
    (state, offsets, starts, sync), the weights, the output."""
    meta = json.loads(str(kfunc.attrs[CACHE_ATTENTION_ATTR]))
    weights = tuple(WeightPrefetch(tirx.decl_buffer(*_shape(w), f"w{i}"), rows)
                    for i, (w, rows) in enumerate(take))
    kernel = flash_decode_cache_primfunc(AttentionSpec(**meta["spec"]),
                                         config=DecodeConfig(**meta["config"]), weights=weights)
    params = [*kernel.params[:4], *(w.buffer for w in weights), kernel.params[4]]
    attrs = {**dict(kfunc.attrs), **dict(kernel.attrs or {}),
             PREFETCH_ONLY_ATTR: list(range(4, 4 + len(weights)))}
    return tirx.PrimFunc(params, kernel.body, attrs=tvm.ir.make_node("ir.DictAttrs", **attrs))


@tvm.transform.module_pass(opt_level=0, name="tvmfuse.PrefetchDecodeWeights")
class PrefetchDecodeWeights:
    """Decode attention calls take the next GEMVs' weights and prefetch them (module doc)."""

    def transform_module(self, mod: tvm.IRModule, _ctx) -> tvm.IRModule:
        budget = current_options().decode_weight_prefetch_bytes
        plans = {gv: p for gv, f in mod.functions.items() if isinstance(f, relax.Function)
                 and isinstance(f.body, relax.SeqExpr) and (p := plan(mod, f, budget))} if budget else {}
        if not plans:
            return mod
        bb = relax.BlockBuilder(mod)  # copy on write: the caller's module stays as it is
        kernels: dict = {}
        updates = {}
        for gv, calls in plans.items():
            func = mod[gv]
            blocks = []
            for block in func.body.blocks:
                bindings = []
                for b in block.bindings:
                    take = calls.get(b.value)
                    if take is None:
                        bindings.append(b)
                        continue
                    kgv = b.value.args[0]
                    key = (kgv.name_hint, tuple((_shape(w), r) for w, r in take))
                    if key not in kernels:
                        kernels[key] = bb.add_func(_kernel(mod[kgv], take), f"{kgv.name_hint}_prefetch")
                    args = [*b.value.args[1].fields, *(w for w, _ in take)]
                    call = relax.op.call_tir(kernels[key], relax.Tuple(args), b.value.ty_args[0])
                    bindings.append(relax.VarBinding(b.var, call))
                blocks.append(type(block)(bindings))
            updates[gv] = bb.normalize(relax.Function(func.params, relax.SeqExpr(blocks, func.body.body),
                                                      func.ret_ty, func.is_pure, func.attrs))
        mod = bb.get()
        for gv, func in updates.items():
            mod[mod.get_global_var(gv.name_hint)] = func
        # the attention PrimFuncs nothing calls any more
        return relax.transform.DeadCodeElimination()(mod)
