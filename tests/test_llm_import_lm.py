"""compile_lm from files: the ONNX export and the ``.pt2`` of a cache-less transformers LM.

transformers Llama (GQA) and GPT-2 at random init (tests/lm_reference.py ``tiny_lm``), wrapped as
``input_ids → logits`` and exported with a dynamic batch and sequence axis by the dynamo exporter
(``dynamic_shapes``) and the legacy one (``dynamic_axes``), or saved by ``torch.export.save``;
``compile_lm`` on the file + ``generate`` on the cpu target must give torch's greedy tokens
(tests/lm_reference.py's rule) for a batch of two prompts and a single longer one (two prefill
lengths, so the symbolic length is specialised twice).

The legacy exporter cannot export the plain wrapper of transformers 5.x: with no attention mask
the model checks position ids for packed sequences with ``torch.diff``, which it has no ONNX
symbolic for; that case is skipped with the exporter's error. Passing an all-ones
``attention_mask`` (the ``legacy-ones-mask`` wrapper) avoids the check, and that export is tested.
The compiling tests are marked slow: a compile (prefill8, prefill16, decode) takes 20-30 s on the
2-core machine, the file ~190 s (580 s when the machine was shared with other jobs).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tests.lm_reference import check_tokens, tiny_lm, torch_greedy

pytest.importorskip("transformers")
onnx = pytest.importorskip("onnx")

import tvmfuse  # noqa: E402
from tvmfuse.errors import ModelError  # noqa: E402

STEPS = 32
MAX_SEQ = 64
MAX_BATCH = 2
PREFILLS = [8, 16]
EXPORTERS = ["dynamo", "legacy", "legacy-ones-mask"]


class Logits(torch.nn.Module):
    """``input_ids → logits`` of a transformers causal LM (optionally with an all-ones mask)."""

    def __init__(self, model: torch.nn.Module, ones_mask: bool = False) -> None:
        super().__init__()
        self.model, self.ones_mask = model, ones_mask

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        mask = torch.ones_like(input_ids) if self.ones_mask else None
        return self.model(input_ids, attention_mask=mask, use_cache=False).logits


def _example() -> torch.Tensor:
    return torch.randint(0, 128, (MAX_BATCH, 8), generator=torch.Generator().manual_seed(0))


def _export_onnx(model: torch.nn.Module, exporter: str, path) -> None:
    from torch.export import Dim

    module = Logits(model, ones_mask=exporter == "legacy-ones-mask").eval()
    names = {"input_names": ["input_ids"], "output_names": ["logits"]}
    if exporter == "dynamo":
        dims = {0: Dim("batch", min=1, max=MAX_BATCH), 1: Dim("seq", min=2, max=MAX_SEQ)}
        torch.onnx.export(module, (_example(),), str(path), dynamo=True, dynamic_shapes=(dims,), **names)
    else:
        axes = {0: "batch", 1: "seq"}
        torch.onnx.export(module, (_example(),), str(path), dynamo=False, opset_version=17,
                          dynamic_axes={"input_ids": axes, "logits": axes}, **names)


@pytest.fixture(scope="module", params=[(m, e) for m in ("llama", "gpt2") for e in EXPORTERS],
                ids=lambda p: f"{p[0]}-{p[1]}")
def onnx_lm(request, tmp_path_factory):
    name, exporter = request.param
    model = tiny_lm(name)
    path = tmp_path_factory.mktemp(f"{name}-{exporter}") / "lm.onnx"
    try:
        _export_onnx(model, exporter, path)
    except Exception as err:  # the exporter's own failure, reported as such
        pytest.skip(f"the {exporter} exporter cannot export {name}: {type(err).__name__}: {err}")
    lib = tvmfuse.compile_lm(str(path), target="cpu", max_seq_len=MAX_SEQ, max_batch=MAX_BATCH,
                             prefill_lengths=PREFILLS)
    return model, lib.load()


def _check_generate(model: torch.nn.Module, lm, batch: int, length: int, seed: int) -> None:
    ids = torch.randint(0, 128, (batch, length), generator=torch.Generator().manual_seed(seed))
    ref_tokens, ref_logits = torch_greedy(model, ids, STEPS)
    got = lm.generate(ids, max_new_tokens=STEPS)
    assert got.shape == (batch, length + STEPS) and torch.equal(got[:, :length], ids)
    check_tokens(lm, ids.numpy(), None, ref_tokens, ref_logits, got.numpy())


@pytest.mark.slow
def test_onnx_greedy_tokens(onnx_lm):
    model, lm = onnx_lm
    _check_generate(model, lm, batch=2, length=5, seed=1)   # prefill8
    _check_generate(model, lm, batch=1, length=13, seed=2)  # prefill16


@pytest.mark.slow
def test_pt2_greedy_tokens(tmp_path):
    """``torch.export.save`` of the Llama wrapper with a dynamic batch and sequence length."""
    from torch.export import Dim

    model = tiny_lm("llama")
    dims = {0: Dim("batch", min=1, max=MAX_BATCH), 1: Dim("seq", min=2, max=MAX_SEQ)}
    ep = torch.export.export(Logits(model).eval(), (_example(),), dynamic_shapes=(dims,))
    path = tmp_path / "lm.pt2"
    torch.export.save(ep, path)
    lm = tvmfuse.compile_lm(str(path), target="cpu", max_seq_len=MAX_SEQ, max_batch=MAX_BATCH,
                            prefill_lengths=PREFILLS).load()
    _check_generate(model, lm, batch=2, length=5, seed=1)
    _check_generate(model, lm, batch=1, length=13, seed=2)


def _ids_model(shape: list) -> onnx.ModelProto:
    """ids → Gather from a (128, 8) embedding: enough of an LM for the input checks."""
    from onnx import TensorProto, helper, numpy_helper

    table = numpy_helper.from_array(np.ones((128, 8), np.float32), "table")
    graph = helper.make_graph([helper.make_node("Gather", ["table", "ids"], ["y"])], "g",
                              [helper.make_tensor_value_info("ids", TensorProto.INT64, shape)],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)], [table])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


@pytest.mark.parametrize("shape, message", [([1, 8], "static sequence length 8"),
                                            ([1, "seq"], "static batch 1, not max_batch=2")])
def test_onnx_ids_axes_refused(tmp_path, shape, message):
    path = tmp_path / "ids.onnx"
    onnx.save(_ids_model(shape), path)
    with pytest.raises(ModelError, match=message) as err:
        tvmfuse.compile_lm(str(path), target="cpu", max_seq_len=MAX_SEQ, max_batch=MAX_BATCH)
    assert str(path) in str(err.value)
