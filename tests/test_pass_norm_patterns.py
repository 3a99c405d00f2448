"""FuseDecomposedNorms: spelled-out RMSNorm / LayerNorm / softmax become one op each."""

from __future__ import annotations

import numpy as np
import tvm
from tvm.script import ir as I
from tvm.script import relax as R

from tests.relax_util import apply_pass, assert_same_numerics
from tvmfuse.passes import FuseDecomposedNorms


@I.ir_module
class RMSTorch:
    """HF Llama RMSNorm as torch.export writes it: pow, mean, add, rsqrt, mul, mul."""

    @R.function
    def main(x: R.Tensor((4, 64), "float32"), w: R.Tensor((64,), "float32")) -> R.Tensor((4, 64), "float32"):
        with R.dataflow():
            sq = R.power(x, R.const(2.0, "float32"))
            ms = R.mean(sq, axis=[-1], keepdims=True)
            ve = R.add(ms, R.const(0.0009765625, "float32"))
            inv = R.rsqrt(ve)
            n = R.multiply(x, inv)
            y = R.multiply(w, n)
            R.output(y)
        return y


@I.ir_module
class RMSOnnx:
    """The ONNX spelling: Pow → ReduceMean → Add → Sqrt → Reciprocal → Mul → Mul."""

    @R.function
    def main(x: R.Tensor((4, 64), "float32"), w: R.Tensor((64,), "float32")) -> R.Tensor((4, 64), "float32"):
        with R.dataflow():
            sq = R.power(x, R.const(2.0, "float32"))
            ms = R.mean(sq, axis=[1], keepdims=True)
            ve = R.add(ms, R.const(0.0009765625, "float32"))
            sd = R.sqrt(ve)
            inv = R.divide(R.const(1.0, "float32"), sd)
            n = R.multiply(x, inv)
            y = R.multiply(n, w)
            R.output(y)
        return y


@I.ir_module
class RMSExpected:
    @R.function
    def main(x: R.Tensor((4, 64), "float32"), w: R.Tensor((64,), "float32")) -> R.Tensor((4, 64), "float32"):
        with R.dataflow():
            y = R.nn.rms_norm(x, w, axes=[-1], epsilon=0.0009765625)
            R.output(y)
        return y


@I.ir_module
class LayerNormDecomposed:
    @R.function
    def main(x: R.Tensor((4, 64), "float32"), g: R.Tensor((64,), "float32"),
             b: R.Tensor((64,), "float32")) -> R.Tensor((4, 64), "float32"):
        with R.dataflow():
            mu = R.mean(x, axis=[-1], keepdims=True)
            d = R.subtract(x, mu)
            sq = R.power(d, R.const(2.0, "float32"))
            var = R.mean(sq, axis=[-1], keepdims=True)
            ve = R.add(var, R.const(0.0009765625, "float32"))
            sd = R.sqrt(ve)
            n = R.divide(d, sd)
            s = R.multiply(n, g)
            y = R.add(s, b)
            R.output(y)
        return y


@I.ir_module
class LayerNormExpected:
    @R.function
    def main(x: R.Tensor((4, 64), "float32"), g: R.Tensor((64,), "float32"),
             b: R.Tensor((64,), "float32")) -> R.Tensor((4, 64), "float32"):
        with R.dataflow():
            y = R.nn.layer_norm(x, g, b, axes=[-1], epsilon=0.0009765625)
            R.output(y)
        return y


@I.ir_module
class SoftmaxDecomposed:
    @R.function
    def main(x: R.Tensor((4, 64), "float32")) -> R.Tensor((4, 64), "float32"):
        with R.dataflow():
            m = R.max(x, axis=[-1], keepdims=True)
            d = R.subtract(x, m)
            e = R.exp(d)
            s = R.sum(e, axis=[-1], keepdims=True)
            y = R.divide(e, s)
            R.output(y)
        return y


