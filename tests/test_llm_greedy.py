"""The greedy ``advance`` kernel of compile_lm libraries: argmax of each row (the first maximum) and
the decode state moved one token (tvmfuse/llm/greedy.py).

CPU: the llvm kernel against numpy, ties included. nvcc: the CUDA kernel reads the logits in 16-byte
vectors when the vocabulary allows, without local memory. GPU (``-m gpu``): the CUDA kernel against
numpy over vocabularies with and without whole vectors, ties placed across and within threads.
"""

from __future__ import annotations

import numpy as np
import pytest
import tvm

from tests.cuda_tools import needs_nvcc
from tvmfuse.build.inspect import cuda_source, fatbin_sass
from tvmfuse.build.nvcc import compile_fatbin
from tvmfuse.llm.greedy import greedy_advance
from tvmfuse.targets import get_target
from tvmfuse.tvm_setup import codegen_scope

HIST = 16


def _case(batch: int, vocab: int, dtype: str, seed: int) -> tuple[list[np.ndarray], np.ndarray]:
    """Random logits with each row's maximum placed twice (the first copy must win), and the
    state tensors; returns (arrays in kernel order, expected tokens)."""
    rng = np.random.default_rng(seed)
    logits = rng.standard_normal((batch, vocab)).astype(dtype)
    first = rng.integers(0, vocab - 1, batch)
    for b, i in enumerate(first):
        j = rng.integers(i + 1, vocab)  # a later equal value: not chosen
        logits[b, i] = logits[b, j] = np.abs(logits[b]).max() + 1
    ids = np.zeros((batch, 1), "int64")
    positions = np.arange(batch, dtype="int64").reshape(batch, 1)
    offsets = np.array([3 + b for b in range(batch)], "int32")
    offsets[-1] = HIST + 5  # past the history: the token goes to its last slot
    hist = np.zeros((batch, HIST), "int64")
    return [ids, positions, offsets, hist, logits], first


def _check(arrays: list[np.ndarray], before: list[np.ndarray], want: np.ndarray) -> None:
    ids, positions, offsets, hist, _ = arrays
    np.testing.assert_array_equal(ids[:, 0], want)
    np.testing.assert_array_equal(positions, before[1] + 1)
    np.testing.assert_array_equal(offsets, before[2] + 1)
    for b, t in enumerate(want):
        assert hist[b, min(int(before[2][b]) + 1, HIST - 1)] == t


def _run(func: tvm.tirx.PrimFunc, target, dev, arrays: list[np.ndarray]) -> list[np.ndarray]:
    lib = tvm.compile(tvm.IRModule({"main": func.with_attr("global_symbol", "main")}), target=target)
    tensors = [tvm.runtime.tensor(a, dev) for a in arrays]
    lib(*tensors)
    return [t.numpy() for t in tensors]


@pytest.mark.parametrize("vocab", [1000, 1001])
def test_llvm_advance_takes_the_first_maximum(vocab):
    arrays, want = _case(3, vocab, "float32", seed=vocab)
    got = _run(greedy_advance(3, vocab, HIST, "float32", cuda=False), "llvm", tvm.cpu(), arrays)
    _check(got, arrays, want)


@needs_nvcc
@pytest.mark.parametrize("vocab, vectors", [(32000, True), (1001, False)])
def test_cuda_advance_loads_16_byte_vectors(vocab, vectors, tmp_path):
    """32000 fp16 logits: 16-byte loads (the scan of one 2-byte load at a time took 25 µs a step
    on the 7B, H200 session 15); an odd vocabulary falls back to one element a load."""
    spec = get_target("sm90")
    func = greedy_advance(8, vocab, HIST, "float16", cuda=True)
    with codegen_scope():
        source = cuda_source(tvm.compile(tvm.IRModule({"main": func.with_attr(
            "global_symbol", "main")}), target=spec.tvm_target()))
    sass = fatbin_sass(compile_fatbin(source, spec, tmp_path))
    text = next(t for arch, t in sass.items() if arch.startswith("sm_"))
    assert ("LDG.E.128" in text) == vectors
    assert "STL" not in text and "LDL" not in text


def _cuda(func: tvm.tirx.PrimFunc) -> str:
    with codegen_scope():
        return cuda_source(tvm.compile(tvm.IRModule({"main": func.with_attr("global_symbol", "main")}),
                                       target=get_target("sm90").tvm_target()))


def test_cuda_advance_reads_the_state_before_the_wait():
    """Launched programmatically (``pdl``), thread 0 reads the position and offset before
    ``griddepcontrol.wait`` and nothing is loaded after the argmax; without it there is no wait.
    Both reduce over the warps by shuffles (5 rounds of value and index, twice), not a loop."""
    with_pdl = _cuda(greedy_advance(2, 8192, HIST, "float16", cuda=True, pdl=True))
    wait = with_pdl.index("griddepcontrol_wait();")
    assert with_pdl.index("positions_ptr[") < wait and with_pdl.index("offsets_ptr[") < wait
    after = with_pdl[wait:]
    assert "= positions_ptr[" not in after and "= ((int64_t)offsets_ptr[" not in after
    plain = _cuda(greedy_advance(2, 8192, HIST, "float16", cuda=True))
    assert "griddepcontrol" not in plain
    for src in (with_pdl, plain):
        assert src.count("__shfl_xor_sync") == 20
        assert "for (int w" not in src


@pytest.mark.gpu
@pytest.mark.parametrize("pdl", [False, True], ids=["plain", "pdl"])
@pytest.mark.parametrize("vocab", [32000, 8192, 1001, 50257, 128256])
@pytest.mark.parametrize("dtype", ["float16", "float32"])
def test_cuda_advance_on_the_gpu(vocab, dtype, pdl):
    """H200: the CUDA kernel's tokens and state against numpy (first maximum), batch 4 (``pdl``:
    the state read before the wait; launched here without the attribute, the wait returns)."""
    arrays, want = _case(4, vocab, dtype, seed=vocab % 97)
    got = _run(greedy_advance(4, vocab, HIST, dtype, cuda=True, pdl=pdl),
               get_target("sm90").tvm_target(), tvm.cuda(), arrays)
    _check(got, arrays, want)
