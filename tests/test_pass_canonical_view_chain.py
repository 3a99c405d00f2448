"""CollapseViewChains: view chains before a reshape → at most one permute and the reshape.

Before/Expected pairs (torch.export's einsum spelling of Q·Kᵀ, a permute that moves only size-1
axes), the chains it must leave alone, numerics against a freshly parsed Before module on llvm,
and einsum attention written by a user in fp16 through the whole pipeline (one attention op,
numerics against torch).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
import tvm
from tvm import relax
from tvm.script import ir as I  # noqa: E741
from tvm.script import relax as R

from tests.relax_util import apply_pass, assert_same_numerics
from tvmfuse.passes.canonical import CanonicalizeBatchedMatmul, CollapseViewChains


def collapse(mod: tvm.IRModule) -> tvm.IRModule:
    return apply_pass(CollapseViewChains(), mod)


@I.ir_module
class EinsumBefore:
    """``einsum("bhqd,bhkd->bhqk", q, k)`` on (2, 4, 8, 16) fp16, as torch.export writes it."""

    @R.function
    def main(q: R.Tensor((2, 4, 8, 16), "float16"),
             k: R.Tensor((2, 4, 8, 16), "float16")) -> R.Tensor((2, 4, 8, 8), "float16"):
        with R.dataflow():
            q5 = R.expand_dims(q, axis=[4])
            q5p = R.permute_dims(q5, axes=[0, 1, 2, 4, 3])
            k5 = R.expand_dims(k, axis=[4])
            k5p = R.permute_dims(k5, axes=[0, 1, 4, 2, 3])
            q5b = R.permute_dims(q5p, axes=[0, 1, 2, 4, 3])
            q3 = R.reshape(q5b, R.shape([8, 8, 16]))
            k5b = R.permute_dims(k5p, axes=[0, 1, 4, 3, 2])
            k3 = R.reshape(k5b, R.shape([8, 16, 8]))
            s3 = R.matmul(q3, k3, out_dtype="float32")
            s3h = R.astype(s3, "float16")
            s5 = R.reshape(s3h, R.shape([2, 4, 8, 1, 8]))
            s5p = R.permute_dims(s5, axes=[0, 1, 2, 4, 3])
            s = R.reshape(s5p, R.shape([2, 4, 8, 8]))
            R.output(s)
        return s


@I.ir_module
class EinsumExpected:
    @R.function
    def main(q: R.Tensor((2, 4, 8, 16), "float16"),
             k: R.Tensor((2, 4, 8, 16), "float16")) -> R.Tensor((2, 4, 8, 8), "float16"):
        with R.dataflow():
            q3 = R.reshape(q, R.shape([8, 8, 16]))
            kt = R.permute_dims(k, axes=[0, 1, 3, 2])
            k3 = R.reshape(kt, R.shape([8, 16, 8]))
            s3 = R.matmul(q3, k3, out_dtype="float32")
            s3h = R.astype(s3, "float16")
            s = R.reshape(s3h, R.shape([2, 4, 8, 8]))
            R.output(s)
        return s


def test_einsum_scores():
    after = collapse(EinsumBefore)
    tvm.ir.assert_structural_equal(after, EinsumExpected)
    assert_same_numerics(EinsumBefore, after, rtol=1e-3)


@I.ir_module
class UnitAxesBefore:
    """Batch 1: permutes that move only size-1 axes, a squeeze and an expand_dims, then a reshape."""

    @R.function
    def main(x: R.Tensor((1, 4, 8, 16), "float32")) -> R.Tensor((4, 128), "float32"):
        with R.dataflow():
            a = R.permute_dims(x, axes=[1, 0, 2, 3])
            b = R.squeeze(a, axis=[1])
            c = R.expand_dims(b, axis=[0])
            d = R.permute_dims(c, axes=[1, 2, 0, 3])
            y = R.reshape(d, R.shape([4, 128]))
            R.output(y)
        return y


@I.ir_module
class UnitAxesExpected:
    @R.function
    def main(x: R.Tensor((1, 4, 8, 16), "float32")) -> R.Tensor((4, 128), "float32"):
        with R.dataflow():
            y = R.reshape(x, R.shape([4, 128]))
            R.output(y)
        return y


def test_order_keeping_views_dropped():
    after = collapse(UnitAxesBefore)
    tvm.ir.assert_structural_equal(after, UnitAxesExpected)
    assert_same_numerics(UnitAxesBefore, after)


@I.ir_module
class ComposedBefore:
    """Two transposes around a size-1 axis compose into one permute; the reshape back is a no-op."""

    @R.function
    def main(x: R.Tensor((2, 3, 4, 5), "float32")) -> R.Tensor((2, 5, 4, 3), "float32"):
        with R.dataflow():
            a = R.expand_dims(x, axis=[2])
            b = R.permute_dims(a, axes=[0, 4, 2, 3, 1])
            c = R.permute_dims(b, axes=[0, 1, 3, 2, 4])
            y = R.reshape(c, R.shape([2, 5, 4, 3]))
            R.output(y)
        return y


@I.ir_module
class ComposedExpected:
    @R.function
    def main(x: R.Tensor((2, 3, 4, 5), "float32")) -> R.Tensor((2, 5, 4, 3), "float32"):
        with R.dataflow():
            y = R.permute_dims(x, axes=[0, 3, 2, 1])
            R.output(y)
        return y


def test_permutes_composed():
    after = collapse(ComposedBefore)
    tvm.ir.assert_structural_equal(after, ComposedExpected)
    assert_same_numerics(ComposedBefore, after)


# --- left alone ---------------------------------------------------------------------------------


@I.ir_module
class HeadMerge:
    """HF's ``o.transpose(1, 2).reshape(B, S, H·D)``: one real permute, nothing to drop."""

    @R.function
    def main(o: R.Tensor((2, 4, 8, 16), "float32")) -> R.Tensor((2, 8, 64), "float32"):
        with R.dataflow():
            t = R.permute_dims(o, axes=[0, 2, 1, 3])
            y = R.reshape(t, R.shape([2, 8, 64]))
            R.output(y)
        return y


