"""Greedy generation with a ``tvmfuse.compile_lm`` library. Needs only the TVM runtime (and numpy).

State per loaded model: one cache per layer, ``(max_batch, 2·Hkv·max_seq + Hq, D)`` (its keys,
values and the decode step's query: :mod:`tvmfuse.llm.kernels`), and on CUDA the decode
attention's int32 counters (metadata ``init: zeros``: zeroed once, left zero by every call), allocated
once on the device and written in place by the library's entry points (no copy per step), and the
weights (``<name>.safetensors``, uploaded once), passed to every entry point after the caches.

A prompt batch ``(B, T)`` comes left-padded (transformers' convention, with ``attention_mask``);
the runtime moves each row's ``T_b`` real tokens to slots ``0 .. T_b − 1`` and right-pads to the
next compiled prefill length ``n`` (slot = position, as transformers' cumsum(mask) − 1 gives the
real tokens). Causal attention then never lets a real token see padding, so the prefill needs no
mask (and takes the plain causal flash kernel); it returns row b's logits at ``last[b] = T_b − 1``.
Decode step i of sequence b writes slot ``T_b + i`` (``offsets``, per sequence) and reads slots
``0 .. T_b + i`` (``starts`` = 0): the padding slots are overwritten before they are read. The
output keeps the caller's left padding.
"""

from __future__ import annotations

import time
from typing import Any

import numpy as np

from ..errors import InputError

LM_FORMAT = "tvmfuse-lm/1"


