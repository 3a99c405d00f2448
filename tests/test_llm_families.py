"""compile_lm on transformers families beyond Llama / GPT-2, at random init, as a user brings them:
Phi-3 (one fused QKV weight, one fused gate/up weight cut by ``chunk``), Qwen3 (RMSNorm on
each query / key head), GPTBigCode (multi-query; ``view(*input_shape, -1, head_dim)`` under the
symbolic length used to fail the import) and Falcon's new decoder architecture (grouped K/V
picked by ``[..., -2, :]`` / ``[..., -1, :]``: silently wrong before NegativeIndices). Greedy
tokens equal transformers' (``lm_reference.check_tokens``); the last two are initialised with a
larger spread (``initializer_range=0.3``) so that their greedy tokens are not one repeated token."""

from __future__ import annotations

import pytest
import torch

import tvmfuse
from tests.lm_reference import greedy_matches_torch


def _model(name: str) -> torch.nn.Module:
    import transformers as T

    torch.manual_seed(0)
    common = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
    if name == "phi3":
        return T.Phi3ForCausalLM(T.Phi3Config(**common, pad_token_id=0, eos_token_id=0)).eval()
    if name == "gpt_bigcode":
        return T.GPTBigCodeForCausalLM(T.GPTBigCodeConfig(
            vocab_size=128, n_embd=64, n_layer=2, n_head=4, n_inner=128, n_positions=256,
            multi_query=True, initializer_range=0.3, bos_token_id=0, eos_token_id=0)).eval()
    if name == "falcon":
        return T.FalconForCausalLM(T.FalconConfig(
            vocab_size=128, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
            num_kv_heads=2, new_decoder_architecture=True, max_position_embeddings=256,
            ffn_hidden_size=128, initializer_range=0.3, bos_token_id=0, eos_token_id=0)).eval()
    return T.Qwen3ForCausalLM(T.Qwen3Config(**common, head_dim=16)).eval()


@pytest.mark.parametrize("name", ["phi3", "qwen3", "gpt_bigcode", "falcon"])
def test_greedy_tokens(name):
    model = _model(name)
    lm = tvmfuse.compile_lm(model, target="cpu", max_seq_len=64, prefill_lengths=[16]).load()
    for length in (5, 13):
        greedy_matches_torch(model, lm, length, 24)


def test_phi3_mlp_is_one_pair_gemm():
    """Phi-3's ``gate_up_proj(x).chunk(2, -1)`` SwiGLU: the pair GEMM in the prefill, no kernel
    that slices the GEMM's output."""
    from tests.test_llm_import_lm import Logits
    from tvmfuse.frontend import import_model
    from tvmfuse.report import analyze
    from tvmfuse.targets import get_target

    ids = torch.randint(0, 128, (1, 16))
    report = analyze(import_model(Logits(_model("phi3")), (ids,)).mod, get_target("sm90"), "float16",
                     stock=False)
    names = [k["name"] for k in report["kernels"]]
    assert sum("matmul_pair" in n for n in names) == 2, names  # one per layer
    assert not any("split" in n for n in names), names