@I.ir_module
class SharedView:
    """The expanded view has a second user: dropping it from the chain would not remove it."""

    @R.function
    def main(x: R.Tensor((2, 8, 16), "float32")
             ) -> R.Tuple(R.Tensor((16, 16), "float32"), R.Tensor((2, 16, 8, 1), "float32")):
        with R.dataflow():
            e = R.expand_dims(x, axis=[3])
            p = R.permute_dims(e, axes=[0, 2, 1, 3])
            y = R.reshape(p, R.shape([16, 16]))
            out = (y, p)
            R.output(out)
        return out


@I.ir_module
class RepeatKV:
    """GQA's ``expand_dims → broadcast_to → reshape``: a broadcast is no view, the chain stops."""

    @R.function
    def main(k: R.Tensor((1, 2, 8, 16), "float32")) -> R.Tensor((1, 4, 8, 16), "float32"):
        with R.dataflow():
            e = R.expand_dims(k, axis=[2])
            b = R.broadcast_to(e, R.shape([1, 2, 2, 8, 16]))
            y = R.reshape(b, R.shape([1, 4, 8, 16]))
            R.output(y)
        return y


@I.ir_module
class ProductHeadMerge:
    """P·V in 3-D, unfolded to (1, H, S, D), heads merged: the unfold stays for the batched fold."""

    @R.function
    def main(p: R.Tensor((4, 8, 8), "float16"), v: R.Tensor((4, 8, 16), "float16")
             ) -> R.Tensor((8, 64), "float16"):
        with R.dataflow():
            o3 = R.matmul(p, v, out_dtype="float32")
            o3h = R.astype(o3, "float16")
            o4 = R.reshape(o3h, R.shape([1, 4, 8, 16]))
            t = R.permute_dims(o4, axes=[0, 2, 1, 3])
            y = R.reshape(t, R.shape([8, 64]))
            R.output(y)
        return y


@pytest.mark.parametrize("mod", [HeadMerge, SharedView, RepeatKV, ProductHeadMerge],
                         ids=["head_merge", "shared_view", "repeat_kv", "product_head_merge"])
def test_left_alone(mod: tvm.IRModule):
    tvm.ir.assert_structural_equal(collapse(mod), mod)


# --- as a user writes it ----------------------------------------------------------------------------


class EinsumAttention(torch.nn.Module):
    """Causal attention with both products as ``torch.einsum``, in the given q/k/v layout."""

    def __init__(self, layout: str, seq: int = 24) -> None:
        super().__init__()
        self.layout = layout
        self.register_buffer("mask", torch.ones(seq, seq, dtype=torch.bool).triu(1), persistent=False)

    def forward(self, q, k, v):
        if self.layout == "bhsd":
            s = torch.einsum("bhqd,bhkd->bhqk", q, k) * q.shape[-1] ** -0.5
        else:  # (B, S, H, D) inputs, output back in (B, S, H, D)
            s = torch.einsum("bqhd,bkhd->bhqk", q, k) * q.shape[-1] ** -0.5
        p = torch.softmax(s.masked_fill(self.mask, float("-inf")).float(), -1).to(q.dtype)
        if self.layout == "bhsd":
            return torch.einsum("bhqk,bhkd->bhqd", p, v)
        return torch.einsum("bhqk,bkhd->bqhd", p, v)


def _ranks(mod: tvm.IRModule) -> set[int]:
    """Ranks of every tensor bound in ``main``."""
    return {len(b.var.ty.shape.values) for block in mod["main"].body.blocks for b in block.bindings
            if isinstance(b.var.ty, relax.TensorType)}


@pytest.mark.parametrize("layout", ["bhsd", "bshd"])
def test_einsum_attention_fp16(layout: str):
    from tvmfuse.frontend import import_model
    from tvmfuse.passes.attention import attention_decisions
    from tvmfuse.pipeline import build, lower
    from tvmfuse.targets import get_target

    g = torch.Generator().manual_seed(0)
    shape = (2, 4, 24, 16) if layout == "bhsd" else (2, 24, 4, 16)
    inputs = tuple(torch.randn(*shape, generator=g).half() for _ in range(3))
    module = EinsumAttention(layout).half().eval()
    imported = import_model(module, inputs)
    before = relax.transform.CanonicalizeBindings()(imported.mod)
    assert 5 in _ranks(before)  # torch.export's einsum: 5-D views
    after = apply_pass(CanonicalizeBatchedMatmul(), collapse(before))
    assert 5 not in _ranks(after)

    stages: dict[str, tvm.IRModule] = {}
    spec = get_target("cpu")
    lowered = lower(imported.mod, spec, on_stage=lambda n, m: stages.__setitem__(n, m))
    (decision,) = attention_decisions(stages["fuse_attention"])
    assert decision["status"] == "fused" and decision["causal"] == "TopLeft", decision
    vm = relax.VirtualMachine(build(lowered, spec), tvm.cpu())
    out = vm["main"](*[tvm.runtime.tensor(x.numpy()) for x in inputs])
    out = (out if hasattr(out, "numpy") else out[0]).numpy().astype(np.float64)
    with torch.no_grad():
        ref = module.double()(*[x.double() for x in inputs]).numpy()
    err = np.linalg.norm(out - ref) / np.linalg.norm(ref)
    assert err <= 5e-3, err
