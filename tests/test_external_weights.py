"""Weights outside the library: ``compile(weights="external")`` exports ``<name>.so`` plus
``<name>.safetensors``; the loaded library equals the embedded build and the framework; ``auto``
switches at ``AUTO_EXTERNAL_BYTES``; a missing, truncated, reshaped or foreign weights file is a
LibraryError naming the file; the kernels are the embedded build's; the runtime alone loads it."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

import tvmfuse
from models import decoder_layer, llama_lm, mlp_block
from models.export_onnx import export_onnx
from tests.conftest import rel_err
from tvmfuse.errors import InputSpecError, LibraryError
from tvmfuse.frontend import import_model
from tvmfuse.passes import lift_weights
from tvmfuse.report import analyze
from tvmfuse.runtime import read_metadata
from tvmfuse.targets import get_target

ROOT = Path(__file__).resolve().parents[1]


def _lm():
    """The fp16 Llama-style LM (models/llama_lm.py) a user writes, at a size whose weights
    (≈3.4 MB) dwarf the library's code."""
    return llama_lm.build(vocab=512, hidden=256, ffn=688)


def _export(module, example, path: Path, **kw) -> tvmfuse.compiler.Library:
    lib = tvmfuse.compile(module, example, target="cpu", **kw)
    lib.export(path)
    return lib


@pytest.fixture(scope="module")
def lm_libs(tmp_path_factory):
    """(module, example, {"embedded": .so, "external": .so}, external Library)."""
    module, example = _lm()
    d = tmp_path_factory.mktemp("lm")
    _export(module, example, d / "embedded.so", weights="embedded")
    ext = _export(module, example, d / "external.so", weights="external")
    return module, example, {"embedded": d / "embedded.so", "external": d / "external.so"}, ext


def _weight_bytes(lib) -> int:
    return sum(t.numpy().nbytes for _, t in lib.weights)


def test_torch_lm_external_equals_embedded_and_torch(lm_libs):
    module, (ids,), paths, _ = lm_libs
    ids = torch.randint(0, 512, ids.shape, generator=torch.Generator().manual_seed(1))
    outs = {k: tvmfuse.load(p, device="cpu")(ids) for k, p in paths.items()}
    assert torch.equal(outs["external"], outs["embedded"])  # same kernels, same bytes
    with torch.no_grad():
        ref = module(ids)
    assert rel_err(outs["external"], ref) <= 5e-3
    again = tvmfuse.load(paths["external"], device="cpu")
    np.testing.assert_array_equal(again(ids.numpy()), outs["external"].numpy())  # weights not consumed


def test_library_is_small_and_weights_file_standard(lm_libs):
    from safetensors import safe_open

    _, _, paths, lib = lm_libs
    wfile = paths["external"].with_suffix(".safetensors")
    weight_bytes = _weight_bytes(lib)
    assert weight_bytes > 3_000_000
    so, embedded_so = paths["external"].stat().st_size, paths["embedded"].stat().st_size
    assert so < weight_bytes / 8, (so, weight_bytes)
    assert embedded_so - so > 0.9 * weight_bytes
    assert 0 <= wfile.stat().st_size - weight_bytes < 8192  # data plus the JSON header
    meta = read_metadata(paths["external"])["weights"]
    assert meta["file"] == "external.safetensors" and meta["size"] == wfile.stat().st_size
    assert [p["name"] for p in meta["params"]] == [n for n, _ in lib.weights]
    with safe_open(str(wfile), framework="numpy") as f:  # the reference reader takes the file
        assert sorted(f.keys()) == sorted(n for n, _ in lib.weights)
        for name, tensor in lib.weights:
            np.testing.assert_array_equal(f.get_tensor(name), tensor.numpy())
    assert "weights" not in read_metadata(paths["embedded"])


def test_kernels_same_embedded_and_external():
    """The fused layouts (QKV / gate-up concatenation, folded transposes, norm weights in the
    GEMMs) are what the file holds: the kernel list is the embedded build's, one for one."""
    module, example = llama_lm.build(n_layers=1)
    imported = import_model(module, example, {})
    reports = {w: analyze(imported.mod, get_target("sm90"), stock=False, weights=w)
               for w in ("embedded", "external")}
    emb, ext = reports["embedded"], reports["external"]
    assert emb["fused_kernel_count"] == ext["fused_kernel_count"] > 0
    assert emb["kernels"] == ext["kernels"]


@pytest.mark.parametrize("dynamo", [True, False], ids=["dynamo", "torchscript"])
def test_onnx_external_equals_embedded_and_onnxruntime(dynamo, tmp_path):
    module, example = decoder_layer.small()
    path = export_onnx(module, example, tmp_path / "decoder.onnx", dynamo=dynamo)
    libs = {w: tvmfuse.compile(os.fspath(path), target="cpu", weights=w) for w in ("embedded", "external")}
    assert libs["embedded"].weights == [] and len(libs["external"].weights) >= 5
    for w, lib in libs.items():
        lib.export(tmp_path / f"{w}.so")
    x = np.random.default_rng(3).standard_normal(tuple(example[0].shape)).astype("float32")
    outs = {w: tvmfuse.load(tmp_path / f"{w}.so", device="cpu")(x) for w in libs}
    np.testing.assert_array_equal(outs["external"], outs["embedded"])
    (ref,) = libs["external"].model.reference(x)
    assert rel_err(outs["external"], ref) <= 1e-4


