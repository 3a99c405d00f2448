"""Derived KV cache: each ``R.nn.attention`` of a cache-less causal LM reads and writes a cache.

For attention layer l of a function with static shapes (B, S); ``state_l`` (B, 2·Hkv·M + Hq, D)
holds the layer's keys, values and (decode) this step's query (:mod:`tvmfuse.llm.kernels`)::

    o = R.nn.attention(q (B,S,Hq,D), k (B,S,Hkv,D), v, scale, causal_mask)
  → decode (S = 1):
    s_l = call_tir_inplace(decode_append, (state_l, concat(q, k, v), offsets))   # in place
    o = call_tir(cache_attention, (s_l, offsets, starts[, attn_sync]))
  → prefill (S > 1):
    s_l = call_tir_inplace(kv_append_k, (state_l, k, offsets));  then kv_append_v with v
    o = R.nn.attention(q, K(s_l)[:, :, :S]ᵀ, V(s_l)[:, :, :S]ᵀ, scale, causal_mask="TopLeft")

A prefill starts its sequences (the runtime passes offsets 0): its attention is over this call's
keys and values (read back from the slots just written, which keeps the append alive), computed
by the flash kernels as plain causal attention. Prompts are right-padded
(:mod:`tvmfuse.runtime.lm`): a real token never has a padding slot at or before it, so causality
alone hides the padding, no mask tensor is read, and the fastest flash kernel (sm_90a: the wgmma
one, which takes no bias) applies. Padding rows attend to the real tokens and themselves (finite
values nobody reads: decode overwrites those slots, and reads slots ``starts[b] .. p``). Decode
reads the cache through the split-KV kernel.

and the function gains the parameters ``offsets`` (B,) int32, ``starts`` (B,) int32 and
``cache_0, cache_1, ...`` (the states) after its own, on CUDA then ``attn_sync``
(the decode kernel's int32 counters, zero between calls; every entry point takes it). Kernels
and their formulas: :mod:`tvmfuse.llm.kernels`. No cache is copied: the append writes the
caller's buffers. Only causal self-attention is accepted (``causal_mask`` TopLeft, or
BottomRight with Sq == Skv; no bias: FuseAttention proved the model's mask causal); anything
else raises a :class:`~tvmfuse.errors.CompileError` naming the binding. A sliding window (Mistral's
causal band of w keys, ``window_size``) carries over: the prefill's attention keeps it and decode
reads the slots ``max(starts[b], p − w + 1) .. p`` (slot = position); the cpu target only for
now (CUDA refuses a window shorter than ``max_seq_len``, which never binds).

Sits after FuseAttention (it needs R.nn.attention with known q, k, v) and after the positions
were made per-sequence (:mod:`tvmfuse.llm.positions`), before mixed precision and LegalizeOps.
"""

from __future__ import annotations

import math

import tvm
from tvm import relax

from ..attrs import STEP_INPUTS_ATTR, causal_attr, parse_causal_attr
from ..errors import CompileError
from ..options import current_options
from ..passes.attention import attention_decisions
from ._graph import var_name
from .kernels import CacheSpec, cache_attention, decode_append, kv_append

# every form FuseAttention may leave: the ones with a bias or packed lengths are refused, never
# left in place (they would attend over this call's keys only)
_ATTENTION_OPS = ("relax.nn.attention", "relax.nn.attention_bias", "relax.nn.attention_var_len")


