"""Tiny Hugging Face models (GPT-2, BERT with padding mask, Llama GQA eager and SDPA) exported to
ONNX by both torch exporters (models/hf_models.py), compiled for target "cpu" and compared with
onnxruntime in fp32 (rel err <= 1e-4 on the single output: logits, or BERT's last_hidden_state).

Both exporters' files must import and match. Set ``TVMFUSE_HF_ONNX_DIR`` to keep the exported
files between runs.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import numpy as np
import pytest

import tvmfuse

REPO_ROOT = Path(__file__).resolve().parents[1]
if str(REPO_ROOT) not in sys.path:  # models.hf_models is imported as a module of the repo root
    sys.path.insert(0, str(REPO_ROOT))

from models import hf_models  # noqa: E402

RTOL = 1e-4  # fp32: ||out - ref|| / ||ref||
OUTPUTS = {"gpt2": "logits", "bert": "last_hidden_state", "llama": "logits", "llama_sdpa": "logits"}


# All four TorchScript exports hold ConstantOfShape(shape=int64[0]) (transformers' and_masks), which
# TVM 0.27's importer cannot convert; tvmfuse folds it first (fold_scalar_constant_of_shape).
CASES = [pytest.param(name, exporter, id=f"{name}-{exporter}")
         for exporter in ("torchscript", "dynamo") for name in hf_models.MODELS]


@pytest.fixture(scope="session")
def hf_onnx_dir(tmp_path_factory) -> Path:
    """Where the exports go: $TVMFUSE_HF_ONNX_DIR (kept between runs) or a session temp dir."""
    keep = os.environ.get("TVMFUSE_HF_ONNX_DIR")
    return Path(keep) if keep else tmp_path_factory.mktemp("hf_onnx")


def rel_err(out: np.ndarray, ref: np.ndarray) -> float:
    out, ref = np.asarray(out, np.float64), np.asarray(ref, np.float64)
    assert out.shape == ref.shape, f"shape {out.shape} != reference {ref.shape}"
    return float(np.linalg.norm(out - ref) / np.linalg.norm(ref))


def compile_hf(path: Path):
    return tvmfuse.compile(os.fspath(path), target="cpu")


@pytest.mark.parametrize(("name", "exporter"), CASES)
def test_hf_model_cpu(name, exporter, hf_onnx_dir):
    path = hf_models.MODELS[name](hf_onnx_dir, exporter)
    assert hf_models.exporter_of(path).startswith(exporter + "-")
    lib = compile_hf(path)
    assert [(s.name, s.shape, s.dtype) for s in lib.model.inputs] == [
        (inp, shape, "int64") for inp, shape in hf_models.input_specs(name)
    ]
    assert lib.model.output_names == [OUTPUTS[name]]
    run = lib.load()
    for seed in (0, 1):  # seed 1: other ids and, for BERT, another padding length
        inputs = hf_models.sample_inputs(name, seed)
        out = run(*inputs)
        (ref,) = lib.model.reference(*inputs)
        assert isinstance(out, np.ndarray) and out.dtype == ref.dtype == np.float32
        assert np.isfinite(out).all()
        err = rel_err(out, ref)
        assert err <= RTOL, f"{name} ({exporter}) seed {seed}: relative error {err:.3e} > {RTOL}"

    # The masks survived export and compilation: tokens that must not be seen change nothing.
    inputs = hf_models.sample_inputs(name, 0)
    changed = [a.copy() for a in inputs]
    ids = changed[0]
    if name == "bert":  # padded positions of row 1 are invisible to its other positions
        keep = inputs[1][1].astype(bool)
        ids[1, ~keep] = (ids[1, ~keep] + 1) % hf_models.VOCAB
        rows = (1, keep)
    else:  # causal: the last token is invisible to every earlier position
        ids[:, -1] = (ids[:, -1] + 1) % hf_models.VOCAB
        rows = (slice(None), slice(0, -1))
    base, other = run(*inputs), run(*changed)
    assert rel_err(other[rows], base[rows]) <= RTOL
    assert not np.allclose(other, base), "the changed tokens must change some output"
