"""CanonicalizeBatchedMatmul: torch.export's 3-D spelling of N-D ``@`` → the N-D matmul.

Before/Expected pairs (fp16 with the fp32-accumulating cast, fp32, a real broadcast), the forms it
must leave alone, numerics against a freshly parsed Before module on llvm, and the spelling as
torch.export writes it for a user's fp16 module, checked against torch.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
import tvm
from tvm import relax
from tvm.script import ir as I  # noqa: E741
from tvm.script import relax as R

from tests.relax_util import random_inputs, run_llvm
from tvmfuse.passes.canonical import CanonicalizeBatchedMatmul

IMMUTABLE = {"testing.immutable_module": True}  # TVM checks the pass leaves its input untouched


def canonical(mod: tvm.IRModule) -> tvm.IRModule:
    with tvm.transform.PassContext(config=IMMUTABLE):
        return CanonicalizeBatchedMatmul()(mod)


def assert_same_numerics(before: tvm.IRModule, after: tvm.IRModule, rtol: float) -> None:
    arrays = random_inputs(before)
    ref, out = run_llvm(before, *arrays), run_llvm(after, *arrays)
    err = np.linalg.norm(out.astype(np.float64) - ref) / np.linalg.norm(ref.astype(np.float64))
    assert err <= rtol, f"relative error {err:.3e} > {rtol}"


def fp16_before() -> tvm.IRModule:
    """``q @ kᵀ`` on (2, 4, 8, 16) fp16 as torch.export + tvmfuse's product converter write it."""

    @I.ir_module
    class Before:
        @R.function
        def main(q: R.Tensor((2, 4, 8, 16), "float16"),
                 k: R.Tensor((2, 4, 16, 8), "float16")) -> R.Tensor((2, 4, 8, 8), "float16"):
            with R.dataflow():
                qb = R.broadcast_to(q, R.shape([2, 4, 8, 16]))
                q3 = R.reshape(qb, R.shape([8, 8, 16]))
                kb = R.broadcast_to(k, R.shape([2, 4, 16, 8]))
                k3 = R.reshape(kb, R.shape([8, 16, 8]))
                s3 = R.matmul(q3, k3, out_dtype="float32")
                s3h = R.astype(s3, "float16")
                s = R.reshape(s3h, R.shape([2, 4, 8, 8]))
                R.output(s)
            return s

    return Before


@I.ir_module
class Fp16Expected:
    @R.function
    def main(q: R.Tensor((2, 4, 8, 16), "float16"),
             k: R.Tensor((2, 4, 16, 8), "float16")) -> R.Tensor((2, 4, 8, 8), "float16"):
        with R.dataflow():
            s3 = R.matmul(q, k, out_dtype="float32")
            s = R.astype(s3, "float16")
            R.output(s)
        return s


def test_fp16_accumulating_product():
    after = canonical(fp16_before())
    tvm.ir.assert_structural_equal(after, Fp16Expected)
    assert_same_numerics(fp16_before(), after, rtol=1e-3)


def fp32_before() -> tvm.IRModule:
    """A 5-D fp32 product (batch dims (2, 3, 2)): no cast, out_dtype left unset."""

    @I.ir_module
    class Before:
        @R.function
        def main(a: R.Tensor((2, 3, 2, 8, 16), "float32"),
                 b: R.Tensor((2, 3, 2, 16, 4), "float32")) -> R.Tensor((2, 3, 2, 8, 4), "float32"):
            with R.dataflow():
                ab = R.broadcast_to(a, R.shape([2, 3, 2, 8, 16]))
                a3 = R.reshape(ab, R.shape([12, 8, 16]))
                b3 = R.reshape(b, R.shape([12, 16, 4]))
                y3 = R.matmul(a3, b3)
                y = R.reshape(y3, R.shape([2, 3, 2, 8, 4]))
                R.output(y)
            return y

    return Before


@I.ir_module
class Fp32Expected:
    @R.function
    def main(a: R.Tensor((2, 3, 2, 8, 16), "float32"),
             b: R.Tensor((2, 3, 2, 16, 4), "float32")) -> R.Tensor((2, 3, 2, 8, 4), "float32"):
        with R.dataflow():
            y = R.matmul(a, b)
            R.output(y)
        return y


def test_fp32_five_dims():
    after = canonical(fp32_before())
    tvm.ir.assert_structural_equal(after, Fp32Expected)
    assert_same_numerics(fp32_before(), after, rtol=1e-5)


