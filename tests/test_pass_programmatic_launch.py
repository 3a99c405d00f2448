"""Programmatic dependent launch (rules/programmatic_launch.py): the Relax stage that asks for the
launch attribute (its scopes: the decode step by default, all kernels, off), the device pass that
puts ``griddepcontrol.wait`` first in each such kernel, and what a compiled sm90 library holds
(every kernel in scope waits before it touches a parameter; the GEMV reads nothing but its weights,
into L2, before the wait; the exported function map carries the launch flag). sm80 and
``programmatic_launch="off"`` get none of it."""

from __future__ import annotations

import dataclasses
import re

import pytest
import torch
import tvm
from tvm.script import ir as I
from tvm.script import tirx as T

import tvmfuse
from tests.cuda_tools import kernel_bodies, needs_nvcc
from tvmfuse.build.inspect import cuda_source, launch_tags
from tvmfuse.options import Options
from tvmfuse.rules.programmatic_launch import (
    PDL_TAG,
    insert_grid_dependency_wait,
    mark_programmatic_launch,
    scope,
    supported,
)

ALL = Options(programmatic_launch="all")


def _module():
    @I.ir_module
    class Mod:
        @T.prim_func(s_tir=True)
        def double(A: T.Buffer((256,), "float32"), B: T.Buffer((256,), "float32")):
            bx = T.launch_thread("blockIdx.x", 2)
            tx = T.launch_thread("threadIdx.x", 128)
            B[bx * 128 + tx] = A[bx * 128 + tx] * T.float32(2)

        @T.prim_func(s_tir=True)
        def waits(A: T.Buffer((256,), "float32"), B: T.Buffer((256,), "float32")):
            T.func_attr({"tirx.kernel_launch_params": ["tirx.use_programtic_dependent_launch"]})
            bx = T.launch_thread("blockIdx.x", 2)
            tx = T.launch_thread("threadIdx.x", 128)
            T.ptx.griddepcontrol.wait()
            B[bx * 128 + tx] = A[bx * 128 + tx]

    return Mod


def test_supported_targets():
    cuda = lambda arch: tvm.target.Target({"kind": "cuda", "arch": arch})  # noqa: E731
    assert supported(cuda("sm_90a")) and supported(cuda("sm_90")) and supported(cuda("sm_100a"))
    assert not supported(cuda("sm_80")) and not supported(cuda("sm_86"))
    assert not supported(tvm.target.Target({"kind": "llvm"})) and not supported(None)


def test_mark_asks_every_primfunc_once_and_copies():
    before = _module()
    kept = before.script()
    after = mark_programmatic_launch("all")(before)
    assert before.script() == kept  # the input module is not modified
    for gv in ("double", "waits"):
        tags = [str(t) for t in after[gv].attrs["tirx.kernel_launch_params"]]
        assert tags.count(PDL_TAG) == 1, tags


def test_scopes():
    assert scope(True) == "all" and scope(False) == "off" and scope("decode") == "decode"
    with pytest.raises(ValueError, match="programmatic_launch must be one of"):
        scope("some")
    # "decode": only the PrimFuncs a Relax function named decode (or advance) calls
    mod = _module()
    bb = tvm.relax.BlockBuilder()
    a = tvm.relax.Var("a", tvm.relax.TensorType([256], "float32"))
    with bb.function("decode", [a]):
        out = bb.emit(tvm.relax.call_tir(mod.get_global_var("double"), [a],
                                         tvm.relax.TensorType([256], "float32")))
        bb.emit_func_output(out)
    mod["decode"] = bb.finalize()["decode"]
    after = mark_programmatic_launch("decode")(mod)
    assert PDL_TAG in [str(t) for t in after["double"].attrs["tirx.kernel_launch_params"]]
    assert after["waits"].same_as(mod["waits"])  # asked already, in its own attrs; not called
    del mod["decode"]
    assert mark_programmatic_launch("decode")(mod)["double"].attrs.get(
        "tirx.kernel_launch_params") is None


