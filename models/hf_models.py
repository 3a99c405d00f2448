"""Tiny Hugging Face models (random init, no hub access) exported to ONNX (tests, tools/report_models).

    from models.hf_models import gpt2_onnx, bert_onnx, llama_onnx, llama_sdpa_onnx, llama_pt2
    path = llama_onnx(tmp_dir)          # written once, reused while the file exists

Every model is built from a small config (2 layers, hidden 64, 4 heads, vocab 128) after
``torch.manual_seed(0)``, put in ``eval()`` mode and wrapped in a module that returns one tensor
(``logits`` for GPT-2 / Llama, ``last_hidden_state`` for BERT) with ``use_cache=False``, so each
graph has exactly one output. Shapes are fixed: ``input_ids`` [1, 16] for the decoders, ``input_ids``
and ``attention_mask`` [2, 16] (int64) for BERT.

Exporters (torch 2.13, transformers 5.24). ``exporter="auto"`` (the default) tries them in this
order and keeps the first whose file passes ``onnx.checker`` and matches torch under onnxruntime
(rel err <= 1e-4 on the example inputs and on a second input set with other ids and, for BERT,
another padding length); ``"torchscript"`` / ``"dynamo"`` force one and write
``<name>.<exporter>.onnx`` instead of ``<name>.onnx``. The exporter used is stored in the file's
``metadata_props`` (:func:`exporter_of`).

1. ``torchscript-opset17``: ``torch.onnx.export(..., dynamo=False, opset_version=17)``. Works for
   all four models (under a second each) and keeps the graphs as HF writes them: masks built from
   comparisons/And/Where at run time, Cos/Sin RoPE, the IsNaN/Where guards of the SDPA path. It needs:

   * GPT-2 / Llama: with no ``attention_mask``, transformers' ``create_causal_mask`` derives a
     "packed sequence" mask from ``position_ids`` with ``torch.diff``, which the TorchScript exporter
     cannot translate (``UnsupportedOperatorError: Exporting the operator 'aten::diff' to ONNX opset
     version 17 is not supported``). The wrapper therefore passes an explicit all-ones mask
     (``torch.ones_like(input_ids)``); that computes the same thing.
   * The *wrapper* in eval mode, not only the HF model: the TorchScript exporter restores the top
     module's training flag recursively after exporting, so a train-mode wrapper would leave
     dropout switched on in the HF model afterwards (torch then disagrees with the file).

   BERT's padding mask is data dependent: the traced example has padding (zeros at the end of
   row 1), else the traced graph would drop the mask.

   These graphs contain ``ConstantOfShape(shape=int64[0], value=bool[True])`` (a rank-0 ``True``,
   transformers' ``and_masks``: ``q_idx.new_ones((), dtype=torch.bool)``), which TVM 0.27's Relax
   ONNX frontend cannot import (see tests/test_hf_models.py).
   Graph sizes: GPT-2 169 nodes, BERT 163, Llama 281, Llama SDPA 294 (about a third Constant).
2. ``dynamo-opset18``: ``torch.onnx.export(..., dynamo=True, opset_version=18)``, 3-20 s per model.
   Works for all four models; constant-folds the masks and RoPE tables (the SDPA guards remain as
   IsNaN/Where). Opset 18 is the dynamo exporter's own minimum: asked for 17 it down-converts,
   which gives an invalid GPT-2 file (``Split`` keeps the opset-18 ``num_outputs`` attribute,
   ``onnx.checker`` rejects it) and leaves Llama at opset 18 (conversion fails, silently).
   Graph sizes: GPT-2 80 nodes, BERT 79, Llama 129, Llama SDPA 137. Its onnxscript optimizer prints
   "Evaluation failed: cannot reshape array of size 1 into shape (1,16)" for BERT: harmless, that
   node is simply not constant-folded.
"""

from __future__ import annotations

import os
import tempfile
import warnings
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np

