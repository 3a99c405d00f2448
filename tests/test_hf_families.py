"""transformers causal-LM families beyond the ones the passes were written from, at random init,
as a user brings them (``torch.export`` of ``model(ids).logits``): the sm90 report's kernel count
(an fp16 module; two layers, hidden 64) stays at most what it is today — one attention kernel a
layer, the norms folded — and the cpu target's logits equal torch's in fp32.

Each family was tried as a user in session 21 (tools/bench/NOTES.md): Cohere's LayerNorm without
β was two unfolded kernels (23 kernels, now 14), OPT's report raised on TVM's generic cumsum
kernel, and GPT-J / StarCoder2 stand for the parallel-residual and the LayerNorm-with-bias RoPE
families. Apertus (session 42) had its logits 2e-1 off on every target: SinkReshape put the
up GEMM's output on the wrong side of xIELU's subtraction. (Falcon, Bloom, BERT, GPTBigCode:
tests/test_pass_canonical_negative_indices.py, test_pass_attention_forms.py,
test_pass_attention_sdpa.py, test_llm_families.py.)
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

import tvmfuse
from tests.test_llm_import_lm import Logits

transformers = pytest.importorskip("transformers")

COMMON = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)


def _model(name: str, hidden: int = 64) -> torch.nn.Module:
    """Family ``name`` at random init: 2 layers, 4 heads of ``hidden // 4``, FFN ``2 · hidden``
    (GPT-J and OPT: hidden 64 only)."""
    T = transformers
    torch.manual_seed(0)
    config = dict(COMMON, hidden_size=hidden, intermediate_size=2 * hidden)
    if name == "cohere":
        return T.CohereForCausalLM(T.CohereConfig(**config))
    if name == "starcoder2":
        return T.Starcoder2ForCausalLM(T.Starcoder2Config(**config))
    if name == "qwen3":  # per-head q / k RMSNorms of the QKV GEMM's output
        return T.Qwen3ForCausalLM(T.Qwen3Config(head_dim=hidden // 4, **config))
    if name == "olmo2":  # q / k RMSNorms over all heads, norms after attention and MLP
        return T.Olmo2ForCausalLM(T.Olmo2Config(**config, pad_token_id=0, eos_token_id=1,
                                                bos_token_id=1))
    if name == "gemma3":  # q / k norms after the head transpose, (1 + w) norms, sliding layers
        return T.Gemma3ForCausalLM(T.Gemma3TextConfig(head_dim=hidden // 4, sliding_window=16, **config))
    if name == "helium":  # RMSNorm eps 1e-8: the dynamo ONNX exporter drops its ``+ eps``
        return T.HeliumForCausalLM(T.HeliumConfig(head_dim=hidden // 4, **config))
    if name == "apertus":  # xIELU MLP (no gate): expm1(min(x, eps)) − x on the up GEMM's output
        return T.ApertusForCausalLM(T.ApertusConfig(**config))
    if name == "nanochat":  # RMSNorms without a weight (F.rms_norm(x, (n,))), q / k norms after RoPE
        return T.NanoChatForCausalLM(T.NanoChatConfig(**config))
    if name == "xglm":  # heads folded at batch 1 with no reshape from 4-D, max(s + mask, finfo.min)
        return T.XGLMForCausalLM(T.XGLMConfig(vocab_size=128, d_model=hidden, ffn_dim=2 * hidden,
                                              num_layers=2, attention_heads=4,
                                              max_position_embeddings=max(256, 2 * hidden)))
    if name == "mpt":  # fp32 ALiBi on fp16 scores, masked_fill(finfo(float16).min)
        return T.MptForCausalLM(T.MptConfig(vocab_size=128, d_model=hidden, n_heads=4, n_layers=2))
    if name == "diffllama":  # two attentions a layer over one softmax (shared after CSE), v tiled
        return T.DiffLlamaForCausalLM(T.DiffLlamaConfig(**config))
    if name in ("gemma2", "vaultgemma"):  # tanh soft-capping of the scores, a cap that bends
        cls, cfg = ((T.Gemma2ForCausalLM, T.Gemma2Config) if name == "gemma2" else
                    (T.VaultGemmaForCausalLM, T.VaultGemmaConfig))
        return cls(cfg(head_dim=hidden // 4, attn_logit_softcapping=1.0, initializer_range=0.3,
                       **config))
    if name == "gptj":
        return T.GPTJForCausalLM(T.GPTJConfig(vocab_size=128, n_embd=64, n_layer=2, n_head=4,
                                              n_inner=128, n_positions=256, rotary_dim=8))
    return T.OPTForCausalLM(T.OPTConfig(vocab_size=128, hidden_size=64, num_hidden_layers=2,
                                        num_attention_heads=4, ffn_dim=128,
                                        max_position_embeddings=256, word_embed_proj_dim=64,
                                        pad_token_id=1, bos_token_id=2, eos_token_id=2))


# kernels on sm90 (fp16) today; stock TVM's counts for the same graphs were 57, 50, 46, 44.
# Qwen3 / OLMo2 / Gemma-3: each q / k norm fused with the slice it reads
# (passes/norm_input_copies.py; 22, 26 and 26 before). NanoChat: 46 before the weightless RMSNorm
# rewrite (session 43), each norm 3–4 kernels. XGLM 26 and MPT 24 before session 43 (attention
# unfused: the clamp and the batch-1 head views; the fp32 scores' finfo(float16).min fill).
# DiffLlama: 38 before session 44 (its two attentions share one softmax: "other users").
# Gemma-2 / VaultGemma (attention soft-capping): 30 / 26 before session 45 (attention unfused:
# "no attention kernel takes a soft cap").
KERNELS = {"gemma2": 18, "vaultgemma": 14, "diffllama": 24, "apertus": 20, "nanochat": 23,
           "xglm": 14, "mpt": 14, "cohere": 14, "starcoder2": 14, "gptj": 16, "opt": 15, "qwen3": 18,
           "olmo2": 22, "gemma3": 22, "helium": 14}
ATTENTIONS = {"diffllama": 4}  # attention kernels in the two layers (else 2)


@pytest.mark.parametrize("name", sorted(KERNELS))
def test_family_report_and_cpu_logits(name):
    from tvmfuse.frontend import import_model
    from tvmfuse.report import analyze
    from tvmfuse.targets import get_target

    model = Logits(_model(name).eval())
    ids = torch.randint(0, 128, (1, 32))
    report = analyze(import_model(Logits(_model(name).eval().half()), (ids,)).mod,
                     get_target("sm90"), "float16", stock=False)
    names = [k["name"] for k in report["kernels"]]
    assert len(names) <= KERNELS[name], names
    assert sum(n == "attention" for n in names) == ATTENTIONS.get(name, 2), names
    got = np.asarray(tvmfuse.compile(model, (ids,), target="cpu").load()(ids))
    with torch.no_grad():
        want = model(ids).numpy()
    assert np.linalg.norm(got - want) <= 1e-5 * np.linalg.norm(want)



def _onnx_model(name: str) -> torch.nn.Module:
    T = transformers
    torch.manual_seed(0)
    if name in ("diffllama", "gemma2"):
        return _model(name).eval()
    if name == "falcon":
        return T.FalconForCausalLM(T.FalconConfig(
            vocab_size=128, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
            num_kv_heads=2, new_decoder_architecture=True, max_position_embeddings=256,
            ffn_hidden_size=128)).eval()
    return T.GPTBigCodeForCausalLM(T.GPTBigCodeConfig(
        vocab_size=128, n_embd=64, n_layer=2, n_head=4, n_inner=128, n_positions=256,
        multi_query=True)).eval()


@pytest.mark.parametrize("name", ["falcon", "gpt_bigcode", "diffllama", "gemma2"])
def test_onnx_dynamo_export(name, tmp_path):
    """The dynamo ONNX exports of families the ONNX surveys broke on (sessions 21, 44):
    * Falcon (new decoder architecture): DuplicateGathers dropped a gathered tensor that a slice
      still read ("Var lv33 is not defined" at codegen);
    * GPTBigCode: Kᵀ of the repeated KV head is a 5-D swap between broadcast_to and reshape, so
      the attention was left unfused ("keys repeated 1x but values 4x"; 26 kernels);
    * DiffLlama: the one-head value halves tiled by a broadcast, repeated 4x beside keys 2x
      ("keys repeated 2x but values 4x"; 32 kernels, now 24);
    * Gemma-2: ``Div → Tanh → Mul`` on the scores (soft-capping; 30 kernels, now 18).
    Now: the cpu build matches onnxruntime, and the sm90 report has one attention per attention
    of a layer."""
    ort = pytest.importorskip("onnxruntime")
    from tests.test_llm_import_lm import _export_onnx
    from tvmfuse.frontend import import_model, input_overrides
    from tvmfuse.report import analyze
    from tvmfuse.targets import get_target

    path = tmp_path / f"{name}.onnx"
    _export_onnx(_onnx_model(name), "dynamo", path)
    ids = np.random.default_rng(0).integers(0, 128, (1, 32)).astype(np.int64)
    sess = ort.InferenceSession(str(path))
    want = sess.run(None, {sess.get_inputs()[0].name: ids})[0]
    spec = ["input_ids:1x32"]
    got = np.asarray(tvmfuse.compile(str(path), target="cpu", inputs=spec).load()(ids))
    assert np.linalg.norm(got - want) <= 1e-5 * np.linalg.norm(want)
    mod = import_model(str(path), overrides=input_overrides(spec)).mod
    names = [k["name"] for k in analyze(mod, get_target("sm90"), stock=False)["kernels"]]
    assert sum(n == "attention" for n in names) == ATTENTIONS.get(name, 2), names


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["qwen3", "olmo2", "apertus", "nanochat", "xglm", "mpt",
                                  "diffllama", "gemma2"])
def test_gpu_families(name, tmp_path):
    """On the GPU, in fp16 at head dim 64, against the float64 model: Qwen3 / OLMo2 (the q / k
    norms fused with their slices of the QKV GEMM's output), Apertus (xIELU across SinkReshape),
    NanoChat (weightless RMSNorms), XGLM (batch-1 head views, the clamp), MPT (fp32 ALiBi) and
    DiffLlama (two attentions over one softmax, tiled values), Gemma-2 (soft-capped scores)."""
    from tests.cuda_tools import check_vs_float64

    model = _model(name, hidden=256)
    ids = torch.randint(0, 128, (1, 256))
    # XGLM cannot run in float64 (torch.full((), finfo(float64).min) overflows the default fp32)
    check_vs_float64(Logits(model.eval().half()), (ids,), "sm90", tmp_path, 1e-2,
                     "float32" if name == "xglm" else "float64")


@pytest.mark.parametrize("name, frontend, dtype", [("qwen3", "torch", "float16"),
                                                   ("qwen3", "onnx-dynamo", "float16"),
                                                   ("cohere", "torch", "float16"),
                                                   ("qwen3", "torch", "bfloat16"),
                                                   ("helium", "onnx-dynamo", "float16")])
def test_fp32_model_under_float16_as_half(name, frontend, dtype, tmp_path):
    """An fp32 model compiled with ``--dtype float16`` (every fp32 ONNX export takes this path) gets
    the kernels of the same model after ``.half()``: Qwen3, 18 on sm90 (27 before session 23, when
    the residual stream stayed fp32 from the embedding gather on); Cohere, 14 (its logit scale
    after the last folded norm keeps that GEMM's fp32 output: no cast kernel). The cpu build at
    float16 stays within fp16 rounding of the fp32 reference (measured 7e-4 against onnxruntime).
    Under bfloat16 the same (the report's baseline failed on bf16 ``x ** 2``; 5e-3 from torch).
    Helium's dynamo export has ``Sqrt(ReduceMean(x²))`` with no ``+ eps`` (1e-8, dropped by the
    exporter): its norms were left decomposed (30 kernels), then their statistics beside the
    GEMMs (24); 14, as from torch, since session 46."""
    from tvmfuse.frontend import import_model, input_overrides
    from tvmfuse.report import analyze
    from tvmfuse.targets import get_target

    model = _model(name).eval()
    ids = torch.randint(0, 128, (1, 32), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want = Logits(model)(ids).numpy()
    if frontend == "torch":
        source, spec, mod = Logits(model), None, import_model(Logits(model), (ids,)).mod
    else:
        from tests.test_llm_import_lm import _export_onnx

        source, spec = str(tmp_path / f"{name}.onnx"), ["input_ids:1x32"]
        _export_onnx(model, "dynamo", source)
        mod = import_model(source, overrides=input_overrides(spec)).mod
    names = [k["name"] for k in analyze(mod, get_target("sm90"), dtype, stock=False)["kernels"]]
    assert len(names) <= KERNELS[name], names
    assert not any(n.startswith("cast") or n.endswith("norm_stats") for n in names), names
    lib = tvmfuse.compile(source, (ids,) if spec is None else None, target="cpu", inputs=spec,
                          dtype=dtype).load()
    got = np.asarray(lib(ids.numpy() if spec else ids), dtype=np.float64)
    err = np.linalg.norm(got - want) / np.linalg.norm(want)
    assert 1e-5 < err < (3e-3 if dtype == "float16" else 1e-2), err


class _Hidden(torch.nn.Module):
    """An encoder's ``last_hidden_state`` as the one output."""

    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids=ids).last_hidden_state


def _t5_encoder(d_model: int = 64, heads: int = 4) -> torch.nn.Module:
    torch.manual_seed(0)
    return transformers.T5EncoderModel(transformers.T5Config(
        vocab_size=128, d_model=d_model, d_kv=d_model // heads, d_ff=2 * d_model, num_layers=2,
        num_heads=heads)).eval()


def test_t5_encoder_relative_bias_attention():
    """transformers' T5 encoder: its relative position bias is a constant (1, H, S, S) term of the
    scores, no mask. Session 24: one attention a layer with that bias (was matmul, mask and
    softmax kernels, 33 kernels on sm90 fp16; the fp16 import failed before on T5's
    ``clamp(h, -where(isinf(h).any(), …))``); the cpu build equals torch."""
    from tvmfuse.frontend import import_model
    from tvmfuse.report import analyze
    from tvmfuse.targets import get_target

    model = _Hidden(_t5_encoder())
    ids = torch.randint(0, 128, (1, 32), generator=torch.Generator().manual_seed(0))
    report = analyze(import_model(_Hidden(_t5_encoder().half()), (ids,)).mod, get_target("sm90"),
                     "float16", stock=False)
    names = [k["name"] for k in report["kernels"]]
    assert sum(n == "attention" for n in names) == 2 and len(names) <= 21, names
    got = np.asarray(tvmfuse.compile(model, (ids,), target="cpu").load()(ids))
    with torch.no_grad():
        want = model(ids).numpy()
    assert np.linalg.norm(got - want) <= 1e-5 * np.linalg.norm(want)


@pytest.mark.gpu
@pytest.mark.parametrize("bias_on", [False, True], ids=["sm80_bias", "sm90_bias"])
def test_gpu_t5_encoder(tmp_path, bias_on):
    """On the H200: the T5 encoder in fp16 (head dim 64; the attention kernel reads the (1, H, S, S)
    relative position bias) against the float64 model; ``sm90_bias``: on the wgmma kernel
    (``Options.sm90_attention_bias``)."""
    from tests.cuda_tools import check_vs_float64
    from tvmfuse.options import Options, use_options

    ids = torch.randint(0, 128, (1, 256), generator=torch.Generator().manual_seed(0))
    with use_options(Options(sm90_attention_bias=bias_on)):
        check_vs_float64(_Hidden(_t5_encoder(256, 4).half()), (ids,), "sm90", tmp_path, 1e-2)


def test_t5_seq2seq_logits():
    """The whole T5 (encoder + decoder, ``use_cache`` on as transformers defaults): the decoder's
    DynamicCache concatenates each layer's K / V onto a legacy empty (0,) tensor, which failed to
    import. Now the cpu logits equal torch's, and on sm90 fp16 all six attentions (encoder self,
    decoder causal self with the relative bias, cross) are one kernel each."""
    from tvmfuse.frontend import import_model
    from tvmfuse.report import analyze
    from tvmfuse.targets import get_target

    class Seq2Seq(torch.nn.Module):
        def __init__(self, model: torch.nn.Module) -> None:
            super().__init__()
            self.model = model

        def forward(self, ids: torch.Tensor, dec: torch.Tensor) -> torch.Tensor:
            return self.model(input_ids=ids, decoder_input_ids=dec).logits

    def t5() -> torch.nn.Module:
        torch.manual_seed(0)
        return transformers.T5ForConditionalGeneration(transformers.T5Config(
            vocab_size=128, d_model=64, d_kv=16, d_ff=128, num_layers=2, num_heads=4,
            decoder_start_token_id=0)).eval()

    gen = torch.Generator().manual_seed(0)
    inputs = (torch.randint(0, 128, (1, 32), generator=gen), torch.randint(0, 128, (1, 16), generator=gen))
    model = Seq2Seq(t5())
    got = np.asarray(tvmfuse.compile(model, inputs, target="cpu").load()(*inputs))
    with torch.no_grad():
        want = model(*inputs).numpy()
    assert np.linalg.norm(got - want) <= 1e-5 * np.linalg.norm(want)
    report = analyze(import_model(Seq2Seq(t5().half()), inputs).mod, get_target("sm90"), "float16",
                     stock=False)
    names = [k["name"] for k in report["kernels"]]
    assert sum(n.startswith("attention") for n in names) == 6, names


@pytest.mark.gpu
@pytest.mark.parametrize("bias_on", [False, True], ids=["sm80_bias", "sm90_bias"])
def test_gpu_bert_fp16_from_torch(tmp_path, bias_on):
    """On the H200: transformers BERT in fp16 from torch with a padding mask. Its Q/K/V biases
    (fp16 constants added in fp32) ride in the wide QKV GEMM's sm90 epilogue since session 24
    (before: the sm80 path, fp32 out), and the mask gather is a view; against the float64 model.
    ``sm90_bias``: the mask's additive bias in the wgmma attention (``Options.sm90_attention_bias``)."""
    from tests.cuda_tools import check_vs_float64
    from tvmfuse.options import Options, use_options

    class Hidden(torch.nn.Module):
        def __init__(self, model: torch.nn.Module) -> None:
            super().__init__()
            self.model = model

        def forward(self, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
            return self.model(input_ids=ids, attention_mask=mask).last_hidden_state

    torch.manual_seed(0)
    bert = transformers.BertModel(transformers.BertConfig(
        vocab_size=128, hidden_size=256, num_hidden_layers=2, num_attention_heads=4,
        intermediate_size=512)).eval().half()
    ids = torch.randint(0, 128, (2, 64), generator=torch.Generator().manual_seed(0))
    mask = torch.ones(2, 64, dtype=torch.int64)
    mask[1, 40:] = 0
    with use_options(Options(sm90_attention_bias=bias_on)):
        check_vs_float64(Hidden(bert), (ids, mask), "sm90", tmp_path, 1e-2)
