"""``tools/bench/bench_hf_prefill.py``'s workloads at the CPU smoke sizes: transformers' GPT-2 and
BERT built as users build them, BERT with a padded batch's attention_mask, and the FLOP count."""

from __future__ import annotations

import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                                "tools", "bench"))
pytest.importorskip("transformers")
import bench_hf_prefill  # noqa: E402


@pytest.mark.parametrize("family", ["gpt2", "bert"])
def test_workload_runs_in_torch(family):
    size = bench_hf_prefill.SIZES["cpu"][family]
    wl = bench_hf_prefill.workload(family, size, "float32")
    ids = wl.inputs[0]
    assert ids.shape == (size["batch"], size["seq"]) and ids.dtype == torch.int64
    if family == "bert":  # row b: seq − b·seq/(2·batch) real tokens, then padding
        mask = wl.inputs[1]
        step = size["seq"] // (2 * size["batch"])
        assert mask.sum(1).tolist() == [size["seq"] - b * step for b in range(size["batch"])]
        assert (mask[:, :1] == 1).all() and (mask.diff(dim=1) <= 0).all()
    else:
        assert len(wl.inputs) == 1
    with torch.no_grad():
        out = wl.module(*wl.inputs)
    width = bench_hf_prefill.VOCAB if family == "gpt2" else size["hidden"]
    assert out.shape == (size["batch"], size["seq"], width) and torch.isfinite(out).all()


def test_flops_count_the_causal_half():
    """GPT-2's attention FLOPs are half of BERT's at the same shape (causal), plus its LM head."""
    shape = dict(layers=2, hidden=64, heads=4, batch=1, seq=32)
    t = shape["batch"] * shape["seq"]
    attn = 4.0 * shape["batch"] * shape["seq"] ** 2 * shape["hidden"] * shape["layers"]
    head = 2.0 * t * shape["hidden"] * bench_hf_prefill.VOCAB
    assert bench_hf_prefill.flops("bert", **shape) - bench_hf_prefill.flops("gpt2", **shape) == \
        pytest.approx(attn / 2 - head)
