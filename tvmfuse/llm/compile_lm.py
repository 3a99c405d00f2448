"""``tvmfuse.compile_lm``: a cache-less causal LM → a library with prefill/decode entry points.

    import (symbolic B, S) → PositionTables → per entry point: shapes bound (B = max_batch,
    S = prefill length | 1), canonical passes + FuseAttention, DeriveKVCache, LastTokenLogits →
    the tvmfuse pipeline (all entry points in one module) → relax.build

Entry points (``Bm`` = max_batch, caches ``(Bm, Hkv, max_seq, D)`` per layer, written in place)::

    prefill{S}(ids (Bm, S), positions (Bm, S), offsets (Bm,), starts (Bm,), k_cache_0, v_cache_0, ...)
    decode(ids (Bm, 1), positions (Bm, 1), offsets, starts, caches...)        → logits (Bm, V)
    advance(logits, ids, positions, offsets, history (Bm, max_seq + 1))   greedy step in place

each followed by the same weights ``w_0 … w_{k-1}`` (``LiftWeights``: equal folded constants of
the entry points are one parameter), which ``export`` writes to ``<name>.safetensors``.

The passes after import are static-shape (FuseAttention proves masks causal by evaluating them),
so the symbolic import is specialised per prefill length; a prompt is left-padded to the next one.
"""

from __future__ import annotations

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
from ..passes import FuseDecomposedNorms, SimplifyNoOps
from ..passes.attention import FuseAttention
from ..passes.canonical import Canonicalize
from ..passes.lift_weights import take_weights
from ..pipeline import build, lower
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


def _entry(sym: relax.Function, name: str, batch: int, seq: int, max_seq: int, cuda: bool) -> tvm.IRModule:
    ids = sym.params[0]
    b, s = ids.ty.shape.values
    func = bind_shapes(sym, {str(b): batch, str(s): seq}).with_attr("global_symbol", name)
    mod = tvm.IRModule({name: func})
    stages = [
        relax.transform.DecomposeOpsForInference(), relax.transform.CanonicalizeBindings(),
        SimplifyNoOps(), Canonicalize(), FuseDecomposedNorms(),
        FuseAttention(),  # proves each mask causal: the cache rewrite below relies on it
        DeriveKVCache(max_seq, cuda), LastTokenLogits(), relax.transform.DeadCodeElimination(),
    ]
    for stage in stages:
        mod = stage(mod)
    return mod


@dataclass
class LMLibrary:
    """A compiled LM: ``export(path)`` writes the ``.so`` and ``<name>.safetensors``; ``load()``
    runs it in-process."""

    executable: Any
    target: TargetSpec
    metadata: dict[str, Any]
    # (name, tensor) in the order every entry point takes them after its caches
    weights: list[tuple[str, Any]] = field(default_factory=list)

    def export(self, path: str | os.PathLike) -> Path:
        """Write the ``.so`` and its weights, ``<name>.safetensors`` beside it (always external:
        one copy shared by every entry point)."""
        return export_library(self.executable, path, self.target, self.metadata, weights=self.weights)

    def load(self, device: str | None = None):
        path = self.export(Path(tempfile.mkdtemp(prefix="tvmfuse-lm-")) / "lm.so")
        return load(path, device or ("cuda" if self.target.is_cuda else "cpu"))


def compile_lm(model: Any, *, target: str = "sm90", max_seq_len: int = 2048, max_batch: int = 1,
               prefill_lengths: list[int] | None = None, dtype: str | None = None) -> LMLibrary:
    """Compile a cache-less causal LM (nn.Module, .pt2, .onnx or ``package.module:factory``
    returning ``(module, example_inputs)``; ``ids → logits``) for generation.

    ``prefill_lengths``: the prompt lengths compiled (a prompt is left-padded to the next one;
    default :func:`default_prefill_lengths`). ``dtype``: as in :func:`tvmfuse.compile`.
    """
    spec = get_target(target)
    if max_seq_len < 2 or max_batch < 1:
        raise InputSpecError(f"max_seq_len must be >= 2 and max_batch >= 1, got {max_seq_len}, "
                             f"{max_batch}")
    lengths = sorted(set(prefill_lengths or default_prefill_lengths(max_seq_len)))
    if lengths[0] < 2 or lengths[-1] > max_seq_len:
        raise InputSpecError(f"prefill lengths {lengths} must lie in 2..max_seq_len={max_seq_len}")
    if isinstance(model, str) and _is_factory(model):
        model, _ = load_factory(model)
    sym = PositionTables(max_seq_len)(import_lm(model, max_seq_len, max_batch))["main"]
    combined = tvm.IRModule()
    entries = {f"prefill{n}": n for n in lengths} | {"decode": 1}
    for name, seq in entries.items():
        for gv, func in _entry(sym, name, max_batch, seq, max_seq_len, spec.is_cuda).functions.items():
            combined[gv] = func
    decode = combined["decode"]
    caches = [{"shape": [int(d) for d in p.ty.shape.values], "dtype": str(p.ty.dtype)}
              for p in decode.params[4:]]
    vocab = int(decode.ret_ty.shape.values[1])
    # greedy steps on the device: decode + advance on the same tensors, capturable as a CUDA graph
    logits_dtype = dtype if dtype in ("float16", "bfloat16") else str(decode.ret_ty.dtype)
    for gv, func in advance_module(max_batch, vocab, max_seq_len + 1, logits_dtype,
                                   spec.is_cuda).functions.items():
        combined[gv] = func
    # weights external: the entry points fold the same weights (transposes, fused QKV), LiftWeights
    # makes equal constants one parameter, so the file holds each weight once for all of them
    lowered = lower(combined, spec, dtype if dtype != "float32" else None, weights="external")
    lowered, weights = take_weights(lowered)
    executable = build(lowered, spec)
    if not caches:
        raise CompileError("compile_lm: no KV cache was derived")
    metadata = {
        "format": LM_FORMAT, "target": spec.name, "sass": [real for _, real in spec.gencode],
        "dtype": dtype, "max_seq_len": max_seq_len, "max_batch": max_batch,
        "prefill_lengths": lengths, "vocab": vocab, "caches": caches, "device_greedy": True,
        "inputs": [{"name": "input_ids", "shape": [max_batch, "S"], "dtype": "int64"}], "outputs": [],
        "versions": {"tvmfuse": __version__},
    }
    return LMLibrary(executable, spec, metadata, weights)