def broadcast_before() -> tvm.IRModule:
    """One KV head broadcast over 4 query heads: a real broadcast stays (as the matmul operand)."""

    @I.ir_module
    class Before:
        @R.function
        def main(p: R.Tensor((2, 4, 8, 8), "float32"),
                 v: R.Tensor((2, 1, 8, 16), "float32")) -> R.Tensor((2, 4, 8, 16), "float32"):
            with R.dataflow():
                p3 = R.reshape(p, R.shape([8, 8, 8]))
                vb = R.broadcast_to(v, R.shape([2, 4, 8, 16]))
                v3 = R.reshape(vb, R.shape([8, 8, 16]))
                o3 = R.matmul(p3, v3)
                o = R.reshape(o3, R.shape([2, 4, 8, 16]))
                R.output(o)
            return o

    return Before


@I.ir_module
class BroadcastExpected:
    @R.function
    def main(p: R.Tensor((2, 4, 8, 8), "float32"),
             v: R.Tensor((2, 1, 8, 16), "float32")) -> R.Tensor((2, 4, 8, 16), "float32"):
        with R.dataflow():
            vb = R.broadcast_to(v, R.shape([2, 4, 8, 16]))
            o = R.matmul(p, vb)
            R.output(o)
        return o


def test_real_broadcast_kept():
    after = canonical(broadcast_before())
    tvm.ir.assert_structural_equal(after, BroadcastExpected)
    assert_same_numerics(broadcast_before(), after, rtol=1e-5)


# --- left alone ---------------------------------------------------------------------------------


@I.ir_module
class Linear:
    """x (2, 8, 16) @ W (16, 32) folded to a 2-D GEMM: no batched product, stays."""

    @R.function
    def main(x: R.Tensor((2, 8, 16), "float16"), w: R.Tensor((16, 32), "float16")
             ) -> R.Tensor((2, 8, 32), "float16"):
        with R.dataflow():
            x2 = R.reshape(x, R.shape([16, 16]))
            y2 = R.matmul(x2, w, out_dtype="float32")
            y2h = R.astype(y2, "float16")
            y = R.reshape(y2h, R.shape([2, 8, 32]))
            R.output(y)
        return y


@I.ir_module
class SharedProduct:
    """The 3-D product has a second user: folding it would compute it twice."""

    @R.function
    def main(a: R.Tensor((2, 4, 8, 16), "float32"), b: R.Tensor((2, 4, 16, 8), "float32")
             ) -> R.Tuple(R.Tensor((2, 4, 8, 8), "float32"), R.Tensor((8, 8, 8), "float32")):
        with R.dataflow():
            a3 = R.reshape(a, R.shape([8, 8, 16]))
            b3 = R.reshape(b, R.shape([8, 16, 8]))
            y3 = R.matmul(a3, b3)
            y = R.reshape(y3, R.shape([2, 4, 8, 8]))
            out = (y, y3)
            R.output(out)
        return out


@I.ir_module
class OtherSplit:
    """The result is reshaped to other batch dims than the operands had: not the same product."""

    @R.function
    def main(a: R.Tensor((2, 4, 8, 16), "float32"), b: R.Tensor((2, 4, 16, 8), "float32")
             ) -> R.Tensor((4, 2, 8, 8), "float32"):
        with R.dataflow():
            a3 = R.reshape(a, R.shape([8, 8, 16]))
            b3 = R.reshape(b, R.shape([8, 16, 8]))
            y3 = R.matmul(a3, b3)
            y = R.reshape(y3, R.shape([4, 2, 8, 8]))
            R.output(y)
        return y


@I.ir_module
class MixedBatch:
    """Operands merged from different batch dims ((2, 4) and (4, 2)): not one N-D product."""

    @R.function
    def main(a: R.Tensor((2, 4, 8, 16), "float32"), b: R.Tensor((4, 2, 16, 8), "float32")
             ) -> R.Tensor((2, 4, 8, 8), "float32"):
        with R.dataflow():
            a3 = R.reshape(a, R.shape([8, 8, 16]))
            b3 = R.reshape(b, R.shape([8, 16, 8]))
            y3 = R.matmul(a3, b3)
            y = R.reshape(y3, R.shape([2, 4, 8, 8]))
            R.output(y)
        return y


@pytest.mark.parametrize("mod", [Linear, SharedProduct, OtherSplit, MixedBatch],
                         ids=["linear", "shared_product", "other_split", "mixed_batch"])
