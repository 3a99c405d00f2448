"""compile_lm with a sliding window (transformers Mistral at random init, window shorter than the
cache) on the cpu target: greedy tokens against torch's (tests/lm_reference.py), the window taken
from the prefill traces into the decode step (a one-query trace shows no band), CUDA refused."""

from __future__ import annotations

import pytest
import torch

from tests.lm_reference import check_tokens, greedy_matches_torch, torch_greedy

transformers = pytest.importorskip("transformers")

import tvmfuse  # noqa: E402
from tvmfuse.errors import CompileError  # noqa: E402

WINDOW = 6
STEPS = 24


def _mistral(window: int = WINDOW):
    cfg = transformers.MistralConfig(vocab_size=128, hidden_size=64, intermediate_size=128,
                                     num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                     max_position_embeddings=128, sliding_window=window)
    torch.manual_seed(0)
    return transformers.MistralForCausalLM(cfg).eval()


@pytest.fixture(scope="module")
def mistral():
    """Prefill lengths 4 (no longer than the window: its trace shows plain causal attention) and
    16 (shows the band); decode gets the window from the latter."""
    model = _mistral()
    return model, tvmfuse.compile_lm(model, target="cpu", max_seq_len=64, max_batch=2,
                                     prefill_lengths=[4, 16]).load()


@pytest.mark.parametrize("length", [3, 11])  # one prompt per prefill length
def test_greedy_tokens_past_the_window(mistral, length):
    greedy_matches_torch(*mistral, length, STEPS)


def test_left_padded_batch(mistral):
    model, lm = mistral
    torch.manual_seed(1)
    ids = torch.randint(1, 128, (2, 9))
    mask = torch.ones_like(ids)
    mask[0, :4] = 0
    ids[0, :4] = 0
    ref_tokens, ref_logits = torch_greedy(model, ids, STEPS, mask)
    got = lm.generate(ids.numpy(), max_new_tokens=STEPS, attention_mask=mask.numpy())
    check_tokens(lm, ids.numpy(), mask.numpy(), ref_tokens, ref_logits, got)


def test_the_window_changes_the_tokens(mistral):
    """The same weights without a window (window ≥ the cache: it never binds) decode other
    tokens for this prompt: the test above can tell a window from none."""
    model, lm = mistral
    wide = _mistral(window=4096)
    wide.load_state_dict(model.state_dict())
    ids = torch.randint(0, 128, (1, 3), generator=torch.Generator().manual_seed(3))
    assert not torch.equal(torch.as_tensor(torch_greedy(wide, ids, STEPS)[0]),
                           torch.as_tensor(lm.generate(ids, max_new_tokens=STEPS)[:, 3:]))


def test_cuda_refuses_a_window_shorter_than_the_cache():
    with pytest.raises(CompileError, match="sliding window of 6 keys, shorter than max_seq_len 64"):
        tvmfuse.compile_lm(_mistral(), target="sm90", max_seq_len=64, max_batch=1, prefill_lengths=[16])
