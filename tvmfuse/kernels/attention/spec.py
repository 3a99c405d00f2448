"""The attention problem: the contract between the attention rewrite and the kernel generators.

The rewrite (``tvmfuse.passes.attention``) turns an attention subgraph into ``R.nn.attention``;
its legalisation reads an :class:`AttentionSpec` off the call, asks
:func:`.attention.attention_primfunc` for a kernel and emits ``R.call_tir`` to it. Layout is
TVM's ``R.nn.attention`` layout::

    q    (B, Sq,  Hq,  D)        k (B, Skv, Hkv, D)   v (B, Skv, Hkv, Dv)   Hq % Hkv == 0 (GQA / MQA)
    bias (B|1, Hq|1, Sq|1, Skv)  additive, optional (padding masks arrive as (B, 1, 1, Skv))
    out  (B, Sq,  Hq,  Dv)
    out[b, i, h] = Σ_j softmax_j(scale · q[b, i, h]·k[b, j, h // (Hq/Hkv)] + bias[..] + causal(i, j))
                   · v[b, j, h // (Hq/Hkv)]

``Dv`` (``v_head_dim``; None means ``D``) differs from ``D`` in multi-head latent attention
(DeepSeek-V2/V3, MiniCPM3: q·k over 192 = 128 + 64 RoPE dims, values of 128).

``causal``: ``"none"``, ``"TopLeft"`` (key j visible to query i iff j ≤ i) or ``"BottomRight"``
(iff j ≤ i + Skv − Sq; the KV-cache alignment). Both are the same when Sq == Skv.

``window`` (sliding-window attention, ``R.nn.attention``'s ``window_size``; needs a causal kind):
key j is visible to query i iff ``i + off − window < j ≤ i + off`` (``off`` the causal offset
above), each query sees its last ``window`` keys up to its diagonal. That is FlashAttention's
``window_size_left = window − 1, window_size_right = 0`` which TVM's CUTLASS codegen passes for
the attribute, and ``topi.testing.attention_python``'s ``triu(·, 1 − window)`` when Sq == Skv.
Kernels skip the KV tiles wholly outside the band (:func:`band_tiles`).

``softcap`` (logit soft-capping, Gemma-2's ``attn_logit_softcapping``, FlashAttention's
``softcap``): the scores pass through ``c · tanh(S / c)`` before the bias and the causal mask::

    S = c · tanh(scale · q·k / c) + bias[..] + causal(i, j)

``R.nn.attention`` has no attribute for it, so tvmfuse carries it in the ``causal_mask`` string
(:func:`tvmfuse.attrs.causal_attr` / :func:`tvmfuse.attrs.parse_causal_attr`:
``"TopLeft;softcap=50.0"``); only tvmfuse's
legalisation reads that attribute (TVM's stock rule would reject the string, never run it wrongly).

Fully masked rows: a query row whose every score is −inf (it sees no key: BottomRight with
Sq > Skv, or a −inf bias on every visible key) yields ``out = 0``, not NaN, in every
implementation (cpu, flash sm80 / sm90a, split-KV decode, the CUDA-core fallback and the
kernel-less decomposition of ``tvmfuse.passes.attention_lower``). That is what torch's
``_safe_softmax`` (``where(all(S == −inf), 0, softmax(S))``) computes, so the attention rewrite
drops that guard on the strength of this rule; a new kernel must keep it.

Every kernel takes its buffers in the order ``q, k, v, [bias,] out``.

Memory layout: ``qkv_layout`` / ``out_layout`` say how q, k, v and out lie in memory, "BSHD"
(the layout above), "BHSD" (torch's ``(B, H, S, D)``: the buffer is ``(B, H, S, D)`` and the
kernel reads element (b, s, h, d) of the formula at ``[b, h, s, d]``, :func:`at`) or "SBHD"
(sequence first, ``[s, b, h, d]``: what torch's ``nn.MultiheadAttention`` with ``batch_first=False``
reads back). So a graph that transposes (B, H, S, D) tensors into ``R.nn.attention`` and its result
back, or a sequence-first module's result, needs no transpose kernel
(``tvmfuse.passes.attention_layout``). Every kernel indexes through :func:`at`, so every kernel
honours every layout.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass

from tvm import tirx

CAUSAL_KINDS = ("none", "TopLeft", "BottomRight")
LAYOUTS = ("BSHD", "BHSD", "SBHD")


def at(layout: str, b, s, h, d) -> tuple:
    """Buffer indices of element (batch b, position s, head h, dim d) in ``layout``; also the
    buffer shape when given the extents (B, S, H, D)."""
    if layout == "BSHD":
        return (b, s, h, d)
    return (b, h, s, d) if layout == "BHSD" else (s, b, h, d)


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
    qkv_layout: str = "BSHD"  # memory layout of q, k and v: one of LAYOUTS
    out_layout: str = "BSHD"  # memory layout of out
    window: int | None = None  # sliding window: each query sees its last ``window`` keys
    softcap: float | None = None  # S = softcap · tanh(scale · q·k / softcap) before bias and mask
    v_head_dim: int | None = None  # Dv of v and out where it differs from head_dim (MLA); None: D

    def __post_init__(self) -> None:
        if self.softcap is not None and not self.softcap > 0:
            raise ValueError(f"softcap must be positive, not {self.softcap}")
        if self.causal not in CAUSAL_KINDS:
            raise ValueError(f"causal must be one of {CAUSAL_KINDS}, not {self.causal!r}")
        if self.window is not None and (self.causal == "none" or self.window < 1):
            raise ValueError(f"window {self.window} needs a causal kind and window >= 1 "
                             f"(causal is {self.causal!r})")
        for name in ("qkv_layout", "out_layout"):
            if getattr(self, name) not in LAYOUTS:
                raise ValueError(f"{name} must be one of {LAYOUTS}, not {getattr(self, name)!r}")
        if self.v_head_dim is not None and self.v_head_dim < 1:
            raise ValueError(f"v_head_dim must be positive, not {self.v_head_dim}")
        if self.q_heads % self.kv_heads:
            raise ValueError(f"q_heads {self.q_heads} is not a multiple of kv_heads {self.kv_heads}")

    @property
    def value_dim(self) -> int:
        """``Dv``: the head dim of v and out (``head_dim`` unless ``v_head_dim`` says otherwise)."""
        return self.v_head_dim if self.v_head_dim is not None else self.head_dim

    @property
    def value_dim_differs(self) -> str | None:
        """The reason a kernel with one head dim for q, k and v declines this spec, or None."""
        if self.value_dim == self.head_dim:
            return None
        return f"value head dim {self.value_dim} differs from the query/key head dim {self.head_dim}"

    @property
    def flops(self) -> int:
        """``2·B·Hq·(D + Dv)·(visible (query, key) pairs)``: Q·Kᵀ and P·V (:func:`visible_pairs`)."""
        pairs = visible_pairs(self.q_len, self.kv_len, self.causal, self.window)
        return 2 * self.batch * self.q_heads * (self.head_dim + self.value_dim) * pairs

    @property
    def score_unit(self) -> float:
        """``u`` with scores ``S = u · t``, where ``t`` is what a kernel keeps of the product: the
        raw ``q·k`` (``u = scale``) or, soft-capped, ``tanh(scale · q·k / softcap)``
        (``u = softcap``). A kernel scales by ``u · log2 e`` inside the exp2 and adds a bias as
        ``bias / u``, whichever ``t`` it holds."""
        return self.softcap if self.softcap is not None else self.scale

    @property
    def tanh_scale(self) -> float | None:
        """The factor inside the soft cap's tanh, ``scale / softcap`` (None without a cap): a
        kernel keeps ``t = tanh(tanh_scale · q·k)`` and scales it by :attr:`score_unit`."""
        return None if self.softcap is None else self.scale / self.softcap

    @property
    def group(self) -> int:
        """Query heads per KV head (1 = MHA, Hq = MQA)."""
        return self.q_heads // self.kv_heads

    @property
    def result_dtype(self) -> str:
        return self.out_dtype or self.dtype

    @property
    def q_shape(self) -> tuple[int, int, int, int]:
        """Shape of the q buffer (in ``qkv_layout``)."""
        return at(self.qkv_layout, self.batch, self.q_len, self.q_heads, self.head_dim)

    @property
    def kv_shape(self) -> tuple[int, int, int, int]:
        """Shape of the k buffer, and of v where ``Dv == D`` (in ``qkv_layout``)."""
        return at(self.qkv_layout, self.batch, self.kv_len, self.kv_heads, self.head_dim)

    @property
    def v_shape(self) -> tuple[int, int, int, int]:
        """Shape of the v buffer (in ``qkv_layout``): :attr:`kv_shape` with ``Dv``."""
        return at(self.qkv_layout, self.batch, self.kv_len, self.kv_heads, self.value_dim)

    @property
    def out_shape(self) -> tuple[int, int, int, int]:
        """Shape of the out buffer (in ``out_layout``)."""
        return at(self.out_layout, self.batch, self.q_len, self.q_heads, self.value_dim)


def visible_pairs(q_len: int, kv_len: int, causal: str = "none", window: int | None = None) -> int:
    """(query, key) pairs the causal kind and window leave: query i sees keys j ≤ i + shift
    (shift = Skv − Sq for BottomRight, 0 for TopLeft) and j > i + shift − window."""
    if causal == "none":
        return q_len * kv_len
    shift = kv_len - q_len if causal == "BottomRight" else 0
    pairs = 0
    for i in range(q_len):
        hi = min(kv_len, max(0, i + shift + 1))
        lo = max(0, i + shift + 1 - window) if window else 0
        pairs += max(0, hi - lo)
    return pairs


def spec_json(spec: AttentionSpec) -> str:
    """Canonical JSON of a spec (a flash kernel's ``tvmfuse.attention_spec`` attribute)."""
    fields = dataclasses.asdict(spec)
    for name in ("qkv_layout", "out_layout"):  # the default is left out: older records stay valid
        if fields[name] == "BSHD":
            del fields[name]
    for name in ("window", "softcap", "v_head_dim"):  # left out when unset, as above
        if fields[name] is None:
            del fields[name]
    return json.dumps(fields, sort_keys=True)


def spec_from_json(text: str) -> AttentionSpec:
    """The spec :func:`spec_json` wrote."""
    fields = json.loads(text)
    if fields.get("bias_shape") is not None:
        fields["bias_shape"] = tuple(fields["bias_shape"])
    return AttentionSpec(**fields)


def causal_offset(spec: AttentionSpec) -> int | None:
    """Key j is visible to query i iff ``j <= i + offset``; None when not causal."""
    if spec.causal == "none":
        return None
    return 0 if spec.causal == "TopLeft" else spec.kv_len - spec.q_len


def masked(spec: AttentionSpec, row, col):
    """TIR condition: key ``col`` is hidden from query ``row``: past Skv, (causal) right of the
    diagonal, (window) left of the band."""
    conds = [col >= spec.kv_len]
    off = causal_offset(spec)
    if off is not None:
        conds.append(col > row + off)
        if spec.window is not None:
            conds.append(col <= row + off - spec.window)
    return tirx.any(*conds)


def tile_end(spec: AttentionSpec, last_row, tile: int):
    """KV tiles of ``tile`` keys ``[0, end)`` hold every key visible to the rows up to
    ``last_row``: past the tile of its diagonal key (causal), all ``ceil(Skv / tile)`` otherwise."""
    n_kv = (spec.kv_len + tile - 1) // tile
    off = causal_offset(spec)
    if off is None:
        return n_kv
    return tirx.max(tirx.min(n_kv, (last_row + off) // tile + 1), 0)


def full_tiles(spec: AttentionSpec, first_row, tile: int):
    """Leading KV tiles that hold no key past Skv nor (causal) right of ``first_row``'s diagonal."""
    off = causal_offset(spec)
    if off is None:
        return spec.kv_len // tile
    return tirx.max(tirx.min(spec.kv_len // tile, (first_row + off + 1) // tile), 0)


def band_tiles(spec: AttentionSpec, first_row, last_row, tile: int, end=None) -> tuple:
    """KV tiles of ``tile`` keys for the query rows ``first_row..last_row`` (TIR or int values):
    ``(start, full_start, full_end, end)`` with ``start ≤ full_start ≤ full_end ≤ end``.

    Tiles ``[start, end)`` hold a key visible to some row (the rest are skipped, never loaded);
    ``[full_start, full_end)`` hold only keys visible to every row (no mask needed); the others
    need the element mask :func:`masked`. Not causal: every tile, ``Skv // tile`` full. Without a
    window ``start = full_start = 0``. ``end`` (default :func:`tile_end`) may be a variable the
    kernel bound it to; the other bounds are then written in terms of it.
    """
    end = tile_end(spec, last_row, tile) if end is None else end
    lo, hi = tirx.max, tirx.min
    full_end = full_tiles(spec, first_row, tile)
    if causal_offset(spec) is None:
        return 0, 0, full_end, end
    if spec.window is None:
        return 0, 0, hi(full_end, end), end
    off, w = causal_offset(spec), spec.window

    def clamp(x, a, b):
        return hi(lo(x, a), b)

    # start: the tile of the first row's first key (none past Skv: no tile); full_start: the first
    # tile wholly right of the last row's first key (ceil division of a value that may be negative)
    first = first_row + off - w + 1
    start = hi(lo(first, 0) // tile, end)
    if spec.q_len + off - w >= spec.kv_len:  # TopLeft, Sq ≥ Skv + w: the last rows see no key
        start = tirx.if_then_else(first < spec.kv_len, start, end)
    full_start = clamp(lo(last_row + off - w + 1 + tile - 1, 0) // tile, start, end)
    return start, full_start, clamp(full_end, full_start, end), end
