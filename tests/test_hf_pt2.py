"""transformers' ``LlamaForCausalLM`` at random init (hidden 256, 8 query / 2 KV heads, 2 layers)
exported with ``torch.export.save`` and compiled from the ``.pt2`` file, as a user does
(models/hf_models.py ``llama_pt2``; issue 13 item 5: ``fuse_attention`` failed with
``Check failed: (t.MatchesCode(DLDataTypeCode::kDLFloat))`` on the mask's bool ``cumsum``).

cpu: fp32 logits against the exported program (rel err <= 1e-4); sm90: ``tvmfuse report`` lowers
the whole pipeline, with each layer's attention one kernel. Set ``TVMFUSE_HF_PT2_DIR`` to keep the
exported file between runs.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pytest
import torch
from click.testing import CliRunner

import tvmfuse
from models import hf_models
from tests.conftest import rel_err
from tvmfuse.cli import main

RTOL = 1e-4  # fp32: ||out - ref|| / ||ref||


@pytest.fixture(scope="module")
def llama_pt2(tmp_path_factory) -> Path:
    keep = os.environ.get("TVMFUSE_HF_PT2_DIR")
    return hf_models.llama_pt2(Path(keep) if keep else tmp_path_factory.mktemp("hf_pt2"))


def test_llama_pt2_cpu_matches_torch(llama_pt2):
    lib = tvmfuse.compile(os.fspath(llama_pt2), target="cpu")
    assert [(s.name, s.shape, s.dtype) for s in lib.model.inputs] == [("input_ids", (1, 16), "int64")]
    run = lib.load()
    program = torch.export.load(llama_pt2).module()
    for seed in (0, 1):
        (ids,) = hf_models.sample_inputs("llama", seed)
        with torch.no_grad():
            ref = program(torch.from_numpy(ids)).numpy()
        out = run(ids)
        assert out.shape == ref.shape == (1, 16, hf_models.VOCAB) and np.isfinite(out).all()
        err = rel_err(out, ref)
        assert err <= RTOL, f"seed {seed}: relative error {err:.3e} > {RTOL}"
    # causal: the last token changes the last row only
    changed = ids.copy()
    changed[:, -1] = (changed[:, -1] + 1) % hf_models.VOCAB
    base, other = run(ids), run(changed)
    assert rel_err(other[:, :-1], base[:, :-1]) <= RTOL
    assert not np.allclose(other[:, -1], base[:, -1])


def test_llama_pt2_sm90_report(llama_pt2):
    result = CliRunner().invoke(main, ["report", os.fspath(llama_pt2), "--target", "sm90", "--json"])
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout[result.stdout.index("{"):])
    attention = [k for k in report["kernels"] if k["pattern"] == "attention"]
    assert len(attention) == hf_models.LAYERS, [k["ops"] for k in report["kernels"]]
    assert report["fused_kernel_count"] < report["unfused_kernel_count"]
