"""NegativeIndices: constant negative ``take`` / ``index_tensor`` indices count from the end.

TVM 0.27's torch importer emits ``take(x, -2)`` for ``x[..., -2, :]`` and TVM's "fast" take reads
before the buffer: transformers' Falcon (new decoder architecture) gave NaN / relative error ~1 on
the cpu target with no error. Structure (Before / Expected), the symbolic-axis case (wrap mode),
runtime indices left alone, and numerics through ``tvmfuse.compile`` against torch.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
import tvm
from tvm.script import ir as I
from tvm.script import relax as R

import tvmfuse
from tests.canonical_util import apply
from tvmfuse.passes.canonical import NegativeIndices


@I.ir_module
class Before:
    @R.function
    def main(x: R.Tensor((2, 5, 4), "float32")):
        with R.dataflow():
            a = R.take(x, R.const(-2, "int64"), axis=1, mode="fast")
            b = R.take(x, R.const(np.array([-1, 0], "int64")), axis=1, mode="fast")
            c = R.index_tensor(x, (R.const(np.array([[-1]], "int64")), R.const(np.array([[-5]], "int64"))))
            out = (a, b, c)
            R.output(out)
        return out


@I.ir_module
class Expected:
    @R.function
    def main(x: R.Tensor((2, 5, 4), "float32")):
        with R.dataflow():
            a = R.take(x, R.const(3, "int64"), axis=1, mode="fast")
            b = R.take(x, R.const(np.array([4, 0], "int64")), axis=1, mode="fast")
            c = R.index_tensor(x, (R.const(np.array([[1]], "int64")), R.const(np.array([[0]], "int64"))))
            out = (a, b, c)
            R.output(out)
        return out


@I.ir_module
class Symbolic:
    @R.function
    def main(x: R.Tensor((2, "n"), "float32"), i: R.Tensor((3,), "int64")):
        with R.dataflow():
            a = R.take(x, R.const(-1, "int64"), axis=1, mode="fast")
            b = R.take(x, i, axis=1, mode="fast")  # a runtime index: left as it comes
            out = (a, b)
            R.output(out)
        return out


@I.ir_module
class SymbolicExpected:
    @R.function
    def main(x: R.Tensor((2, "n"), "float32"), i: R.Tensor((3,), "int64")):
        with R.dataflow():
            a = R.take(x, R.const(-1, "int64"), axis=1, mode="wrap")
            b = R.take(x, i, axis=1, mode="fast")
            out = (a, b)
            R.output(out)
        return out


def test_static_axes_count_from_the_end():
    tvm.ir.assert_structural_equal(apply(NegativeIndices(), Before), Expected)


def test_symbolic_axis_wraps_and_runtime_indices_stay():
    tvm.ir.assert_structural_equal(apply(NegativeIndices(), Symbolic), SymbolicExpected)


def test_non_negative_left_alone():
    tvm.ir.assert_structural_equal(apply(NegativeIndices(), Expected), Expected)


class Picks(torch.nn.Module):
    """Falcon's K/V split (``grouped[..., -2, :]``, ``[..., -1, :]``) and a list index from the end."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x[..., -2, :] * 2 + x[..., -1, :] + x[:, :, [-1], :].squeeze(2)


def test_torch_negative_indices_match_torch():
    x = torch.randn(2, 3, 5, 4)
    got = tvmfuse.compile(Picks(), (x,), target="cpu").load()(x)
    np.testing.assert_allclose(np.asarray(got), Picks()(x).numpy(), rtol=1e-6, atol=1e-6)


def test_falcon_new_decoder_architecture_logits():
    """transformers' Falcon with ``new_decoder_architecture`` (grouped K/V picked by -2 / -1) at
    random init: the cpu target's logits equal torch's (before the pass: NaN or rel. err ~1)."""
    transformers = pytest.importorskip("transformers")
    from tests.test_llm_import_lm import Logits

    torch.manual_seed(0)
    cfg = transformers.FalconConfig(vocab_size=128, hidden_size=64, num_hidden_layers=2,
                                    num_attention_heads=4, num_kv_heads=2,
                                    new_decoder_architecture=True, max_position_embeddings=256,
                                    ffn_hidden_size=128)
    model = Logits(transformers.FalconForCausalLM(cfg).eval())
    ids = torch.randint(0, 128, (1, 32))
    got = np.asarray(tvmfuse.compile(model, (ids,), target="cpu").load()(ids))
    with torch.no_grad():
        want = model(ids).numpy()
    assert np.linalg.norm(got - want) <= 1e-5 * np.linalg.norm(want)
