"""ONNX converters of ops TVM 0.27 lacks (CumProd, NonMaxSuppression, TfIdfVectorizer, Det) on
cases the ONNX node tests miss, compared with onnx's reference evaluator on random inputs."""

from __future__ import annotations

import numpy as np
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper
from onnx.reference import ReferenceEvaluator

import tvmfuse


def _model(node, inputs, outputs, inits=(), opset=26):
    graph = helper.make_graph([node], "g", inputs, outputs, list(inits))
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])
    model.ir_version = 10
    return model


def _ort(model, feed: dict) -> list:
    """onnxruntime's outputs (where the reference evaluator is wrong or refuses the form)."""
    return ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, feed)


def _numpy(value) -> np.ndarray:
    return value.cpu().numpy() if hasattr(value, "cpu") else np.asarray(value)


def _check(model, feeds: dict, exact: bool = False, runs=None, target: str = "cpu"):
    """tvmfuse's outputs against the reference evaluator's, for one or more feeds."""
    run = tvmfuse.compile(model, target=target).load("cpu" if target == "cpu" else "cuda")
    ref = ReferenceEvaluator(model)
    for feed in runs or [feeds]:
        got = run(*feed.values())
        got = [_numpy(g) for g in got] if isinstance(got, tuple | list) else [_numpy(got)]
        for g, w in zip(got, ref.run(None, feed), strict=True):
            assert g.shape == w.shape and g.dtype == w.dtype
            if exact:
                np.testing.assert_array_equal(g, w)
            else:
                np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("exclusive,reverse", [(0, 0), (1, 0), (0, 1), (1, 1)])
def test_cumprod_constant_axis(exclusive, reverse):
    """A constant (negative) axis of a 3-D tensor, with exclusive / reverse."""
    node = helper.make_node("CumProd", ["x", "a"], ["y"], exclusive=exclusive, reverse=reverse)
    model = _model(node, [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 5, 3])],
                   [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 5, 3])],
                   [helper.make_tensor("a", TensorProto.INT64, [], [-2])])
    x = np.random.default_rng(exclusive + 2 * reverse).uniform(0.5, 1.5, (2, 5, 3)).astype(np.float32)
    _check(model, {"x": x})


def test_cumprod_runtime_axis_each_axis():
    """One library, every axis of a 3-D int tensor chosen at run time (negative ones too)."""
    node = helper.make_node("CumProd", ["x", "a"], ["y"], reverse=1)
    model = _model(node, [helper.make_tensor_value_info("x", TensorProto.INT32, [2, 3, 4]),
                          helper.make_tensor_value_info("a", TensorProto.INT64, [])],
                   [helper.make_tensor_value_info("y", TensorProto.INT32, [2, 3, 4])])
    x = np.random.default_rng(0).integers(-3, 4, (2, 3, 4)).astype(np.int32)
    _check(model, {}, exact=True,
           runs=[{"x": x, "a": np.array(a, np.int64)} for a in (0, 1, 2, -1, -3)])


def _nms_model(center: int, optional: int):
    """NonMaxSuppression over (2, 12, 4) boxes and 3 classes, the first ``optional`` of
    (max, iou, score) as runtime inputs."""
    names = ["boxes", "scores", "max", "iou", "score"][: 2 + optional]
    node = helper.make_node("NonMaxSuppression", names, ["sel"], center_point_box=center)
    types = [(TensorProto.FLOAT, [2, 12, 4]), (TensorProto.FLOAT, [2, 3, 12]),
             (TensorProto.INT64, [1]), (TensorProto.FLOAT, [1]), (TensorProto.FLOAT, [1])]
    inputs = [helper.make_tensor_value_info(n, *t) for n, t in zip(names, types, strict=False)]
    return _model(node, inputs, [helper.make_tensor_value_info("sel", TensorProto.INT64, None)],
                  opset=11)


