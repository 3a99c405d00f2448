"""ONNX ``NegativeLogLikelihoodLoss`` and ``SoftmaxCrossEntropyLoss`` (absent in TVM 0.27).

Input ``x`` (N, C, d1…dk) of log-probabilities (NLL) or scores (SCE, ``x → log_softmax(x, 1)``),
``target`` (N, d1…dk) of class indices, optional ``weight`` (C,)::

    w[n, d]    = weight[target[n, d]] (1 without weight),  0 where target[n, d] == ignore_index
    loss[n, d] = −x[n, target[n, d], d] · w[n, d]
    reduction: none → loss;  sum → Σ loss;
               mean → Σ loss / Σ w  (with weight or ignore_index),  else mean(loss)

An ignored target may be outside [0, C): it is read as class 0 and its weight is 0.
``SoftmaxCrossEntropyLoss``'s optional second output is the log-probabilities (N, C, d1…dk).
"""

from __future__ import annotations

from tvm import relax
from tvm.relax.frontend.onnx import onnx_frontend as stock


def _reduction(attr: dict) -> str:
    value = attr.get("reduction", b"mean")
    return value.decode("ascii") if isinstance(value, bytes) else str(value)


def nll(bb: relax.BlockBuilder, x: relax.Expr, target: relax.Expr, weight: relax.Expr | None,
        reduction: str, ignore_index: int | None) -> relax.Expr:
    """The weighted negative log-likelihood of ``target`` under log-probabilities ``x``."""
    dtype = str(x.ty.dtype)
    target = bb.normalize(relax.op.astype(target, "int64"))
    ignored = None
    if ignore_index is not None:
        ignored = bb.normalize(relax.op.equal(target, relax.const(ignore_index, "int64")))
        target = bb.normalize(relax.op.where(ignored, relax.const(0, "int64"), target))
    picked = relax.op.gather_elements(x, relax.op.expand_dims(target, 1), axis=1)
    loss = relax.op.negative(relax.op.squeeze(picked, axis=[1]))
    w = None if weight is None else relax.op.take(weight, target, axis=0)
    if ignored is not None:
        zero = relax.const(0, dtype)
        w = relax.op.where(ignored, zero, relax.op.ones_like(loss) if w is None else w)
    if w is not None:
        w = bb.normalize(w)
        loss = relax.op.multiply(loss, w)
    loss = bb.normalize(loss)
    if reduction == "none":
        return loss
    if reduction == "sum":
        return relax.op.sum(loss)
    if reduction != "mean":
        raise ValueError(f"unknown reduction {reduction!r}")
    if w is None:
        return relax.op.mean(loss)
    return relax.op.divide(relax.op.sum(loss), relax.op.sum(w))


def _weight(inputs: list) -> relax.Expr | None:
    return inputs[2] if len(inputs) > 2 and inputs[2] is not None else None


class NegativeLogLikelihoodLoss(stock.OnnxOpConverter):
    """ONNX ``NegativeLogLikelihoodLoss`` (opset 12/13/22) from Relax ops."""

    @classmethod
    def _impl_v12(cls, bb, inputs, attr, params):
        return nll(bb, inputs[0], inputs[1], _weight(inputs), _reduction(attr),
                   attr.get("ignore_index"))


class SoftmaxCrossEntropyLoss(stock.OnnxOpConverter):
    """ONNX ``SoftmaxCrossEntropyLoss`` (opset 12/13): ``nll(log_softmax(scores, 1), labels)``."""

    @classmethod
    def _impl_v12(cls, bb, inputs, attr, params):
        log_prob = bb.normalize(relax.op.nn.log_softmax(inputs[0], axis=1))
        loss = nll(bb, log_prob, inputs[1], _weight(inputs), _reduction(attr),
                   attr.get("ignore_index"))
        if attr["tvm_custom"]["num_outputs"] < 2:
            return loss
        return relax.Tuple([bb.normalize(loss), log_prob])
