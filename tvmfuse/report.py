"""``tvmfuse report``: what fusion saved, in HBM bytes, kernel by kernel.

Bytes follow the "do the math" rule: a kernel reads each input once and writes each output once.
``unfused`` is the same sum over the graph with one kernel per operator (views such as reshape
move no bytes and launch nothing in either case). Schema in DESIGN.md.
"""

from __future__ import annotations

import math
import re
from dataclasses import asdict, dataclass, field
from typing import Any

import tvm
from tvm import relax, tirx
from tvm.relax.backend import cpu_generic as stock_cpu
from tvm.relax.backend import cuda as stock_cuda
from tvm.s_tir.analysis import estimate_tir_flops

from .attrs import (
    FALLBACK_ATTR,
    FLOPS_ATTR,
    IN_LOOP_ATTR,
    KEPT_ATTR,
    KERNEL_TILE_ATTR,
    PARTIALS_ATTR,
    REPLACES_ATTR,
    RULE_ATTR,
    TILE_ATTR,
    TUNING_ATTR,
)
from .device_props import DEFAULT_DEVICE, DEVICES, device_properties
from .errors import TVM_ERRORS, CompileError
from .passes import MixedPrecision
from .passes.attention import attention_decisions
from .passes.canonical import BoundedSlices
from .passes.legalize_fixes import legalize_overrides
from .pipeline import lower
from .targets import TargetSpec

VIEW_OPS = {"reshape", "expand_dims", "squeeze", "flatten"}
REDUCTION_OPS = {"softmax", "layer_norm", "rms_norm", "group_norm", "mean", "sum", "max", "min",
                 "variance", "log_softmax", "argmax", "argmin", "prod", "std"}
LAYOUT_OPS = {"transpose", "permute_dims", "strided_slice", "concatenate", "take", "broadcast_to",
              "split", "reshape"}
GEMM_OPS = {"matmul", "dense", "conv2d", "conv1d", "batch_matmul", "attention"}
# AnnotateTIROpPattern kinds
_K_REDUCE, _K_GEMM = 3, 4


@dataclass
class KernelInfo:
    """One kernel launch: its ops, FLOPs and the bytes it moves."""

    name: str
    pattern: str
    ops: list[str]
    flops: int
    bytes: int
    measured_ms: float | None = field(default=None)
    tuning: str | None = field(default=None)  # with a tuning database: "tuned" or "default: why"
    fallback: str | None = field(default=None)  # why a rule / generator left it (tvmfuse.fallback)
    rule: str | None = field(default=None)  # the tvmfuse rule / generator that made it (tvmfuse.rule)
    # the tile / config it was generated with (tvmfuse.gemm_tile, tvmfuse.tile): e.g. a GEMV's engine
    tile: str | None = field(default=None)

    def to_json(self) -> dict[str, Any]:
        d = asdict(self)
        for key in ("measured_ms", "tuning", "fallback", "rule", "tile"):
            if d[key] is None:
                del d[key]
        return d


def op_name(gvar_name: str) -> str:
    """Legalised PrimFunc name → operator: ``tir_rsqrt3`` → ``rsqrt``, ``add12`` → ``add``."""
    name = re.sub(r"\d+$", "", gvar_name)
    return name[4:] if name.startswith("tir_") else name


# A dynamic model's report is computed at given sizes (default: each symbol's upper bound).
_SIZES: dict[str, int] = {}


def _dim_value(dim) -> int:
    """A shape dimension as an int; a symbolic one at the report's size for its symbols."""
    if isinstance(dim, tirx.IntImm) or isinstance(dim, int):
        return int(dim)
    analyzer = tvm.sym.Analyzer()
    for var in tirx.analysis.undefined_vars(dim):
        size = _SIZES.get(var.name)
        if size is None and len(_SIZES) == 1:
            # a kernel's own name for the one symbol (TVM's legalised ops name theirs, e.g. "m")
            size = next(iter(_SIZES.values()))
        if size is None:
            raise CompileError(f"report: the size of the symbolic dimension {var.name!r} (in {dim}) is "
                               f"unknown; the model's symbols are {sorted(_SIZES)}")
        analyzer.bind(var, tirx.IntImm("int64", size))
    return int(analyzer.simplify(dim))