@I.ir_module
class SoftmaxExpected:
    @R.function
    def main(x: R.Tensor((4, 64), "float32")) -> R.Tensor((4, 64), "float32"):
        with R.dataflow():
            y = R.nn.softmax(x, axis=-1)
            R.output(y)
        return y


@I.ir_module
class RMSWrongAxis:
    """Mean over axis 0 is not an RMSNorm over rows: must stay as it is."""

    @R.function
    def main(x: R.Tensor((4, 64), "float32"), w: R.Tensor((64,), "float32")) -> R.Tensor((4, 64), "float32"):
        with R.dataflow():
            sq = R.power(x, R.const(2.0, "float32"))
            ms = R.mean(sq, axis=[0], keepdims=True)
            ve = R.add(ms, R.const(0.0009765625, "float32"))
            inv = R.rsqrt(ve)
            n = R.multiply(x, inv)
            y = R.multiply(n, w)
            R.output(y)
        return y


@I.ir_module
class RMSCube:
    """Exponent 3 is not a mean square: must stay as it is."""

    @R.function
    def main(x: R.Tensor((4, 64), "float32"), w: R.Tensor((64,), "float32")) -> R.Tensor((4, 64), "float32"):
        with R.dataflow():
            sq = R.power(x, R.const(3.0, "float32"))
            ms = R.mean(sq, axis=[-1], keepdims=True)
            ve = R.add(ms, R.const(0.0009765625, "float32"))
            inv = R.rsqrt(ve)
            n = R.multiply(x, inv)
            y = R.multiply(n, w)
            R.output(y)
        return y


@I.ir_module
class RMSHalf:
    """HF Llama RMSNorm on fp16: upcast, normalise in fp32, cast back, then the weight."""

    @R.function
    def main(x: R.Tensor((4, 64), "float16"), w: R.Tensor((64,), "float16")) -> R.Tensor((4, 64), "float16"):
        with R.dataflow():
            xf = R.astype(x, "float32")
            sq = R.power(xf, R.const(2.0, "float32"))
            ms = R.mean(sq, axis=[-1], keepdims=True)
            ve = R.add(ms, R.const(0.0009765625, "float32"))
            inv = R.rsqrt(ve)
            n = R.multiply(xf, inv)
            nh = R.astype(n, "float16")
            y = R.multiply(w, nh)
            R.output(y)
        return y


@I.ir_module
class RMSHalfExpected:
    @R.function
    def main(x: R.Tensor((4, 64), "float16"), w: R.Tensor((64,), "float16")) -> R.Tensor((4, 64), "float16"):
        with R.dataflow():
            y = R.nn.rms_norm(x, w, axes=[-1], epsilon=0.0009765625)
            R.output(y)
        return y


@I.ir_module
class RMSHalfSymbolic:
    """The same on (1, S, 64) with S symbolic (``--dynamic``): only the normalised axis is static."""

    @R.function
    def main(x: R.Tensor((1, "S", 64), "float16"), w: R.Tensor((64,), "float16")
             ) -> R.Tensor((1, "S", 64), "float16"):
        with R.dataflow():
            xf = R.astype(x, "float32")
            sq = R.power(xf, R.const(2.0, "float32"))
            ms = R.mean(sq, axis=[-1], keepdims=True)
            ve = R.add(ms, R.const(0.0009765625, "float32"))
            inv = R.rsqrt(ve)
            n = R.multiply(xf, inv)
            nh = R.astype(n, "float16")
            y = R.multiply(w, nh)
            R.output(y)
        return y


@I.ir_module
class RMSHalfSymbolicExpected:
    @R.function
    def main(x: R.Tensor((1, "S", 64), "float16"), w: R.Tensor((64,), "float16")
             ) -> R.Tensor((1, "S", 64), "float16"):
        with R.dataflow():
            y = R.nn.rms_norm(x, w, axes=[-1], epsilon=0.0009765625)
            R.output(y)
        return y