VOCAB = 128
SEQ = 16
HIDDEN = 64
LAYERS = 2
HEADS = 4
KV_HEADS = 2  # Llama: grouped-query attention, 2 query heads per KV head
BERT_BATCH = 2
DECODER_BATCH = 1
EXPORTERS = ("torchscript-opset17", "dynamo-opset18")
_EXPORTER_CHOICES = ("auto", "torchscript", "dynamo")
_EXPORTER_KEY = "tests.hf_models.exporter"
_CHECK_RTOL = 1e-4  # onnxruntime vs torch, fp32


def input_specs(name: str) -> list[tuple[str, tuple[int, ...]]]:
    """``[(input name, shape)]`` of model ``name``; every input is int64."""
    if name == "bert":
        return [("input_ids", (BERT_BATCH, SEQ)), ("attention_mask", (BERT_BATCH, SEQ))]
    return [("input_ids", (DECODER_BATCH, SEQ))]


def sample_inputs(name: str, seed: int = 0) -> list[np.ndarray]:
    """Valid random inputs for model ``name``: ids in [0, VOCAB); BERT's mask pads row ends.

    Row 0 of BERT's mask is all ones, every later row ends in ``3 + seed % 5 + row`` zeros.
    """
    rng = np.random.default_rng(seed)
    arrays = []
    for inp, shape in input_specs(name):
        if inp == "attention_mask":
            mask = np.ones(shape, np.int64)
            for row in range(1, shape[0]):
                mask[row, shape[1] - (3 + seed % 5 + row):] = 0
            arrays.append(mask)
        else:
            arrays.append(rng.integers(0, VOCAB, size=shape, dtype=np.int64))
    return arrays


def exporter_of(path: str | os.PathLike) -> str:
    """The exporter that wrote ``path`` (one of :data:`EXPORTERS`), from its metadata."""
    import onnx

    model = onnx.load(os.fspath(path), load_external_data=False)
    return next((p.value for p in model.metadata_props if p.key == _EXPORTER_KEY), "unknown")


# --- models --------------------------------------------------------------------------------------


def _wrapper(model, output: str, decoder: bool):
    import torch

    class OneOutput(torch.nn.Module):
        """Returns only ``output``; decoders get an explicit all-ones mask (see module docstring)."""

        def __init__(self):
            super().__init__()
            self.model = model
            self.output = output  # also the ONNX graph output's name

        def forward(self, input_ids, attention_mask=None):
            if attention_mask is None and decoder:
                attention_mask = torch.ones_like(input_ids)
            out = self.model(input_ids=input_ids, attention_mask=attention_mask, use_cache=False)
            return getattr(out, self.output)

    # eval() on the wrapper, not only on the HF model: see the module docstring.
    return OneOutput().eval()


def _build_gpt2(attn: str):
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(
        vocab_size=VOCAB, n_positions=64, n_embd=HIDDEN, n_layer=LAYERS, n_head=HEADS,
        bos_token_id=0, eos_token_id=0, use_cache=False, attn_implementation=attn,
    )
    torch.manual_seed(0)
    return _wrapper(GPT2LMHeadModel(config).eval(), "logits", decoder=True)


def _build_bert(attn: str):
    import torch
    from transformers import BertConfig, BertModel

    config = BertConfig(
        vocab_size=VOCAB, hidden_size=HIDDEN, num_hidden_layers=LAYERS, num_attention_heads=HEADS,
        intermediate_size=4 * HIDDEN, max_position_embeddings=64, pad_token_id=0,
        attn_implementation=attn,
    )
    torch.manual_seed(0)
    return _wrapper(BertModel(config, add_pooling_layer=False).eval(), "last_hidden_state", decoder=False)