@pytest.mark.parametrize("center", [0, 1])
def test_nms_runtime_thresholds(center):
    """One library, several thresholds / limits: random (partly flipped) boxes, tied scores."""
    rng = np.random.default_rng(center)
    boxes = rng.uniform(0, 4, (2, 12, 4)).astype(np.float32)
    if center:
        boxes[..., 2:] = np.abs(boxes[..., 2:]) + 0.5
    scores = rng.integers(0, 6, (2, 3, 12)).astype(np.float32) / 5  # ties
    runs = [{"boxes": boxes, "scores": scores, "max": np.array([m], np.int64),
             "iou": np.array([i], np.float32), "score": np.array([s], np.float32)}
            for m, i, s in [(3, 0.3, 0.1), (12, 0.0, -1.0), (0, 0.5, 0.0), (5, 0.7, 0.5)]]
    _check(_nms_model(center, 3), {}, exact=True, runs=runs)


def test_nms_absent_inputs():
    """No max input: nothing selected (the reference evaluator fails on it: checked directly);
    no score threshold: every box is a candidate."""
    rng = np.random.default_rng(1)
    feed = {"boxes": rng.uniform(0, 4, (2, 12, 4)).astype(np.float32),
            "scores": rng.uniform(0, 1, (2, 3, 12)).astype(np.float32)}
    none = tvmfuse.compile(_nms_model(0, 0), target="cpu").load("cpu")(*feed.values())
    assert np.asarray(none).shape == (0, 3)
    feed |= {"max": np.array([4], np.int64), "iou": np.array([0.2], np.float32)}
    _check(_nms_model(0, 2), feed, exact=True)


def _tfidf_model(mode: str, weighted: bool = False):
    """1- to 3-grams with skips, two grams sharing an output column; (3, 10) int64 rows."""
    pool = [1, 2, 3, 1, 2, 2, 3, 3, 1, 1, 2, 3, 2, 2, 2]  # 3 unigrams, 3 bigrams, 2 trigrams
    attrs = dict(mode=mode, min_gram_length=1, max_gram_length=3, max_skip_count=2,
                 ngram_counts=[0, 3, 9], ngram_indexes=[0, 1, 2, 3, 4, 5, 6, 3], pool_int64s=pool)
    if weighted:
        attrs["weights"] = [0.5, 1.0, 2.0, 1.5, 0.25, 3.0, 4.0]
    node = helper.make_node("TfIdfVectorizer", ["x"], ["y"], **attrs)
    model = _model(node, [helper.make_tensor_value_info("x", TensorProto.INT64, [3, 10])],
                   [helper.make_tensor_value_info("y", TensorProto.FLOAT, [3, 7])], opset=9)
    return model


@pytest.mark.parametrize("mode,weighted", [("TF", False), ("IDF", True), ("TFIDF", True)])
def test_tfidf_modes_trigrams(mode, weighted):
    x = np.random.default_rng(len(mode)).integers(0, 4, (3, 10)).astype(np.int64)
    _check(_tfidf_model(mode, weighted), {"x": x})


def test_tfidf_idf_without_weights():
    """IDF without weights is tf > 0 (the reference evaluator fails on it: checked against TF)."""
    x = np.random.default_rng(5).integers(0, 4, (3, 10)).astype(np.int64)
    tf, idf = (np.asarray(tvmfuse.compile(_tfidf_model(m, False), target="cpu").load("cpu")(x))
               for m in ("TF", "IDF"))
    assert tf.max() > 1 and 0 < (tf > 0).sum() < tf.size
    np.testing.assert_array_equal(idf, (tf > 0).astype(np.float32))


