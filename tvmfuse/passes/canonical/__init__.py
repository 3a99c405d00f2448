"""Canonicalisation: exporter spellings → one form, before any pattern pass runs.

torch.export and the ONNX exporters write the same computation differently (a Linear on 3-D
input, fp16 matmuls, ``.float()`` upcasts, repeated casts). Each rewrite below is a named module
pass in its own file; :func:`Canonicalize` runs them in the order of :data:`PASSES` (pipeline stage
``canonicalize_spellings``), so the pattern passes after it match one spelling per computation.
"""

from __future__ import annotations

import tvm

from .batched_matmul import CanonicalizeBatchedMatmul
from .bounded_slices import BoundedSlices
from .constant_gather_nd import ConstantGatherND
from .constant_index_tensor import ConstantIndexTensor
from .empty_pieces import EmptyPieces
from .fold_leading_dims import FoldMatmulLeadingDims
from .half_accumulate import HalfMatmulAccumulate
from .lift_folded_batch import LiftFoldedBatch
from .matmul_ranks import MatmulRanks
from .negative_indices import NegativeIndices
from .share_casts import ShareCasts
from .stacked_extrema import StackedExtrema
from .tuple_output import TupleOutput
from .upcast_matmul import UpcastMatmul
from .view_chain import CollapseViewChains

# In order; a line's comment says why it sits where it does.
PASSES = [
    NegativeIndices,  # constant negative take / index_tensor indices count from the end
    ConstantGatherND,  # constant-index gather_nd (ONNX GatherND of index grids) → a view or a take
    ConstantIndexTensor,  # index_tensor on arange grids (torch's mask[batch_idx, kv_idx]) likewise
    EmptyPieces,  # zero-size split pieces / concat operands: nothing may fuse a loop of extent 0
    StackedExtrema,  # ONNX Max / Min imported as max(stack(...)): one elementwise op, as torch's
    BoundedSlices,  # symbolic lengths: a slice the ranges prove in bounds keeps exact shapes
    CollapseViewChains,  # einsum's 5-D expand_dims/permute views around a bmm → one permute + reshape
    MatmulRanks,  # a 3-D operand beside a 4-D one (dynamo ONNX at batch 1) gets its unit axis
    CanonicalizeBatchedMatmul,  # torch.export's N-D `@` (reshape → 3-D matmul → reshape) is one product
    LiftFoldedBatch,  # heads-folded (B·H, S, ·) products (baddbmm/bmm) get their (B, H) axes back
    ShareCasts,  # one astype per (value, dtype): the passes below compare operands by identity
    HalfMatmulAccumulate,  # every GEMM names its fp32 accumulator before the two below read it
    UpcastMatmul,  # needs out_dtype=float32 (above); folds casts before the GEMM is reshaped
    FoldMatmulLeadingDims,  # folds the final matmul and its cast / bias epilogue
    TupleOutput,  # after the fold: a reshape it leaves before the output must stay a view
]


def Canonicalize() -> tvm.transform.Pass:  # noqa: N802 - pass constructors are CamelCase
    """The canonicalisation passes of :data:`PASSES` as one ``Sequential``."""
    return tvm.transform.Sequential([p() for p in PASSES], name="tvmfuse.Canonicalize")


__all__ = ["PASSES", "BoundedSlices", "Canonicalize", "CanonicalizeBatchedMatmul", "CollapseViewChains",
           "ConstantGatherND", "ConstantIndexTensor", "EmptyPieces", "FoldMatmulLeadingDims",
           "HalfMatmulAccumulate", "LiftFoldedBatch", "MatmulRanks", "NegativeIndices", "ShareCasts",
           "StackedExtrema", "TupleOutput", "UpcastMatmul"]