def test_rms_norm_with_symbolic_rows():
    after = apply_pass(FuseDecomposedNorms(), RMSHalfSymbolic)
    tvm.ir.assert_structural_equal(after, RMSHalfSymbolicExpected)
    assert_same_numerics(RMSHalfSymbolic, after, rtol=2e-3)


def test_rms_norm_half_precision_hf_form():
    after = apply_pass(FuseDecomposedNorms(), RMSHalf)
    tvm.ir.assert_structural_equal(after, RMSHalfExpected)
    assert_same_numerics(RMSHalf, after, rtol=2e-3)


def test_rms_norm_torch_form():
    after = apply_pass(FuseDecomposedNorms(), RMSTorch)
    tvm.ir.assert_structural_equal(after, RMSExpected)
    assert_same_numerics(RMSTorch, after)


def test_rms_norm_onnx_form():
    after = apply_pass(FuseDecomposedNorms(), RMSOnnx)
    tvm.ir.assert_structural_equal(after, RMSExpected)
    assert_same_numerics(RMSOnnx, after)


@I.ir_module
class RMSOnnxNoEps:
    """The dynamo ONNX export of Helium's RMSNorm (eps 1e-8): the exporter dropped the Add,
    ``Sqrt(ReduceMean(x²))``; session 46 found it 16 kernels more than the torch import."""

    @R.function
    def main(x: R.Tensor((4, 64), "float32"), w: R.Tensor((64,), "float32")) -> R.Tensor((4, 64), "float32"):
        with R.dataflow():
            sq = R.power(x, R.const(2.0, "float32"))
            ms = R.mean(sq, axis=[1], keepdims=True)
            sd = R.sqrt(ms)
            inv = R.divide(R.const(1.0, "float32"), sd)
            n = R.multiply(x, inv)
            y = R.multiply(w, n)
            R.output(y)
        return y


@I.ir_module
class RMSNoEpsExpected:
    @R.function
    def main(x: R.Tensor((4, 64), "float32"), w: R.Tensor((64,), "float32")) -> R.Tensor((4, 64), "float32"):
        with R.dataflow():
            y = R.nn.rms_norm(x, w, axes=[-1], epsilon=0.0)
            R.output(y)
        return y


@I.ir_module
class LayerNormNoEps:
    @R.function
    def main(x: R.Tensor((4, 64), "float32"), g: R.Tensor((64,), "float32"),
             b: R.Tensor((64,), "float32")) -> R.Tensor((4, 64), "float32"):
        with R.dataflow():
            mu = R.mean(x, axis=[-1], keepdims=True)
            c = R.subtract(x, mu)
            var = R.mean(R.multiply(c, c), axis=[-1], keepdims=True)
            n = R.divide(c, R.sqrt(var))
            y = R.add(R.multiply(n, g), b)
            R.output(y)
        return y


@I.ir_module
class LayerNormNoEpsExpected:
    @R.function
    def main(x: R.Tensor((4, 64), "float32"), g: R.Tensor((64,), "float32"),
             b: R.Tensor((64,), "float32")) -> R.Tensor((4, 64), "float32"):
        with R.dataflow():
            y = R.nn.layer_norm(x, g, b, axes=[-1], epsilon=0.0)
            R.output(y)
        return y


def test_norms_without_eps():
    """No ``+ eps`` before the square root (dropped by the exporter, or never written): eps 0."""
    for before, expected in ((RMSOnnxNoEps, RMSNoEpsExpected), (LayerNormNoEps, LayerNormNoEpsExpected)):
        after = apply_pass(FuseDecomposedNorms(), before)
        tvm.ir.assert_structural_equal(after, expected)
        assert_same_numerics(before, after)


def test_layer_norm_decomposed():
    after = apply_pass(FuseDecomposedNorms(), LayerNormDecomposed)
    tvm.ir.assert_structural_equal(after, LayerNormExpected)
    assert_same_numerics(LayerNormDecomposed, after)


