"""``tvmfuse compile`` and ``tvmfuse run`` as a user types them (DESIGN.md contract)."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest
import torch

ROOT = __import__("pathlib").Path(__file__).resolve().parents[1]


def tvmfuse(*args: str, cwd=ROOT) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "tvmfuse.cli", *args], cwd=cwd,
                          capture_output=True, text=True)


@pytest.fixture(scope="module")
def mlp_pt2(tmp_path_factory):
    from models import mlp_block

    module, example = mlp_block.small()
    path = tmp_path_factory.mktemp("pt2") / "mlp.pt2"
    torch.export.save(torch.export.export(module, example), str(path))
    return path, module, example


def test_compile_factory_with_check_then_run(tmp_path):
    lib = tmp_path / "mlp.so"
    res = tvmfuse("compile", "models.mlp_block:small", "-o", str(lib), "--target", "cpu", "--check")
    assert res.returncode == 0, res.stderr
    assert "check (cpu build vs torch reference)" in res.stdout and ": ok" in res.stdout
    x = np.random.default_rng(1).standard_normal((2, 16, 64)).astype("float32")
    np.savez(tmp_path / "in.npz", x=x)
    res = tvmfuse("run", str(lib), "--inputs", str(tmp_path / "in.npz"),
                  "--output", str(tmp_path / "out.npz"))
    assert res.returncode == 0, res.stderr
    from models import mlp_block

    module, _ = mlp_block.small()
    with torch.no_grad():
        ref = module(torch.from_numpy(x)).numpy()
    out = np.load(tmp_path / "out.npz")["output0"]
    assert np.linalg.norm(out - ref) / np.linalg.norm(ref) <= 1e-4


def test_compile_pt2_sm90(mlp_pt2, tmp_path):
    path, _, _ = mlp_pt2
    res = tvmfuse("compile", str(path), "-o", str(tmp_path / "m90.so"), "--target", "sm90")
    assert res.returncode == 0, res.stderr
    assert (tmp_path / "m90.so").stat().st_size > 10_000
    assert "x:float32[2, 16, 64]" in res.stdout


def test_run_reports_missing_input_array(mlp_pt2, tmp_path):
    path, _, _ = mlp_pt2
    lib = tmp_path / "m.so"
    assert tvmfuse("compile", str(path), "-o", str(lib), "--target", "cpu").returncode == 0
    np.savez(tmp_path / "in.npz", y=np.ones((2, 16, 64), "float32"))
    res = tvmfuse("run", str(lib), "--inputs", str(tmp_path / "in.npz"))
    assert res.returncode == 1
    assert "missing array(s) for input(s) ['x']" in res.stderr
    assert "Traceback" not in res.stderr


def test_compile_unknown_format_is_one_line_error(tmp_path):
    bad = tmp_path / "model.txt"
    bad.write_text("hi")
    res = tvmfuse("compile", str(bad), "-o", str(tmp_path / "x.so"))
    assert res.returncode == 1
    assert res.stderr.startswith("error: cannot tell the model format")
    assert "Traceback" not in res.stderr


def test_help_lists_commands():
    res = tvmfuse("--help")
    assert res.returncode == 0 and "compile" in res.stdout and "run" in res.stdout