def test_bfloat16_weights_roundtrip(tmp_path):
    """bfloat16 weights (no numpy dtype of their own) are written and mapped through ml_dtypes."""
    module, example = mlp_block.small()
    lib = _export(module, example, tmp_path / "bf16.so", dtype="bfloat16", weights="external")
    assert {str(t.dtype) for _, t in lib.weights} >= {"bfloat16"}
    y = tvmfuse.load(tmp_path / "bf16.so", device="cpu")(example[0])
    with torch.no_grad():
        ref = module(example[0])
    assert rel_err(y, ref) <= 2e-2


def test_auto_switches_at_the_threshold(monkeypatch):
    module, example = mlp_block.small()
    ext = tvmfuse.compile(module, example, target="cpu", weights="external")
    total = _weight_bytes(ext)
    assert lift_weights.AUTO_EXTERNAL_BYTES == 256 << 20 > total
    assert tvmfuse.compile(module, example, target="cpu").weights == []  # the default: auto
    monkeypatch.setattr(lift_weights, "AUTO_EXTERNAL_BYTES", total + 1)
    assert tvmfuse.compile(module, example, target="cpu").weights == []
    monkeypatch.setattr(lift_weights, "AUTO_EXTERNAL_BYTES", total)
    auto = tvmfuse.compile(module, example, target="cpu")
    assert [n for n, _ in auto.weights] == [n for n, _ in ext.weights]


def test_unknown_weights_mode_is_an_input_error():
    module, example = decoder_layer.small()
    with pytest.raises(InputSpecError, match="weights must be one of auto, external, embedded"):
        tvmfuse.compile(module, example, target="cpu", weights="outside")


# ---- a weights file that does not fit: every case a LibraryError naming the file -------------

def _copy(paths: dict, dest: Path) -> tuple[Path, Path]:
    dest.mkdir()
    so = Path(shutil.copy(paths["external"], dest / "lm.so"))
    shutil.copy(paths["external"].with_suffix(".safetensors"), dest / "lm.safetensors")
    return so, dest / "lm.safetensors"


def _rewrite(wfile: Path, change) -> None:
    """Rewrite ``wfile`` with the safetensors library after ``change(dict of arrays)``."""
    from safetensors.numpy import load_file, save_file

    arrays = load_file(str(wfile))
    change(arrays)
    save_file(arrays, str(wfile))


def _first(arrays: dict) -> str:
    return sorted(arrays, key=lambda n: int(n.split(".")[0][1:]))[0]


def test_missing_weights_file(lm_libs, tmp_path):
    so, wfile = _copy(lm_libs[2], tmp_path / "lib")
    wfile.unlink()
    with pytest.raises(LibraryError, match=r"lm\.so keeps its weights in \S*/lm\.safetensors or "
                                           r"\S*/external\.safetensors, which does not exist"):
        tvmfuse.load(so, device="cpu")


