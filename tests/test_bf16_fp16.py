"""Mixed precision on CPU: ``dtype="float16"`` / ``"bfloat16"`` compile the fp32 MLP block to
reduced-precision compute (fp32 accumulation) with an fp32 signature, close to fp32 torch.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest
import torch

import tvmfuse
from tvmfuse.frontend import import_model
from tvmfuse.pipeline import lower
from tvmfuse.targets import get_target

REPO_ROOT = Path(__file__).resolve().parents[1]
if str(REPO_ROOT) not in sys.path:  # `models` lives at the repo root, next to tests/
    sys.path.insert(0, str(REPO_ROOT))

from models import decoder_layer, mlp_block  # noqa: E402

# Max ||out - ref|| / ||ref|| against fp32 torch. Measured on these shapes: fp16 ~1.5e-4 on the
# output (~7e-4 on the residual branch), bf16 ~1e-3 (~5e-3 on the branch).
TOLERANCE = {"float16": 5e-3, "bfloat16": 2e-2}
# Below this the compiled model cannot have computed in 16 bits (fp32 gives ~1e-7).
MIN_ERR = 1e-5

# LLVM object codegen of fp16 kernels for the generic x86 CPU target is slow (lib.export of a
# (2, 8, 32) block with ffn 128 took ~39 s in fp16, ~2 s in bf16 or fp32), so the shapes stay tiny.
SHAPES = dict(batch=2, seq=4, hidden=16, ffn=32)


def _dtype_token(dtype: str) -> re.Pattern:
    # "float16" must not match inside "bfloat16".
    return re.compile(rf"(?<![a-z]){dtype}(?![0-9])")


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    assert out.shape == ref.shape
    return float((out.double() - ref.double()).norm() / ref.double().norm())


@pytest.fixture(scope="module")
def mlp():
    module, inputs = mlp_block.build(**SHAPES)
    with torch.no_grad():
        ref = module(*inputs)
    return module, inputs, ref


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_mlp_mixed_precision(mlp, dtype):
    module, (x,), ref = mlp
    lib = tvmfuse.compile(module, (x,), target="cpu", dtype=dtype)
    assert lib.dtype == dtype
    # The signature stays float32.
    assert [s.dtype for s in lib.model.inputs] == ["float32"]
    assert [s.dtype for s in lib.outputs] == ["float32"]

    out = lib.load()(x)
    assert out.dtype == torch.float32
    assert torch.isfinite(out).all()
    err = rel_err(out, ref)
    assert err <= TOLERANCE[dtype], f"{dtype}: relative error {err:.3e} > {TOLERANCE[dtype]}"
    assert err >= MIN_ERR, f"{dtype}: error {err:.1e} is fp32-exact: was anything converted?"
    # The residual x dominates the output; the MLP branch alone must be close too.
    branch = rel_err(out - x, ref - x)
    assert branch <= TOLERANCE[dtype], f"{dtype}: branch relative error {branch:.3e}"


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_mlp_lowered_ir_has_dtype(mlp, dtype):
    module, inputs, _ = mlp
    imported = import_model(module, inputs)  # what tvmfuse.compile lowers (lib.model)
    spec = get_target("cpu")
    script = lower(imported.mod, spec, dtype).script()
    assert _dtype_token(dtype).search(script), f"no {dtype} in the lowered IR"
    other = "bfloat16" if dtype == "float16" else "float16"
    assert not _dtype_token(other).search(script), f"{other} left in the {dtype} IR"
    # The fp32 lowering of the same imported module has neither.
    fp32 = lower(imported.mod, spec, None).script()
    assert not _dtype_token("float16").search(fp32)
    assert not _dtype_token("bfloat16").search(fp32)


def test_decoder_layer_bfloat16():
    module, (x,) = decoder_layer.build(batch=1, seq=4, hidden=16, n_heads=2, n_kv_heads=1)
    with torch.no_grad():
        ref = module(x)
    lib = tvmfuse.compile(module, (x,), target="cpu", dtype="bfloat16")
    out = lib.load()(x)
    assert out.dtype == torch.float32
    err = rel_err(out, ref)
    assert MIN_ERR <= err <= TOLERANCE["bfloat16"], f"relative error {err:.3e}"
    assert _dtype_token("bfloat16").search(lower(lib.model.mod, get_target("cpu"), "bfloat16").script())


def test_rejects_unknown_dtype(mlp):
    module, inputs, _ = mlp
    with pytest.raises(tvmfuse.InputSpecError, match="float8"):
        tvmfuse.compile(module, inputs, target="cpu", dtype="float8")
