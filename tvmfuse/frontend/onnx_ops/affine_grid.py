"""ONNX ``AffineGrid`` with the ``size`` input a runtime tensor.

``size`` = (N, C, H, W) or (N, C, D, H, W) becomes symbolic dims at run time (N must be theta's
batch, or the call fails); one TE kernel writes the grid (N, [D,] H, W, d)::

    grid[n, …, i] = Σ_j theta[n, i, j] · base_j        base = (x_w, y_h, [z_d,] 1)
    a_t = -1 + 2t / (S - 1)   (align_corners; -1 when S = 1)      a_t = -1 + (2t + 1) / S   (else)
"""

from __future__ import annotations

from tvm import relax, te, tirx

from ...relax_shapes import static_shape
from .runtime_values import Fallback, int64, symbolic_dims


def _coordinate(t: tirx.PrimExpr, size: tirx.PrimExpr, align: bool, dtype: str) -> tirx.PrimExpr:
    tf, sf = tirx.Cast(dtype, t), tirx.Cast(dtype, size)
    one = tirx.const(1.0, dtype)
    if align:
        return tirx.Select(size > 1, -one + 2 * tf / (sf - one), -one)
    return -one + (2 * tf + one) / sf


def affine_grid_runtime_size(bb: relax.BlockBuilder, inputs: list, attr: dict,
                             fallback: Fallback) -> relax.Expr:
    """``AffineGrid(theta, size)`` with ``size`` a runtime tensor (see the module docstring)."""
    theta, size = inputs[0], inputs[1]
    shape = static_shape(theta)
    if shape is None or len(shape) != 3 or (shape[1], shape[2]) not in ((2, 3), (3, 4)):
        raise ValueError(f"AffineGrid: theta must be (N, 2, 3) or (N, 3, 4), got {theta.ty}")
    spatial = shape[1]
    size = bb.normalize(relax.op.astype(size, "int64"))
    batch_ok = relax.op.equal(relax.op.take(size, int64(0), axis=0), int64(shape[0]))
    dims = symbolic_dims(bb, size, spatial + 2, "size", bb.normalize(batch_ok))
    grid_dims = dims[2:]  # (H, W) or (D, H, W)
    align = bool(attr.get("align_corners", 0))

    def grid(th: te.Tensor) -> te.Tensor:
        dtype = str(th.dtype)

        def body(n, *rest):
            *pos, i = rest
            # base_j: x (last spatial axis), y, [z], then 1
            base = [_coordinate(pos[spatial - 1 - j], grid_dims[spatial - 1 - j], align, dtype)
                    for j in range(spatial)]
            total = th[n, i, spatial]
            for j in range(spatial):
                total = total + th[n, i, j] * base[j]
            return total

        return te.compute([shape[0], *grid_dims, spatial], body, name="affine_grid")

    return bb.emit_te(grid, theta)