@pytest.mark.parametrize("shape", [(2, 3, 5, 5), (1, 1), (7, 7)])
def test_det_against_numpy(shape):
    """Batched, 1×1 and larger matrices; one singular matrix, one that needs row swaps."""
    node = helper.make_node("Det", ["x"], ["y"])
    model = _model(node, [helper.make_tensor_value_info("x", TensorProto.FLOAT, list(shape))],
                   [helper.make_tensor_value_info("y", TensorProto.FLOAT, list(shape[:-2]))], opset=22)
    x = np.random.default_rng(len(shape)).standard_normal(shape).astype(np.float32)
    if len(shape) == 4:
        x[0, 1, 2] = x[0, 1, 0] * 2  # singular
        x[1, 0] = np.eye(5, dtype=np.float32)[::-1]  # a permutation: det ±1 only with pivoting
    got = np.asarray(tvmfuse.compile(model, target="cpu").load("cpu")(x))
    want = np.linalg.det(x.astype(np.float64))
    assert got.shape == want.shape
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("inverse,onesided", [(0, 1), (1, 0), (1, 1)])
def test_dft_runtime_axis(inverse, onesided):
    """One library, every signal axis (of lengths 3, 6, 5) chosen at run time; the output's
    shape follows the axis. The re / im axis fails the call."""
    shape = [3, 6, 5, 2 if inverse else 1]
    node = helper.make_node("DFT", ["x", "", "a"], ["y"], inverse=inverse, onesided=onesided)
    model = _model(node, [helper.make_tensor_value_info("x", TensorProto.FLOAT, shape),
                          helper.make_tensor_value_info("a", TensorProto.INT64, [])],
                   [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)], opset=20)
    x = np.random.default_rng(inverse + 2 * onesided).standard_normal(shape).astype(np.float32)
    run = tvmfuse.compile(model, target="cpu").load("cpu")
    sig = x[..., 0] + 1j * x[..., 1] if inverse else x[..., 0]
    for axis in (0, 1, 2, -2, -3):
        a = axis % 4  # ONNX counts a negative axis from the back of x, re / im axis included
        if inverse and onesided:
            want = np.fft.irfft(sig, axis=a)[..., None]
        else:
            f = (np.fft.ifft if inverse else np.fft.fft)(sig, axis=a)
            if onesided:
                f = np.moveaxis(np.moveaxis(f, a, 0)[: sig.shape[a] // 2 + 1], 0, a)
            want = np.stack([f.real, f.imag], -1)
        got = np.asarray(run(x, np.array(axis, np.int64)))
        assert got.shape == want.shape
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)
    with pytest.raises(tvmfuse.errors.InputError, match="run-time check"):
        run(x, np.array(3, np.int64))


@pytest.mark.parametrize("runtime", [True, False])
def test_col2im_strides_pads_dilations(runtime):
    """Strides, asymmetric pads and dilations together, shapes as runtime inputs or initializers;
    a block shape that does not match the input fails the call."""
    attrs = dict(strides=[2, 1], pads=[1, 0, 0, 2], dilations=[2, 1])
    node = helper.make_node("Col2Im", ["x", "img", "blk"], ["y"], **attrs)
    img, blk = np.array([7, 6], np.int64), np.array([2, 3], np.int64)
    # blocks: (7 + 1 - 2 - 1) // 2 + 1 = 3, (6 + 2 - 2 - 1) // 1 + 1 = 6
    x_info = helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 3 * 6, 18])
    y_info = helper.make_tensor_value_info("y", TensorProto.FLOAT, None)
    shapes = [helper.make_tensor_value_info(n, TensorProto.INT64, [2]) for n in ("img", "blk")]
    inits = [helper.make_tensor(n, TensorProto.INT64, [2], v) for n, v in (("img", img), ("blk", blk))]
    model = _model(node, [x_info, *shapes] if runtime else [x_info], [y_info],
                   () if runtime else inits, opset=18)
    x = np.random.default_rng(7).standard_normal((2, 18, 18)).astype(np.float32)
    _check(model, {"x": x, "img": img, "blk": blk} if runtime else {"x": x})
    if runtime:
        run = tvmfuse.compile(model, target="cpu").load("cpu")
        with pytest.raises(tvmfuse.errors.InputError, match="run-time check"):
            run(x, img, np.array([3, 3], np.int64))


@pytest.mark.parametrize("mode", ["DCR", "CRD"])
def test_space_to_depth_modes(mode):
    """Both channel orderings (0.27's converter knows only DCR), block 2 over (2, 3, 4, 6)."""
    node = helper.make_node("SpaceToDepth", ["x"], ["y"], blocksize=2, mode=mode)
    model = _model(node, [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 3, 4, 6])],
                   [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 12, 2, 3])], opset=25)
    _check(model, {"x": np.random.default_rng(3).standard_normal((2, 3, 4, 6)).astype(np.float32)},
           exact=True)