def _attention_spec(var: relax.Var, call: relax.Call, max_seq: int, cuda: bool = False,
                    window: int | None = None) -> CacheSpec:
    """The layer's cache spec. ``window``: the layer's sliding window as the prefill entries
    traced it (a decode trace, one query over one key, shows no band)."""
    q, k, v = call.args[:3]
    where = f"compile_lm: attention at binding {var_name(var)!r}"
    if call.op.name == "relax.nn.attention_var_len":
        raise CompileError(f"{where} is variable-length (packed sequences): cannot derive a cache")
    if len(call.args) > 3:
        raise CompileError(f"{where} has a bias (padding or data-dependent mask): cannot derive a cache")
    if call.attrs.window_size is not None:
        window = int(call.attrs.window_size)
    window = window if window is not None and window < max_seq else None  # else it never binds
    if window is not None and cuda:
        raise CompileError(f"{where} has a sliding window of {window} keys, shorter than max_seq_len "
                           f"{max_seq}: the CUDA decode kernels do not take a window yet (the cpu "
                           "target does; or compile with max_seq_len ≤ the window)")
    qs, ks, vs = ([int(d) for d in x.ty.shape.values] for x in (q, k, v))
    causal, softcap = parse_causal_attr(call.attrs.causal_mask)
    # one query sees its single key under any mask: decode is causal when the prefills were
    if (causal not in ("TopLeft", "BottomRight") and qs[1] != 1) or qs[1] != ks[1]:
        raise CompileError(f"{where} is not causal self-attention (mask {causal}, q {qs}, k {ks}): "
                           "a derived cache needs a causal LM")
    if ks != vs or qs[3] != ks[3]:
        raise CompileError(f"{where}: key {ks} / value {vs} shapes differ")
    scale = call.attrs.scale
    scale = float(scale) if scale is not None else 1.0 / math.sqrt(qs[3])
    return CacheSpec(batch=qs[0], seq=qs[1], q_heads=qs[2], kv_heads=ks[2], head_dim=qs[3],
                     max_seq=max_seq, dtype=str(q.ty.dtype), scale=scale, window=window,
                     softcap=softcap)


