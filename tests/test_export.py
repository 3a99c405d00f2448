"""AOT export: the .so embeds an nvcc fatbin (SASS for the target's archs) and metadata."""

from __future__ import annotations

import re
import shutil
import struct
from pathlib import Path

import pytest
import torch

import tvmfuse
from tvmfuse.build.export import parse_cuda_payload, rewrite_cuda_modules
from tvmfuse.build.inspect import (
    cuda_images,
    embedded_modules,
    fatbin_sass,
    find_cuobjdump,
    module_blob,
)
from tvmfuse.runtime import read_metadata


class Tiny(torch.nn.Module):
    """y = relu(x·Wᵀ + b) + x, x: (4, 32)."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(32, 32)

    def forward(self, x):
        return torch.relu(self.lin(x)) + x


@pytest.fixture(scope="module")
def libs(tmp_path_factory):
    torch.manual_seed(0)
    m, x = Tiny().eval(), torch.randn(4, 32)
    out = {}
    for target in ("sm80", "sm90"):
        path = tmp_path_factory.mktemp(target) / f"tiny_{target}.so"
        tvmfuse.compile(m, (x,), target=target).export(path)
        out[target] = path
    return out


def test_cuda_module_is_a_fatbin_not_source(libs):
    for path in libs.values():
        images = cuda_images(path)
        assert len(images) == 1
        fmt, code = images[0]
        assert fmt == "fatbin"
        assert b"__global__" not in code and b"extern \"C\"" not in code  # no CUDA source left
        assert struct.unpack_from("<I", code)[0] == 0xBA55ED50  # fatbin magic


@pytest.mark.skipif(find_cuobjdump() is None, reason="cuobjdump not installed")
@pytest.mark.parametrize("target, archs", [("sm80", {"sm_80", "sm_90"}), ("sm90", {"sm_90a"})])
def test_fatbin_holds_sass_for_target(libs, target, archs):
    (_, code), = cuda_images(libs[target])
    sass = fatbin_sass(code)
    assert set(k for k in sass if k.startswith("sm_")) == archs
    assert "ptx" not in sass  # SASS only: nothing for the driver to JIT
    for arch in archs:
        assert "Function :" in sass[arch] and "EXIT" in sass[arch]


def test_metadata_signature_target_versions(libs):
    import tvm  # noqa: F401

    meta = read_metadata(libs["sm90"])
    assert meta["target"] == "sm90" and meta["sass"] == ["sm_90a"]
    assert meta["inputs"] == [{"name": "x", "shape": [4, 32], "dtype": "float32"}]
    assert meta["outputs"] == [{"name": "output0", "shape": [4, 32], "dtype": "float32"}]
    assert meta["versions"]["tvm"] == "0.27.0.post1"
    assert read_metadata(libs["sm80"])["sass"] == ["sm_80", "sm_90"]


def test_blob_rewrite_roundtrip(libs):
    """Re-running the rewrite on an exported blob changes nothing (already fatbin): it compiles
    nothing and gives back the same bytes."""
    mods = embedded_modules(libs["sm90"])
    kinds = [k for k, _ in mods]
    assert "cuda" in kinds and "_lib" in kinds
    payload = dict(mods)["cuda"]
    fmt, fmap, code = parse_cuda_payload(payload)
    assert fmt == "fatbin" and len(fmap) > 8 and len(code) > 1000

    def no_source(src: str) -> bytes:
        raise AssertionError(f"the exported blob still holds CUDA source: {src[:80]!r}")

    blob = module_blob(libs["sm90"])
    assert rewrite_cuda_modules(blob, no_source) == (blob, 0)


def test_rewrite_replaces_source_payload():
    """A synthetic blob with one CUDA-source module gets the compiled bytes and fmt fatbin."""

    def s(b: bytes) -> bytes:
        return struct.pack("<Q", len(b)) + b

    fmap = struct.pack("<Q", 0)
    payload = s(b"cuda") + fmap + s(b"__global__ void k() {}")
    body = struct.pack("<QQQ", 2, 0, 1) + struct.pack("<Q", 0) + s(b"cuda") + s(payload)
    blob = struct.pack("<Q", len(body)) + body
    new, n = rewrite_cuda_modules(blob, lambda src: b"FATBIN:" + src.encode())
    assert n == 1
    (kind_payload,) = [p for k, p in _walk(new) if k == b"cuda"]
    assert parse_cuda_payload(kind_payload) == ("fatbin", fmap, b"FATBIN:__global__ void k() {}")


def _walk(blob: bytes):
    from tvmfuse.build.export import BlobReader

    r = BlobReader(blob, 8)
    indptr = r.u64_vec()
    r.u64_vec()
    for _ in range(len(indptr) - 1):
        kind = r.raw()
        yield kind, (b"" if kind == b"_lib" else r.raw())


def test_failed_export_keeps_existing_library(libs, tmp_path, monkeypatch):
    """A failing nvcc leaves the previous library at the path untouched."""
    from tvmfuse.errors import CompileError

    dest = tmp_path / "keep.so"
    dest.write_bytes(libs["sm90"].read_bytes())
    before = dest.read_bytes()
    monkeypatch.setenv("TVMFUSE_NVCC", str(tmp_path / "false-nvcc"))
    (tmp_path / "false-nvcc").write_text("#!/bin/sh\necho 'nvcc: simulated failure' >&2\nexit 1\n")
    (tmp_path / "false-nvcc").chmod(0o755)
    torch.manual_seed(0)
    lib = tvmfuse.compile(Tiny().eval(), (torch.randn(4, 32),), target="sm90")
    with pytest.raises(CompileError, match="nvcc failed for target sm90") as info:
        lib.export(dest)
    assert dest.read_bytes() == before
    assert not list(tmp_path.glob(".keep.so.*"))
    # the CUDA source the message names is there to read (the temporary folder was removed
    # before session 44, so "source kept at" named a file that did not exist)
    kept = Path(re.search(r"source kept at (\S+?)\)", str(info.value)).group(1))
    assert kept.is_file() and "__global__" in kept.read_text()
    shutil.rmtree(kept.parent)


def test_bool_mask_graph_builds_for_sm90(tmp_path):
    """A causal mask (bool tensors) must not be vectorised: TVM has no CUDA boolx16 type."""
    import torch.nn.functional as F

    class Attn(torch.nn.Module):
        def forward(self, q, k, v):
            return F.scaled_dot_product_attention(q, k, v, is_causal=True)

    q = torch.randn(1, 2, 64, 32, dtype=torch.float16)
    path = tvmfuse.compile(Attn(), (q, q, q), target="sm90").export(tmp_path / "attn.so")
    assert cuda_images(path)[0][0] == "fatbin"


def _pypi_nvcc():
    import os

    try:
        import nvidia
    except ImportError:
        return None
    cands = [os.path.join(p, "cu13", "bin", "nvcc") for p in nvidia.__path__]
    return next((c for c in cands if os.path.isfile(c)), None)


@pytest.mark.skipif(_pypi_nvcc() is None, reason="PyPI nvidia-cuda-nvcc not installed")
def test_export_with_pypi_nvcc_only(tmp_path, monkeypatch):
    """AOT export works with PyPI's nvcc alone (no CUDA toolkit on PATH)."""
    monkeypatch.setenv("TVMFUSE_NVCC", _pypi_nvcc())
    monkeypatch.setenv("PATH", "/usr/bin:/bin")
    torch.manual_seed(0)
    lib = tvmfuse.compile(Tiny().eval(), (torch.randn(4, 32),), target="sm90")
    (fmt, code), = cuda_images(lib.export(tmp_path / "pypi.so"))
    assert fmt == "fatbin" and struct.unpack_from("<I", code)[0] == 0xBA55ED50