@pytest.mark.parametrize("dtype", [TensorProto.INT8, TensorProto.UINT8, TensorProto.INT16])
def test_blocked_quantize_dequantize(dtype):
    """Blocks of 2 over an axis of 5 (the last block short), ties at .5, saturation; the
    round trip through DequantizeLinear."""
    rng = np.random.default_rng(dtype)
    np_dtype = {TensorProto.INT8: np.int8, TensorProto.UINT8: np.uint8, TensorProto.INT16: np.int16}[dtype]
    scale = rng.uniform(0.05, 0.5, (3, 3)).astype(np.float32)  # (4, 5) blocked along axis 1
    zp = rng.integers(0, 20, (3, 3)).astype(np_dtype)
    s_full = np.repeat(scale, 2, axis=1)[:, :5]
    x = ((rng.integers(-300, 300, (3, 5)) + 0.5) * s_full).astype(np.float32)  # ties
    q = helper.make_node("QuantizeLinear", ["x", "s", "z"], ["q"], axis=1, block_size=2)
    dq = helper.make_node("DequantizeLinear", ["q", "s", "z"], ["y"], axis=1, block_size=2)
    graph = helper.make_graph([q, dq], "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [3, 5])],
                              [helper.make_tensor_value_info("q", dtype, [3, 5]),
                               helper.make_tensor_value_info("y", TensorProto.FLOAT, [3, 5])],
                              [helper.make_tensor("s", TensorProto.FLOAT, [3, 3], scale.ravel()),
                               helper.make_tensor("z", dtype, [3, 3], zp.ravel())])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21)])
    model.ir_version = 10
    _check(model, {"x": x}, exact=True)


@pytest.mark.parametrize("attrs", [dict(kernel_shape=[3, 2], strides=[2, 1], pads=[1, 0, 1, 1]),
                                   dict(kernel_shape=[2, 2], dilations=[2, 1], storage_order=1),
                                   dict(kernel_shape=[3, 3], pads=[1, 1, 1, 1])])
def test_maxpool_indices(attrs):
    """Values and first-maximum indices (ties: small integers), batch 2 × 3 channels, against
    onnxruntime (the reference evaluator's stride-1 path returns negative indices with pads)."""
    node = helper.make_node("MaxPool", ["x"], ["y", "i"], **attrs)
    model = _model(node, [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 3, 6, 5])],
                   [helper.make_tensor_value_info("y", TensorProto.FLOAT, None),
                    helper.make_tensor_value_info("i", TensorProto.INT64, None)], opset=12)
    x = np.random.default_rng(len(attrs)).integers(-3, 4, (2, 3, 6, 5)).astype(np.float32)
    want = _ort(model, {"x": x})
    got = tvmfuse.compile(model, target="cpu").load("cpu")(x)
    for g, w in zip(got, want, strict=True):
        np.testing.assert_array_equal(np.asarray(g), w)


@pytest.mark.parametrize("auto_pad,out", [("SAME_UPPER", [5, 6]), ("SAME_LOWER", [6, 5]),
                                          ("NOTSET", [8, 8]), ("SAME_LOWER", [8, 7])])
def test_convtranspose_output_shape(auto_pad, out):
    """output_shape under each auto_pad (natural size 7 × 7), 2 groups and a bias, against
    onnxruntime; a form where the runtimes disagree is refused."""
    node = helper.make_node("ConvTranspose", ["x", "w", "b"], ["y"], strides=[2, 2], group=2,
                            output_shape=out, auto_pad=auto_pad)
    rng = np.random.default_rng(len(auto_pad))
    feed = {"x": rng.standard_normal((1, 4, 3, 3)).astype(np.float32),
            "w": rng.standard_normal((4, 3, 3, 3)).astype(np.float32),
            "b": rng.standard_normal(6).astype(np.float32)}
    inputs = [helper.make_tensor_value_info(n, TensorProto.FLOAT, v.shape) for n, v in feed.items()]
    model = _model(node, inputs, [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)], opset=17)
    (want,) = _ort(model, feed)
    got = np.asarray(tvmfuse.compile(model, target="cpu").load("cpu")(*feed.values()))
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