@relax.expr_functor.mutator
class _Rewrite(relax.PyExprMutator):
    def __init__(self, mod: tvm.IRModule, max_seq: int, cuda: bool, prefix: str,
                 pdl: bool = False, windows: list | None = None, clusters: bool = False) -> None:
        super().__init__(mod)
        self.max_seq, self.cuda, self.prefix, self.pdl = max_seq, cuda, prefix, pdl
        self.clusters = clusters
        self.windows = windows or []  # per layer, from the prefill traces (_layer_windows)
        self.caches: list[relax.Var] = []
        self.specs: list[CacheSpec] = []
        self.kernels: dict[CacheSpec, tuple[relax.GlobalVar, relax.GlobalVar]] = {}
        self.offsets = self.starts = None
        self.sync: relax.Var | None = None

    def set_batch(self, batch: int) -> None:
        self.offsets = relax.Var("offsets", relax.TensorType([batch], "int32"))
        self.starts = relax.Var("starts", relax.TensorType([batch], "int32"))

    def _kernels(self, spec: CacheSpec) -> tuple[relax.GlobalVar, relax.GlobalVar]:
        """Decode: (append of concat(q, k, v), cache attention); prefill: (K append, V append)."""
        if spec not in self.kernels:
            n, add = len(self.kernels), self.builder_.add_func
            if spec.seq == 1:  # the RoPE of q and k and the V slice fuse into the append kernel
                opts = current_options()
                # with PDL, a cache that fits beside the weights in L2 is prefetched while the
                # append runs (flash_decode's l2_prefetch)
                state_bytes = math.prod(spec.state_shape) * tvm.DataType(spec.dtype).bits // 8
                prefetch = self.pdl and state_bytes <= opts.decode_kv_prefetch_bytes
                # with PDL the first keys may load into registers before the wait (preload)
                preload = self.pdl and opts.decode_preload_kv
                # the combine inside a cluster (sm_90; by default where the step launches
                # programmatically, the batch-1 path it was measured on)
                mode = opts.decode_cluster_combine
                cluster = self.clusters and (mode == "on" or (mode == "pdl" and self.pdl))
                name = f"{self.prefix}cache_attention{n}"
                try:
                    attention = cache_attention(spec, self.cuda, opts.decode_fused_combine,
                                                prefetch, preload, cluster,
                                                opts.decode_attention_threads,
                                                opts.decode_attention_heads)
                except ValueError as err:  # a thread count (for its heads) the kernel cannot take
                    raise CompileError(f"compile_lm: decode attention {name!r} ({spec.q_heads} q / "
                                       f"{spec.kv_heads} KV heads, head_dim {spec.head_dim}) with "
                                       f"Options.decode_attention_threads="
                                       f"{opts.decode_attention_threads}, decode_attention_heads="
                                       f"{opts.decode_attention_heads}: {err}") from err
                pair = (add(decode_append(spec), f"{self.prefix}decode_append{n}"),
                        add(attention, name))
            else:
                pair = tuple(add(kv_append(spec, region, self.cuda), f"{self.prefix}{kv}_append{n}")
                             for region, kv in ((0, "k"), (1, "v")))
            self.kernels[spec] = pair
        return self.kernels[spec]

    def _sync_for(self, var: relax.Var, spec: CacheSpec) -> None:
        """One counter buffer for every layer (the decode kernels run one after another)."""
        if self.sync is None:
            self.sync = relax.Var("attn_sync", relax.TensorType(list(spec.sync_shape), "int32"))
        elif [int(d) for d in self.sync.ty.shape.values] != list(spec.sync_shape):
            raise CompileError(f"compile_lm: attention at binding {var_name(var)!r} has other head "
                               "counts than the first layer's: one decode counter buffer needs "
                               "equal layers")

    def visit_var_binding_(self, binding: relax.VarBinding) -> None:
        call = binding.value
        if not (isinstance(call, relax.Call) and isinstance(call.op, tvm.ir.Op)
                and call.op.name in _ATTENTION_OPS):
            super().visit_var_binding_(binding)
            return
        layer = len(self.specs)
        spec = _attention_spec(binding.var, call, self.max_seq, self.cuda,
                               self.windows[layer] if layer < len(self.windows) else None)
        if self.cuda:
            self._sync_for(binding.var, spec)
        self.specs.append(spec)
        stype = relax.TensorType(list(spec.state_shape), spec.dtype)
        state = relax.Var(f"cache_{layer}", stype)
        self.caches.append(state)
        first, second = self._kernels(spec)
        q, k, v = (self.visit_expr(a) for a in call.args[:3])

        def in_place(kernel, x, name):
            return self.builder_.emit(relax.op.call_tir_inplace(
                kernel, relax.Tuple([state, x, self.offsets]), [0], stype), name_hint=name)

        if spec.seq > 1:  # prefill starts sequences: attention over this call's k, v (flash kernels)
            state = in_place(first, k, f"kc_{layer}")
            state = in_place(second, v, f"vc_{layer}")
            # read back from slots 0..S-1 of the rows just written: the data dependence keeps
            # the in-place appends (pure calls to Relax) from being removed as unused
            B, Hkv, M, D = spec.cache_shape
            k_new, v_new = (self.builder_.emit(relax.op.permute_dims(relax.op.strided_slice(
                relax.op.reshape(relax.op.strided_slice(state, [1], [row0], [row0 + Hkv * M]),
                                 [B, Hkv, M, D]), [2], [0], [spec.seq]), [0, 2, 1, 3]))
                for row0 in spec.rows[:2])
            out = self.builder_.emit(relax.op.nn.attention(
                q, k_new, v_new, scale=spec.scale, causal_mask=causal_attr("TopLeft", spec.softcap),
                window_size=spec.window),
                name_hint=var_name(binding.var))
        else:
            qkv = self.builder_.emit(relax.op.concat([q, k, v], axis=2), name_hint=f"qkv_{layer}")
            state = in_place(first, qkv, f"state_{layer}")
            sync = [self.sync] if self.cuda else []
            out = self.builder_.emit(relax.call_tir(
                second, relax.Tuple([state, self.offsets, self.starts, *sync]), call.ty),
                name_hint=var_name(binding.var))
        self.set_var_remap(binding.var, out)


