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


@pytest.mark.slow
def test_compile_lm_then_generate(tmp_path):
    """`compile --lm` + `generate` on models/llama_lm.py's fp16 `small` (RoPE tables of 32 rows)
    against torch's greedy tokens (tests/lm_reference.py's rule)."""
    from models import llama_lm
    from tests.lm_reference import check_tokens, torch_greedy
    from tvmfuse.runtime import load

    lib = tmp_path / "lm.so"
    res = tvmfuse("compile", "models.llama_lm:small", "--lm", "--target", "cpu", "--max-seq-len", "32",
                  "--prefill-lengths", "8", "-o", str(lib))
    assert res.returncode == 0, res.stderr
    assert "2 KV-cache layers, prefill lengths [8]" in res.stdout
    prompt = [5, 77, 3, 250, 9]
    res = tvmfuse("generate", str(lib), "--prompt-ids", ",".join(map(str, prompt)),
                  "--max-new-tokens", "16")
    assert res.returncode == 0, res.stderr
    tokens = [line for line in res.stdout.splitlines() if line.startswith("tokens: ")]
    got = np.array([prompt + [int(t) for t in tokens[0].split()[1].split(",")]])
    assert got.shape == (1, 5 + 16)
    assert "prefill:" in res.stdout and "ms/token (15 steps)" in res.stdout
    model, _ = llama_lm.small()
    ids = torch.tensor([prompt])
    ref_tokens, ref_logits = torch_greedy(model, ids, 16)
    check_tokens(load(lib, device="cpu"), ids.numpy(), None, ref_tokens, ref_logits, got)
    np.savez(tmp_path / "in.npz", ids=ids.numpy())
    res = tvmfuse("run", str(lib), "--inputs", str(tmp_path / "in.npz"))
    assert res.returncode == 1 and "run it with `tvmfuse generate`" in res.stderr


def test_generate_refuses_a_plain_library(mlp_pt2, tmp_path):
    path, _, _ = mlp_pt2
    lib = tmp_path / "m.so"
    assert tvmfuse("compile", str(path), "-o", str(lib), "--target", "cpu").returncode == 0
    res = tvmfuse("generate", str(lib), "--prompt-ids", "1,2")
    assert res.returncode == 1 and "not a language-model library" in res.stderr
    res = tvmfuse("generate", str(lib), "--prompt-ids", "1,x")
    assert res.returncode == 1 and "--prompt-ids must be comma-separated integers" in res.stderr


def test_compile_lm_refuses_input_overrides(tmp_path):
    res = tvmfuse("compile", "models.llama_lm:small", "--lm", "--target", "cpu", "--input", "ids:1x8",
                  "-o", str(tmp_path / "x.so"))
    assert res.returncode == 1 and "--lm takes no --input" in res.stderr
    assert "Traceback" not in res.stderr