def test_convtranspose_output_shape_refused():
    node = helper.make_node("ConvTranspose", ["x", "w"], ["y"], strides=[2, 2], output_shape=[5, 5])
    model = _model(node, [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 1, 3, 3]),
                          helper.make_tensor_value_info("w", TensorProto.FLOAT, [1, 1, 3, 3])],
                   [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)], opset=17)
    with pytest.raises(tvmfuse.errors.UnsupportedOpError, match="ConvTranspose attribute output_shape"):
        tvmfuse.compile(model, target="cpu")


def test_deform_conv_groups_strides_mask():
    """2 groups, 2 offset groups, strides / pads / dilations, offsets reaching outside the
    image, mask and bias, against the reference evaluator."""
    rng = np.random.default_rng(11)
    feed = {"x": rng.standard_normal((2, 4, 5, 6)), "w": rng.standard_normal((6, 2, 2, 3)),
            "offset": rng.uniform(-2.5, 2.5, (2, 2 * 2 * 6, 5, 3)), "b": rng.standard_normal(6),
            "mask": rng.uniform(0, 1, (2, 2 * 6, 5, 3))}
    feed = {k: v.astype(np.float32) for k, v in feed.items()}
    node = helper.make_node("DeformConv", list(feed), ["y"], group=2, offset_group=2, strides=[1, 2],
                            pads=[1, 0, 1, 1], dilations=[2, 1], kernel_shape=[2, 3])
    inputs = [helper.make_tensor_value_info(n, TensorProto.FLOAT, v.shape) for n, v in feed.items()]
    model = _model(node, inputs, [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 6, 5, 3])],
                   opset=19)
    _check(model, feed)


@pytest.mark.parametrize("mode", ["avg", "max"])
@pytest.mark.parametrize("transform,ratio", [("half_pixel", 0), ("output_half_pixel", 2), ("half_pixel", 3)])
def test_roi_align(mode, transform, ratio):
    """Both modes and transforms, spatial_scale 0.5 (0.27 shifted before scaling), adaptive and
    fixed sampling grids, rois reaching outside the map, two images."""
    node = helper.make_node("RoiAlign", ["x", "rois", "idx"], ["y"], mode=mode, output_height=3,
                            output_width=4, sampling_ratio=ratio, spatial_scale=0.5,
                            coordinate_transformation_mode=transform)
    rng = np.random.default_rng(ratio)
    corner = rng.uniform(-4, 16, (5, 2))
    feed = {"x": rng.standard_normal((2, 3, 8, 9)).astype(np.float32),
            "rois": np.concatenate([corner, corner + rng.uniform(0.5, 12, (5, 2))], 1).astype(np.float32),
            "idx": rng.integers(0, 2, 5).astype(np.int64)}
    inputs = [helper.make_tensor_value_info(n, TensorProto.INT64 if n == "idx" else TensorProto.FLOAT,
                                            v.shape) for n, v in feed.items()]
    model = _model(node, inputs, [helper.make_tensor_value_info("y", TensorProto.FLOAT, [5, 3, 3, 4])],
                   opset=16)
    _check(model, feed)


@pytest.mark.parametrize("mode", ["nearest", "linear"])
def test_upsample_against_onnxruntime(mode):
    """Runtime scales (opset 9), two calls of one library with different scales, fractional
    ones included; the opset-7 attribute form."""
    x = np.random.default_rng(4).standard_normal((1, 2, 3, 4)).astype(np.float32)
    node = helper.make_node("Upsample", ["x", "s"], ["y"], mode=mode)
    model = _model(node, [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 2, 3, 4]),
                          helper.make_tensor_value_info("s", TensorProto.FLOAT, [4])],
                   [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)], opset=9)
    run = tvmfuse.compile(model, target="cpu").load("cpu")
    for scales in ([1, 1, 2, 3], [1, 1, 1.5, 2.7]):
        feed = {"x": x, "s": np.array(scales, np.float32)}
        got = np.asarray(run(*feed.values()))
        np.testing.assert_allclose(got, _ort(model, feed)[0], rtol=1e-5, atol=1e-6)
    node7 = helper.make_node("Upsample", ["x"], ["y"], mode=mode, scales=[1.0, 1.0, 2.0, 1.5])
    model7 = _model(node7, [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 2, 3, 4])],
                    [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)], opset=7)
    got = np.asarray(tvmfuse.compile(model7, target="cpu").load("cpu")(x))
    np.testing.assert_allclose(got, _ort(model7, {"x": x})[0], rtol=1e-5, atol=1e-6)


