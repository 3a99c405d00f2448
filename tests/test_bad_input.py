"""Bad input, end to end (issue 16): each case gives a tvmfuse error naming what and where, or the
right answer; never a crash, a raw Python / TVM exception or silent wrong numbers.

Models: one tiny ONNX graph ``y = softmax(relu(x·W + b))``, ``z = exp(x) * 0.5`` (x: 2×4), built for
cpu once per module (and for sm90 once, for the wrong-GPU cases; the CPU machine builds the fatbin
with nvcc and fakes the GPU). GPU cases carry ``@pytest.mark.gpu``.
"""

from __future__ import annotations

import errno
import json
import os
import shutil
import subprocess
import sys
import threading
from pathlib import Path

import numpy as np
import onnx
import pytest
import torch
from onnx import TensorProto, helper, numpy_helper

import tvmfuse
import tvmfuse.runtime as rt
from tvmfuse.errors import CompileError, DeviceError, InputError, LibraryError, ModelError
from tvmfuse.tuning_db import RECORD_FILE, TASKS_FILE, WORKLOAD_FILE, TuningDatabase

REPO = Path(__file__).resolve().parents[1]
SHIPPED_DB = REPO / "schedules" / "sm90" / "bias_relu_4096x4096x4096_fp16"


def _tiny_onnx(opset: int = 17, with_initializers: bool = True) -> onnx.ModelProto:
    """y = Softmax(Relu(x·W + b)), z = Exp(x) * 0.5; x: float32 (2, 4)."""
    rng = np.random.default_rng(0)
    w = numpy_helper.from_array(rng.standard_normal((4, 4)).astype(np.float32), "W")
    b = numpy_helper.from_array(rng.standard_normal(4).astype(np.float32), "b")
    half = numpy_helper.from_array(np.array(0.5, np.float32), "half")
    nodes = [
        helper.make_node("MatMul", ["x", "W"], ["xw"], name="matmul0"),
        helper.make_node("Add", ["xw", "b"], ["xwb"], name="add0"),
        helper.make_node("Relu", ["xwb"], ["r"], name="relu0"),
        helper.make_node("Softmax", ["r"], ["y"], name="softmax0", axis=-1),
        helper.make_node("Exp", ["x"], ["e"], name="exp0"),
        helper.make_node("Mul", ["e", "half"], ["z"], name="mul0"),
    ]
    graph = helper.make_graph(
        nodes, "tiny", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 4])],
        [helper.make_tensor_value_info(n, TensorProto.FLOAT, [2, 4]) for n in ("y", "z")],
        initializer=[w, b, half] if with_initializers else [half])
    # IR version 10: what onnx 1.16+ writes by default is newer than older onnxruntimes read
    # (the H200's reads at most 13), and the references here come from onnxruntime.
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)], ir_version=10)


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> dict[str, Path]:
    """The tiny model as .onnx and its cpu and sm90 libraries (built once)."""
    d = tmp_path_factory.mktemp("bad_input")
    onnx.save(_tiny_onnx(), d / "tiny.onnx")
    lib = tvmfuse.compile(str(d / "tiny.onnx"), target="cpu")
    return {"dir": d, "onnx": d / "tiny.onnx", "cpu": lib.export(d / "tiny_cpu.so")}


@pytest.fixture(scope="module")
def sm90_lib(files) -> Path:
    return tvmfuse.compile(str(files["onnx"]), target="sm90").export(files["dir"] / "tiny_sm90.so")


@pytest.fixture(scope="module")
def model(files):
    return tvmfuse.load(files["cpu"], device="cpu")


def _ort(x: np.ndarray) -> list[np.ndarray]:
    import onnxruntime as ort

    sess = ort.InferenceSession(_tiny_onnx().SerializeToString(), providers=["CPUExecutionProvider"])
    return sess.run(None, {"x": x})


# ---------------------------------------------------------------------------------------- model files