def _tensor_bytes(ty) -> int:
    if not isinstance(ty, relax.TensorType) or ty.shape is None:
        return 0
    dims = [_dim_value(d) for d in ty.shape.values]
    return math.prod(dims) * tvm.runtime.DataType(str(ty.dtype)).bits // 8


def _param_bytes(param) -> int:
    if not hasattr(param, "shape") or param.shape is None:
        return 0  # scalar parameters (shape vars) move no tensor bytes
    dims = [_dim_value(d) for d in param.shape]
    return math.prod(dims) * tvm.runtime.DataType(str(param.dtype)).bits // 8


def primfunc_bytes(func: tirx.PrimFunc) -> int:
    """Every buffer parameter read or written once (a kernel's minimal HBM traffic)."""
    return sum(_param_bytes(p) for p in func.params)


def call_bytes(func: tirx.PrimFunc, call: relax.Call) -> int:
    """:func:`primfunc_bytes` of ``func``; where its parameters have sizes of their own (TVM's
    generic kernels, e.g. the cumsum of transformers' masks takes (m, n) buffers), the sizes of
    the tensors ``call`` passes it."""
    try:
        return primfunc_bytes(func)
    except CompileError:
        return sum(_tensor_bytes(arg.ty) for arg in call.args if isinstance(arg, relax.Expr))


def kernel_flops(func: tirx.PrimFunc) -> int:
    """TVM's FLOP estimate of an unscheduled kernel (0 where it cannot tell: symbolic loops too);
    a generated kernel's own count where it carries one (attention)."""
    if func.attrs is not None and FLOPS_ATTR in func.attrs:
        return int(func.attrs[FLOPS_ATTR])
    try:
        return int(estimate_tir_flops(tvm.IRModule({"main": func})))
    except TVM_ERRORS:  # TVM cannot count scheduled / opaque functions: FLOPs unknown, bytes exact
        return 0


def _main_calls(mod: tvm.IRModule, items: bool = False) -> list[relax.Call]:
    """Calls in ``main``'s bindings, in program order (``items``: tuple item reads too)."""
    calls: list[relax.Call] = []
    body = mod["main"].body
    for block in body.blocks:
        for binding in block.bindings:
            value = binding.value
            if isinstance(value, relax.Call) or (items and isinstance(value, relax.TupleGetItem)):
                calls.append((binding.var, value))
    return calls


def classify(ops: list[str], kinds: list[int]) -> str:
    """The report's ``pattern`` of a kernel made of ``ops`` (AnnotateTIROpPattern ``kinds``)."""
    # AnnotateTIROpPattern also marks reductions with an epilogue kOutEWiseFusable: names decide GEMMs.
    has_gemm = any(o in GEMM_OPS for o in ops)
    has_reduce = any(o in REDUCTION_OPS for o in ops) or any(
        k in (_K_REDUCE, _K_GEMM) and o not in GEMM_OPS for o, k in zip(ops, kinds))
    if "attention" in ops or (has_gemm and "softmax" in ops):
        return "attention"
    if has_gemm and any(o in ("layer_norm", "rms_norm") or o.endswith("_norm_stats") for o in ops):
        return "norm_gemm"
    if has_gemm:
        return "gemm_epilogue"
    if has_reduce:
        return "norm"
    if kinds and all(0 <= k <= 2 for k in kinds):  # elemwise, broadcast, injective
        return "elementwise"
    return "other"


class _StageCapture:
    """Keeps the modules a report needs from a ``pipeline.lower`` run."""

    wanted = ("fuse_attention", "fuse_ops", "fuse_tir", "finalize")

    def __init__(self) -> None:
        self.mods: dict[str, tvm.IRModule] = {}

    def __call__(self, name: str, mod: tvm.IRModule) -> None:
        if name in self.wanted:
            self.mods[name] = mod


def _unfused(legalized: tvm.IRModule) -> list[KernelInfo]:
    """One kernel per graph operator: every call_tir of the legalised, unfused ``main``."""
    kernels = []
    for var, call in _main_calls(legalized):
        if call.op != tvm.ir.Op.get("relax.call_tir"):
            continue
        gvar = call.args[0]
        op = op_name(gvar.name_hint)
        if op in VIEW_OPS:
            continue
        func = legalized[gvar]
        kind = int(func.attrs["op_pattern"]) if func.attrs and "op_pattern" in func.attrs else -1
        args = call.args[1].fields if isinstance(call.args[1], relax.Tuple) else [call.args[1]]
        nbytes = sum(_tensor_bytes(a.ty) for a in args) + _tensor_bytes(var.ty)
        kernels.append(KernelInfo(gvar.name_hint, classify([op], [kind]), [op], kernel_flops(func), nbytes))
    return kernels