def _stft_numpy(sig: np.ndarray, step: int, length: int, window: np.ndarray, onesided: bool) -> np.ndarray:
    frames = 1 + (sig.shape[1] - length) // step
    cut = np.stack([sig[:, f * step: f * step + length] * window for f in range(frames)], 1)
    spec = np.fft.fft(cut, axis=-1)[..., : length // 2 + 1 if onesided else length]
    return np.stack([spec.real, spec.imag], -1)


def test_stft_runtime_step_and_length():
    """Complex signal, two-sided; step and frame length are runtime scalars, so one library
    serves two framings (different output shapes)."""
    node = helper.make_node("STFT", ["x", "s", "", "n"], ["y"], onesided=0)
    model = _model(node, [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 40, 2]),
                          helper.make_tensor_value_info("s", TensorProto.INT64, []),
                          helper.make_tensor_value_info("n", TensorProto.INT64, [])],
                   [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)], opset=17)
    x = np.random.default_rng(2).standard_normal((2, 40, 2)).astype(np.float32)
    run = tvmfuse.compile(model, target="cpu").load("cpu")
    for step, length in ((4, 12), (7, 9)):
        got = np.asarray(run(x, np.array(step, np.int64), np.array(length, np.int64)))
        want = _stft_numpy(x[..., 0] + 1j * x[..., 1], step, length, np.ones(length), False)
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)


def test_stft_window_onesided():
    """A Hann window (its length the frame length), real signal, one-sided; a frame_length that
    contradicts the window fails the call."""
    node = helper.make_node("STFT", ["x", "s", "w", "n"], ["y"])
    window = np.hanning(10).astype(np.float32)
    model = _model(node, [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 33, 1]),
                          helper.make_tensor_value_info("s", TensorProto.INT64, []),
                          helper.make_tensor_value_info("n", TensorProto.INT64, [])],
                   [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
                   [helper.make_tensor("w", TensorProto.FLOAT, [10], window)], opset=17)
    x = np.random.default_rng(3).standard_normal((1, 33, 1)).astype(np.float32)
    run = tvmfuse.compile(model, target="cpu").load("cpu")
    got = np.asarray(run(x, np.array(3, np.int64), np.array(10, np.int64)))
    np.testing.assert_allclose(got, _stft_numpy(x[..., 0], 3, 10, window, True), rtol=1e-4, atol=1e-4)
    with pytest.raises(tvmfuse.errors.InputError, match="run-time check"):
        run(x, np.array(3, np.int64), np.array(12, np.int64))


def test_mel_weight_matrix_runtime_parameters():
    """One library, three parameter sets (three output shapes) against the reference evaluator;
    upper < lower fails the call."""
    names = ["m", "d", "r", "lo", "hi"]
    node = helper.make_node("MelWeightMatrix", names, ["w"])
    types = [TensorProto.INT32] * 3 + [TensorProto.FLOAT] * 2
    model = _model(node, [helper.make_tensor_value_info(n, t, []) for n, t in zip(names, types, strict=True)],
                   [helper.make_tensor_value_info("w", TensorProto.FLOAT, None)], opset=17)

    def feed(m, d, r, lo, hi):
        ints = [np.array(v, np.int32) for v in (m, d, r)]
        return dict(zip(names, [*ints, np.array(lo, np.float32), np.array(hi, np.float32)], strict=True))

    runs = [feed(8, 64, 16000, 0.0, 8000.0), feed(5, 30, 8000, 100.0, 3000.0),
            feed(3, 256, 22050, 20.0, 400.0)]
    _check(model, {}, runs=runs)
    with pytest.raises(tvmfuse.errors.InputError, match="run-time check"):
        tvmfuse.compile(model, target="cpu").load("cpu")(*feed(4, 64, 16000, 500.0, 100.0).values())