@pytest.mark.parametrize("damage", ["truncated", "garbage", "empty"])
def test_damaged_onnx_file(files, tmp_path, damage):
    data = files["onnx"].read_bytes()
    bad = tmp_path / f"{damage}.onnx"
    bad.write_bytes({"truncated": data[: len(data) // 2],
                     "garbage": np.random.default_rng(1).bytes(300), "empty": b""}[damage])
    with pytest.raises(ModelError, match=f"{damage}.onnx.*(not a readable ONNX|empty graph)"):
        tvmfuse.compile(str(bad), target="cpu")


def test_missing_external_data_file(tmp_path):
    path = tmp_path / "ext.onnx"
    onnx.save(_tiny_onnx(), path, save_as_external_data=True, all_tensors_to_one_file=True,
              location="ext.weights", size_threshold=0)
    (tmp_path / "ext.weights").unlink()
    with pytest.raises(ModelError, match=r"ext.onnx: cannot read the model's external data.*"
                                         r"tensor name: W\).*ext.weights"):
        tvmfuse.compile(str(path), target="cpu")


def test_opset_newer_than_onnx_knows(tmp_path):
    newest = onnx.defs.onnx_opset_version()
    path = tmp_path / "future.onnx"
    onnx.save(_tiny_onnx(opset=newest + 1), path)
    with pytest.raises(ModelError, match=f"future.onnx: the model imports ONNX opset {newest + 1}; "
                                         f"the installed onnx .* knows opsets up to {newest}"):
        tvmfuse.compile(str(path), target="cpu")


def test_missing_initializer(tmp_path):
    path = tmp_path / "noinit.onnx"
    onnx.save(_tiny_onnx(with_initializers=False), path)
    with pytest.raises(ModelError, match=r"noinit.onnx: node 'matmul0' \(op MatMul\) reads tensor "
                                         r"'W', which is no graph input, initializer"):
        tvmfuse.compile(str(path), target="cpu")


# ---------------------------------------------------------------------------------------- calls

def test_nan_and_inf_propagate_like_onnxruntime(model):
    x = np.random.default_rng(2).standard_normal((2, 4)).astype(np.float32)
    x[0, 1], x[1, 0], x[1, 3] = np.nan, np.inf, -np.inf
    outs, refs = model(x), _ort(x)
    for out, ref in zip(outs, refs):
        np.testing.assert_array_equal(np.isnan(out), np.isnan(ref))
        np.testing.assert_array_equal(np.isposinf(out), np.isposinf(ref))
        np.testing.assert_allclose(out, ref, rtol=1e-5, atol=1e-6, equal_nan=True)
    assert np.isnan(outs[0][0]).all() and np.isposinf(outs[1][1, 0]) and outs[1][1, 3] == 0


def _bad_calls():
    x = np.ones((2, 4), np.float32)
    return {
        "no inputs": ((), {}, r"missing input\(s\) \['x'\]; the library takes \['x'\]"),
        "two inputs": ((x, x), {}, r"2 inputs given, the library takes 1: \['x'\]"),
        "unknown name": ((), {"X": x}, r"unknown input name\(s\) \['X'\]; the library's inputs are"),
        "given twice": ((x,), {"x": x}, "input 'x' given twice"),
        "numpy shape": ((np.ones((4, 2), np.float32),), {},
                        r"input 0 'x': expected shape \[2, 4\], got \[4, 2\]"),
        "numpy rank": ((np.ones(8, np.float32),), {}, r"input 0 'x': expected shape \[2, 4\], got \[8\]"),
        "numpy dtype": ((x.astype(np.float16),), {}, "input 0 'x': expected dtype float32, got float16"),
        "torch dtype": ((torch.ones(2, 4, dtype=torch.float64),), {},
                        "input 0 'x': expected dtype float32, got float64"),
        "torch int": ((torch.ones(2, 4, dtype=torch.int32),), {},
                      "input 0 'x': expected dtype float32, got int32"),
        "torch shape": ((torch.ones(3, 4),), {}, r"input 0 'x': expected shape \[2, 4\], got \[3, 4\]"),
        "python list": (([[1.0] * 4] * 2,), {}, "input 0 'x': expected a torch.Tensor or numpy.ndarray"),
    }


@pytest.mark.parametrize("case", list(_bad_calls()))
def test_wrong_inputs_at_call(model, case):
    args, kwargs, msg = _bad_calls()[case]
    with pytest.raises(InputError, match=msg):
        model(*args, **kwargs)


def test_eight_threads_one_model(model):
    """8 threads call one loaded model at once (torch fast path and numpy path alternating): every
    result equals the single-threaded one. The VM is not thread-safe; the runtime serialises calls
    (without the lock this segfaulted in StorageObj::AllocTensor)."""
    rng = np.random.default_rng(3)
    xs = [rng.standard_normal((2, 4)).astype(np.float32) for _ in range(8)]
    expected = [model(x) for x in xs]
    barrier, got, errors = threading.Barrier(8), {}, []

    def work(i: int) -> None:
        try:
            barrier.wait()
            got[i] = [model(xs[i]) if k % 2 else tuple(t.numpy() for t in model(torch.from_numpy(xs[i])))
                      for k in range(50)]
        except Exception as err:  # reported below, with the thread's index
            errors.append((i, err))

    threads = [threading.Thread(target=work, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not errors and len(got) == 8
    for i, results in got.items():
        for outs in results:
            for out, ref in zip(outs, expected[i]):
                np.testing.assert_array_equal(out, ref)
    np.testing.assert_allclose(expected[0][0], _ort(xs[0])[0], rtol=1e-5, atol=1e-6)


@pytest.mark.gpu
def test_tensor_on_the_wrong_device(files, sm90_lib):
    cpu_model = tvmfuse.load(files["cpu"], device="cpu")
    with pytest.raises(InputError, match="input 0 'x': tensor is on cuda:0, the library runs on cpu"):
        cpu_model(torch.ones(2, 4, device="cuda"))
    gpu_model = tvmfuse.load(sm90_lib, device="cuda")
    with pytest.raises(InputError, match="input 0 'x': tensor is on cpu, the library runs on cuda:0"):
        gpu_model(torch.ones(2, 4))
    x = torch.randn(2, 4, device="cuda")
    x[0, 1], x[1, 0], x[1, 3] = float("nan"), float("inf"), float("-inf")
    for out, ref in zip(gpu_model(x), _ort(x.cpu().numpy())):  # NaN and Inf as onnxruntime has them
        np.testing.assert_allclose(out.cpu().numpy(), ref, rtol=1e-4, atol=1e-5, equal_nan=True)


# ---------------------------------------------------------------------------------------- libraries

class _FakeGpu:
    device_name = "NVIDIA A100-SXM4-80GB"


def test_sm90a_library_on_an_sm80_gpu(sm90_lib, monkeypatch):
    """The device is faked: TVM's CUDA device lookup and its compute-capability query."""
    monkeypatch.setattr(rt, "_cuda_device", lambda index, path, target: _FakeGpu())
    monkeypatch.setattr(rt, "_compute_capability", lambda dev: "8.0")
    with pytest.raises(DeviceError, match=r"tiny_sm90.so holds SASS for sm_90a only \(target sm90\); "
                                          r"GPU 0 \(NVIDIA A100-SXM4-80GB\) is sm_80"):
        tvmfuse.load(sm90_lib, device="cuda")


@pytest.mark.gpu
def test_sm90a_library_on_a_gpu_reporting_sm80(sm90_lib, monkeypatch):
    """On the H200 with only its compute capability faked."""
    monkeypatch.setattr(rt, "_compute_capability", lambda dev: "8.0")
    with pytest.raises(DeviceError, match=r"SASS for sm_90a only .* is sm_80"):
        tvmfuse.load(sm90_lib, device="cuda")


def _loaded_libc() -> str:
    """The path of the C library this process runs on (a system .so)."""
    for line in Path("/proc/self/maps").read_text().splitlines():
        path = line.split()[-1]
        if "/libc.so" in path or "/libc-" in path:
            return path
    pytest.skip("no libc in /proc/self/maps")


@pytest.mark.parametrize("kind", ["zero_bytes", "elf_header_only", "truncated_90pct", "python_extension",
                                  "system_libc"])
def test_truncated_or_foreign_library(files, tmp_path, kind):
    import _ctypes

    data = files["cpu"].read_bytes()
    bad = tmp_path / f"{kind}.so"
    if kind == "zero_bytes":
        bad.write_bytes(b"")
    elif kind == "elf_header_only":
        bad.write_bytes(data[:64])
    elif kind == "truncated_90pct":
        bad.write_bytes(data[: len(data) * 9 // 10])
    else:  # a real shared library that is not a tvmfuse library
        shutil.copy(_ctypes.__file__ if kind == "python_extension" else _loaded_libc(), bad)
    foreign = kind in ("python_extension", "system_libc")
    match = "not a tvmfuse library" if foreign else "not a valid shared library"
    with pytest.raises(LibraryError, match=f"{kind}.so.*{match}"):
        tvmfuse.load(bad, device="cpu")


def test_library_named_by_a_bare_file_name(files, monkeypatch):
    """``tvmfuse run model.so``: dlopen looks a name without a slash up on the library path, not in
    the working directory (this failed with "no tvmfuse metadata ... cannot open shared object")."""
    monkeypatch.chdir(files["dir"])
    x = np.random.default_rng(4).standard_normal((2, 4)).astype(np.float32)
    np.testing.assert_allclose(tvmfuse.load(files["cpu"].name, device="cpu")(x)[0], _ort(x)[0],
                               rtol=1e-5, atol=1e-6)


# ---------------------------------------------------------------------------------------- tuning db

def _corrupt(name: str, db: Path) -> str:
    """Damage one file of a copied database; returns the file the error must name."""
    tasks = (db / TASKS_FILE).read_text()
    damage = {
        "tasks_truncated": (TASKS_FILE, tasks[: len(tasks) // 2]),
        "tasks_not_an_object": (TASKS_FILE, "[]"),
        "task_times_not_numbers": (TASKS_FILE, json.dumps(
            {"format": "tvmfuse-tuning/1", "tasks": {"k": {"default_ms": 1.0, "tuned_ms": "fast"}}})),
        "workload_garbage": (WORKLOAD_FILE, '{"truncated": \n'),
        "workload_not_a_workload": (WORKLOAD_FILE, '{"a": 1}\n'),
        "record_index_out_of_range": (RECORD_FILE, '[3, {}]\n'),
        "record_binary": (RECORD_FILE, b"\xff\xfe\x00\x01"),
    }
    file, content = damage[name]
    (db / file).write_bytes(content if isinstance(content, bytes) else content.encode())
    return file


@pytest.mark.parametrize("corruption", ["tasks_truncated", "tasks_not_an_object", "task_times_not_numbers",
                                        "workload_garbage", "workload_not_a_workload",
                                        "record_index_out_of_range", "record_binary"])
def test_corrupt_tuning_database(files, tmp_path, corruption):
    db = tmp_path / "db"
    shutil.copytree(SHIPPED_DB, db)
    TuningDatabase.open(db)  # the copy is sound before the damage
    file = _corrupt(corruption, db)
    with pytest.raises(CompileError, match=f"tuning database {db}.*{file}"):
        TuningDatabase.open(db)
    with pytest.raises(CompileError, match=f"tuning database {db}.*{file}"):
        tvmfuse.compile(str(files["onnx"]), target="cpu", tuning_db=db)


# ---------------------------------------------------------------------------------------- export

@pytest.fixture
def existing(files, tmp_path) -> Path:
    """A directory holding a library that a failed export must leave byte for byte."""
    d = tmp_path / "out"
    d.mkdir()
    shutil.copy(files["cpu"], d / "keep.so")
    return d / "keep.so"


def _unprivileged() -> list[str]:
    """Prefix that runs a command without root's permission bypass (CAP_DAC_OVERRIDE)."""
    if os.geteuid() != 0:
        return []
    if shutil.which("setpriv") is None:
        pytest.skip("running as root without setpriv: a read-only directory cannot be made")
    caps = "-dac_override,-dac_read_search,-fowner"
    return ["setpriv", f"--inh-caps={caps}", f"--bounding-set={caps}", "--"]


def test_export_into_read_only_directory(files, existing):
    before = existing.read_bytes()
    existing.parent.chmod(0o555)
    try:
        run = subprocess.run(_unprivileged() + [
            sys.executable, "-m", "tvmfuse.cli", "compile", str(files["onnx"]), "-o", str(existing),
            "--target", "cpu"], capture_output=True, text=True, timeout=300,
            env=dict(os.environ, PYTHONPATH=str(REPO)))
    finally:
        existing.parent.chmod(0o755)
    assert run.returncode == 1, run.stderr[-2000:]
    assert f"error: cannot write {existing}: Permission denied" in run.stderr
    assert "Traceback" not in run.stderr
    assert existing.read_bytes() == before and os.listdir(existing.parent) == ["keep.so"]


def test_export_into_a_full_directory(files, existing, monkeypatch):
    """ENOSPC while the library is written: simulated by writing half of it, then failing."""
    from tvm.relax import VMExecutable

    real = VMExecutable.export_library
    seen = []

    def full_disk(self, file_name, *args, **kwargs):
        real(self, file_name, *args, **kwargs)
        seen.append(Path(file_name))
        with open(file_name, "r+b") as f:
            f.truncate(os.path.getsize(file_name) // 2)
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), file_name)

    monkeypatch.setattr(VMExecutable, "export_library", full_disk)
    lib = tvmfuse.compile(str(files["onnx"]), target="cpu")
    before = existing.read_bytes()
    with pytest.raises(CompileError, match=f"exporting {existing} failed: No space left on device"):
        lib.export(existing)
    assert seen and seen[0].parent == existing.parent  # written beside the target, then renamed
    assert existing.read_bytes() == before and os.listdir(existing.parent) == ["keep.so"]
    monkeypatch.setattr(VMExecutable, "export_library", real)
    lib.export(existing)  # the same export succeeds once there is space, replacing the file
    assert tvmfuse.load(existing, device="cpu")(np.ones((2, 4), np.float32))[0].shape == (2, 4)
    assert os.listdir(existing.parent) == ["keep.so"]