def _legalize_unfused(mod: tvm.IRModule, spec: TargetSpec, dtype: str | None) -> tvm.IRModule:
    """The imported graph legalised op by op, without tvmfuse's fusion passes: the baseline."""
    # BoundedSlices: symbolic lengths only; without it a clamped slice leaves shapes unknown.
    seq = [relax.transform.DecomposeOpsForInference(), relax.transform.CanonicalizeBindings(),
           BoundedSlices()]
    if dtype in ("float16", "bfloat16"):
        seq.append(MixedPrecision(dtype))
    seq += [relax.transform.LegalizeOps(legalize_overrides()), relax.transform.AnnotateTIROpPattern(),
            relax.transform.FoldConstant()]
    with spec.tvm_target():
        return tvm.transform.Sequential(seq)(mod)


def fused_groups(fuse_ops: tvm.IRModule) -> dict[str, tuple[list[str], list[int]]]:
    """Fused kernel name → (ops, op-pattern kinds) of its FuseOps group."""
    groups: dict[str, tuple[list[str], list[int]]] = {}
    for gvar, func in fuse_ops.functions.items():
        if isinstance(func, relax.Function) and func.attrs and "Primitive" in func.attrs:
            ops, kinds = [], []
            for _, call in _main_calls(tvm.IRModule({"main": func})):
                if call.op == tvm.ir.Op.get("relax.call_tir"):
                    callee = fuse_ops[call.args[0]]
                    ops.append(op_name(call.args[0].name_hint))
                    attrs = callee.attrs
                    kinds.append(int(attrs["op_pattern"]) if attrs and "op_pattern" in attrs else -1)
            groups[gvar.name_hint] = (ops, kinds)
    return groups


def _fused(stages: dict[str, tvm.IRModule]) -> list[KernelInfo]:
    """Kernels in launch order from the final module; ops from the FuseOps groups."""
    fuse_ops, fuse_tir, final = stages["fuse_ops"], stages["fuse_tir"], stages["finalize"]
    groups = fused_groups(fuse_ops)
    prim_names = {gv.name_hint for gv, f in final.functions.items() if isinstance(f, tirx.PrimFunc)}
    fuse_ops_fns = {gv.name_hint: f for gv, f in fuse_ops.functions.items()}
    fuse_tir_fns = {gv.name_hint: f for gv, f in fuse_tir.functions.items()}
    kernels = []
    for _, call in _main_calls(final):
        if not isinstance(call.op, tvm.ir.GlobalVar) or call.op.name_hint not in prim_names:
            continue
        name = call.op.name_hint
        attrs = final[name].attrs
        # a generated kernel under a new name (e.g. ``…_gemv``): the ops of the function it replaces
        source = str(attrs[REPLACES_ATTR]) if attrs and REPLACES_ATTR in attrs else name
        # an sm_90a GEMM that also computes its A's row statistics: the GEMM's ops, stats first
        merged = final[name].attrs.get(IN_LOOP_ATTR) if final[name].attrs else None
        if merged is not None:
            gemm, stats = (str(n) for n in merged)
            ops, kinds = groups.get(gemm, ([op_name(gemm)], [-1]))
            ops, kinds = [op_name(stats), *ops], [_K_REDUCE, *kinds]
        elif source in groups:
            ops, kinds = groups[source]
        else:
            callee = fuse_ops_fns.get(name)
            cattrs = callee.attrs if callee is not None else None
            ops = [op_name(name)]
            kinds = [int(cattrs["op_pattern"])] if cattrs and "op_pattern" in cattrs else [-1]
        unscheduled = fuse_tir_fns.get(str(merged[0]) if merged is not None else source) or final[name]
        rule = str(attrs[RULE_ATTR]) if attrs and RULE_ATTR in attrs else None
        kernels.append(KernelInfo(name, "gemv" if rule == "gemv" else classify(ops, kinds), ops,
                                  kernel_flops(unscheduled),
                                  call_bytes(final[name], call),
                                  tuning=str(attrs[TUNING_ATTR]) if attrs and
                                  TUNING_ATTR in attrs else None,
                                  fallback=str(attrs[FALLBACK_ATTR]) if attrs and
                                  FALLBACK_ATTR in attrs else None, rule=rule,
                                  tile=next((str(attrs[a]) for a in (TILE_ATTR, KERNEL_TILE_ATTR)
                                             if attrs and a in attrs), None)))
    return kernels