@pytest.mark.gpu
def test_sequential_and_data_dependent_kernels_sm90():
    """NonMaxSuppression and Det (sequential te.extern kernels), TfIdfVectorizer and Col2Im
    (runtime-bound dims) under the GPU schedule rules."""
    rng = np.random.default_rng(0)
    nms = {"boxes": rng.uniform(0, 4, (2, 12, 4)).astype(np.float32),
           "scores": rng.uniform(0, 1, (2, 3, 12)).astype(np.float32), "max": np.array([3], np.int64),
           "iou": np.array([0.3], np.float32), "score": np.array([0.2], np.float32)}
    _check(_nms_model(0, 3), nms, exact=True, target="sm90")
    det = helper.make_node("Det", ["x"], ["y"])
    det_model = _model(det, [helper.make_tensor_value_info("x", TensorProto.FLOAT, [3, 4, 4])],
                       [helper.make_tensor_value_info("y", TensorProto.FLOAT, [3])], opset=22)
    _check(det_model, {"x": rng.standard_normal((3, 4, 4)).astype(np.float32)}, target="sm90")
    _check(_tfidf_model("TF"), {"x": rng.integers(0, 4, (3, 10)).astype(np.int64)}, target="sm90")
    # blocks (7 - 2) // 2 + 1 = 3 by (4 - 3) // 1 + 1 = 2: L = 6 columns of C·2·3 = 6 (the session-9
    # version fed L = 12, which the run-time check refused on every target, rightly)
    col = helper.make_node("Col2Im", ["x", "img", "blk"], ["y"], strides=[2, 1])
    col_model = _model(col, [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 6, 6]),
                             helper.make_tensor_value_info("img", TensorProto.INT64, [2]),
                             helper.make_tensor_value_info("blk", TensorProto.INT64, [2])],
                       [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)], opset=18)
    _check(col_model, {"x": rng.standard_normal((1, 6, 6)).astype(np.float32),
                       "img": np.array([7, 4], np.int64), "blk": np.array([2, 3], np.int64)}, target="sm90")


@pytest.mark.parametrize("fmod", [0, 1])
@pytest.mark.parametrize("elem", [TensorProto.FLOAT16, TensorProto.BFLOAT16])
def test_mod_half_builds_for_sm90(fmod, elem, tmp_path):
    """16-bit ``Mod`` takes its remainder in float32 (CUDA has no half fmod: codegen refused it);
    fp16 on cpu matches the reference evaluator bit for bit, both signs and fmod values."""
    node = helper.make_node("Mod", ["x", "y"], ["z"], fmod=fmod)
    model = _model(node, [helper.make_tensor_value_info(n, elem, [2, 6]) for n in ("x", "y")],
                   [helper.make_tensor_value_info("z", elem, [2, 6])], opset=13)
    assert tvmfuse.compile(model, target="sm90").export(tmp_path / "mod.so").is_file()
    if elem == TensorProto.FLOAT16:
        x = np.array([[-4.3, 7.2, 5.0, 4.3, -7.2, 8.0], [0.5, -0.5, 65504, -3.75, 1e-3, 0]], np.float16)
        y = np.array([[2.1, -3.4, 8.0, -2.1, 3.4, 5.0], [0.3, 0.3, 7.0, 1.5, -3e-4, 2]], np.float16)
        _check(model, {"x": x, "y": y}, exact=True)


def test_det_kernel_runs_on_the_gpu_sm90(tmp_path):
    """Det's sequential LU kernel (one opaque block, which no dlight rule takes) becomes a one-
    thread CUDA kernel; unbound, relax.build compiled it for the host, where it would read
    device memory (and test_det_nd's library held no CUDA module at all)."""
    from tvmfuse.build.inspect import cuda_images, cuda_source

    node = helper.make_node("Det", ["x"], ["y"])
    model = _model(node, [helper.make_tensor_value_info("x", TensorProto.FLOAT, [3, 2, 2])],
                   [helper.make_tensor_value_info("y", TensorProto.FLOAT, [3])], opset=22)
    lib = tvmfuse.compile(model, target="sm90")
    source = cuda_source(lib.executable) or ""
    assert "__global__" in source and "det_ptr" in source
    (fmt, _), = cuda_images(lib.export(tmp_path / "det.so"))
    assert fmt == "fatbin"