def test_truncated_weights_file(lm_libs, tmp_path):
    so, wfile = _copy(lm_libs[2], tmp_path / "lib")
    data = wfile.read_bytes()
    wfile.write_bytes(data[: len(data) // 2])
    with pytest.raises(LibraryError, match=r"lm\.safetensors is truncated: tensor 'w\d+\..*' ends at byte"):
        tvmfuse.load(so, device="cpu")


def test_garbage_weights_file(lm_libs, tmp_path):
    so, wfile = _copy(lm_libs[2], tmp_path / "lib")
    wfile.write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00not json at all!" + b"\0" * 64)
    with pytest.raises(LibraryError, match=r"lm\.safetensors is not a valid safetensors file \(header"):
        tvmfuse.load(so, device="cpu")


def test_weight_with_wrong_dtype(lm_libs, tmp_path):
    so, wfile = _copy(lm_libs[2], tmp_path / "lib")
    name = None

    def to_f32(arrays):
        nonlocal name
        name = _first(arrays)
        arrays[name] = arrays[name].astype("float32")

    _rewrite(wfile, to_f32)
    with pytest.raises(LibraryError, match=rf"tensor '{name}' is float32\[.*needs float16"):
        tvmfuse.load(so, device="cpu")


def test_weight_with_wrong_shape(lm_libs, tmp_path):
    so, wfile = _copy(lm_libs[2], tmp_path / "lib")
    name = None

    def transpose(arrays):
        nonlocal name
        name = _first(arrays)
        arrays[name] = np.ascontiguousarray(arrays[name].T)

    _rewrite(wfile, transpose)
    a, b = lm_libs[3].weights[0][1].shape
    with pytest.raises(LibraryError,
                       match=rf"tensor '{name}' is float16\[{b}, {a}\], .* needs float16\[{a}, {b}\]"):
        tvmfuse.load(so, device="cpu")


def test_weights_from_another_export(lm_libs, tmp_path):
    """Same architecture, other weights (another seed): same names, shapes and size."""
    so, wfile = _copy(lm_libs[2], tmp_path / "lib")
    module, example = llama_lm.build(vocab=512, hidden=256, ffn=688, seed=1)
    _export(module, example, tmp_path / "other.so", weights="external")
    shutil.copy(tmp_path / "other.safetensors", wfile)
    with pytest.raises(LibraryError, match=r"lm\.safetensors does not belong to .*lm\.so"):
        tvmfuse.load(so, device="cpu")


# ---- command line and runtime-only TVM -------------------------------------------------------

def _cli(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "tvmfuse.cli", *args], cwd=ROOT, capture_output=True,
                          text=True, env=env)


def test_cli_weights_flag(tmp_path):
    res = _cli("compile", "models.mlp_block:small", "--target", "cpu", "--weights", "external",
               "-o", str(tmp_path / "mlp.so"))
    assert res.returncode == 0, res.stderr
    assert f"weights: {tmp_path / 'mlp.safetensors'}" in res.stdout
    assert (tmp_path / "mlp.safetensors").is_file()
    module, (x,) = mlp_block.small()
    x = torch.randn(x.shape, generator=torch.Generator().manual_seed(1))
    np.savez(tmp_path / "in.npz", x=x.numpy())
    res = _cli("run", str(tmp_path / "mlp.so"), "--inputs", str(tmp_path / "in.npz"),
               "--output", str(tmp_path / "out.npz"))
    assert res.returncode == 0, res.stderr
    with torch.no_grad():
        ref = module(x)
    assert rel_err(np.load(tmp_path / "out.npz")["output0"], ref) <= 1e-5
    res = _cli("compile", "models.mlp_block:small", "--weights", "outside", "-o", str(tmp_path / "x.so"))
    assert res.returncode == 2 and "'outside' is not one of 'auto', 'external', 'embedded'" in res.stderr


_RUNTIME_ONLY = """
import json, sys
import numpy as np
import tvm.base
import tvmfuse
model = tvmfuse.load(sys.argv[1], device="cpu")
np.save(sys.argv[3], model(np.load(sys.argv[2])))
compiler = [m for m in sys.modules if m.split(".")[:2] in (["tvmfuse", p] for p in
            ("frontend", "passes", "rules", "kernels", "build", "pipeline", "compiler"))]
print(json.dumps({"runtime_only": bool(tvm.base._RUNTIME_ONLY), "compiler_modules": compiler,
                  "weights": len(model.weights)}))
"""


def test_runtime_only_tvm_loads_external_weights(lm_libs, tmp_path):
    _, (ids,), paths, lib = lm_libs
    np.save(tmp_path / "ids.npy", ids.numpy())
    env = dict(os.environ, TVM_USE_RUNTIME_LIB="1", PYTHONPATH=str(ROOT))
    args = [str(paths["external"]), str(tmp_path / "ids.npy"), str(tmp_path / "out.npy")]
    res = subprocess.run([sys.executable, "-c", _RUNTIME_ONLY, *args], capture_output=True, text=True,
                         env=env, cwd=tmp_path)
    assert res.returncode == 0, res.stderr
    info = json.loads(res.stdout.strip().splitlines()[-1])
    assert info == {"runtime_only": True, "compiler_modules": [], "weights": len(lib.weights)}
    expected = tvmfuse.load(paths["embedded"], device="cpu")(ids.numpy())
    np.testing.assert_array_equal(np.load(tmp_path / "out.npy"), expected)


@pytest.mark.gpu
@pytest.mark.parametrize("target", ["sm90", "sm80"])
def test_external_weights_lm_on_gpu(target, tmp_path):
    """The fp16 LM built with external weights, loaded on cuda: matches the embedded build,
    close to torch on the GPU; the weights live on the device once."""
    if target == "sm90" and torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("sm90 library needs an sm_90 GPU")
    module, (ids,) = _lm()
    for w in ("embedded", "external"):
        tvmfuse.compile(module, (ids,), target=target, weights=w).export(tmp_path / f"{w}.so")
    models = {w: tvmfuse.load(tmp_path / f"{w}.so", device="cuda") for w in ("embedded", "external")}
    assert models["external"].weights and all(t.device.dlpack_device_type() == 2
                                              for t in models["external"].weights)
    ids = ids.cuda()
    outs = {w: m(ids) for w, m in models.items()}
    assert outs["external"].is_cuda
    assert rel_err(outs["external"], outs["embedded"]) <= 1e-3  # same kernels (split-K may reorder sums)
    with torch.no_grad():
        ref = module.cuda()(ids)
    assert rel_err(outs["external"], ref) <= 5e-3
