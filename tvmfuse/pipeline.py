"""The tvmfuse compilation pipeline: imported Relax → scheduled, lowered IRModule.

One linear function; every stage is named and, with ``TVMFUSE_DUMP_IR=DIR``, the IR after each
stage is written to ``DIR/NN_name.py``. Both :func:`lower` and :func:`build` run inside the
caller's :class:`~tvmfuse.options.Options` (``options=``, else the ones in effect) and register
tvmfuse's TVM patches first (``build/tvm_setup.py``).
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Callable
from pathlib import Path

import tvm
from tvm import relax

from .errors import CompileError, TvmfuseError
from .locate import locate
from .options import Options, current_options, use_options
from .passes import (
    FuseDecomposedNorms,
    GatherRowStats,
    HorizontalGemm,
    InjectiveGather,
    MixedPrecision,
    NormGemmPrologue,
    PackAttentionInputs,
    RemoveRedundantReshapes,
    SimplifyNoOps,
    SinkReshape,
)
from .passes.attention import FuseAttention
from .passes.attention_layout import FoldAttentionLayout
from .passes.canonical import Canonicalize
from .passes.cast_before_slices import CastBeforeSlices
from .passes.duplicate_gathers import DuplicateGathers
from .passes.fold_weight_transposes import FoldWeightTransposes
from .passes.legalize_fixes import legalize_overrides
from .passes.lift_weights import LiftWeights, lift_threshold
from .passes.norm_input_copies import NormInputCopies
from .passes.order_symbolic_defs import OrderSymbolicDefs
from .passes.pair_gemm import PairGemm
from .passes.permute_rows import PermuteRowsThroughGemm
from .passes.unit_k_matmul import UnitKMatmul
from .passes.unwrap_output import UnwrapSingleOutput
from .rules import gpu_rules
from .rules.fallback import ApplyRules
from .rules.fold_decode_append import FoldDecodeAppend
from .rules.fold_gemm_tail import FoldGemmTail
from .rules.gemm_row_stats_simt import SimtGemmRowStats
from .rules.gemm_sm90 import HYBRID_PIPELINE, Sm90Gemm, uses_tirx
from .rules.gemm_sm90_producer_stats import Sm90ProducerRowStats
from .rules.gemm_sm90_stats import Sm90GemmRowStats
from .rules.gemv import SmallMGemm
from .rules.programmatic_launch import active as pdl_active
from .rules.programmatic_launch import mark_programmatic_launch
from .targets import TargetSpec
from .tuning_db import ApplyTuningDatabase
from .tvm_setup import S_TIR_PIPELINE, codegen_scope, register_tvm_patches


def _with_cuda_graph(inner: tvm.transform.Pass) -> tvm.transform.Pass:
    """``inner`` run with TVM's ``relax.backend.use_cuda_graph`` on (RewriteCUDAGraph reads it
    from the PassContext), only there: the constant folding above builds llvm VMs that lack the
    CUDA-graph builtins."""

    @tvm.transform.module_pass(opt_level=0, name="tvmfuse.WithCUDAGraph")
    def run(mod: tvm.IRModule, ctx: tvm.transform.PassContext) -> tvm.IRModule:
        config = {str(k): v for k, v in ctx.config.items()}
        config["relax.backend.use_cuda_graph"] = True
        with tvm.transform.PassContext(opt_level=ctx.opt_level, config=config):
            return inner(mod)

    return run


class _Stages:
    """Runs named stages in order, dumping IR after each when ``TVMFUSE_DUMP_IR`` is set and
    printing each stage's seconds and the process's resident memory after it to stderr when
    ``TVMFUSE_TIME_STAGES`` is."""

    def __init__(self, on_stage: Callable[[str, tvm.IRModule], None] | None = None) -> None:
        self.on_stage = on_stage
        dump = os.environ.get("TVMFUSE_DUMP_IR")
        self.dump_dir = Path(dump) if dump else None
        self.count = 0
        self.timed = os.environ.get("TVMFUSE_TIME_STAGES", "") not in ("", "0")
        if self.dump_dir:
            self.dump_dir.mkdir(parents=True, exist_ok=True)

    def __call__(self, name: str, pass_: tvm.transform.Pass, mod: tvm.IRModule) -> tvm.IRModule:
        start = time.perf_counter()
        try:
            mod = pass_(mod)
        except TvmfuseError:
            raise
        except Exception as err:  # TVM raises RuntimeError, ValueError, TVMError subclasses
            raise _stage_error(name, pass_, mod, err) from err
        self.count += 1
        if self.timed:
            print(f"tvmfuse: stage {name} {time.perf_counter() - start:.2f} s, rss {_rss_gb():.2f} GB",
                  file=sys.stderr, flush=True)
        if self.on_stage:
            self.on_stage(name, mod)
        if self.dump_dir:
            (self.dump_dir / f"{self.count:02d}_{name}.py").write_text(mod.script(show_meta=False))
        return mod


def _rss_gb() -> float:
    """The process's resident memory now (Linux ``/proc``), else its peak (``getrusage``), GB."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 1e9
    except OSError:
        import resource

        scale = 1 if sys.platform == "darwin" else 1024  # bytes on macOS, KiB elsewhere
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * scale / 1e9