def test_softmax_decomposed():
    after = apply_pass(FuseDecomposedNorms(), SoftmaxDecomposed)
    tvm.ir.assert_structural_equal(after, SoftmaxExpected)
    assert_same_numerics(SoftmaxDecomposed, after)


def test_not_a_norm_is_left_alone():
    for mod in (RMSWrongAxis, RMSCube):
        tvm.ir.assert_structural_equal(apply_pass(FuseDecomposedNorms(), mod), mod)


@I.ir_module
class LayerNormNoBiasHalf:
    """Cohere's LayerNorm in an fp16 module: fp32 upcast, no β, ``w.float() · x̂``, cast back."""

    @R.function
    def main(x: R.Tensor((4, 64), "float16"), g: R.Tensor((64,), "float16")
             ) -> R.Tensor((4, 64), "float16"):
        with R.dataflow():
            xf = R.astype(x, "float32")
            mu = R.mean(xf, axis=[-1], keepdims=True)
            d = R.subtract(xf, mu)
            sq = R.power(d, R.const(2.0, "float32"))
            var = R.mean(sq, axis=[-1], keepdims=True)
            ve = R.add(var, R.const(0.0009765625, "float32"))
            r = R.rsqrt(ve)
            n = R.multiply(d, r)
            gf = R.astype(g, "float32")
            s = R.multiply(gf, n)
            y = R.astype(s, "float16")
            R.output(y)
        return y


@I.ir_module
class LayerNormNoBiasHalfExpected:
    @R.function
    def main(x: R.Tensor((4, 64), "float16"), g: R.Tensor((64,), "float16")
             ) -> R.Tensor((4, 64), "float16"):
        with R.dataflow():
            xf = R.astype(x, "float32")
            gf = R.astype(g, "float32")
            s = R.nn.layer_norm(xf, gf, R.const(np.zeros(64, "float32")), axes=[-1], epsilon=0.0009765625)
            y = R.astype(s, "float16")
            R.output(y)
        return y


def test_layer_norm_without_bias_in_half_module():
    """Cohere (and OLMo) write LayerNorm without β, on the fp32 upcast: one ``layer_norm`` with a
    zero β (was ``mean, subtract`` + an ``rms_norm`` of the centred row: two kernels, and not
    folded into the following GEMM; a transformers Cohere went 23 → 14 kernels on sm90)."""
    after = apply_pass(FuseDecomposedNorms(), LayerNormNoBiasHalf)
    tvm.ir.assert_structural_equal(after, LayerNormNoBiasHalfExpected)
    assert_same_numerics(LayerNormNoBiasHalf, after)


@I.ir_module
class LayerNormNoBiasOnnx:
    """The ONNX export's spelling: ``(x − μ) · (1 / sqrt(var + eps))`` (Reciprocal of Sqrt)."""

    @R.function
    def main(x: R.Tensor((4, 64), "float32"), g: R.Tensor((64,), "float32")
             ) -> R.Tensor((4, 64), "float32"):
        with R.dataflow():
            mu = R.mean(x, axis=[-1], keepdims=True)
            d = R.subtract(x, mu)
            sq = R.power(d, R.const(2.0, "float32"))
            var = R.mean(sq, axis=[-1], keepdims=True)
            ve = R.add(var, R.const(0.0009765625, "float32"))
            sd = R.sqrt(ve)
            inv = R.divide(R.const(1.0, "float32"), sd)
            n = R.multiply(d, inv)
            y = R.multiply(g, n)
            R.output(y)
        return y


@I.ir_module
class LayerNormNoBiasOnnxExpected:
    @R.function
    def main(x: R.Tensor((4, 64), "float32"), g: R.Tensor((64,), "float32")
             ) -> R.Tensor((4, 64), "float32"):
        with R.dataflow():
            y = R.nn.layer_norm(x, g, R.const(np.zeros(64, "float32")), axes=[-1],
                                epsilon=0.0009765625)
            R.output(y)
        return y


