"""Canonicalisation: exporter spellings → one form, before any pattern pass. One rewrite per file."""

from .batched_matmul import CanonicalizeBatchedMatmul
from .lift_folded_batch import LiftFoldedBatch
from .view_chain import CollapseViewChains

__all__ = ["CanonicalizeBatchedMatmul", "CollapseViewChains", "LiftFoldedBatch"]
