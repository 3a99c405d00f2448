"""LLM inference: a KV cache derived from a cache-less causal LM, prefill/decode entry points.

``compile_lm`` (:mod:`.compile_lm`) runs the passes of this folder (one per file: positions,
kv_cache, last_token) around the tvmfuse pipeline; generation at run time lives in
:mod:`tvmfuse.runtime.lm` (runtime-only TVM).
"""

from .compile_lm import LMLibrary, compile_lm, default_prefill_lengths

__all__ = ["LMLibrary", "compile_lm", "default_prefill_lengths"]