def test_wait_goes_first_in_kernels_that_ask():
    mod = mark_programmatic_launch("all")(_module())
    out = insert_grid_dependency_wait(mod)
    body = out["double"].body
    assert isinstance(body, tvm.tirx.SeqStmt)
    first, second = (str(s.value.args[0]).strip('"') for s in list(body)[:2])
    assert (first, second) == ("wait", "launch_dependents")
    tvm.ir.assert_structural_equal(body[2], mod["double"].body)
    # a kernel that places its own wait is left as it is
    tvm.ir.assert_structural_equal(out["waits"], mod["waits"])
    # a kernel that does not ask gets nothing
    plain = _module()
    tvm.ir.assert_structural_equal(insert_grid_dependency_wait(plain)["double"], plain["double"])


class _Mlp(torch.nn.Module):
    """RMSNorm (transformers' form) → gate/up SwiGLU → down + residual: GEMVs at M = 1."""

    def __init__(self, d: int = 256, f: int = 512) -> None:
        super().__init__()
        self.w = torch.nn.Parameter(torch.rand(d) + 0.5)
        self.gate, self.up = torch.nn.Linear(d, f, bias=False), torch.nn.Linear(d, f, bias=False)
        self.down = torch.nn.Linear(f, d, bias=False)

    def forward(self, x):
        v = x.float().pow(2).mean(-1, keepdim=True)
        h = (x.float() * torch.rsqrt(v + 1e-6)).to(x.dtype) * self.w
        return x + self.down(torch.nn.functional.silu(self.gate(h)) * self.up(h))


def _compile(target: str, options: Options | None = None):
    torch.manual_seed(0)
    model = _Mlp().half().eval()
    return tvmfuse.compile(model, [torch.randn(1, 256).half()], target=target, options=options)


@pytest.fixture(scope="module")
def sm90_lib():
    return _compile("sm90", ALL)


@pytest.fixture(scope="module")
def sm90_prefetch_lib():
    return _compile("sm90", Options(programmatic_launch="all", gemv_l2_prefetch_bytes=65536))


def test_sm90_every_kernel_waits_first(sm90_lib):
    """Every kernel waits before it touches memory, except the GEMVs' weight loads
    (``Options.gemv_preload_weights``, on by default): before their wait they only load W."""
    kernels = kernel_bodies(cuda_source(sm90_lib.executable))
    assert kernels
    preloading = 0
    for name, (params, body) in kernels.items():
        if body.lstrip().startswith("tvm_builtin_ptx_griddepcontrol_wait();"):
            continue
        assert name.endswith("_gemv_kernel") and "griddepcontrol_wait()" in body, (name, body[:200])
        before = body[: body.index("griddepcontrol_wait()")]
        read = {p for p in params if re.search(rf"\b{p}\b", before)}
        assert len(read) == 1, (name, read)  # the weight, only loaded (right of an assignment)
        w = read.pop()
        for line in (ln for ln in before.splitlines() if w in ln):
            assert " = " in line and line.index(w) > line.index(" = "), (name, line)
        preloading += 1
    assert preloading >= 2, list(kernels)  # the gate/up pair and down GEMVs


def test_sm90_gemv_prefetch_is_the_only_access_before_the_wait(sm90_prefetch_lib):
    kernels = kernel_bodies(cuda_source(sm90_prefetch_lib.executable))
    assert kernels
    gemv = 0
    for name, (params, body) in kernels.items():
        assert "griddepcontrol_wait()" in body, name
        before = body[: body.index("griddepcontrol_wait()")]
        for line in before.splitlines():
            if any(re.search(rf"\b{p}\[", line) for p in params):
                assert "prefetch_L2_global" in line, (name, line)  # only W, only into L2
        gemv += "prefetch_L2_global" in before
        assert "griddepcontrol_launch_dependents()" in body, name
    assert gemv >= 2, list(kernels)  # the gate/up pair and down GEMVs prefetch their weights


