"""Decode: the append kernel folded into the split-KV attention kernel (one launch a layer fewer).

``compile_lm``'s decode step runs per layer (:mod:`tvmfuse.llm.kv_cache`)::

    s = call_tir_inplace(fused_append, (x..., state, offsets))   # RoPE(q), RoPE(k), v → state
    o = call_tir(cache_attention, (s, offsets, starts, sync))    # reads q, K, V from the state

After FuseTIR the append is one PrimFunc: TVM's elementwise ops (QKV slices, the rotations, the
cos/sin gathers) and the ``append`` block of :func:`tvmfuse.llm.kernels.decode_append`, whose
store writes element ``(b, 0, h, d)`` of ``concat(q, k, v)``. With every other block inlined,
that store's value is an expression of ``(b, h, d)`` over the append's inputs. The attention is
rebuilt with it (:class:`~tvmfuse.kernels.attention.flash_decode.NewToken`)::

    o, state = call_tir_inplace(attention_append, (state, offsets, starts, sync, x...), [0, -1])

each block computes its query heads from the expression, and the block whose chunk holds the
newest slot writes that slot's key and value first. The append kernel and its launch go; so do
the state's query rows' writes (nothing else reads them). Bytes moved are the same.

Applies where the append's output is read by the attention alone, the append PrimFunc inlines
to its one ``append`` block of extents ``(B, 1, Hq + 2·Hkv, D)`` matching the attention's, and
the value expression is made of the expression kinds :func:`~tvmfuse.kernels.tir_util.rebuild`
knows; otherwise both kernels stay. ``Options.decode_fold_append`` switches it. CUDA only (the
llvm decode keeps its two kernels); after FuseTIR, before the rules schedule the append.
"""

from __future__ import annotations

import json

import tvm
from tvm import relax, s_tir, tirx

from ..attrs import CACHE_ATTENTION_ATTR
from ..errors import TVM_ERRORS
from ..kernels.attention.flash_decode import DecodeConfig, NewToken, flash_decode_cache_primfunc
from ..kernels.attention.spec import AttentionSpec
from ..kernels.tir_util import UnknownExpr, dtype_of, substitute
from ..options import current_options

NAME = "fold_decode_append"


def append_store(func: tirx.PrimFunc, shape: tuple[int, ...] | None
                 ) -> tuple[list, tirx.PrimExpr | None, tirx.BufferStore] | None:
    """(iter vars (b, s, h, d), the store's guard (None: none), the store) of ``func``'s
    ``append`` block once every other block is inlined into it; None when that fails or the block
    is not the decode append of ``shape`` (None: of any shape)."""
    try:
        sch = s_tir.Schedule(func)
        for block in sch.get_child_blocks(sch.get_sblock("root")):
            if sch.get(block).name_hint != "append":
                sch.compute_inline(block)
        block = sch.get(sch.get_sblock("append"))
    except (s_tir.ScheduleError, *TVM_ERRORS):
        return None
    ivs = list(block.iter_vars)
    if shape is not None and [int(iv.dom.extent) for iv in ivs] != list(shape):
        return None
    body, guard = block.body, None
    if isinstance(body, tirx.IfThenElse) and body.else_case is None:
        body, guard = body.then_case, body.condition
    return (ivs, guard, body) if isinstance(body, tirx.BufferStore) else None


def _state_index(append: relax.Call) -> int | None:
    """The argument the decode append writes in place (the state); None if not exactly one."""
    indices = [int(i) for i in append.attrs.inplace_indices]
    return indices[0] if len(indices) == 1 else None


def _fold_kernel(mod: tvm.IRModule, append: relax.Call, attention: relax.Call
                 ) -> tirx.PrimFunc | None:
    """The attention kernel doing the append, or None (module doc). Its parameters: the
    attention's (state, offsets, starts, sync), the append's other inputs, the output."""
    afunc, kfunc = mod[append.args[0]], mod[attention.args[0]]
    state_index = _state_index(append)
    if not isinstance(afunc, tirx.PrimFunc) or state_index is None:
        return None
    meta = json.loads(str(kfunc.attrs[CACHE_ATTENTION_ATTR]))
    spec = AttentionSpec(**meta["spec"])
    config = DecodeConfig(**meta["config"])
    if config.cluster:  # the cluster kernel has no append inside (flash_decode_cache_primfunc)
        return None
    found = append_store(afunc, (spec.batch, 1, spec.q_heads + 2 * spec.kv_heads, spec.head_dim))
    if found is None:
        return None
    ivs, _guard, store = found  # the kernel writes the newest slot only where it is in the cache
    if not store.buffer.same_as(afunc.params[state_index]):  # a param is its buffer (0.27)
        return None

    def value(b, h, d):
        pos = [(iv.var, tirx.Cast(dtype_of(iv.var), x)) for iv, x in zip(ivs, (b, 0, h, d))]
        return substitute(store.value, pos)

    try:
        value(tirx.Var("b", "int32"), tirx.Var("h", "int32"), tirx.Var("d", "int32"))
    except UnknownExpr:
        return None
    kernel = flash_decode_cache_primfunc(spec, config=config, new_token=NewToken(value))
    extra = [p for i, p in enumerate(afunc.params) if i != state_index]
    params = [*kernel.params[:4], *extra, kernel.params[4]]
    attrs = {**dict(kfunc.attrs), **dict(kernel.attrs or {})}
    return tirx.PrimFunc(params, kernel.body, attrs=tvm.ir.make_node("ir.DictAttrs", **attrs))