def _boundary_reason(prod: KernelInfo, cons: KernelInfo) -> str:
    p, c = prod.pattern, cons.pattern
    if p in ("gemm_epilogue", "norm_gemm", "attention") and c == "norm":
        return ("consumer reduces over whole rows of a GEMM output: a row spans several GEMM tiles, "
                "so it needs a cross-block reduction first")
    if prod.rule == "gemm_sm90_producer_stats" and cons.ops[0].endswith("_stats"):
        return ("the producer writes the A operand of a GEMM after a norm, and the row sums of "
                "squares of each of its column tiles, from which that GEMM forms the norm's "
                "statistics (gemm_sm90_producer_stats): GEMM feeding a GEMM, fusing would "
                "recompute the first product for every tile of the second")
    if p in ("gemm_epilogue", "norm_gemm", "attention") and cons.ops[0].endswith("_stats"):
        return ("the producer writes the A operand of a GEMM that computes its row statistics "
                "in-loop (norm → Linear folded in): GEMM feeding a GEMM, fusing would recompute the "
                "first product for every tile of the second")
    if p in ("gemm_epilogue", "norm_gemm", "attention") and c in ("gemm_epilogue", "norm_gemm"):
        return ("GEMM feeding a GEMM: fusing would recompute the first product for every tile of "
                "the second")
    if p == "norm" and c == "gemm_epilogue" and prod.ops[-1].endswith("_stats"):
        return ("row statistics for the GEMM epilogue (norm_gemm applied): they need whole rows of "
                "the GEMM's A operand before the epilogue; only the sm_90a wgmma GEMM (from the A "
                "tiles its main loop loads) and fp32 SIMT GEMMs (per thread block, from a second "
                "read of its rows of A, mostly from L2) compute them in-kernel; the sm80 mma.sync "
                "GEMM does not")
    if p == "norm" and c in ("gemm_epilogue",):
        return ("norm → Linear prologue (norm_gemm) not applied: the normed tensor has other users, "
                "or the weight / norm parameters are not constants, or the norm is not over K")
    if p == "norm" and c == "norm":
        return "a second reduction over a finished reduction's broadcast result needs another pass"
    if p == "elementwise" and c == "attention":
        return ("attention operands computed by injective ops (RoPE, Q/K/V slices, mask) are written "
                "by one kernel (PackAttentionInputs); folding them into the attention kernel's tile "
                "loads is not done yet")
    if p == "elementwise" and c in ("gemm_epilogue", "norm_gemm"):
        return "elementwise/layout producer of a GEMM operand is not folded into the GEMM's loads yet"
    if p in ("gemm_epilogue", "norm_gemm") and c == "elementwise" and any(
            o in LAYOUT_OPS for o in cons.ops):
        return ("consumer moves data across the tile (" + ", ".join(
            sorted({o for o in cons.ops if o in LAYOUT_OPS})) + "): FuseOps only fuses pointwise "
                "consumers into a GEMM, and layout folding into the GEMM's store is not done yet")
    if p == "norm" and c == "elementwise":
        return ("the reduction's output is broadcast back over the reduced axis: FuseOps does not "
                "put a broadcasting consumer after a reduction")
    return f"FuseOps grouping rule: {p} → {c} kept apart"


