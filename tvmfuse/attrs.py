"""Names of the PrimFunc attributes tvmfuse writes and reads: one vocabulary for every layer.

Rules and generators write them, the pipeline, ``tvmfuse report`` and ``tvmfuse tune`` read them.
Defined here, in the base layer, so a reader needs no import of the writer (and no import cycle).
Also the one extension tvmfuse makes to a Relax attribute: the soft cap carried in
``R.nn.attention``'s ``causal_mask`` (:func:`causal_attr`).
"""

# which tvmfuse rule scheduled the function (elementwise, row_norm, gemm_sm80, gemm_sm90, ...)
RULE_ATTR = "tvmfuse.rule"
# why a GEMM-like / attention function kept the default (slower) path
FALLBACK_ATTR = "tvmfuse.fallback"
# the tile a scheduled SIMT / sm80 GEMM got (its GemmConfig tag)
TILE_ATTR = "tvmfuse.gemm_tile"
# the tile and pipeline depth of a generated sm_90a kernel (GEMM or attention), for the report
KERNEL_TILE_ATTR = "tvmfuse.tile"
# lower this PrimFunc with TVM's tirx pipeline (the generated sm_90a kernels)
TIRX_ATTR = "tvmfuse.tirx"
# "tuned" or "default: <reason>": what the tuning database did for this kernel
TUNING_ATTR = "tvmfuse.tuning"
# JSON of the config a tuned sm_90a GEMM is generated with (set by ApplyTuningDatabase)
CONFIG_ATTR = "tvmfuse.kernel_config"
# JSON of the AttentionSpec a flash-attention kernel computes
SPEC_ATTR = "tvmfuse.attention_spec"
# the FLOPs of a generated kernel whose loops TVM's estimate cannot count (attention kernels)
FLOPS_ATTR = "tvmfuse.flops"
# JSON {"spec": AttentionSpec, "config": DecodeConfig} of compile_lm's split-KV decode attention
# over a cache (rules/fold_decode_append.py rebuilds it with the append inside)
CACHE_ATTENTION_ATTR = "tvmfuse.cache_attention"
# on a GEMM PrimFunc merged with its norm statistics: "layer" (mean, rstd) or "rms" (rstd)
SIMT_ATTR = "tvmfuse.simt_row_stats"
# on a statistics PrimFunc that still runs: why it was not moved into the GEMM
KEPT_ATTR = "tvmfuse.stats_kept"
# on a GEMM kernel computing statistics: [the GEMM PrimFunc it replaces, the statistics PrimFunc]
IN_LOOP_ATTR = "tvmfuse.in_loop_stats"
# on a generated kernel that replaces a fused PrimFunc under a new name: the fused PrimFunc's name
REPLACES_ATTR = "tvmfuse.replaces"
# on a GEMM kernel that also writes row partial sums of squares (gemm_sm90_producer_stats): the
# statistics PrimFunc they replace
PARTIALS_ATTR = "tvmfuse.row_partials"
# on a GEMM PrimFunc merged with the injective kernel reading its output (passes/fold_gemm_tail.py):
# the name of that kernel's fused function; kernels/gemm/tail.py reads its stores
GATHER_TAIL_ATTR = "tvmfuse.gather_tail"
# Relax function (compile_lm's entry points, DeriveKVCache): the names of its parameters that no
# kernel of the call writes (ids, positions, offsets, starts): loads of them may go before a
# programmatic-launch wait (rules/gemv_append.py)
STEP_INPUTS_ATTR = "tvmfuse.step_inputs"


_SOFTCAP = ";softcap="


def causal_attr(causal: str, softcap: float | None = None) -> str | None:
    """``R.nn.attention``'s ``causal_mask`` attribute for the causal kind and soft cap (None for
    plain non-causal attention, as TVM spells it)."""
    if softcap is None:
        return None if causal == "none" else causal
    return f"{causal}{_SOFTCAP}{float(softcap)!r}"


def parse_causal_attr(attr) -> tuple[str, float | None]:
    """``(causal kind, softcap or None)`` of a ``causal_mask`` attribute :func:`causal_attr` wrote
    (or TVM's own: None, "TopLeft", "BottomRight")."""
    text = "none" if attr is None else str(attr)
    causal, _, cap = text.partition(_SOFTCAP)
    return causal, float(cap) if cap else None