class LanguageModel:
    """A loaded LM library: ``generate(input_ids, max_new_tokens=N, attention_mask=None)``."""

    def __init__(self, vm: Any, device: Any, metadata: dict[str, Any], path: Any,
                 weights: list | None = None) -> None:
        import tvm

        self.vm, self.device, self.metadata, self.path = vm, device, metadata, path
        self.weights = weights or []  # <name>.safetensors on the device, after the caches
        self.max_seq = int(metadata["max_seq_len"])
        self.max_batch = int(metadata["max_batch"])
        self.prefill_lengths = [int(n) for n in metadata["prefill_lengths"]]
        self.caches = [tvm.runtime.tensor(np.zeros(c["shape"], c["dtype"]), device)
                       if c.get("init") == "zeros" else
                       tvm.runtime.empty(tuple(c["shape"]), c["dtype"], device)
                       for c in metadata["caches"]]
        self._prefill = {n: vm[f"prefill{n}"] for n in self.prefill_lengths}
        self._decode = vm["decode"]
        self._advance = vm["advance"] if metadata.get("device_greedy") else None
        self._starts = np.zeros(self.max_batch, "int32")  # first visible slot: always 0 (right padding)
        self._offsets = np.zeros(self.max_batch, "int32")  # each sequence's next slot
        self._batch = 0
        self.timings: dict[str, float] = {}

    def __repr__(self) -> str:
        return (f"LanguageModel({self.path}, target={self.metadata['target']}, max_batch="
                f"{self.max_batch}, max_seq_len={self.max_seq})")

    def _run(self, func, *arrays: np.ndarray) -> np.ndarray:
        import tvm

        args = [tvm.runtime.tensor(np.ascontiguousarray(a), self.device) for a in arrays]
        return func(*args, *self.caches, *self.weights).numpy()

    def prefill(self, input_ids: np.ndarray, attention_mask: np.ndarray | None = None) -> np.ndarray:
        """Start sequences from a (B, T) prompt batch; the last position's logits (B, V)."""
        ids = np.asarray(input_ids, dtype="int64")
        if ids.ndim != 2 or not 1 <= ids.shape[0] <= self.max_batch or ids.shape[1] < 1:
            raise InputError(f"input_ids must be (batch <= {self.max_batch}, length >= 1), got "
                             f"{list(ids.shape)}")
        mask = np.ones_like(ids) if attention_mask is None else np.asarray(attention_mask)
        if mask.shape != ids.shape:
            raise InputError(f"attention_mask shape {list(mask.shape)} != input_ids {list(ids.shape)}")
        batch, length = ids.shape
        fits = [n for n in self.prefill_lengths if n >= length]
        if not fits:
            raise InputError(f"prompt length {length} exceeds the longest compiled prefill length "
                             f"{self.prefill_lengths[-1]}")
        n = fits[0]
        real = mask.astype(bool)
        if not real.any(axis=1).all() or (np.diff(real.astype(int), axis=1) < 0).any():
            raise InputError("attention_mask must be left padding: each row 0...0 1...1 with a 1")
        lengths = np.ones(self.max_batch, "int32")  # rows past the batch: one padding token
        lengths[:batch] = real.sum(axis=1)
        pad = np.zeros((self.max_batch, n), "int64")  # right-padded: real tokens at slots 0..T_b−1
        for b in range(batch):
            pad[b, : lengths[b]] = ids[b, length - lengths[b]:]
        positions = np.broadcast_to(np.arange(n, dtype="int64"), (self.max_batch, n))
        self._offsets[:] = lengths
        self._batch = batch
        zeros = np.zeros(self.max_batch, "int32")
        logits = self._run(self._prefill[n], pad, positions, lengths - 1, zeros, self._starts)
        return logits[:batch]

    def decode(self, tokens: np.ndarray) -> np.ndarray:
        """Append one token per sequence (B,); the next logits (B, V)."""
        if self._offsets.max() >= self.max_seq:
            raise InputError(f"the cache is full ({self.max_seq} slots)")
        ids = np.zeros((self.max_batch, 1), "int64")
        ids[: self._batch, 0] = np.asarray(tokens).reshape(-1)
        offsets = self._offsets.copy()
        positions = offsets[:, None].astype("int64")  # slot = position
        self._offsets += 1
        return self._run(self._decode, ids, positions, offsets, self._starts)[: self._batch]

    def _device_steps(self, first: np.ndarray, steps: int) -> np.ndarray:
        """``steps`` greedy tokens after ``first`` (B,), every step ``decode`` + ``advance`` on the
        same device tensors (the argmax and the state update run on the device); on CUDA the
        step is captured once as a CUDA graph and replayed. (B, steps) ids."""
        import tvm

        if self._offsets.max() + steps > self.max_seq:
            raise InputError(f"the cache is full ({self.max_seq} slots)")
        ids = np.zeros((self.max_batch, 1), "int64")
        ids[: self._batch, 0] = first
        offsets = self._offsets.copy()
        positions = offsets[:, None].astype("int64")  # slot = position
        history = np.zeros((self.max_batch, self.max_seq + 1), "int64")
        state = [tvm.runtime.tensor(a, self.device) for a in (ids, positions, offsets, history)]
        starts = tvm.runtime.tensor(self._starts, self.device)

        def step() -> Any:
            logits = self._decode(state[0], state[1], state[2], starts, *self.caches, *self.weights)
            self._advance(logits, *state, *self.weights)  # LiftWeights gives every entry the list
            return logits

        done = 0
        if self.device.dlpack_device_type() == 2 and steps > 2:  # kDLCUDA
            done = self._graph_steps(step, steps)
        for _ in range(steps - done):
            step()
        history = state[3].numpy()  # sequence b's new tokens at slots offsets[b] + 1 ..
        self._offsets += steps
        return np.stack([history[b, offsets[b] + 1: offsets[b] + 1 + steps]
                         for b in range(self._batch)])

    def _graph_steps(self, step, steps: int) -> int:
        """Run ``steps`` steps as one eager step + a captured CUDA graph replayed ``steps − 1``
        times (torch's capture, the library's kernels on torch's stream); the steps done (0 when
        capture is unavailable: the caller runs them eagerly). Timings: the replay loop only."""
        try:
            import torch
            import tvm_ffi
        except ImportError:
            self.timings["cuda_graph"] = "off: torch is not installed"
            return 0
        step()  # eager: the VM's memory pool holds every buffer the captured step uses
        graph = torch.cuda.CUDAGraph()
        try:
            with tvm_ffi.use_torch_stream(torch.cuda.graph(graph, capture_error_mode="relaxed")):
                logits = step()  # recorded, not run
        except Exception as err:  # noqa: BLE001 - fall back to eager steps, say why
            self.timings["cuda_graph"] = f"off: capture failed: {type(err).__name__}: {err}"[:300]
            return 1
        torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(steps - 1):
            graph.replay()
        torch.cuda.synchronize()
        self.timings["decode_ms_per_token"] = (time.perf_counter() - start) * 1e3 / (steps - 1)
        self.timings["cuda_graph"] = "on"
        del logits
        return steps

    def generate(self, input_ids: Any, max_new_tokens: int = 16, attention_mask: Any = None) -> Any:
        """Greedy decoding: (B, T + max_new_tokens) ids, padding kept; torch in → torch out."""
        is_torch = type(input_ids).__module__.startswith("torch")
        ids = input_ids.cpu().numpy() if is_torch else np.asarray(input_ids)
        mask = None
        if attention_mask is not None:
            mask = attention_mask.cpu().numpy() if hasattr(attention_mask, "cpu") else attention_mask
        start = time.perf_counter()
        logits = self.prefill(ids, mask)
        longest = int(self._offsets[: self._batch].max())
        if longest + max_new_tokens - 1 > self.max_seq:
            raise InputError(f"prompt tokens {longest} + {max_new_tokens} new tokens exceed "
                             f"max_seq_len {self.max_seq}")
        prefill_s = time.perf_counter() - start
        first = logits.argmax(-1)
        steps = max_new_tokens - 1
        self.timings = {"prefill_ms": prefill_s * 1e3}
        start = time.perf_counter()
        if self._advance is not None and steps > 0:
            new = self._device_steps(first, steps)
        else:
            out = [first]
            for _ in range(steps):
                out.append(self.decode(out[-1]).argmax(-1))
            new = np.stack(out[1:], axis=1) if steps else np.zeros((len(first), 0), "int64")
        decode_s = time.perf_counter() - start
        self.timings.setdefault("decode_ms_per_token", decode_s * 1e3 / max(1, steps))
        result = np.concatenate([ids.astype("int64"), first[:, None].astype("int64"),
                                 new.astype("int64")], axis=1)
        if is_torch:
            import torch

            return torch.from_numpy(result).to(input_ids.device)
        return result


__all__ = ["LM_FORMAT", "LanguageModel"]
