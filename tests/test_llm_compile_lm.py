"""compile_lm + generate on the cpu target against torch's greedy tokens (tests/lm_reference.py)."""

from __future__ import annotations

import re

import numpy as np
import pytest
import torch

from tests.cuda_tools import needs_nvcc
from tests.lm_reference import check_tokens, greedy_matches_torch, tiny_llama, tiny_lm, torch_greedy

transformers = pytest.importorskip("transformers")

import tvmfuse  # noqa: E402
from tvmfuse.errors import InputError  # noqa: E402
from tvmfuse.runtime import read_metadata  # noqa: E402

STEPS = 32
MAX_SEQ = 64


def _llama():
    return tiny_llama()


@pytest.fixture(scope="module")
def llama(tmp_path_factory):  # compiles 4 entry points: ~20 s on CI's 2 cores
    model = _llama()
    lib = tvmfuse.compile_lm(model, target="cpu", max_seq_len=MAX_SEQ, max_batch=2,
                             prefill_lengths=[8, 16, 24])
    path = lib.export(tmp_path_factory.mktemp("lm") / "lm.so")
    return model, tvmfuse.load(path, device="cpu")


def test_weights_external_and_shared(llama):
    """lm.safetensors beside lm.so holds each weight once for the 4 entry points (3 prefill lengths
    and decode fold the same transposes / fused QKV): its size is the model's parameter bytes plus
    the RoPE tables, not 4 times that; the .so does not hold them."""
    model, lm = llama
    params = sum(p.numel() * p.element_size() for p in model.parameters())
    tables = 2 * MAX_SEQ * (64 // 4) * 4  # cos and sin, (max_seq, head_dim) fp32
    weights = lm.path.with_suffix(".safetensors")
    assert lm.metadata["weights"]["file"] == "lm.safetensors" and len(lm.weights) > 0
    assert params <= weights.stat().st_size <= params + tables + 16384  # + header
    row = model.model.embed_tokens.weight[3].detach().numpy().tobytes()  # gathered as is
    assert row in weights.read_bytes() and row not in lm.path.read_bytes()


@pytest.mark.slow
@pytest.mark.parametrize("length", [3, 11, 20])  # one per prefill length
def test_llama_greedy_tokens(llama, length):
    greedy_matches_torch(*llama, length, STEPS)


def test_greedy_steps_run_on_the_device(llama):
    """``generate`` steps with the library's ``advance`` (argmax and state update on the device);
    the host loop of ``prefill`` + ``decode`` + numpy argmax gives the same tokens."""
    _, lm = llama
    assert lm.metadata["device_greedy"] and lm._advance is not None
    ids = np.random.default_rng(4).integers(1, 128, (2, 7))
    got = lm.generate(ids, max_new_tokens=6)
    host = [lm.prefill(ids).argmax(-1)]
    for _ in range(5):
        host.append(lm.decode(host[-1]).argmax(-1))
    np.testing.assert_array_equal(got[:, 7:], np.stack(host, axis=1))


def test_llama_left_padded_batch(llama):
    model, lm = llama
    torch.manual_seed(1)
    ids = torch.randint(1, 128, (2, 9))
    mask = torch.ones_like(ids)
    mask[0, :4] = 0  # first prompt has 5 tokens, second 9
    ids[0, :4] = 0
    ref_tokens, ref_logits = torch_greedy(model, ids, STEPS, mask)
    got = lm.generate(ids.numpy(), max_new_tokens=STEPS, attention_mask=mask.numpy())
    assert isinstance(got, np.ndarray) and got.shape == (2, 9 + STEPS)
    assert (got[:, :9] == ids.numpy()).all()  # padding kept
    check_tokens(lm, ids.numpy(), mask.numpy(), ref_tokens, ref_logits, got)


def test_generate_refuses_past_the_cache(llama):
    _, lm = llama
    with pytest.raises(InputError, match="max_seq_len"):
        lm.generate(np.zeros((1, 20), "int64"), max_new_tokens=MAX_SEQ)


@pytest.mark.slow
def test_gpt2_learned_positions():
    model = tiny_lm("gpt2")
    lm = tvmfuse.compile_lm(model, target="cpu", max_seq_len=MAX_SEQ, max_batch=1,
                            prefill_lengths=[16]).load()
    ids = torch.randint(0, 128, (1, 6))
    ref_tokens, ref_logits = torch_greedy(model, ids, STEPS)
    got = lm.generate(ids, max_new_tokens=STEPS)
    check_tokens(lm, ids.numpy(), None, ref_tokens, ref_logits, got.numpy())


@pytest.mark.slow
def test_gpt2_batch_of_two_left_padded():
    """GPT-2 at max_batch 2: its Conv1D views the attention output as (B·S, E), which torch's
    SDPA decomposition left unviewable with a symbolic batch (the import failed); the views are
    now reshapes on that retry. Two prompts, one left-padded, against torch's greedy tokens."""
    model = tiny_lm("gpt2")
    lm = tvmfuse.compile_lm(model, target="cpu", max_seq_len=MAX_SEQ, max_batch=2,
                            prefill_lengths=[16]).load()
    ids = torch.randint(0, 128, (2, 7))
    mask = torch.ones_like(ids)
    mask[1, :3] = 0
    ids[1, :3] = 0
    ref_tokens, ref_logits = torch_greedy(model, ids, STEPS, mask)
    got = lm.generate(ids, max_new_tokens=STEPS, attention_mask=mask)
    assert torch.equal(got[:, :7], ids)
    check_tokens(lm, ids.numpy(), mask.numpy(), ref_tokens, ref_logits, got.numpy())


@pytest.mark.slow
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_llama_lm_module(dtype):
    """models/llama_lm.py as a user writes it (fused QKV, cos/sin buffers sliced [:S], GQA by
    repeat_interleave, SDPA), fp32 and fp16 as the model is (no dtype= conversion)."""
    from models.llama_lm import build

    model, _ = build(dtype=dtype, seq=MAX_SEQ)  # RoPE tables of MAX_SEQ rows
    lm = tvmfuse.compile_lm(model, target="cpu", max_seq_len=MAX_SEQ, prefill_lengths=[16]).load()
    assert lm.metadata["caches"][0]["dtype"] == str(dtype).removeprefix("torch.")
    torch.manual_seed(7)
    ids = torch.randint(0, 256, (1, 7))
    ref_tokens, ref_logits = torch_greedy(model, ids, STEPS)
    got = lm.generate(ids, max_new_tokens=STEPS)
    check_tokens(lm, ids.numpy(), None, ref_tokens, ref_logits, got.numpy())


def _sm90_fp16_llama(path, **options):
    """The fp16 tiny Llama compiled for sm90 under ``options`` (Options fields), exported to path."""
    import dataclasses

    from tvmfuse.options import current_options, use_options

    model = _llama().half()
    with use_options(dataclasses.replace(current_options(), **options)):
        lib = tvmfuse.compile_lm(model, target="sm90", max_seq_len=MAX_SEQ, max_batch=2, prefill_lengths=[16])
    return model, lib.export(path)


@needs_nvcc
@pytest.mark.slow
def test_sm90_lowers_and_builds_with_nvcc(tmp_path):
    """The fp16 Llama for sm90: every entry point lowers, nvcc builds the fatbin (export refuses a
    library without CUDA code), the weights go to lm.safetensors once (one layout for decode and
    prefill)."""
    model, path = _sm90_fp16_llama(tmp_path / "lm.so")
    params = sum(p.numel() * p.element_size() for p in model.parameters())
    size = path.with_suffix(".safetensors").stat().st_size
    meta = read_metadata(path)
    assert meta["target"] == "sm90" and meta["caches"][0]["dtype"] == "float16"
    # each weight once: the prefill's wgmma GEMMs read the decode GEMV's (N, K) copy of every
    # projection (rules/weight_twins.py); session 8's library held both layouts (2× params)
    assert params <= size <= params + 2 * MAX_SEQ * 16 * 2 + 16384, (size, params)


_PDL_AT_2 = {"programmatic_launch_max_batch": 2}  # max_batch 2 would otherwise launch plainly


@pytest.mark.gpu
@pytest.mark.parametrize("options", [{}, {"gemv_prefetch_after_attention": True, **_PDL_AT_2},
                                     {"decode_fold_append": True, "decode_cluster_combine": "off",
                                      "gemv_prefetch_after_attention": True, **_PDL_AT_2},
                                     {"gemv_preload_weights": True, **_PDL_AT_2},
                                     {"decode_cluster_combine": "on"},
                                     {"decode_gemv_append": True, **_PDL_AT_2},
                                     {"decode_gemv_append": False}],
                         ids=["default", "prefetch_after_attention", "fold_and_prefetch", "preload",
                              "cluster_without_pdl", "gemv_append", "append_kernel"])
def test_sm90_generate_on_the_gpu(tmp_path, options):
    """H200: the sm90 library's greedy tokens against torch's (fp16 model on the CPU), with the
    decode options that change kernels off their defaults too (those that act only on kernels
    launched programmatically with PDL kept on at max_batch 2)."""
    model, path = _sm90_fp16_llama(tmp_path / "lm.so", **options)
    lm = tvmfuse.load(path, device="cuda")
    torch.manual_seed(3)
    ids = torch.randint(0, 128, (2, 9))
    ref_tokens, ref_logits = torch_greedy(model, ids, STEPS)
    got = lm.generate(ids, max_new_tokens=STEPS)
    check_tokens(lm, ids.numpy(), None, ref_tokens, ref_logits, got.numpy())
    # prompts of 5 and 9 tokens, left-padded: the runtime right-pads them for the causal prefill
    mask = torch.ones_like(ids)
    mask[0, :4] = 0
    ids[0, :4] = 0
    ref_tokens, ref_logits = torch_greedy(model, ids, STEPS, mask)
    got = lm.generate(ids, max_new_tokens=STEPS, attention_mask=mask)
    assert torch.equal(got[:, :9], ids)  # padding kept
    check_tokens(lm, ids.numpy(), mask.numpy(), ref_tokens, ref_logits, got.numpy())


@needs_nvcc
@pytest.mark.slow
@pytest.mark.parametrize("mode, max_batch, cluster", [("pdl", 1, True), ("pdl", 2, False),
                                                      ("on", 2, True)])
def test_sm90_decode_attention_combines_in_a_cluster(mode, max_batch, cluster):
    """``Options.decode_cluster_combine``: "pdl" (default) gives the decode step launched
    programmatically (one sequence) the cluster kernel (one kernel reading its peers' shared
    memory); at two sequences the step launches plainly and keeps the partial + combine kernels;
    "on" takes the cluster there too."""
    import dataclasses

    from tvmfuse.build.inspect import cuda_source
    from tvmfuse.options import current_options, use_options

    with use_options(dataclasses.replace(current_options(), decode_cluster_combine=mode)):
        lib = tvmfuse.compile_lm(_llama().half(), target="sm90", max_seq_len=MAX_SEQ,
                                 max_batch=max_batch, prefill_lengths=[16])
    source = cuda_source(lib.executable)
    names = re.findall(r"__global__ void (?:__launch_bounds__\(\d+\) )?(\w+)\(", source)
    attention = sorted({n for n in names if "cache_attention" in n})
    assert len(attention) == (1 if cluster else 2), attention
    assert ("ld.shared::cluster" in source) == cluster


@needs_nvcc
@pytest.mark.slow
def test_sm90_decode_fuses_rope_into_the_cache_append():
    """At decode the RoPE of q and k, the V slice and the RoPE tables' gathers are fused into the
    in-place append of the layer's state: per layer one kernel between the QKV projection and the
    attention, and no kernel only copies q, k or v or gathers cos / sin. (With
    ``Options.decode_fold_append`` (off by default) that kernel then moves into the attention:
    tests/test_rule_fold_decode_append.py; with ``decode_gemv_append`` (on by default) into the
    QKV GEMV: tests/test_rule_gemv_append.py.)"""
    import dataclasses

    from tvmfuse.build.inspect import cuda_source
    from tvmfuse.options import current_options, use_options

    with use_options(dataclasses.replace(current_options(), decode_fold_append=False,
                                         decode_gemv_append=False)):
        lib = tvmfuse.compile_lm(_llama().half(), target="sm90", max_seq_len=MAX_SEQ, max_batch=2,
                                 prefill_lengths=[16])
    names = re.findall(r"__global__ void (?:__launch_bounds__\(\d+\) )?(\w+)\(", cuda_source(lib.executable))
    appends = sorted({n for n in names if "decode_append" in n})
    assert len(appends) == 1, appends  # every layer shares it
    assert "negative" in appends[0] and "take" in appends[0], appends  # rotate_half, cos/sin
    assert appends[0].startswith("fused_"), appends
    assert not [n for n in names if re.fullmatch(r"take\d*_kernel", n)], names  # cos / sin alone


def test_sm90_compile_keeps_no_weights_once_dropped():
    """The weights a compile derives (fused, γ-scaled, interleaved, transposed: torch tensors
    under numpy views) die with the library: none stays resident for the rest of the process
    (session 41: 3.3x the model's weights did, through mutator classes defined per call)."""
    import gc

    model = _llama().half()
    gc.collect()
    before = {id(o) for o in gc.get_objects() if isinstance(o, torch.Tensor)}
    lib = tvmfuse.compile_lm(model, target="sm90", max_seq_len=MAX_SEQ, max_batch=1, prefill_lengths=[16])
    assert lib.weights
    del lib
    gc.collect()
    fake = torch._subclasses.fake_tensor.FakeTensor  # torch.export's graph metadata: no storage
    left = [tuple(o.shape) for o in gc.get_objects() if isinstance(o, torch.Tensor) and id(o) not in before
            and not isinstance(o, fake) and o.numel() > 1024]
    assert not left, f"tensors the compile left alive: {left}"