def _layer_windows(mod: tvm.IRModule) -> tuple[int, list]:
    """(S, each attention layer's ``window_size`` in binding order, None: no window) of the
    module's function with S > 1 queries; (1, []) for a decode step."""
    for func in mod.functions.values():
        if not isinstance(func, relax.Function) or not isinstance(func.body, relax.SeqExpr):
            continue
        calls = [b.value for block in func.body.blocks for b in block.bindings
                 if isinstance(b.value, relax.Call) and isinstance(b.value.op, tvm.ir.Op)
                 and b.value.op.name in _ATTENTION_OPS]
        seq = int(calls[0].args[0].ty.shape.values[1]) if calls else 1
        if seq > 1:
            return seq, [None if c.attrs.window_size is None else int(c.attrs.window_size)
                         for c in calls]
    return 1, []


def _left(mod: tvm.IRModule) -> str:
    """Why FuseAttention left the module's attention candidates alone, for an error message."""
    reasons = sorted({d["reason"] for d in attention_decisions(mod)
                      if d.get("status") == "left" and d.get("reason")})
    if not reasons:
        return " (`tvmfuse report` lists why attention was left alone)"
    return "; the candidates were left alone because: " + "; ".join(reasons)


@tvm.transform.module_pass(opt_level=0, name="tvmfuse.llm.DeriveKVCache")
class DeriveKVCache:
    """Every Relax function with attention gets the cache parameters (module doc)."""

    def __init__(self, max_seq: int, cuda: bool = False, pdl: bool = False,
                 windows: list | None = None, clusters: bool = False) -> None:
        """``pdl``: the decode kernels launch programmatically (sm_90+, ``programmatic_launch``
        on): the decode attention may prefetch its cache rows before its wait. ``clusters``: the
        target runs thread-block clusters (sm_90+; ``Options.decode_cluster_combine``).
        ``windows``: a list
        shared by the entry points' modules, the longest prefill first and decode last: the
        layers' sliding windows as that prefill traced them (:func:`_layer_windows`), for the
        decode step, whose trace shows none."""
        self.max_seq, self.cuda, self.pdl, self.clusters = max_seq, cuda, pdl, clusters
        self.windows = windows if windows is not None else []

    def transform_module(self, mod: tvm.IRModule, _ctx) -> tvm.IRModule:
        out = mod.clone()
        seq, traced = _layer_windows(mod)
        if traced and not self.windows:
            self.windows[:] = traced  # the longest prefill comes first: it shows every band
        elif traced and any(t != w and not (t is None and w is not None and seq <= w)
                            for t, w in zip(traced, self.windows, strict=True)):
            # a prefill no longer than a window cannot show it; anything else is a contradiction
            raise CompileError(f"compile_lm: the {seq}-token prefill traces other sliding windows "
                               f"({traced}) than a longer one ({self.windows})")
        windows = self.windows
        for gv, func in mod.functions.items():
            if not isinstance(func, relax.Function):
                continue
            batch = int(func.params[0].ty.shape.values[0])
            rw = _Rewrite(out, self.max_seq, self.cuda, prefix=f"{gv.name_hint}_", pdl=self.pdl,
                          windows=windows, clusters=self.clusters)
            rw.set_batch(batch)
            body = rw.visit_expr(func.body)
            if not rw.specs:
                raise CompileError(f"compile_lm: function {gv.name_hint!r} has no attention that "
                                   f"FuseAttention recognised: no KV cache to derive{_left(mod)}")
            sync = [rw.sync] if rw.sync is not None else []
            params = [*func.params, rw.offsets, rw.starts, *rw.caches, *sync]
            new = relax.Function(params, body, func.ret_ty, func.is_pure, func.attrs).with_attr(
                STEP_INPUTS_ATTR, [str(p.name) for p in [*func.params, rw.offsets, rw.starts]])
            out = rw.builder_.finalize()
            out[out.get_global_var(gv.name_hint)] = new
        return out