def _edges(stages: dict[str, tvm.IRModule], kernels: list[KernelInfo]) -> list[dict[str, Any]]:
    """Producer → consumer pairs between kernels, each with the reason they stayed apart."""
    by_name = {k.name: k for k in kernels}
    inside: dict[str, set[str]] = {}  # kernel → the statistics functions computed inside it
    partials: dict[str, str] = {}  # kernel → the statistics function its partial sums replace
    for k in kernels:  # a GEMM that computes its statistics stands for both fused_tir functions
        attrs = stages["finalize"][k.name].attrs
        merged = [str(n) for n in (attrs.get(IN_LOOP_ATTR) or [])] if attrs is not None else []
        for name in merged:
            by_name.setdefault(name, k)
        inside[k.name] = set(merged[1:])
        if attrs is not None and REPLACES_ATTR in attrs:  # a generated kernel's fused function
            by_name.setdefault(str(attrs[REPLACES_ATTR]), k)
        if attrs is not None and PARTIALS_ATTR in attrs:
            partials[k.name] = str(attrs[PARTIALS_ATTR])
    producer_of: dict[Any, KernelInfo] = {}
    found: list[dict[str, Any]] = []
    views = tuple(tvm.ir.Op.get(n) for n in ("relax.memory.view", "relax.memory.ensure_zero_offset"))
    for var, call in _main_calls(stages["fuse_tir"], items=True):
        if isinstance(call, relax.TupleGetItem):  # one output of a multi-output kernel (mean, rstd)
            if call.tuple_value in producer_of:
                producer_of[var] = producer_of[call.tuple_value]
            continue
        if any(call.op.same_as(v) for v in views) and call.args[0] in producer_of:
            producer_of[var] = producer_of[call.args[0]]  # a view of a packed output: same producer
            continue
        if call.op != tvm.ir.Op.get("relax.call_tir"):
            continue
        kernel = by_name.get(call.args[0].name_hint)
        args = call.args[1].fields if isinstance(call.args[1], relax.Tuple) else [call.args[1]]
        first = producer_of.get(args[0]) if args else None
        if first is not None and partials.get(first.name) == call.args[0].name_hint:
            producer_of[var] = first  # statistics its producer wrote as partial sums
            continue
        if kernel is not None:
            for arg in args:
                prod = producer_of.get(arg)
                if prod is not None and prod.name in inside.get(kernel.name, ()):
                    continue  # statistics this kernel computes itself (a kept call's name)
                if prod is not None and prod is not kernel and not any(
                        e["kernels"] == [prod.name, kernel.name] for e in found):
                    attrs = stages["finalize"][prod.name].attrs
                    kept = attrs.get(KEPT_ATTR) if attrs is not None else None
                    found.append({"ops": [prod.ops[-1], kernel.ops[0]],
                                  "kernels": [prod.name, kernel.name],
                                  "reason": _boundary_reason(prod, kernel) + (
                                      f" (kept because {kept})" if kept else "")})
            producer_of[var] = kernel
        else:  # a view (reshape) between kernels: pass the producer through
            for arg in args:
                if arg in producer_of:
                    producer_of[var] = producer_of[arg]
    return found


def _attention_left(mod: tvm.IRModule | None) -> list[dict[str, Any]]:
    """Attention subgraphs FuseAttention left as separate ops, with its reason."""
    return [{"ops": ["matmul", "softmax", "matmul"], "kernels": [d["binding"]],
             "reason": f"attention not fused into one op: {d['reason']}"}
            for d in (attention_decisions(mod) if mod is not None else []) if d["status"] == "left"]


def stock_kernel_count(mod: tvm.IRModule, spec: TargetSpec) -> int | None:
    """Kernel launches of the same graph under TVM's stock default pipeline.

    Stock stages in stock order, with one change: 0.27's broken ``full(-inf)`` legalisation is
    replaced by the fixed one, without which the stock pipeline fails on every causal mask. The
    stock dlight scheduling step is left out: it changes no launch count.
    """
    stock = stock_cuda.pipeline if spec.is_cuda else stock_cpu.pipeline
    target = spec.tvm_target()
    legalize = [relax.transform.LegalizeOps(legalize_overrides()), relax.transform.AnnotateTIROpPattern(),
                relax.transform.FoldConstant(), relax.transform.FuseOps(), relax.transform.FuseTIR()]
    try:
        with target:
            lowered = tvm.transform.Sequential(
                stock.library_dispatch_passes(target) + legalize
                + stock.dataflow_lower_passes(target) + stock.finalize_passes(target))(mod)
    except TVM_ERRORS:  # the stock pipeline refuses the graph: report "unknown" rather than guess
        return None
    prims = {gv.name_hint for gv, f in lowered.functions.items() if isinstance(f, tirx.PrimFunc)}
    return sum(1 for _, c in _main_calls(lowered)
               if isinstance(c.op, tvm.ir.GlobalVar) and c.op.name_hint in prims)