def _identity_onnx():
    """y = Identity(x): an ONNX graph that needs no kernel at all."""
    from onnx import TensorProto, helper

    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [3, 4])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, [3, 4])
    graph = helper.make_graph([helper.make_node("Identity", ["x"], ["y"])], "g", [x], [y])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


_RUN_VM_CODE = """
import json, sys
import numpy as np
import tvm, tvm.base
from tvm.runtime.vm import VirtualMachine
from tvmfuse.runtime import read_metadata
meta = read_metadata(sys.argv[1])
vm = VirtualMachine(tvm.runtime.load_module(sys.argv[1]), tvm.cpu())  # VM code only: no kernel
x = np.arange(12, dtype="float32").reshape(3, 4)
y = vm["main"](tvm.runtime.tensor(x)).numpy()
compiler = [m for m in sys.modules if m.split(".")[:2] in (["tvmfuse", p] for p in
            ("frontend", "passes", "rules", "kernels", "build", "pipeline", "compiler"))]
print(json.dumps({"runtime_only": bool(tvm.base._RUNTIME_ONLY), "compiler_modules": compiler,
                  "target": meta["target"], "same": bool((y == x).all())}))
"""


def test_library_without_kernels_exports_and_loads_runtime_only(tmp_path):
    """A CUDA library whose graph needs no kernel has no CUDA module: it still exports (nothing
    for nvcc), and runtime-only TVM loads it and runs its VM code."""
    import json
    import os
    import subprocess
    import sys

    path = tvmfuse.compile(_identity_onnx(), target="sm90").export(tmp_path / "identity.so")
    assert cuda_images(path) == []
    res = subprocess.run([sys.executable, "-c", _RUN_VM_CODE, str(path)], capture_output=True,
                         text=True, cwd=tmp_path,
                         env=dict(os.environ, TVM_USE_RUNTIME_LIB="1",
                                  PYTHONPATH=os.path.dirname(os.path.dirname(tvmfuse.__file__))))
    assert res.returncode == 0, res.stderr
    info = json.loads(res.stdout.strip().splitlines()[-1])
    assert info == {"runtime_only": True, "compiler_modules": [], "target": "sm90", "same": True}


def test_cuda_module_left_as_source_is_an_error(tmp_path, monkeypatch):
    """Zero kernels is fine, but a CUDA module the rewrite missed (a changed blob format) is not:
    the library would need a compiler at load."""
    import tvmfuse.build.export as export
    from tvmfuse.errors import CompileError

    monkeypatch.setattr(export, "rewrite_cuda_modules", lambda blob, _compile: (blob, 0))
    torch.manual_seed(0)
    lib = tvmfuse.compile(Tiny().eval(), (torch.randn(4, 32),), target="sm90")
    with pytest.raises(CompileError, match="0 of 1 CUDA modules compiled"):
        lib.export(tmp_path / "tiny.so")
