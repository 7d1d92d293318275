"""Pure-PyTorch references for the NVFP4 GEMMs (the test oracle and the CPU path).

Semantics shared with the Triton kernels (``megamoe/kernels/gemm/nvfp4_gemm.py``):

* weights are decoded exactly (``e2m1 * block_scale * global_scale`` in float32),
  the product with the bf16 activations is computed in float32 and the result is
  rounded once to bfloat16;
* ``mode="w4a4"``: the activations are first quantized to NVFP4 with a dynamic
  per-row global scale (the format's reference quantizer) and decoded back to
  bfloat16, which reproduces Blackwell W4A4 numerics up to that bf16 rounding;
* grouped GEMM: rows of ``x`` are sorted by expert, ``expert_offsets[e]`` is the
  cumulative end row of expert ``e``; rows at or beyond ``expert_offsets[-1]``
  (padding) are written as zeros;
* ``activation="swiglu"``: the weight rows are in the *interleaved* gate/up
  layout of :func:`interleave_gate_up` (row ``2j`` = gate ``j``, row ``2j+1`` =
  up ``j``) and the output column ``j`` is
  ``silu(min(gate_j, limit)) * clamp(up_j, -limit, limit)`` (no clamp when
  ``swiglu_limit`` is None), evaluated in float32.

These functions read device values on the host (they are references); the ops
in ``megamoe/ops/gemm.py`` never do on their Triton path.
"""
from __future__ import annotations

import torch

from ..format.mma_order import from_paired_order, to_paired_order
from ..format.tensor import NVFP4Tensor
from .quantize import dequantize, quantize

MODES = ("w4a16", "w4a4", "w4a8")
ACTIVATIONS = (None, "swiglu")


