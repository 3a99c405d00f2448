"""Shared check of generated tokens against torch's greedy tokens (the LLM issue's rule).

Tokens must be equal for every step, except at a step where the reference's top-2 logits differ by
less than 1e-3 relative (a near tie: either token is right); there, and from there on, the
teacher-forced logits (both sides fed the reference tokens) must agree within 2e-2 relative.
"""

from __future__ import annotations

import inspect

import numpy as np
import torch

TIE_REL = 1e-3
LOGITS_REL = 2e-2


def tiny_llama(**config) -> torch.nn.Module:
    """transformers' LlamaForCausalLM at random init (seed 0), eval mode, fp32: vocab 128, hidden
    64, FFN 128, 2 layers, 4 query / 2 KV heads (``config`` overrides LlamaConfig fields)."""
    import transformers

    cfg = transformers.LlamaConfig(**{
        "vocab_size": 128, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 256,
        **config})
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(cfg).eval()


def torch_greedy(model: torch.nn.Module, ids: torch.Tensor, steps: int,
                 mask: torch.Tensor | None = None) -> tuple[np.ndarray, list[np.ndarray]]:
    """Greedy tokens (B, steps) of a cache-less model and each step's logits (B, V), recomputing
    the whole sequence each step (positions = cumsum(mask) - 1 for left padding). ``model``: a
    transformers causal LM, or a module whose ``forward(ids)`` returns logits."""
    plain = "attention_mask" not in inspect.signature(model.forward).parameters
    if plain and mask is not None:
        raise ValueError("a model whose forward takes only ids has no left padding")
    mask = torch.ones_like(ids) if mask is None else mask
    tokens, logits = [], []
    with torch.no_grad():
        for _ in range(steps):
            pos = (mask.cumsum(-1) - 1).clamp(min=0)
            if plain:  # ids → logits, like models/llama_lm.py
                out = model(ids)
            else:
                out = model(input_ids=ids, attention_mask=mask, position_ids=pos, use_cache=False).logits
            last = out[:, -1].float()
            logits.append(last.numpy())
            nxt = last.argmax(-1)
            tokens.append(nxt.numpy())
            ids = torch.cat([ids, nxt[:, None]], 1)
            mask = torch.cat([mask, torch.ones_like(nxt[:, None])], 1)
    return np.stack(tokens, 1), logits


def _rel(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.abs(a - b).max() / max(np.abs(b).max(), 1e-6))


def check_tokens(lm, ids: np.ndarray, mask: np.ndarray | None, ref_tokens: np.ndarray,
                 ref_logits: list[np.ndarray], got: np.ndarray) -> None:
    """Apply the rule above to ``got`` (B, T + steps) from ``lm.generate``."""
    t = ids.shape[1]
    new = got[:, t:]
    assert new.shape == ref_tokens.shape
    for step in range(ref_tokens.shape[1]):
        top2 = np.sort(ref_logits[step], axis=-1)[:, -2:]
        tie = (top2[:, 1] - top2[:, 0]) < TIE_REL * np.abs(top2[:, 1])
        differ = new[:, step] != ref_tokens[:, step]
        assert not (differ & ~tie).any(), (
            f"step {step}: tokens {new[:, step]} != torch {ref_tokens[:, step]} without a near tie")
        if differ.any():  # a near tie broke the other way: compare teacher-forced logits from here
            forced = [lm.prefill(ids, mask)]
            for s in range(ref_tokens.shape[1] - 1):
                forced.append(lm.decode(ref_tokens[:, s]))
            for s, (a, b) in enumerate(zip(forced, ref_logits)):
                assert _rel(a, b) < LOGITS_REL, f"teacher-forced logits at step {s}: rel {_rel(a, b)}"
            return


def greedy_matches_torch(model: torch.nn.Module, lm, length: int, steps: int) -> None:
    """A random prompt of ``length`` tokens (seeded by its length): ``lm.generate`` keeps the
    prompt and its new tokens pass :func:`check_tokens` against :func:`torch_greedy`."""
    torch.manual_seed(length)
    ids = torch.randint(0, 128, (1, length))
    ref_tokens, ref_logits = torch_greedy(model, ids, steps)
    got = lm.generate(ids, max_new_tokens=steps)
    assert isinstance(got, torch.Tensor) and got.shape == (1, length + steps)
    assert torch.equal(got[:, :length], ids)
    check_tokens(lm, ids.numpy(), None, ref_tokens, ref_logits, got.numpy())


def tiny_lm(name: str) -> torch.nn.Module:
    """transformers ``llama`` (4 query / 2 KV heads) or ``gpt2`` at random init: 2 layers, hidden 64,
    vocab 128."""
    import transformers

    torch.manual_seed(0)
    if name == "llama":
        cfg = transformers.LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128,
                                       num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                       max_position_embeddings=256)
        return transformers.LlamaForCausalLM(cfg).eval()
    cfg = transformers.GPT2Config(vocab_size=128, n_embd=64, n_layer=2, n_head=4, n_positions=128,
                                  bos_token_id=0, eos_token_id=0)
    return transformers.GPT2LMHeadModel(cfg).eval()