def analyze(mod: tvm.IRModule, spec: TargetSpec, dtype: str | None = None,
            tuning_db: str | None = None, stock: bool = True,
            sizes: dict[str, int] | None = None, weights: str = "embedded") -> dict[str, Any]:
    """Lower ``mod`` for ``spec`` and return the report object (DESIGN.md schema).

    ``stock=False`` skips the stock-TVM launch count (a second lowering): ``None`` in the report.
    A model with symbolic dims is lowered as it is (the kernels the library runs); bytes and FLOPs
    are counted at ``sizes`` (default: each symbol's upper bound), reported as ``sizes``.
    ``weights``: as ``tvmfuse.compile``'s (lowered with the weights as parameters or constants).
    """
    bounds = (mod["main"].attrs or {}).get("tir_var_upper_bound", {})
    sizes = {str(k): int(v) for k, v in dict(bounds).items()} | dict(sizes or {})
    _SIZES.clear()
    _SIZES.update(sizes)
    try:
        result = _analyze(mod, spec, dtype, tuning_db, stock and not sizes, weights)
    finally:
        _SIZES.clear()
    return result | ({"sizes": sizes} if sizes else {})


def _float_dtypes(mod: tvm.IRModule) -> set[str]:
    """The float dtypes of ``main``'s tensor parameters."""
    return {str(p.ty.dtype) for p in mod["main"].params
            if isinstance(p.ty, relax.TensorType) and str(p.ty.dtype).startswith(("float", "bfloat"))}


def _stock_count(mod: tvm.IRModule, spec: TargetSpec, dtype: str | None) -> int | None:
    """Stock TVM's launches for the graph as ``dtype`` asks: the graph itself when it already is
    in that dtype (or no dtype is asked), TVM's own ``ToMixedPrecision`` first for an fp32 graph
    compiled as fp16 (what a stock user would run); None where stock TVM has no such conversion."""
    floats = _float_dtypes(mod)
    if dtype is None or floats <= {dtype}:
        return stock_kernel_count(mod, spec)
    if dtype == "float16" and floats <= {"float32"}:
        try:
            mixed = relax.transform.ToMixedPrecision(out_dtype="float32")(mod)
        except TVM_ERRORS:
            return None
        return stock_kernel_count(mixed, spec)
    return None


def _analyze(mod: tvm.IRModule, spec: TargetSpec, dtype: str | None, tuning_db: str | None,
             stock: bool, weights: str) -> dict[str, Any]:
    capture = _StageCapture()
    lower(mod, spec, dtype, on_stage=capture, tuning_db=tuning_db, weights=weights)
    unfused = _unfused(_legalize_unfused(mod, spec, dtype))
    fused = _fused(capture.mods)
    return {
        "target": spec.name,
        "unfused_kernel_count": len(unfused),
        "stock_tvm_kernel_count": _stock_count(mod, spec, dtype) if stock else None,
        "fused_kernel_count": len(fused),
        "hbm_bytes_unfused": sum(k.bytes for k in unfused),
        "hbm_bytes_fused": sum(k.bytes for k in fused),
        "flops": sum(k.flops for k in fused),
        "kernels": [k.to_json() for k in fused],
        "not_fused": _edges(capture.mods, fused) + _attention_left(capture.mods.get("fuse_attention")),
        "ceilings": _ceilings(spec),
    }


def _ceilings(spec: TargetSpec) -> dict[str, Any]:
    """Roofline ceilings of the target's device (``device_props``; cpu: the default GPU's)."""
    device = device_properties(spec) if spec.is_cuda else DEVICES[DEFAULT_DEVICE]
    return {"device": device.name, "bandwidth_Bps": device.bandwidth,
            "fp16_flops": device.fp16_flops, "source": device.source}


