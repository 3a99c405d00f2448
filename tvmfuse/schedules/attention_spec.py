"""The attention problem: the contract between the attention rewrite and the kernel generators.

The rewrite (``tvmfuse.passes.attention``) turns an attention subgraph into ``R.nn.attention``;
its legalisation reads an :class:`AttentionSpec` off the call, asks
:func:`.attention.attention_primfunc` for a kernel and emits ``R.call_tir`` to it. Layout is
TVM's ``R.nn.attention`` layout::

    q    (B, Sq,  Hq,  D)        k, v (B, Skv, Hkv, D)        Hq % Hkv == 0 (GQA / MQA)
    bias (B|1, Hq|1, Sq|1, Skv)  additive, optional (padding masks arrive as (B, 1, 1, Skv))
    out  (B, Sq,  Hq,  D)
    out[b, i, h] = Σ_j softmax_j(scale · q[b, i, h]·k[b, j, h // (Hq/Hkv)] + bias[..] + causal(i, j))
                   · v[b, j, h // (Hq/Hkv)]

``causal``: ``"none"``, ``"TopLeft"`` (key j visible to query i iff j ≤ i) or ``"BottomRight"``
(iff j ≤ i + Skv − Sq; the KV-cache alignment). Both are the same when Sq == Skv.

Fully masked rows: a query row whose every score is −inf (it sees no key: BottomRight with
Sq > Skv, or a −inf bias on every visible key) yields ``out = 0``, not NaN, in every
implementation (cpu, flash sm80 / sm90a, split-KV decode, the CUDA-core fallback and the
kernel-less decomposition of ``tvmfuse.passes.attention_lower``). That is what torch's
``_safe_softmax`` (``where(all(S == −inf), 0, softmax(S))``) computes, so the attention rewrite
drops that guard on the strength of this rule; a new kernel must keep it.

Every kernel takes its buffers in the order ``q, k, v, [bias,] out``.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass

CAUSAL_KINDS = ("none", "TopLeft", "BottomRight")


@dataclass(frozen=True)
class AttentionSpec:
    """Static description of one attention call (all shapes static)."""

    batch: int
    q_len: int
    kv_len: int
    q_heads: int
    kv_heads: int
    head_dim: int
    dtype: str  # q/k/v dtype: float16 | bfloat16 | float32
    scale: float
    causal: str = "none"  # one of CAUSAL_KINDS
    bias_shape: tuple[int, int, int, int] | None = None  # (B|1, Hq|1, Sq|1, Skv) or None
    bias_dtype: str | None = None
    out_dtype: str | None = None  # defaults to dtype

    def __post_init__(self) -> None:
        if self.causal not in CAUSAL_KINDS:
            raise ValueError(f"causal must be one of {CAUSAL_KINDS}, not {self.causal!r}")
        if self.q_heads % self.kv_heads:
            raise ValueError(f"q_heads {self.q_heads} is not a multiple of kv_heads {self.kv_heads}")

    @property
    def group(self) -> int:
        """Query heads per KV head (1 = MHA, Hq = MQA)."""
        return self.q_heads // self.kv_heads

    @property
    def result_dtype(self) -> str:
        return self.out_dtype or self.dtype


def spec_json(spec: AttentionSpec) -> str:
    """Canonical JSON of a spec (a flash kernel's ``tvmfuse.attention_spec`` attribute)."""
    return json.dumps(dataclasses.asdict(spec), sort_keys=True)


def spec_from_json(text: str) -> AttentionSpec:
    """The spec :func:`spec_json` wrote."""
    fields = json.loads(text)
    if fields.get("bias_shape") is not None:
        fields["bias_shape"] = tuple(fields["bias_shape"])
    return AttentionSpec(**fields)
