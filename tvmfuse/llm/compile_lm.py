"""``tvmfuse.compile_lm``: a cache-less causal LM → a library with prefill/decode entry points.

    import (symbolic B, S) → PositionTables → per entry point: shapes bound (B = max_batch,
    S = prefill length | 1), canonical passes + FuseAttention, DeriveKVCache, LastTokenLogits →
    the tvmfuse pipeline (all entry points in one module) → relax.build

Entry points (``Bm`` = max_batch; one cache per layer, ``(Bm, 2·Hkv·max_seq + Hq, D)``: its keys,
values and the decode step's query (:mod:`tvmfuse.llm.kernels`), written in place; on CUDA then
the decode attention's counters ``attn_sync``)::

    prefill{S}(ids (Bm, S), positions (Bm, S), last (Bm,), offsets (Bm,), starts (Bm,),
               cache_0, cache_1, ...)            → logits (Bm, V) at each row's last real token
    decode(ids (Bm, 1), positions (Bm, 1), offsets, starts, caches...)        → logits (Bm, V)
    advance(logits, ids, positions, offsets, history (Bm, max_seq + 1))   greedy step in place

each followed by the same weights ``w_0 … w_{k-1}`` (``LiftWeights``: equal folded constants of
the entry points are one parameter), which ``export`` writes to ``<name>.safetensors``.

The passes after import are static-shape (FuseAttention proves masks causal by evaluating them),
so the symbolic import is specialised per prefill length; a prompt is right-padded to the next one
(``last`` says where each row's real tokens end).
"""

from __future__ import annotations

import dataclasses
import os
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import tvm
from tvm import relax

from ..build import export_library
from ..errors import CompileError, InputSpecError
from ..frontend.torch_import import load_factory
from ..options import Options, current_options, use_options
from ..passes import FuseDecomposedNorms, SimplifyNoOps
from ..passes.attention import FuseAttention
from ..passes.canonical import Canonicalize
from ..passes.lift_weights import take_weights
from ..pipeline import build, lower
from ..rules.programmatic_launch import active as pdl_active
from ..rules.programmatic_launch import scope as pdl_scope
from ..rules.programmatic_launch import supported as sm90_cuda
from ..runtime import load
from ..runtime.lm import LM_FORMAT
from ..targets import TargetSpec, get_target
from ..version import __version__
from ._graph import bind_shapes
from .greedy import advance_module
from .import_lm import import_lm
from .kv_cache import DeriveKVCache
from .last_token import LastTokenLogits
from .positions import PositionTables
from .tensor_parallel import ShardTensorParallel


def _is_factory(spec: str) -> bool:
    """``package.module:factory`` (not a file path)."""
    return ":" in spec and not os.path.exists(spec) and not spec.endswith((".onnx", ".pt2"))


def default_prefill_lengths(max_seq: int) -> list[int]:
    """Powers of 4 from 16 below ``max_seq``, and ``max_seq``."""
    lengths, n = [], 16
    while n < max_seq:
        lengths.append(n)
        n *= 4
    return lengths + [max_seq]


def _entry(sym: relax.Function, name: str, batch: int, seq: int, max_seq: int, cuda: bool,
           tp: tuple[int, int] = (1, 0), pdl: bool = False, windows: list | None = None,
           clusters: bool = False) -> tvm.IRModule:
    """One entry point's module with its cache. ``windows``: shared by the entry points (prefill
    first): each layer's sliding window as a prefill traced it (DeriveKVCache)."""
    ids = sym.params[0]
    b, s = ids.ty.shape.values
    func = bind_shapes(sym, {str(b): batch, str(s): seq}).with_attr("global_symbol", name)
    mod = tvm.IRModule({name: func})
    stages = [
        relax.transform.DecomposeOpsForInference(), relax.transform.CanonicalizeBindings(),
        SimplifyNoOps(), Canonicalize(), FuseDecomposedNorms(),
        FuseAttention(),  # proves each mask causal: the cache rewrite below relies on it
        # before the shard: the LM head's all-gather then moves the last position's logits only
        LastTokenLogits(),
        # before the cache: its kernels take the rank's head counts
        ShardTensorParallel(*tp),
        DeriveKVCache(max_seq, cuda, pdl, windows, clusters), relax.transform.DeadCodeElimination(),
    ]
    for stage in stages:
        mod = stage(mod)
    return mod


