"""Canonicalisation: exporter spellings → one form, before any pattern pass. One rewrite per file."""

from .batched_matmul import CanonicalizeBatchedMatmul

__all__ = ["CanonicalizeBatchedMatmul"]