@pytest.mark.parametrize("target, options", [("sm80", ALL), ("sm90", Options(programmatic_launch="off")),
                                             ("sm90", None)], ids=["sm80", "off", "default"])
def test_no_programmatic_launch_off_or_below_sm90(target, options):
    """sm80, the option off, and (default scope "decode") a model without a decode step."""
    source = cuda_source(_compile(target, options).executable)
    assert "griddepcontrol" not in source and "prefetch_L2_global(" not in source.split(
        "__global__", 1)[1]


@needs_nvcc
def test_exported_kernels_carry_the_launch_flag(sm90_lib, tmp_path):
    tags = launch_tags(sm90_lib.export(tmp_path / "m.so"))
    assert tags and all(PDL_TAG in t for t in tags.values()), tags
    # TVM's runtime requires the dynamic shared memory tag (if any) to stay last
    assert all(t[-1] != PDL_TAG or "tirx.use_dyn_shared_memory" not in t for t in tags.values())


@pytest.mark.gpu
def test_gpu_numerics_with_programmatic_launch(tmp_path):
    """H200: the PDL library's output equals the plain library's and torch's (a wait missing or
    misplaced reads the previous kernel's output early: wrong numbers, not a crash)."""
    torch.manual_seed(1)
    x = torch.randn(1, 256).half()
    outs = []
    for opts in (ALL, Options(programmatic_launch="off")):
        lib = _compile("sm90", opts)
        run = tvmfuse.load(lib.export(tmp_path / f"m{len(outs)}.so"), device="cuda")
        outs.append(run(x.cuda()).float().cpu())
    torch.manual_seed(0)
    ref = _Mlp().double().eval()(x.double()).float()
    for out in outs:
        assert ((out - ref).norm() / ref.norm()) < 2e-2
    assert torch.equal(outs[0], outs[1])


def test_compile_lm_turns_the_decode_scope_off_above_the_batch_limit():
    """compile_lm's options: "decode" stays up to ``programmatic_launch_max_batch`` sequences and
    becomes "off" above (measured slower at batch 8); "all" and "off" are left as they are."""
    from tvmfuse.llm.compile_lm import _launch_options

    default = Options()
    assert _launch_options(default, 1) is None
    assert _launch_options(default, 8).programmatic_launch == "off"
    assert _launch_options(dataclasses.replace(default, programmatic_launch_max_batch=8), 8) is None
    assert _launch_options(Options(programmatic_launch="all"), 8) is None


@pytest.mark.slow
@pytest.mark.parametrize("max_batch", [1, 2])
def test_default_scope_is_the_decode_step_of_compile_lm(max_batch):
    """compile_lm for sm90 with the default options: the decode step's kernels (split-KV attention,
    the greedy advance) wait first; the prefill's (its cache appends) launch plainly. At
    max_batch 2 (above ``programmatic_launch_max_batch``) no kernel waits."""
    transformers = pytest.importorskip("transformers")
    cfg = transformers.LlamaConfig(vocab_size=128, hidden_size=128, intermediate_size=256,
                                   num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(cfg).eval().half()
    lib = tvmfuse.compile_lm(model, target="sm90", max_seq_len=64, max_batch=max_batch,
                             prefill_lengths=[16])
    kernels = kernel_bodies(cuda_source(lib.executable))
    waits = {name: "griddepcontrol_wait()" in body for name, (_, body) in kernels.items()}
    decode = [n for n in waits if "decode_cache_attention" in n or "greedy_advance" in n]
    prefill = [n for n in waits if n.startswith(("prefill16_k_append", "prefill16_v_append"))]
    assert decode and prefill, list(waits)
    assert all(waits[n] == (max_batch == 1) for n in decode), waits
    assert not any(waits[n] for n in prefill), waits