@dataclass
class LMLibrary:
    """A compiled LM: ``export(path)`` writes the ``.so`` and ``<name>.safetensors`` (tensor-parallel:
    ``<name>.rank<i>.safetensors``); ``load()`` runs it (in-process, or N worker processes)."""

    executable: Any
    target: TargetSpec
    metadata: dict[str, Any]
    # (name, tensor) in the order every entry point takes them after its caches
    weights: list[tuple[str, Any]] = field(default_factory=list)
    # tensor_parallel > 1: each rank's weights (same names, shapes and order), instead of weights
    shards: list[list[tuple[str, Any]]] = field(default_factory=list)

    def export(self, path: str | os.PathLike) -> Path:
        """Write the ``.so`` and its weights beside it (always external: one copy shared by every
        entry point)."""
        return export_library(self.executable, path, self.target, self.metadata,
                              weights=self.weights or None, shards=self.shards or None)

    def load(self, device: str | None = None, **kwargs: Any):
        path = self.export(Path(tempfile.mkdtemp(prefix="tvmfuse-lm-")) / "lm.so")
        return load(path, device or ("cuda" if self.target.is_cuda else "cpu"), **kwargs)


def _lower_rank(sym: relax.Function, entries: dict[str, int], max_batch: int, max_seq: int,
                spec: TargetSpec, dtype: str | None, tp: tuple[int, int]):
    """Every entry point of rank ``tp[1]`` of ``tp[0]``: (decode before lowering, lowered module,
    weights)."""
    combined = tvm.IRModule()
    # the decode kernels launch programmatically (PDL): its attention may prefetch before waiting
    pdl = pdl_active(spec.tvm_target())
    windows: list = []  # the sliding windows the longest prefill shows, for the decode step
    for name, seq in sorted(entries.items(), key=lambda e: (e[1] == 1, -e[1])):
        for gv, func in _entry(sym, name, max_batch, seq, max_seq, spec.is_cuda, tp,
                               pdl, windows, sm90_cuda(spec.tvm_target())).functions.items():
            combined[gv] = func
    # greedy steps on the device: decode + advance on the same tensors, capturable as a CUDA graph
    decode = combined["decode"]
    logits_dtype = dtype if dtype in ("float16", "bfloat16") else str(decode.ret_ty.dtype)
    for gv, func in advance_module(max_batch, int(decode.ret_ty.shape.values[1]), max_seq + 1,
                                   logits_dtype, spec.is_cuda, pdl).functions.items():
        combined[gv] = func
    # weights external: the entry points fold the same weights (transposes, fused QKV), LiftWeights
    # makes equal constants one parameter, so the file holds each weight once for all of them
    lowered = lower(combined, spec, dtype if dtype != "float32" else None, weights="external")
    return (combined["decode"], *take_weights(lowered))


def _same_layout(shards: list[list[tuple[str, Any]]]) -> None:
    """Every rank's weights line up with rank 0's (the one executable takes them all)."""
    def layout(weights):
        return [(name, tuple(t.shape), str(t.dtype)) for name, t in weights]

    for rank, weights in enumerate(shards[1:], 1):
        if layout(weights) != layout(shards[0]):
            raise CompileError(f"compile_lm: rank {rank}'s weights {layout(weights)[:4]}... differ in "
                               f"layout from rank 0's {layout(shards[0])[:4]}...: the shards do not "
                               "share one library")


