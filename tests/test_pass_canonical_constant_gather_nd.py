"""ConstantGatherND: ``gather_nd`` with constant indices → a reshape, or a ``take`` that fuses.

torch.onnx's dynamo exporter writes transformers' padding mask ``mask[batch_idx, kv_idx]`` as
GatherND with a constant index grid; TVM legalises that into two blocks (index transpose + gather),
which stay an opaque kernel of their own. Structure (Before / Expected), the cases left alone,
numerics on llvm against numpy, and BERT's dynamo export at its TorchScript export's kernel count.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest
import tvm
from tvm.ir.expr import Constant
from tvm.script import ir as I
from tvm.script import relax as R

from models import hf_models
from tests.canonical_util import apply, run_outputs
from tvmfuse.frontend import import_model
from tvmfuse.passes.canonical import ConstantGatherND
from tvmfuse.report import analyze
from tvmfuse.targets import get_target

GRID = np.stack(np.meshgrid(np.arange(2), np.arange(16), indexing="ij"), -1).reshape(2, 1, 1, 16, 2)
PICK = np.array([[2, 1], [-1, 0]], "int64")  # rows (2, 1) and (2, 0) of a (3, 4, 5) tensor


@I.ir_module
class Before:
    @R.function
    def main(m: R.Tensor((2, 16), "bool"), x: R.Tensor((3, 4, 5), "float32"),
             y: R.Tensor((5, 3), "float32")):
        with R.dataflow():
            a = R.gather_nd(m, R.const(GRID, "int64"))
            b = R.gather_nd(x, R.const(PICK, "int64"))
            c = R.gather_nd(y, R.const(np.array([[4], [0]]), "int64"))
            out = (a, b, c)
            R.output(out)
        return out


@I.ir_module
class Expected:
    @R.function
    def main(m: R.Tensor((2, 16), "bool"), x: R.Tensor((3, 4, 5), "float32"),
             y: R.Tensor((5, 3), "float32")):
        with R.dataflow():
            a = R.reshape(m, (2, 1, 1, 16))
            t = R.reshape(x, (12, 5))
            b = R.take(t, R.const(np.array([9, 8]), "int64"), axis=0)
            c = R.take(y, R.const(np.array([4, 0]), "int64"), axis=0)
            out = (a, b, c)
            R.output(out)
        return out


@I.ir_module
class LeftAlone:
    @R.function
    def main(x: R.Tensor((3, 4), "float32"), i: R.Tensor((2, 2), "int64"),
             z: R.Tensor((2, 3, 4), "float32")):
        with R.dataflow():
            a = R.gather_nd(x, i)  # computed at run time
            b = R.gather_nd(x, R.const(np.array([[3, 0]]), "int64"))  # out of range
            c = R.gather_nd(z, R.const(np.array([[1], [2]]), "int64"), batch_dims=1)
            out = (a, b, c)
            R.output(out)
        return out


def test_index_grids_become_views_and_takes():
    tvm.ir.assert_structural_equal(apply(ConstantGatherND(), Before), Expected)


def test_runtime_out_of_range_and_batched_indices_stay():
    tvm.ir.assert_structural_equal(apply(ConstantGatherND(), LeftAlone), LeftAlone)


def _gather_nd(data: np.ndarray, index: np.ndarray) -> np.ndarray:
    """ONNX GatherND (batch_dims 0): data[tuple(index[..., k] for k)]."""
    return data[tuple(np.moveaxis(index, -1, 0))]


def test_numerics_match_numpy_gather_nd():
    """The rewrite equals numpy's gather everywhere; TVM's own ``gather_nd`` agrees where the
    indices are non-negative (it reads before the buffer for PICK's -1, which the rewrite wraps)."""
    rng = np.random.default_rng(0)
    arrays = (rng.random((2, 16)) < 0.5, rng.standard_normal((3, 4, 5)).astype("float32"),
              rng.standard_normal((5, 3)).astype("float32"))
    refs = [_gather_nd(a, i) for a, i in zip(arrays, (GRID, PICK, np.array([[4], [0]])))]
    after, before = run_outputs(apply(ConstantGatherND(), Before), *arrays), run_outputs(Before, *arrays)
    for out, ref in zip(after, refs):
        np.testing.assert_array_equal(out, ref)
    for k in (0, 2):
        np.testing.assert_array_equal(before[k], refs[k])


@pytest.fixture(scope="module")
def onnx_dir(tmp_path_factory) -> Path:
    keep = os.environ.get("TVMFUSE_HF_ONNX_DIR")
    return Path(keep) if keep else tmp_path_factory.mktemp("hf_onnx")


def test_bert_dynamo_export_as_many_kernels_as_torchscript(onnx_dir):
    counts = {}
    for exporter in ("torchscript", "dynamo"):
        model = import_model(str(hf_models.MODELS["bert"](onnx_dir, exporter)))
        report = analyze(model.mod, get_target("sm90"))
        counts[exporter] = report["fused_kernel_count"]
        names = [k["name"] for k in report["kernels"]]
        assert not [n for n in names if "gather_nd" in n], (exporter, names)
    assert counts["dynamo"] == counts["torchscript"], counts


def test_onnx_gather_nd_with_initializer_indices(tmp_path):
    """An ONNX GatherND whose indices are an initializer with a negative entry: the importer keeps
    them constant (wrapped), the pass makes a ``take``, and the cpu build equals numpy's gather."""
    import onnx
    from onnx import helper, numpy_helper

    import tvmfuse

    index = np.array([[[2, -1], [0, 3]], [[-3, 0], [1, 1]]], "int64")  # (2, 2, 2) into (3, 4, 5)
    x = helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, [3, 4, 5])
    y = helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, [2, 2, 5])
    graph = helper.make_graph([helper.make_node("GatherND", ["x", "i"], ["y"])], "g", [x], [y],
                              initializer=[numpy_helper.from_array(index, "i")])
    path = tmp_path / "gather_nd.onnx"
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=10),
              path)
    lib = tvmfuse.compile(str(path), target="cpu")
    (call,) = [b.value for blk in lib.model.mod["main"].body.blocks for b in blk.bindings
               if getattr(getattr(b.value, "op", None), "name", "") == "relax.gather_nd"]
    assert isinstance(call.args[1], Constant), call.args[1]  # not a where over the run-time shape
    np.testing.assert_array_equal(call.args[1].value.numpy(), np.where(index < 0, index + [3, 4], index))
    after = apply(ConstantGatherND(), lib.model.mod)
    assert "R.take" in after.script() and "gather_nd" not in after.script()
    data = np.random.default_rng(1).standard_normal((3, 4, 5)).astype("float32")
    np.testing.assert_array_equal(lib.load()(data), _gather_nd(data, index))