def interleave_gate_up(weight: NVFP4Tensor) -> NVFP4Tensor:
    """Reorder gate/up rows once at load for the fused SwiGLU epilogue.

    weight: NVFP4Tensor of logical shape (..., 2*I, K) whose rows are
        ``[gate(I); up(I)]`` (data (..., 2*I, K//2) uint8, block_scale
        (..., 2*I, K//16) e4m3). A per-row global scale (..., 2*I, 1) is
        reordered the same way; per-tensor / per-expert scales are kept.
    Returns the same tensor with rows interleaved: row ``2j`` = gate ``j``, row
    ``2j + 1`` = up ``j`` (contiguous copies; not for hot paths).
    """
    if not isinstance(weight, NVFP4Tensor):
        raise TypeError(f"weight: expected an NVFP4Tensor, got {type(weight).__name__}")
    if len(weight.shape) < 2 or weight.shape[-2] % 2:
        raise ValueError(f"weight: expected shape (..., 2*I, K) with an even row count, got {tuple(weight.shape)}")

    _check_rows_in_order(weight)

    def interleave(t: torch.Tensor) -> torch.Tensor:
        rows = t.shape[-2]
        gate, up = t[..., : rows // 2, :], t[..., rows // 2 :, :]
        return torch.stack((gate, up), dim=-2).reshape(t.shape).contiguous()

    gs = weight.global_scale
    if gs.dim() >= 2 and gs.shape[-2] == weight.shape[-2]:
        gs = interleave(gs)
    return NVFP4Tensor(interleave(weight.data), interleave(weight.block_scale), gs, weight.shape)


def _check_rows_in_order(weight: NVFP4Tensor) -> None:
    if weight.row_interleave != 1:
        raise ValueError(f"weight: expected row-major rows (row_interleave 1), got {weight.row_interleave}; "
                         "permute the gate/up rows before interleaving them (NVFP4Tensor.interleave_rows)")


def deinterleave_gate_up(weight: NVFP4Tensor) -> NVFP4Tensor:
    """Inverse of :func:`interleave_gate_up` (rows back to ``[gate(I); up(I)]``)."""
    if not isinstance(weight, NVFP4Tensor):
        raise TypeError(f"weight: expected an NVFP4Tensor, got {type(weight).__name__}")

    _check_rows_in_order(weight)

    def deinterleave(t: torch.Tensor) -> torch.Tensor:
        return torch.cat((t[..., 0::2, :], t[..., 1::2, :]), dim=-2).contiguous()

    gs = weight.global_scale
    if gs.dim() >= 2 and gs.shape[-2] == weight.shape[-2]:
        gs = deinterleave(gs)
    return NVFP4Tensor(deinterleave(weight.data), deinterleave(weight.block_scale), gs, weight.shape)


def one_expert_weight(weight: NVFP4Tensor) -> NVFP4Tensor:
    """A dense (N, K) weight as the grouped weight (1, N, K) of one expert: views of its data and block scale, the
    global scale 0-d or per row (N, 1) -> (1, N, 1)."""
    gs = weight.global_scale
    return NVFP4Tensor(weight.data[None], weight.block_scale[None], gs if gs.dim() == 0 else gs.reshape(1, -1, 1),
                       (1,) + tuple(weight.shape), weight.row_interleave)


def swiglu_reference(y: torch.Tensor, swiglu_limit: float | None) -> torch.Tensor:
    """y: (T, 2*I) float32 in the interleaved layout -> (T, I) float32."""
    gate, up = y[:, 0::2], y[:, 1::2]
    if swiglu_limit is not None:
        gate = torch.where(gate > swiglu_limit, torch.full_like(gate, swiglu_limit), gate)
        up = torch.where(up > swiglu_limit, torch.full_like(up, swiglu_limit), up)
        up = torch.where(up < -swiglu_limit, torch.full_like(up, -swiglu_limit), up)
    return gate * torch.sigmoid(gate) * up


def activations_for_mode(x: torch.Tensor, mode: str) -> torch.Tensor:
    """The bf16 activations the GEMM multiplies in ``mode`` (w4a4: NVFP4 round trip, per-row scale; w4a8:
    FP8 round trip, per-row power-of-two scale, exact in bf16; w4a8 also changes the weights)."""
    if mode not in MODES:
        raise ValueError(f"mode: expected one of {MODES}, got {mode!r}")
    if mode == "w4a16" or x.numel() == 0:
        return x
    if mode == "w4a8":
        from .w4a8 import fake_quant_activations

        return fake_quant_activations(x).to(torch.bfloat16)
    return dequantize(quantize(x, per_row=True), torch.bfloat16)


def _finish(y: torch.Tensor, out: torch.Tensor | None) -> torch.Tensor:
    y = y.to(torch.bfloat16)
    if out is None:
        return y
    out.copy_(y)
    return out


def nvfp4_linear(x, weight: NVFP4Tensor, bias=None, *, mode="w4a16", out=None, host_scale=None, activation=None,
                 swiglu_limit=None, weight_settled=False) -> torch.Tensor:
    """Reference ``x @ dequant(weight).T (+ bias)``.

    x: (M, K) bf16.  weight: NVFP4Tensor (N, K) (data (N, K//2) uint8, block_scale
    (N, K//16) e4m3, global_scale 0-d or (N, 1) fp32).  bias: None or (N,).
    host_scale: the op's route hint (a host copy of the global scale); the reference reads the device scale.
    weight_settled: the op's launch hint (PDL early weight reads); no effect here.
    activation: None, or "swiglu" (weight rows in the interleaved gate/up layout): the float32 product's
    :func:`swiglu_reference`, (M, N // 2).
    Returns (M, N) bf16 (written into ``out`` when given).
    """
    if activation == "swiglu":  # the grouped reference with one expert holding every row
        offsets = torch.full((1,), x.shape[0], dtype=torch.int32, device=x.device)
        return nvfp4_grouped_mm(x, one_expert_weight(weight), offsets, mode=mode, out=out, activation=activation,
                                swiglu_limit=swiglu_limit)
    if mode == "w4a8":
        from .w4a8 import w4a8_linear

        return w4a8_linear(x, weight, bias, out=out)
    xa = activations_for_mode(x, mode)
    w = dequantize(weight, torch.float32)
    y = xa.float() @ w.t()
    if bias is not None:
        y = y + bias.float()
    return _finish(y, out)


def bf16_linear_fp32(x: torch.Tensor, weight: torch.Tensor, *, out=None) -> torch.Tensor:
    """Reference ``x.float() @ weight.float().T``: x (M, K) bf16, weight (N, K) bf16 -> (M, N) float32 (written into
    ``out`` when given). Every product of two bf16 values is exact in float32; only the summation order is free."""
    y = x.float() @ weight.float().t()
    if out is None:
        return y
    out.copy_(y)
    return out


def nvfp4_grouped_mm(
    x,
    weight: NVFP4Tensor,
    expert_offsets,
    *,
    mode="w4a16",
    out=None,
    row_index=None,
    activation=None,
    swiglu_limit=None,
    max_rows_per_expert=None,
    x_order="plain",
    out_order="plain",
    index_settled=False,
) -> torch.Tensor:
    """Reference grouped GEMM over experts (rows sorted by expert).

    x: (T, K) bf16, or (S, K) with ``row_index`` (T,) int32 (row t reads
    ``x[row_index[t]]``).  weight: NVFP4Tensor (E, N, K).  expert_offsets: (E,)
    int32 cumulative row ends.  Returns (T, N) bf16, or (T, N//2) with
    ``activation="swiglu"``; rows >= expert_offsets[-1] are zero. A
    ``row_index`` value outside ``[0, S)`` reads zero activations (the row is
    dropped, as in the kernels). ``max_rows_per_expert``: the kernels' launch-size hint (unused here).
    ``x_order`` / ``out_order`` "paired": x holds, and the result is written in, the paired K order
    (:func:`megamoe.format.mma_order.to_paired_order`); the values are the plain order's.
    ``index_settled``: a launch-order hint of the kernels (the op's); no effect here.
    """
    if activation not in ACTIVATIONS:
        raise ValueError(f"activation: expected one of {ACTIVATIONS}, got {activation!r}")
    if x_order == "paired" or out_order == "paired":
        result = nvfp4_grouped_mm(from_paired_order(x) if x_order == "paired" else x, weight, expert_offsets,
                                  mode=mode, out=None if out_order == "paired" else out, row_index=row_index,
                                  activation=activation, swiglu_limit=swiglu_limit)
        return to_paired_order(result, out=out) if out_order == "paired" else result
    if mode == "w4a8":
        from .w4a8 import w4a8_grouped_mm

        return w4a8_grouped_mm(x, weight, expert_offsets, out=out, row_index=row_index, activation=activation,
                               swiglu_limit=swiglu_limit)
    xa = activations_for_mode(x, mode)
    if row_index is not None:
        idx = row_index.long()
        ok = (idx >= 0) & (idx < xa.shape[0])
        xa = torch.where(ok[:, None], xa[torch.where(ok, idx, 0)] if xa.shape[0] else
                         xa.new_zeros((idx.shape[0], xa.shape[1])), 0)
    num_rows = xa.shape[0]
    num_experts, n = weight.shape[0], weight.shape[1]
    y = torch.zeros((num_rows, n), dtype=torch.float32, device=x.device)
    ends = [min(max(int(v), 0), num_rows) for v in expert_offsets.tolist()]
    start = 0
    for e in range(num_experts):
        end = max(ends[e], start)
        if end > start:
            w_e = NVFP4Tensor(
                weight.data[e],
                weight.block_scale[e],
                _expert_global_scale(weight.global_scale, e),
                weight.shape[1:],
                weight.row_interleave,
            )
            y[start:end] = xa[start:end].float() @ dequantize(w_e, torch.float32).t()
        start = end
    if activation == "swiglu":
        y = swiglu_reference(y, swiglu_limit)
    return _finish(y, out)


def _expert_global_scale(global_scale: torch.Tensor, e: int) -> torch.Tensor:
    if global_scale.dim() == 0:
        return global_scale
    gs = global_scale[e] if global_scale.shape[0] != 1 else global_scale[0]
    return gs