def _launch_options(opts: Options, max_batch: int) -> Options | None:
    """The options to compile with: programmatic launch of the decode step off above
    ``Options.programmatic_launch_max_batch`` sequences (measured slower there); TVM's CUDA-graph
    rewrite off (the runtime captures the decode step in a torch CUDA graph itself, and a capture
    cannot begin inside another); None: as they are."""
    changes: dict[str, object] = {}
    if pdl_scope(opts.programmatic_launch) == "decode" and max_batch > opts.programmatic_launch_max_batch:
        changes["programmatic_launch"] = "off"
    if opts.cuda_graph:
        changes["cuda_graph"] = False
    return dataclasses.replace(opts, **changes) if changes else None


def compile_lm(model: Any, *, target: str = "sm90", max_seq_len: int = 2048, max_batch: int = 1,
               prefill_lengths: list[int] | None = None, dtype: str | None = None,
               tensor_parallel: int = 1) -> LMLibrary:
    """Compile a cache-less causal LM (nn.Module, .pt2, .onnx or ``package.module:factory``
    returning ``(module, example_inputs)``; ``ids → logits``) for generation.

    ``prefill_lengths``: the prompt lengths compiled (a prompt is left-padded to the next one;
    default :func:`default_prefill_lengths`). ``dtype``: as in :func:`tvmfuse.compile`.
    ``tensor_parallel``: N ranks, Megatron-style (:mod:`tvmfuse.llm.tensor_parallel`): one
    rank-agnostic library and each rank's weights; ``load`` starts one process per rank.
    """
    spec = get_target(target)
    if max_seq_len < 2 or max_batch < 1:
        raise InputSpecError(f"max_seq_len must be >= 2 and max_batch >= 1, got {max_seq_len}, "
                             f"{max_batch}")
    if tensor_parallel < 1:
        raise InputSpecError(f"tensor_parallel must be >= 1, got {tensor_parallel}")
    lengths = sorted(set(prefill_lengths or default_prefill_lengths(max_seq_len)))
    if lengths[0] < 2 or lengths[-1] > max_seq_len:
        raise InputSpecError(f"prefill lengths {lengths} must lie in 2..max_seq_len={max_seq_len}")
    if isinstance(model, str) and _is_factory(model):
        model, _ = load_factory(model)
    sym = PositionTables(max_seq_len)(import_lm(model, max_seq_len, max_batch))["main"]
    entries = {f"prefill{n}": n for n in lengths} | {"decode": 1}
    with use_options(_launch_options(current_options(), max_batch)):
        # one lowering per rank: the weights are folded (transposed, fused, cast) per rank; the
        # functions are the same for every rank, so rank 0's module is the one built
        ranks = [_lower_rank(sym, entries, max_batch, max_seq_len, spec, dtype,
                             (tensor_parallel, r)) for r in range(tensor_parallel)]
        _same_layout([w for _, _, w in ranks])
        decode, lowered, weights = ranks[0]
        # the KV caches, then (CUDA) the decode kernels' counters, which start at zero
        caches = [{"shape": [int(d) for d in p.ty.shape.values], "dtype": str(p.ty.dtype)}
                  | ({"init": "zeros"} if str(p.name) == "attn_sync" else {})
                  for p in decode.params[4:]]
        if not caches:
            raise CompileError("compile_lm: no KV cache was derived")
        vocab = int(decode.ret_ty.shape.values[1])
        executable = build(lowered, spec)
    metadata = {
        "format": LM_FORMAT, "target": spec.name, "sass": [real for _, real in spec.gencode],
        "dtype": dtype, "max_seq_len": max_seq_len, "max_batch": max_batch,
        "prefill_lengths": lengths, "vocab": vocab, "caches": caches, "device_greedy": True,
        "tensor_parallel": tensor_parallel,
        "inputs": [{"name": "input_ids", "shape": [max_batch, "S"], "dtype": "int64"}], "outputs": [],
        "versions": {"tvmfuse": __version__},
    }
    if tensor_parallel == 1:
        return LMLibrary(executable, spec, metadata, weights)
    return LMLibrary(executable, spec, metadata, shards=[w for _, _, w in ranks])