_DETAIL_LINES = 12


def _stage_error(name: str, pass_: tvm.transform.Pass, mod: tvm.IRModule, err: Exception) -> CompileError:
    """A failed stage as a CompileError naming the function, binding and op it failed on (rerun on
    reduced copies of its input, :mod:`tvmfuse.locate`); TVM's own text is only the detail."""
    where = locate(pass_, mod, err)
    lines = [line.rstrip() for line in str(err).strip().splitlines() if line.strip()]
    detail = "\n    ".join(lines[:_DETAIL_LINES] + (["..."] if len(lines) > _DETAIL_LINES else []))
    if where is None:
        return CompileError(stage=name, detail=detail or type(err).__name__)
    return CompileError(stage=name, function=where.function, binding=where.binding or None,
                        op=where.op, expr=where.expr or None, detail=detail or type(err).__name__,
                        index=where.index)


def lower(mod: tvm.IRModule, spec: TargetSpec, dtype: str | None = None,
          on_stage: Callable[[str, tvm.IRModule], None] | None = None,
          tuning_db: str | os.PathLike | None = None,
          options: Options | None = None, weights: str = "embedded") -> tvm.IRModule:
    """Run every tvmfuse stage on ``mod`` for ``spec``; the result goes to ``relax.build``.

    ``on_stage(name, mod)`` sees the module after each named stage (the report uses it).
    ``tuning_db``: a ``tvmfuse tune`` database; kernels with a faster tuned record use it.
    ``options``: the passes' and rules' switches (None: the ones in effect).
    ``weights``: "external" makes the weights trailing parameters of ``main`` (``num_input`` and
    ``params`` attributes; :func:`tvmfuse.passes.lift_weights.take_weights` takes them out),
    "auto" does so from ``AUTO_EXTERNAL_BYTES`` of weights on, "embedded" keeps them constants.
    """
    min_weight_bytes = lift_threshold(weights)
    target = spec.tvm_target()
    run = _Stages(on_stage)
    register_tvm_patches()  # rules below check their schedules with TVM's (patched) passes
    with target, use_options(options):
        # Normalise exporter output first so every pattern below sees one canonical form.
        mod = run("decompose", relax.transform.DecomposeOpsForInference(), mod)
        mod = run("canonicalize", relax.transform.CanonicalizeBindings(), mod)
        # Exporters' no-op casts and x*1 would hide the patterns below and add kernel boundaries.
        mod = run("simplify_noops", SimplifyNoOps(), mod)
        # One spelling per computation (both frontends) before the first pattern pass; after the
        # no-op casts are gone, so the cast rewrites see only real conversions.
        mod = run("canonicalize_spellings", Canonicalize(), mod)
        # Spelled-out norms/softmax become single ops before anything else can split them.
        mod = run("fuse_decomposed_norms", FuseDecomposedNorms(), mod)
        # Attention is matched on R.nn.softmax (made just above), before anything moves Q/K/V's views.
        mod = run("fuse_attention", FuseAttention(), mod)
        # Batch/sequence swaps around Linears (nn.MultiheadAttention) move through them into the
        # attention's operand views or cancel with its result's; before the norm folds below.
        mod = run("permute_rows", PermuteRowsThroughGemm(), mod)
        # Linears on one input (Q/K/V) become one wide GEMM before the norm folds into it.
        mod = run("horizontal_gemm", HorizontalGemm(), mod)
        # A norm feeding Linear(s) becomes row stats + GEMM epilogue: the normed tensor stays on chip.
        mod = run("norm_gemm_prologue", NormGemmPrologue(), mod)
        # Reshapes between a GEMM and its epilogue move below it, so FuseOps fuses the epilogue.
        mod = run("sink_reshape", SinkReshape(), mod)
        # reshape(reshape(x)) and no-op reshapes that sinking leaves behind collapse to one view.
        mod = run("remove_redundant_reshape", RemoveRedundantReshapes(), mod)
        # Precision changes op dtypes, so it runs before anything matches on dtype-specific ops.
        if dtype in ("float16", "bfloat16"):
            mod = run("mixed_precision", MixedPrecision(dtype), mod)
        # Stats of gathered embedding rows = gathered stats of the table (needs NormGemmPrologue's
        # stats calls; after mixed precision, which may have made the table half: then it stays).
        mod = run("gather_row_stats", GatherRowStats(), mod)
        # Gate/up Linears meeting elementwise (SwiGLU) → one interleaved GEMM + pair epilogue, grouped
        # for FuseTIR; after mixed precision (its dtypes are final), before LegalizeOps.
        mod = run("pair_gemm", PairGemm(), mod)
        # Attention on (B, H, S, D) tensors: the kernel reads q/k/v and writes its result in that
        # layout, so no transpose kernels; after the operand rewrites, before the pack below.
        mod = run("fold_attention_layout", FoldAttentionLayout(), mod)
        # Attention operands made by injective ops (RoPE, QKV slices, masks): one kernel writes them
        # all; after every pass that rewrites those operands, before ops become TIR.
        mod = run("pack_attention_inputs", PackAttentionInputs(), mod)
        # The packed calls' results, read back permuted ((B, H, S, D), sequence first): written in
        # that layout by the kernel; after the pack, whose views leave nothing to pack.
        mod = run("fold_attention_output", FoldAttentionLayout(), mod)
        # Casts of a GEMM's slices (fused QKV) become one cast in its epilogue: the GEMM writes
        # fp16, not fp32; after the passes that match on those slices, before ops become TIR.
        mod = run("cast_before_slices", CastBeforeSlices, mod)
        # K = 1 products → broadcast multiplies (no one-element reduction for the GPU rules to
        # mis-inline); after every pattern pass, which may still take them as matmuls.
        mod = run("unit_k_matmul", UnitKMatmul(), mod)
        # Library dispatch (sort/scan/sampling) must replace ops before they are legalised.
        mod = run("dispatch", tvm.transform.Sequential(
            [relax.backend.DispatchSampling(), relax.backend.DispatchSortScan()]), mod)
        # Weight transposes the patterns left (o/down projections) become constants here, in torch,
        # once per weight: FoldConstant below would run each through an llvm kernel on one core.
        mod = run("fold_weight_transposes", FoldWeightTransposes(), mod)
        # Ops become TIR; FuseOps groups them by TIR op pattern, FuseTIR merges each group.
        mod = run("legalize", relax.transform.LegalizeOps(legalize_overrides()), mod)
        mod = run("annotate_patterns", relax.transform.AnnotateTIROpPattern(), mod)
        # Gathers read data-dependent indices, so the line above calls them opaque; they are injective.
        mod = run("annotate_gathers", InjectiveGather(), mod)
        # A gather read by several elementwise kernels (RoPE's cos/sin, every layer) is copied per
        # reader, so FuseOps fuses each copy instead of launching the gather alone.
        mod = run("duplicate_gathers", DuplicateGathers(), mod)
        # A norm of a slice (Qwen3's q / k norms of the QKV GEMM's output) takes the slice into
        # its kernel: FuseOps would leave the slice a copy kernel of its own.
        mod = run("norm_input_copies", NormInputCopies(), mod)
        mod = run("fold_constants", relax.transform.FoldConstant(), mod)
        mod = run("fuse_ops", relax.transform.FuseOps(), mod)
        # FuseOps may call a group before the match_cast defining a data-dependent dim it uses.
        mod = run("order_symbolic_defs", OrderSymbolicDefs(), mod)
        mod = run("fuse_tir", relax.transform.FuseTIR(), mod)
        # Pure-reshape kernels become views; must run before scheduling hides the reshape pattern.
        mod = run("reshape_to_view", relax.transform.RewriteDataflowReshape(), mod)
        # Tuned records (tvmfuse tune extracts its tasks just above) go first: the rules below
        # skip kernels marked scheduled and take every kernel without a faster record.
        if tuning_db is not None:
            mod = run("apply_tuning_db", ApplyTuningDatabase(tuning_db, spec), mod)
        # GPU kernels need thread bindings: rules are tried in order per fused PrimFunc.
        if spec.is_cuda:
            # compile_lm decode (Options.decode_fold_append, off): the append's elementwise body
            # moves into the split-KV attention kernel; needs the append as one unscheduled PrimFunc.
            mod = run("fold_decode_append", FoldDecodeAppend(), mod)
            # sm_90a: a GEMM and the injective kernel that alone reads its output (RoPE and the
            # Q, K, V pack) become one PrimFunc; before the GEMM passes, which build its kernel.
            mod = run("fold_gemm_tail", FoldGemmTail, mod)
            # sm_80+: small-M GEMMs (decode) become weight-streaming kernels (their norm statistics
            # inside, constant weights passed (N, K)); before the wgmma passes below see them.
            mod = run("gemv", SmallMGemm, mod)
            # sm_90a only: RMSNorm statistics of a wgmma GEMM's output become partial sums in that
            # GEMM's epilogue (no main-loop cost, unlike the in-loop statistics below: first).
            mod = run("gemm_sm90_producer_stats", Sm90ProducerRowStats, mod)
            # sm_90a only: a norm's row statistics move into the wgmma GEMMs that read them.
            mod = run("gemm_sm90_row_stats", Sm90GemmRowStats, mod)
            # fp32 GEMMs (SIMT): the row statistics merge into them; after the wgmma ones took theirs.
            mod = run("gemm_row_stats_simt", SimtGemmRowStats, mod)
            # sm_90a only: fused GEMMs become TIRx wgmma kernels, tagged so dlight skips them.
            mod = run("gemm_sm90", Sm90Gemm, mod)
            # An exception in a rule propagates (TVMFUSE_STRICT) or is recorded (schedules/fallback.py).
            mod = run("schedule", ApplyRules(*gpu_rules()), mod)
            # sm_90+: the decode step's kernels (Options.programmatic_launch) may launch while their
            # predecessor ends and wait for it inside (PDL); after scheduling: every PrimFunc is a
            # kernel.
            if pdl_active(target):
                mod = run("programmatic_launch",
                          mark_programmatic_launch(current_options().programmatic_launch), mod)
        # One-output models return the tensor, not a 1-tuple: less host work on every call
        # (after the views are made: a reshape feeding the unwrapped output stays a view).
        mod = run("unwrap_single_output", UnwrapSingleOutput(), mod)
        # Weights outside the library: the constants every fold above left (fused layouts) become
        # parameters past num_input, before the VM lowering (which checks only the inputs' shapes;
        # tvmfuse.load checks the weights once against the metadata).
        if min_weight_bytes is not None:
            mod = run("lift_weights", LiftWeights(min_weight_bytes), mod)
        # From here on it is TVM's VM lowering: dataflow removal, memory planning, shapes.
        mod = run("dataflow_lower", tvm.transform.Sequential([
            relax.transform.ToNonDataflow(),
            relax.transform.RemovePurityChecking(),
            relax.transform.CallTIRRewrite(),
        ]), mod)
        finalize = [relax.transform.StaticPlanBlockMemory()]
        if spec.is_cuda and current_options().cuda_graph:
            finalize.append(_with_cuda_graph(relax.transform.RewriteCUDAGraph()))
        finalize += [
            relax.transform.LowerAllocTensor(),
            relax.transform.KillAfterLastUse(),
            relax.transform.LowerRuntimeBuiltin(),
            relax.transform.ComputePrimValue(),
            relax.transform.VMShapeLower(),
            relax.transform.AttachGlobalSymbol(),
        ]
        mod = run("finalize", tvm.transform.Sequential(finalize), mod)
    return mod


def build(mod: tvm.IRModule, spec: TargetSpec, options: Options | None = None):
    """Codegen: ``relax.build`` of a lowered module (CUDA kept as source; export compiles it)."""
    # TIRx kernels (sm90 GEMM) need the tirx TIR pipeline; the hybrid one also runs s_tir.
    tir_pipeline = HYBRID_PIPELINE if uses_tirx(mod) else S_TIR_PIPELINE
    try:
        # Same behaviour with or without a GPU driver: CUDA stays source here; export runs nvcc.
        # gemm_sm80's cp.async pipelines need TIR build options (codegen_scope sets BUILD_CONFIG).
        with codegen_scope(options):
            return relax.build(mod, target=spec.tvm_target(), relax_pipeline=None,
                               tir_pipeline=tir_pipeline)
    except Exception as err:  # TVM raises RuntimeError, ValueError, TVMError subclasses
        raise CompileError(f"codegen for target {spec.name} failed: {err}") from err