def _build_llama(attn: str, hidden: int = HIDDEN, heads: int = HEADS, kv_heads: int = KV_HEADS,
                 ones_mask: bool = True):
    """``ones_mask=False``: called with ``input_ids`` only, as a user does (torch.export only)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=VOCAB, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=LAYERS,
        num_attention_heads=heads, num_key_value_heads=kv_heads, max_position_embeddings=64,
        bos_token_id=1, eos_token_id=2, pad_token_id=0, use_cache=False, attn_implementation=attn,
    )
    torch.manual_seed(0)
    return _wrapper(LlamaForCausalLM(config).eval(), "logits", decoder=ones_mask)


# --- export --------------------------------------------------------------------------------------


def _rel_err(out, ref) -> float:
    out, ref = np.asarray(out, np.float64), np.asarray(ref, np.float64)
    if out.shape != ref.shape:
        return float("inf")
    return float(np.linalg.norm(out - ref) / np.linalg.norm(ref))


def _export_once(module, args, path: Path, names: Sequence[str], exporter: str) -> None:
    import onnx
    import torch

    kind, opset = exporter.split("-opset")
    with warnings.catch_warnings():
        # TorchScript exporter deprecation, TracerWarnings on HF's shape checks, opset bump notes.
        warnings.simplefilter("ignore")
        with torch.no_grad():
            if kind == "torchscript":
                torch.onnx.export(
                    module, args, os.fspath(path), input_names=list(names),
                    output_names=[module.output], opset_version=int(opset), dynamo=False,
                )
            else:
                program = torch.onnx.export(
                    module, args, input_names=list(names), output_names=[module.output],
                    opset_version=int(opset), dynamo=True, verbose=False,
                )
                program.save(os.fspath(path), external_data=False)
    model = onnx.load(os.fspath(path))
    onnx.checker.check_model(model)
    if len(model.graph.output) != 1:
        raise ValueError(f"{exporter}: {len(model.graph.output)} graph outputs, expected 1")


def _check_against_torch(module, path: Path, name: str, exporter: str) -> None:
    import onnxruntime as ort
    import torch

    sess = ort.InferenceSession(os.fspath(path), providers=["CPUExecutionProvider"])
    names = [i.name for i in sess.get_inputs()]
    for seed in (0, 1):  # seed 1: other ids and another padding length than the traced example
        arrays = sample_inputs(name, seed)
        with torch.no_grad():
            ref = module(*(torch.from_numpy(a) for a in arrays)).numpy()
        (out,) = sess.run(None, dict(zip(names, arrays)))
        err = _rel_err(out, ref)
        if not err <= _CHECK_RTOL:
            raise ValueError(f"{exporter}: onnxruntime differs from torch (rel err {err:.3e}, seed {seed})")


def _export(
    name: str, build: Callable, dir: str | os.PathLike, stem: str, exporter: str = "auto"
) -> Path:
    """Write ``dir/<stem>.onnx`` (``<stem>.<exporter>.onnx`` when forced) or reuse it."""
    import onnx
    import torch

    if exporter not in _EXPORTER_CHOICES:
        raise ValueError(f"exporter must be one of {', '.join(_EXPORTER_CHOICES)}, not {exporter!r}")
    path = Path(dir) / (f"{stem}.onnx" if exporter == "auto" else f"{stem}.{exporter}.onnx")
    if path.is_file():
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    module = build()
    args = tuple(torch.from_numpy(a) for a in sample_inputs(name, 0))
    names = [n for n, _ in input_specs(name)]
    failures = []
    for candidate in EXPORTERS:
        if exporter != "auto" and not candidate.startswith(exporter + "-"):
            continue
        fd, tmp = tempfile.mkstemp(suffix=".onnx", prefix=f".{stem}-", dir=path.parent)
        os.close(fd)
        tmp = Path(tmp)
        try:
            _export_once(module, args, tmp, names, candidate)
            _check_against_torch(module, tmp, name, candidate)
            model = onnx.load(os.fspath(tmp))
            onnx.helper.set_model_props(model, {_EXPORTER_KEY: candidate})
            onnx.save(model, os.fspath(tmp))
            os.replace(tmp, path)  # atomic: a concurrent caller never sees a half-written file
            return path
        except Exception as err:  # exporter missing, unable to trace, invalid or wrong file
            first = (str(err).strip().splitlines() or [""])[0][:300]
            failures.append(f"{candidate}: {type(err).__name__}: {first}")
        finally:
            tmp.unlink(missing_ok=True)
    raise RuntimeError(f"could not export {stem} to ONNX:\n  " + "\n  ".join(failures))


def gpt2_onnx(dir: str | os.PathLike, exporter: str = "auto") -> Path:
    """GPT-2 LM (eager attention) -> ``dir/gpt2.onnx``: input_ids [1, 16] -> logits [1, 16, 128].

    ``auto`` gives ``torchscript-opset17`` (with the all-ones mask for ``aten::diff``, see the
    module docstring); ``dynamo`` gives ``dynamo-opset18``.
    """
    return _export("gpt2", lambda: _build_gpt2("eager"), dir, "gpt2", exporter)


def bert_onnx(dir: str | os.PathLike, exporter: str = "auto") -> Path:
    """BERT encoder (eager, no pooler) -> ``dir/bert.onnx``: input_ids, attention_mask [2, 16]
    (int64) -> last_hidden_state [2, 16, 64]; the mask input exports the padding-mask path.

    ``auto`` gives ``torchscript-opset17``; ``dynamo`` gives ``dynamo-opset18``.
    """
    return _export("bert", lambda: _build_bert("eager"), dir, "bert", exporter)


def llama_onnx(dir: str | os.PathLike, exporter: str = "auto") -> Path:
    """Llama LM with GQA (4 query / 2 KV heads, eager attention) -> ``dir/llama.onnx``:
    input_ids [1, 16] -> logits [1, 16, 128].

    ``auto`` gives ``torchscript-opset17`` (with the all-ones mask for ``aten::diff``);
    ``dynamo`` gives ``dynamo-opset18``.
    """
    return _export("llama", lambda: _build_llama("eager"), dir, "llama", exporter)


def llama_sdpa_onnx(dir: str | os.PathLike, exporter: str = "auto") -> Path:
    """:func:`llama_onnx` with ``attn_implementation="sdpa"`` -> ``dir/llama_sdpa.onnx`` (same
    weights); the exported attention carries HF's IsNaN/Where guards (fully masked rows -> 0).

    ``auto`` gives ``torchscript-opset17`` (with the all-ones mask for ``aten::diff``);
    ``dynamo`` gives ``dynamo-opset18``.
    """
    return _export("llama", lambda: _build_llama("sdpa"), dir, "llama_sdpa", exporter)


def llama_pt2(dir: str | os.PathLike, attn: str = "sdpa") -> Path:
    """Llama LM (hidden 256, 8 query / 2 KV heads, 2 layers) → ``torch.export.save`` →
    ``dir/llama_<attn>.pt2``: input_ids [1, 16] -> logits [1, 16, 128].

    Called with ``input_ids`` only (no mask), so transformers' ``create_causal_mask`` keeps its
    packed-sequence check (``torch.diff`` + a bool ``cumsum``), which the TorchScript ONNX exporter
    cannot take but torch.export can. Written once, reused while the file exists.
    """
    import torch

    path = Path(dir) / f"llama_{attn}.pt2"
    if path.is_file():
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    module = _build_llama(attn, hidden=256, heads=8, kv_heads=2, ones_mask=False)
    args = tuple(torch.from_numpy(a) for a in sample_inputs("llama", 0))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        program = torch.export.export(module, args)
    fd, tmp = tempfile.mkstemp(suffix=".pt2", prefix=".llama-", dir=path.parent)
    os.close(fd)
    torch.export.save(program, tmp)
    os.replace(tmp, path)  # atomic: a concurrent caller never sees a half-written file
    return path


MODELS: dict[str, Callable[..., Path]] = {
    "gpt2": gpt2_onnx,
    "bert": bert_onnx,
    "llama": llama_onnx,
    "llama_sdpa": llama_sdpa_onnx,
}


def export_all(dir: str | os.PathLike, exporter: str = "auto") -> dict[str, Path]:
    """All four models into ``dir`` with ``exporter``; ``{name: path}``."""
    return {name: fn(dir, exporter) for name, fn in MODELS.items()}