def test_layer_norm_without_bias_onnx_reciprocal():
    """Cohere's ONNX export (dynamo) writes rsqrt as 1 / sqrt: still one ``layer_norm`` (the RMS
    pattern took the centred half before: 19 kernels vs 16 from torch)."""
    after = apply_pass(FuseDecomposedNorms(), LayerNormNoBiasOnnx)
    tvm.ir.assert_structural_equal(after, LayerNormNoBiasOnnxExpected)
    assert_same_numerics(LayerNormNoBiasOnnx, after)


@I.ir_module
class RMSNoWeightHalf:
    """``F.rms_norm(x, (n,))`` (NanoChat) / LlamaRMSNorm without w in fp16: upcast, x̂, cast back."""

    @R.function
    def main(x: R.Tensor((4, 64), "float16")) -> R.Tensor((4, 64), "float16"):
        with R.dataflow():
            xf = R.astype(x, "float32")
            sq = R.power(xf, R.const(2.0, "float32"))
            ms = R.mean(sq, axis=[-1], keepdims=True)
            ve = R.add(ms, R.const(0.0009765625, "float32"))
            r = R.rsqrt(ve)
            n = R.multiply(xf, r)
            y = R.astype(n, "float16")
            R.output(y)
        return y


@I.ir_module
class RMSNoWeightHalfExpected:
    @R.function
    def main(x: R.Tensor((4, 64), "float16")) -> R.Tensor((4, 64), "float16"):
        with R.dataflow():
            xf = R.astype(x, "float32")
            n = R.nn.rms_norm(xf, R.const(np.ones(64, "float32")), axes=[-1], epsilon=0.0009765625)
            y = R.astype(n, "float16")
            R.output(y)
        return y


def test_rms_norm_without_weight():
    """No weight to multiply by: the match ends at x̂, whose weight is ones (was 4 sm90 kernels
    before the Linear that reads it, now 1 with the norm folded into it: the corpus' no-weight
    forms)."""
    after = apply_pass(FuseDecomposedNorms(), RMSNoWeightHalf)
    tvm.ir.assert_structural_equal(after, RMSNoWeightHalfExpected)
    assert_same_numerics(RMSNoWeightHalf, after, rtol=2e-3)


@I.ir_module
class LayerNormNoWeight:
    """LayerNorm without γ and β (``elementwise_affine=False`` spelled out)."""

    @R.function
    def main(x: R.Tensor((4, 64), "float32")) -> R.Tensor((4, 64), "float32"):
        with R.dataflow():
            mu = R.mean(x, axis=[-1], keepdims=True)
            d = R.subtract(x, mu)
            sq = R.multiply(d, d)
            var = R.mean(sq, axis=[-1], keepdims=True)
            ve = R.add(var, R.const(0.0009765625, "float32"))
            r = R.rsqrt(ve)
            y = R.multiply(d, r)
            R.output(y)
        return y


@I.ir_module
class LayerNormNoWeightExpected:
    @R.function
    def main(x: R.Tensor((4, 64), "float32")) -> R.Tensor((4, 64), "float32"):
        with R.dataflow():
            y = R.nn.layer_norm(x, R.const(np.ones(64, "float32")), R.const(np.zeros(64, "float32")),
                                axes=[-1], epsilon=0.0009765625)
            R.output(y)
        return y


def test_layer_norm_without_weight():
    """Not the weightless RMS rewrite of its centred half (``mean, subtract`` + ``rms_norm``)."""
    after = apply_pass(FuseDecomposedNorms(), LayerNormNoWeight)
    tvm.ir.assert_structural_equal(after, LayerNormNoWeightExpected)
    assert_same_numerics(LayerNormNoWeight, after)
