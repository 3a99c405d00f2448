"""transformers models with LayerNorm at random init in fp16, one forward pass: GPT-2 and BERT.

cuda: GPT-2 (4 layers, hidden 1024, 16 heads, vocab 8192) on ids (1, 2048) → logits, and BERT
(4 layers, hidden 768, 12 heads, intermediate 3072, vocab 8192) on ids (8, 512) with the
attention_mask a padded batch has (row b: 512 − 32·b real tokens, then padding) →
last_hidden_state; cpu smoke: 2 layers, hidden 64, 32 tokens. Both are built as a user would
(``from_config``, ``.half().eval()``, eager attention) and wrapped to return one tensor.
``--family gpt2`` / ``bert``: one of them.

FLOPs per layer, T = batch·seq, h = hidden, f = FFN width:
    projections  2·T·h·4h       (qkv, o)
    MLP          2 · 2·T·h·f    (up, down)
    attention    4·batch·seq²·h (GPT-2: half of it, causal)
plus GPT-2's LM head 2·T·h·vocab. Baselines: the same module in torch eager and torch.compile.
"""

from __future__ import annotations

import argparse
from typing import Any

import common
import torch

SIZES = {
    "cuda": {"gpt2": dict(layers=4, hidden=1024, heads=16, batch=1, seq=2048),
             "bert": dict(layers=4, hidden=768, heads=12, batch=8, seq=512)},
    "cpu": {"gpt2": dict(layers=2, hidden=64, heads=4, batch=1, seq=32),
            "bert": dict(layers=2, hidden=64, heads=4, batch=2, seq=16)},
}
VOCAB = 8192


class _FirstOutput(torch.nn.Module):
    """``model(input_ids) → logits`` or ``last_hidden_state`` (no cache)."""

    def __init__(self, model: torch.nn.Module, field: str) -> None:
        super().__init__()
        self.model, self.field = model, field

    def forward(self, ids: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        out = self.model(input_ids=ids, use_cache=False) if self.field == "logits" else \
            self.model(input_ids=ids, attention_mask=mask)
        return getattr(out, self.field)


def flops(family: str, layers: int, hidden: int, heads: int, batch: int, seq: int) -> float:
    """Matmul FLOPs of one forward pass (see the module docstring)."""
    tokens, ffn = batch * seq, 4 * hidden
    attn = 4.0 * batch * seq * seq * hidden * (0.5 if family == "gpt2" else 1.0)
    layer = 2.0 * tokens * hidden * 4 * hidden + 2 * 2.0 * tokens * hidden * ffn + attn
    head = 2.0 * tokens * hidden * VOCAB if family == "gpt2" else 0.0
    return layers * layer + head


def workload(family: str, size: dict[str, int], dtype: str) -> common.Workload:
    """``family`` ("gpt2" / "bert") at ``size`` as a Workload."""
    import transformers

    torch.manual_seed(0)
    if family == "gpt2":
        cfg = transformers.GPT2Config(n_layer=size["layers"], n_embd=size["hidden"],
                                      n_head=size["heads"], vocab_size=VOCAB,
                                      n_positions=max(1024, size["seq"]),
                                      attn_implementation="eager")
        model, field = transformers.GPT2LMHeadModel(cfg), "logits"
    else:
        cfg = transformers.BertConfig(num_hidden_layers=size["layers"], hidden_size=size["hidden"],
                                      num_attention_heads=size["heads"],
                                      intermediate_size=4 * size["hidden"], vocab_size=VOCAB,
                                      max_position_embeddings=max(512, size["seq"]),
                                      attn_implementation="eager")
        model, field = transformers.BertModel(cfg, add_pooling_layer=False), "last_hidden_state"
    module = _FirstOutput(model.to(common.DTYPES[dtype]).eval(), field).eval()
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, VOCAB, (size["batch"], size["seq"]), generator=gen)
    inputs: tuple[torch.Tensor, ...] = (ids,)
    if family == "bert":  # a padded batch: row b has seq − b·seq/(2·batch) real tokens
        real = size["seq"] - torch.arange(size["batch"]) * (size["seq"] // (2 * size["batch"]))
        inputs = (ids, (torch.arange(size["seq"])[None] < real[:, None]).to(torch.int64))
    return common.Workload(name=f"hf_{family}", module=module, inputs=inputs,
                           shape=" ".join(f"{k}={v}" for k, v in size.items()), dtype=dtype,
                           flops=flops(family, **size))


def run(args: argparse.Namespace) -> list[dict[str, Any]]:
    """Benchmark the families of ``args.family`` (default both); one row each."""
    families = getattr(args, "family", None) or list(SIZES[args.device])
    return [common.bench(workload(family, SIZES[args.device][family], args.dtype), args)
            for family in families]


def options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--family", action="append", choices=list(SIZES["cuda"]),
                   help="only this model (repeatable; default: all)")


if __name__ == "__main__":
    raise SystemExit(common.main(run, __doc__, options))