def format_table(report: dict[str, Any]) -> str:
    """Human-readable report: one line per kernel, then the totals and the boundaries."""
    stock = report.get("stock_tvm_kernel_count")
    lines = [f"target {report['target']}: {report['fused_kernel_count']} kernels "
             f"(unfused graph: {report['unfused_kernel_count']}, stock TVM pipeline: "
             f"{stock if stock is not None else 'n/a'})", ""]
    bw, peak = report["ceilings"]["bandwidth_Bps"], report["ceilings"]["fp16_flops"]
    lines.append(f"{'#':>3} {'pattern':<14} {'MB':>9} {'GFLOP':>9} {'floor us':>9}  {'rule':<16} ops")
    for i, k in enumerate(report["kernels"]):
        floor = max(k["bytes"] / bw, k["flops"] / peak) * 1e6
        ops = ",".join(k["ops"])
        tuned = "  [tuned]" if k.get("tuning") == "tuned" else ""
        lines.append(f"{i:>3} {k['pattern']:<14} {k['bytes'] / 1e6:>9.3f} {k['flops'] / 1e9:>9.3f} "
                     f"{floor:>9.2f}  {k.get('rule') or '-':<16} {ops[:70]}{tuned}")
    uf, f = report["hbm_bytes_unfused"], report["hbm_bytes_fused"]
    lines += ["", f"HBM bytes unfused {uf / 1e6:.3f} MB → fused {f / 1e6:.3f} MB "
                  f"({uf / max(f, 1):.2f}x less); memory floor {f / bw * 1e6:.1f} us "
                  f"at {bw / 1e12:.2f} TB/s, {report['ceilings']['device']} "
                  f"(unfused {uf / bw * 1e6:.1f} us)"]
    fallbacks = [(i, k) for i, k in enumerate(report["kernels"]) if k.get("fallback")]
    if fallbacks:
        lines += ["", "fallbacks (a rule or kernel generator left the kernel; why):"]
        lines += [f"  #{i} {k['name']}: {k['fallback']}" for i, k in fallbacks]
    if report["not_fused"]:
        lines += ["", "kept apart:"]
        for nf in report["not_fused"]:
            lines.append(f"  {nf['ops'][0]} → {nf['ops'][1]}: {nf['reason']}")
    return "\n".join(lines)


def plot_roofline(report: dict[str, Any], path: str, times_ms: dict[str, float] | None = None) -> None:
    """Roofline PNG: each kernel at its arithmetic intensity; measured TFLOP/s when times given."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ceilings = report["ceilings"]
    bw, peak = ceilings["bandwidth_Bps"], ceilings["fp16_flops"]
    fig, ax = plt.subplots(figsize=(9, 6), dpi=120)
    xs = [10 ** (e / 10) for e in range(-50, 41)]
    ax.plot(xs, [min(peak, x * bw) / 1e12 for x in xs], color="black", lw=2,
            label=f"{ceilings['device']} roof: {bw / 1e12:.2f} TB/s, {peak / 1e12:.0f} TFLOP/s fp16")
    colors = {"elementwise": "tab:blue", "norm": "tab:green", "gemm_epilogue": "tab:red",
              "norm_gemm": "tab:purple", "attention": "tab:orange", "other": "tab:gray"}
    seen = set()
    for k in report["kernels"]:
        if k["bytes"] == 0:
            continue
        ai = max(k["flops"], 1) / k["bytes"]
        measured = (times_ms or {}).get(k["name"])
        if measured:
            y, marker = k["flops"] / (measured * 1e-3) / 1e12, "o"
        else:  # no measurement: place at the attainable bound, hollow marker
            y, marker = min(peak, ai * bw) / 1e12, "o"
        label = k["pattern"] if k["pattern"] not in seen else None
        seen.add(k["pattern"])
        ax.scatter([ai], [y], s=60, marker=marker, label=label,
                   facecolors=colors[k["pattern"]] if measured else "none",
                   edgecolors=colors[k["pattern"]])
        ax.annotate(str(report["kernels"].index(k)), (ai, y), textcoords="offset points",
                    xytext=(4, 4), fontsize=7)
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("arithmetic intensity (FLOP / byte of HBM traffic)")
    ax.set_ylabel("TFLOP/s")
    title = (f"{report['target']}: {report['fused_kernel_count']} kernels, "
             f"{report['hbm_bytes_fused'] / 1e6:.1f} MB fused vs "
             f"{report['hbm_bytes_unfused'] / 1e6:.1f} MB unfused")
    ax.set_title(title + ("" if times_ms else "\n(hollow: attainable bound, no measured time)"))
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(loc="lower right")
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