def _fold_args(append: relax.Call, attention: relax.Call) -> list[relax.Expr]:
    """The folded call's arguments: the cache the append wrote in place, the attention's own
    inputs, then the append's (in :func:`_fold_kernel`'s parameter order)."""
    state_index = _state_index(append)
    a_args = list(append.args[1].fields)
    return [a_args[state_index], *attention.args[1].fields[1:],
            *(a for i, a in enumerate(a_args) if i != state_index)]


def _is_call(value: relax.Expr, op: str) -> bool:
    return (isinstance(value, relax.Call) and isinstance(value.op, tvm.ir.Op) and value.op.name == op
            and isinstance(value.args[1], relax.Tuple))


def _fold_block(mod: tvm.IRModule, block: relax.DataflowBlock, uses: dict, kernels: dict,
                bb: relax.BlockBuilder) -> relax.DataflowBlock | None:
    """``block`` with each append → attention pair folded (None: none was). ``kernels``:
    (append, attention) PrimFunc names → the folded kernel's GlobalVar in ``bb``'s module, or None
    where the fold does not apply (the layers share both PrimFuncs: one kernel for all)."""
    producers = {b.var: b.value for b in block.bindings
                 if _is_call(b.value, "relax.call_tir_inplace")}
    out, changed = [], False
    for b in block.bindings:
        value, gv = b.value, None
        if (_is_call(value, "relax.call_tir") and isinstance(value.args[0], tvm.ir.GlobalVar)
                and (mod[value.args[0]].attrs or {}).get(CACHE_ATTENTION_ATTR) is not None):
            state = value.args[1].fields[0]
            if state in producers and uses.get(state, 0) == 1:
                append = producers[state]
                key = (append.args[0].name_hint, value.args[0].name_hint)
                if key not in kernels:
                    func = _fold_kernel(mod, append, value)
                    kernels[key] = None if func is None else bb.add_func(func, f"{key[1]}_append")
                gv = kernels[key]
        if gv is None:
            out.append(b)
            continue
        state_ty = append.args[1].fields[_state_index(append)].ty
        pair = relax.DataflowVar(f"{b.var.name}_{NAME}", relax.TupleType([state_ty, value.ty]))
        call = relax.op.call_tir_inplace(gv, relax.Tuple(_fold_args(append, value)), [0, -1],
                                         [state_ty, value.ty])
        out.append(relax.VarBinding(pair, call))
        out.append(relax.VarBinding(b.var, relax.TupleGetItem(pair, 1)))
        changed = True
    return relax.DataflowBlock(out) if changed else None


def _uses(func: relax.Function) -> dict:
    """var → how many bindings (and the body) read it."""
    counts: dict = {}
    for block in func.body.blocks:
        for b in block.bindings:
            for var in relax.analysis.free_vars(b.value):
                counts[var] = counts.get(var, 0) + 1
    for var in relax.analysis.free_vars(func.body.body):
        counts[var] = counts.get(var, 0) + 1
    return counts


@tvm.transform.module_pass(opt_level=0, name="tvmfuse.FoldDecodeAppend")
class FoldDecodeAppend:
    """The decode append folded into the cache attention kernel (module doc)."""

    def transform_module(self, mod: tvm.IRModule, _ctx) -> tvm.IRModule:
        if not current_options().decode_fold_append or not any(
                isinstance(f, tirx.PrimFunc) and f.attrs is not None and CACHE_ATTENTION_ATTR in f.attrs
                for f in mod.functions.values()):
            return mod
        kernels: dict = {}
        updates = {}
        bb = relax.BlockBuilder(mod)  # copy on write: the caller's module stays as it is
        for gv, func in mod.functions.items():
            if not isinstance(func, relax.Function) or not isinstance(func.body, relax.SeqExpr):
                continue
            uses = _uses(func)
            blocks, changed = [], False
            for block in func.body.blocks:
                new = (_fold_block(mod, block, uses, kernels, bb)
                       if isinstance(block, relax.DataflowBlock) else None)
                changed |= new is not None
                blocks.append(new or block)
            if changed:
                body = relax.SeqExpr(blocks, func.body.body)
                updates[gv] = bb.normalize(
                    relax.Function(func.params, body, func.ret_ty, func.is_pure, func.attrs))
        if not updates:
            return mod
        mod = bb.get()
        for gv, func in updates.items():
            mod[mod.get_global_var(gv.name_hint)] = func
        # the appends' bindings, and the append and attention PrimFuncs nothing calls any more
        return relax.transform.DeadCodeElimination()(mod)
