"""sm_90a GEMM + epilogue: fused GEMM PrimFuncs become TIRx kernels (TMA, mbarriers, wgmma).

``Sm90Gemm`` is a module pass that runs before the dlight rules (``pipeline.lower`` stage
``gemm_sm90``), for targets with arch ``sm_90a`` only. For every PrimFunc that
:func:`.hopper.epilogue.analyze` reads as ``out[i, j] = f(Σ_k A[i, k]·B[·,·], params)`` it
generates the warp-specialised kernel of :mod:`.hopper.kernel` with ``f`` applied to the
accumulators in registers, keeping the function's signature, and tags it

* ``tirx.is_scheduled`` (dlight leaves it alone), ``tvmfuse.rule = "gemm_sm90"``,
* ``tvmfuse.tirx`` (the build lowers it with TVM's ``tirx`` pipeline, see :func:`hybrid_pipeline`).

A GEMM-like function the kernel cannot take (batched B, prologue on A, K not a multiple of 8, …)
keeps its s_tir body for the sm80 / dlight rules and gets ``tvmfuse.fallback = <reason>``.

Build: one TIR pipeline runs per ``relax.build``; :data:`HYBRID_PIPELINE` (registered on import)
sends ``tvmfuse.tirx`` functions through ``tirx`` and everything else through ``s_tir`` (both
share the same host/device finalisation passes).
"""

from __future__ import annotations

import tvm
from tvm import tirx

from .elementwise import RULE_ATTR
from .hopper.epilogue import NotHandled, analyze, expr_text, top_blocks
from .hopper.kernel import GemmConfig, GemmProblem, check, kernel_text

NAME = "gemm_sm90"
TIRX_ATTR = "tvmfuse.tirx"  # lower this PrimFunc with the tirx pipeline
FALLBACK_ATTR = "tvmfuse.fallback"  # why a GEMM-like PrimFunc kept the default path
HYBRID_PIPELINE = "tvmfuse_hybrid"


def _is_sm90a(target) -> bool:
    return target is not None and target.kind.name == "cuda" and str(
        target.attrs.get("arch", "")) == "sm_90a"


def _looks_like_gemm(func: tirx.PrimFunc) -> bool:
    """A function with a top-level reduction block of the form ``C = C + x * y`` (GEMM-like)."""
    try:
        _, blocks = top_blocks(func)
    except Exception:  # not block-structured: not ours
        return False
    for block, _ in blocks:
        body = block.body
        if any(iv.iter_type == tirx.IterVar.CommReduce for iv in block.iter_vars) and \
                isinstance(body, tirx.BufferStore) and isinstance(body.value, tirx.Add) and \
                isinstance(body.value.b, tirx.Mul):
            return True
    return False


def select_config(m: int, n: int) -> GemmConfig:
    """Tile for an (M, N) output: 128×256 for large outputs, 128×128 when N is small."""
    if n <= 128:
        return GemmConfig(bn=128, stages=6)
    return GemmConfig()


def build_kernel(func: tirx.PrimFunc, cfg: GemmConfig | None = None) -> tirx.PrimFunc:
    """The TIRx kernel replacing ``func``; raises :class:`NotHandled` with the reason."""
    from tvm.script import tirx as T
    from tvm.script.parser.core.entry import parse

    g = analyze(func)
    problem = GemmProblem(g.m, g.n, g.k, g.in_dtype, g.out_dtype, g.layout)
    cfg = cfg or select_config(g.m, g.n)
    reason = check(problem, cfg)
    if reason:
        raise NotHandled(reason)
    params = list(func.params)
    names = [f"p{i}" for i in range(len(params))]
    decls = [(nm, tuple(int(d) for d in b.shape), str(b.dtype)) for nm, b in zip(names, params)]

    def store_value(acc: str, row: str, col: str) -> str:
        return expr_text(g.expr, [(g.acc, acc), (g.dims[0], row), (g.dims[1], col)],
                         list(zip(params, names)))

    text = kernel_text(problem, cfg, "main", names, g.a, g.b, g.out, decls, store_value)
    try:
        kernel = parse(text, extra_vars={"T": T})
    except Exception as err:  # parser diagnostics: report as not handled, keep the default
        raise NotHandled(f"generated kernel does not parse: {str(err)[-300:]}") from err
    attrs = {"tirx.is_scheduled": True, RULE_ATTR: NAME, TIRX_ATTR: True,
             "tvmfuse.tile": f"{cfg.bm}x{cfg.bn}x64 stages={cfg.stages}"}
    return kernel.without_attr("global_symbol").with_attrs(attrs)


@tvm.transform.module_pass(opt_level=0, name="Sm90Gemm")
def Sm90Gemm(mod: tvm.IRModule, _ctx) -> tvm.IRModule:  # noqa: N802 - pass names are CamelCase
    """Replace fused GEMM PrimFuncs by TIRx wgmma kernels when the current target is sm_90a."""
    target = tvm.target.Target.current(allow_none=True)
    if not _is_sm90a(target):
        return mod
    updates = {}
    for gv, func in mod.functions_items():
        if not isinstance(func, tirx.PrimFunc) or func.attrs.get("tirx.is_scheduled"):
            continue
        if not _looks_like_gemm(func):
            continue
        try:
            updates[gv] = build_kernel(func)
        except NotHandled as why:
            updates[gv] = func.with_attr(FALLBACK_ATTR, f"{NAME}: {why}")
    for gv, func in updates.items():
        mod[gv] = func
    return mod


def uses_tirx(mod: tvm.IRModule) -> bool:
    """True when some PrimFunc of ``mod`` must be lowered by the tirx pipeline."""
    return any(isinstance(f, tirx.PrimFunc) and f.attrs.get(TIRX_ATTR)
               for _, f in mod.functions_items())


def hybrid_pipeline():
    """TIR pipeline factory: ``tvmfuse.tirx`` functions through tirx, the rest through s_tir."""
    s_tir_pass, finalize_host, finalize_device = tirx.get_tir_pipeline("s_tir")
    tirx_pass, _, _ = tirx.get_tir_pipeline("tirx")

    @tvm.transform.module_pass(opt_level=0, name="TvmfuseHybridTIR")
    def _pipeline(mod: tvm.IRModule, _ctx) -> tvm.IRModule:
        mine = {gv: f for gv, f in mod.functions_items()
                if isinstance(f, tirx.PrimFunc) and f.attrs.get(TIRX_ATTR)}
        if not mine:
            return s_tir_pass(mod)
        rest = {gv: f for gv, f in mod.functions_items() if gv not in mine}
        out = s_tir_pass(tvm.IRModule(rest, attrs=mod.attrs)) if rest else \
            tvm.IRModule({}, attrs=mod.attrs)
        lowered = tirx_pass(tvm.IRModule(mine, attrs=mod.attrs))
        out.update(lowered)
        return out

    return _pipeline, finalize_host, finalize_device


tirx.register_tir_pipeline(HYBRID_PIPELINE, hybrid_pipeline)