def test_left_alone(mod: tvm.IRModule):
    tvm.ir.assert_structural_equal(canonical(mod), mod)


# --- as torch.export writes it --------------------------------------------------------------------


class Products(torch.nn.Module):
    """A user's fp16 module: 4-D ``@`` with a transposed operand, 3-D ``torch.bmm``, and a Linear."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = torch.nn.Linear(16, 16, bias=False)

    def forward(self, q: torch.Tensor, k: torch.Tensor, a: torch.Tensor) -> torch.Tensor:
        s = q @ k.transpose(-1, -2)  # (2, 4, 8, 8)
        t = torch.bmm(a, a.transpose(1, 2))  # (2, 8, 8)
        return self.proj(s @ q) + t[:, None, :, :1]


def _count(mod: tvm.IRModule, op: str) -> dict[int, int]:
    """Calls of ``op`` in ``main`` by the rank of their result."""
    ranks: dict[int, int] = {}
    for block in mod["main"].body.blocks:
        for binding in block.bindings:
            value = binding.value
            if isinstance(value, relax.Call) and getattr(value.op, "name", None) == op:
                rank = len(value.ty.shape.values)
                ranks[rank] = ranks.get(rank, 0) + 1
    return ranks


def _run_tuple(mod: tvm.IRModule, arrays: list[np.ndarray]) -> list[np.ndarray]:
    """Build ``mod`` (``main`` returns a tuple, as imported) for llvm and run it."""
    from tvmfuse.passes.legalize_fixes import legalize_overrides

    mod = relax.transform.LegalizeOps(legalize_overrides())(mod)
    vm = relax.VirtualMachine(tvm.compile(mod, target="llvm"), tvm.cpu())
    return [o.numpy() for o in vm["main"](*[tvm.runtime.tensor(a) for a in arrays])]


def test_torch_export_fp16_module():
    from tvmfuse.frontend import import_model

    torch.manual_seed(0)
    module = Products().half().eval()
    inputs = (torch.randn(2, 4, 8, 16).half(), torch.randn(2, 4, 8, 16).half(),
              torch.randn(2, 8, 16).half())
    imported = import_model(module, inputs)
    before = relax.transform.CanonicalizeBindings()(imported.mod)
    assert _count(before, "relax.matmul").get(4, 0) == 0  # torch.export spells `@` in 3-D
    after = canonical(before)
    # the two 4-D products and the bmm are N-D now (no reshape round trip); the Linear stays 2-D
    assert _count(after, "relax.matmul") == {4: 2, 3: 1, 2: 1}
    with torch.no_grad():
        ref = module(*inputs).float().numpy()
    out = _run_tuple(after, [t.numpy() for t in inputs])[0].astype(np.float32)
    assert np.abs(out - ref).max() <= 2e-2 * np.abs(ref).max()


@I.ir_module
class BroadcastWeight:
    """A Linear on (2, 3, 16) as torch.export writes it with a symbolic batch bound to 2: the
    reshapes to 3-D are gone, the weight is broadcast over the batch."""

    @R.function
    def main(x: R.Tensor((2, 3, 16), "float32"),
             w: R.Tensor((8, 16), "float32")) -> R.Tensor((2, 3, 8), "float32"):
        with R.dataflow():
            wt = R.permute_dims(w, axes=[1, 0])
            xb = R.broadcast_to(x, R.shape([2, 3, 16]))
            wb = R.broadcast_to(wt, R.shape([2, 16, 8]))
            y = R.matmul(xb, wb, out_dtype="float32")
            R.output(y)
        return y


@I.ir_module
class BroadcastWeightExpected:
    @R.function
    def main(x: R.Tensor((2, 3, 16), "float32"),
             w: R.Tensor((8, 16), "float32")) -> R.Tensor((2, 3, 8), "float32"):
        with R.dataflow():
            wt = R.permute_dims(w, axes=[1, 0])
            xb = R.broadcast_to(x, R.shape([2, 3, 16]))
            y = R.matmul(xb, wt, out_dtype="float32")
            R.output(y)
        return y


def test_weight_broadcast_over_the_batch_dropped():
    after = relax.transform.DeadCodeElimination()(canonical(BroadcastWeight))
    tvm.ir.assert_structural_equal(after, BroadcastWeightExpected)
    assert_same_numerics(BroadcastWeight, after, rtol=1e-6)
