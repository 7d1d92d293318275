"""Single-launch decode MoE (``megamoe/kernels/moe_fused_decode.py``): gate_up + SwiGLU, down and combine.

:func:`moe_fused_decode` takes the routed pairs as the dispatch leaves them (``expert_offsets``,
``row_index``, ``inv_perm``, the (T, S) pair weights) and returns ``out[t] = sum_j w[t, j] *
expert_{id(t, j)}(x[t])`` (slot order j = 0..S-1, float32, one bf16 rounding) in one launch on the GPU (two
under the Triton interpreter). Sync-free and CUDA-graph capturable; deterministic (the same bits on every run).

Numerics: as the unfused path except that the down projection's output stays float32 into the combine (the
unfused path rounds it to bf16 first); h (the SwiGLU output) is rounded to bf16 in both.
"""
from __future__ import annotations

import torch

from ..format.tensor import NVFP4Tensor
from ._dispatch import interpreter_enabled, use_triton
from ._validate import check_positive_finite


def fused_decode_workspace(max_tokens: int, slots: int, num_groups: int, hidden: int, inter: int,
                           device, h: torch.Tensor | None = None) -> dict:
    """Preallocated buffers of :func:`moe_fused_decode` for up to ``max_tokens`` tokens of ``slots`` pairs:
    ``h`` (T*S, I) bf16, ``y`` (T*S, H) fp32, ``counters`` int32 zeros (every launch leaves them zero).
    h: a caller's (>= T*S, I) bf16 buffer to use for ``h`` (its first T*S rows; e.g. the layer's GEMM
    intermediate), else a new one."""
    from ..kernels.moe_fused_decode import FUSED_DECODE_MAX_TOKENS, counter_slots

    max_tokens = min(max_tokens, FUSED_DECODE_MAX_TOKENS)
    pairs = max_tokens * slots
    return {
        "h": h[:pairs] if h is not None else torch.empty((pairs, inter), dtype=torch.bfloat16, device=device),
        "y": torch.empty((pairs, hidden), dtype=torch.float32, device=device),
        "counters": torch.zeros(counter_slots(num_groups, max_tokens, hidden), dtype=torch.int32, device=device),
        "max_tokens": max_tokens,
    }


def fused_decode_supported(hidden_states: torch.Tensor, w13: NVFP4Tensor, w2: NVFP4Tensor) -> bool:
    """Host-shape rule: the kernel runs these tensors (Triton path, H and I multiples of 32, 4-byte rows)."""
    from ..kernels.gemm.nvfp4_gemv import gemv_supports
    from ..kernels.moe_fused_decode import FUSED_DECODE_MAX_TOKENS

    hidden, inter = w13.shape[-1], w2.shape[-1]
    return (w13.row_interleave == 1 and w2.row_interleave == 1  # the kernel reads row-major weights
            and use_triton(hidden_states) and hidden % 32 == 0 and inter % 32 == 0
            and 1 <= hidden_states.shape[0] <= FUSED_DECODE_MAX_TOKENS
            and gemv_supports(hidden_states, w13.data) and w2.data.is_contiguous() and w2.data.data_ptr() % 4 == 0)


def _check_int(t, name: str, length: int | None, at_least: bool, device) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
    if t.dtype != torch.int32:
        raise TypeError(f"{name}: expected int32, got {t.dtype}")
    if t.dim() != 1 or not t.is_contiguous() or (length is not None and (
            t.shape[0] < length if at_least else t.shape[0] != length)):
        raise ValueError(f"{name}: expected a contiguous ({'>= ' if at_least else ''}{length},) tensor, got "
                         f"shape {tuple(t.shape)}")
    if t.device != device:
        raise ValueError(f"{name}: expected device {device}, got {t.device}")


def moe_fused_decode(
    hidden_states: torch.Tensor,
    w13: NVFP4Tensor,
    w2: NVFP4Tensor,
    expert_offsets: torch.Tensor,
    row_index: torch.Tensor,
    inv_perm: torch.Tensor,
    topk_weights: torch.Tensor,
    *,
    swiglu_limit: float | None,
    workspace: dict | None = None,
    out: torch.Tensor | None = None,
    phases: int = 1,
) -> torch.Tensor:
    """Routed experts + combine of 1..16 tokens in one launch: (T, H) bf16.

    hidden_states: (T, H) bf16, unit column stride. w13: NVFP4Tensor (G, 2I, H) with gate/up rows
    *interleaved* (``megamoe.ops.gemm.interleave_gate_up``; a fused shared expert is group E); w2:
    NVFP4Tensor (G, H, I). expert_offsets (G,), row_index (>= T*S,), inv_perm (T*S,): int32, the dispatch's
    (``megamoe.ops.moe.dispatch`` / ``route_dispatch`` with ``num_groups=G``, ``slots=S``). topk_weights:
    (T, S) fp32 with unit column stride (S = the pairs per token; the fused shared expert's column holds 1.0).
    swiglu_limit: the SwiGLU clamp, a finite positive number (None: no clamp). workspace:
    :func:`fused_decode_workspace` (default: a new one per call). out: optional (T, H) bf16. phases: 1 (one
    launch) or 2 (two launches: a debugging switch on the GPU, always under the interpreter); the same bits.

    Every pair id must be valid (a row in ``[0, expert_offsets[G-1])``): a token none of whose pairs is valid
    is not written. T = 0 returns at once.
    """
    if not isinstance(hidden_states, torch.Tensor):
        raise TypeError(f"hidden_states: expected a torch.Tensor, got {type(hidden_states).__name__}")
    if hidden_states.dtype != torch.bfloat16:
        raise TypeError(f"hidden_states: expected bfloat16, got {hidden_states.dtype}")
    if hidden_states.dim() != 2 or hidden_states.stride(1) != 1:
        raise ValueError(f"hidden_states: expected a (T, H) tensor with unit column stride, got shape "
                         f"{tuple(hidden_states.shape)} strides {hidden_states.stride()}")
    device = hidden_states.device
    num_tokens, hidden = hidden_states.shape
    for name, w in (("w13", w13), ("w2", w2)):
        if not isinstance(w, NVFP4Tensor):
            raise TypeError(f"{name}: expected an NVFP4Tensor, got {type(w).__name__}")
        if len(w.shape) != 3 or w.device != device:
            raise ValueError(f"{name}: expected a stacked (G, N, K) NVFP4Tensor on {device}, got {tuple(w.shape)} "
                             f"on {w.device}")
        if w.row_interleave != 1:
            raise ValueError(f"{name}: expected row-major weights (row_interleave 1), got row_interleave "
                             f"{w.row_interleave}; pass {name}.rows_in_order()")
    groups, two_i, h_w = w13.shape
    if h_w != hidden or two_i % 2:
        raise ValueError(f"w13: expected shape (G, 2I, {hidden}), got {tuple(w13.shape)}")
    inter = two_i // 2
    if tuple(w2.shape) != (groups, hidden, inter):
        raise ValueError(f"w2: expected shape {(groups, hidden, inter)} (w13's G, H and I), got {tuple(w2.shape)}")
    if hidden % 32 or inter % 32:
        raise ValueError(f"w13/w2: H={hidden} and I={inter} must be multiples of 32")
    if not isinstance(topk_weights, torch.Tensor):
        raise TypeError(f"topk_weights: expected a torch.Tensor, got {type(topk_weights).__name__}")
    if topk_weights.dtype != torch.float32:
        raise TypeError(f"topk_weights: expected float32, got {topk_weights.dtype}")
    if topk_weights.dim() != 2 or topk_weights.shape[0] != num_tokens or topk_weights.shape[1] < 1 \
            or (topk_weights.shape[1] > 1 and topk_weights.stride(1) != 1):
        raise ValueError(f"topk_weights: expected ({num_tokens}, S) with unit column stride, got shape "
                         f"{tuple(topk_weights.shape)} strides {topk_weights.stride()}")
    if topk_weights.device != device:
        raise ValueError(f"topk_weights: expected device {device}, got {topk_weights.device}")
    slots = topk_weights.shape[1]
    pairs = num_tokens * slots
    _check_int(expert_offsets, "expert_offsets", groups, False, device)
    _check_int(row_index, "row_index", pairs, True, device)
    _check_int(inv_perm, "inv_perm", pairs, False, device)
    if isinstance(phases, bool) or not isinstance(phases, int) or phases not in (1, 2):
        raise ValueError(f"phases: expected 1 or 2, got {phases!r}")
    if swiglu_limit is not None:
        check_positive_finite(swiglu_limit, "swiglu_limit")
    from ..kernels.moe_fused_decode import FUSED_DECODE_MAX_TOKENS, counter_slots, launch_moe_fused_decode

    if num_tokens > FUSED_DECODE_MAX_TOKENS:
        raise ValueError(f"hidden_states: the fused decode MoE takes at most {FUSED_DECODE_MAX_TOKENS} tokens, "
                         f"got {num_tokens}")
    if out is None:
        out = torch.empty((num_tokens, hidden), dtype=torch.bfloat16, device=device)
    elif not isinstance(out, torch.Tensor):
        raise TypeError(f"out: expected a torch.Tensor, got {type(out).__name__}")
    elif out.dtype != torch.bfloat16 or tuple(out.shape) != (num_tokens, hidden) or out.stride(1) != 1 \
            or out.device != device:
        raise ValueError(f"out: expected a ({num_tokens}, {hidden}) bf16 tensor with unit column stride on {device}, "
                         f"got {tuple(out.shape)} {out.dtype} on {out.device}")
    if num_tokens == 0:
        return out
    if not use_triton(hidden_states):
        raise ValueError("hidden_states: the fused decode MoE runs on CUDA tensors (or CPU tensors under the "
                         "Triton interpreter, TRITON_INTERPRET=1)")
    from ..kernels.gemm.nvfp4_gemv import gemv_supports

    if not gemv_supports(hidden_states, w13.data) or not gemv_supports(hidden_states, w2.data):
        raise ValueError("hidden_states/w13/w2: rows must start on 4-byte boundaries with contiguous weight data")
    if workspace is None:
        workspace = fused_decode_workspace(num_tokens, slots, groups, hidden, inter, device)
    if not isinstance(workspace, dict) or not {"h", "y", "counters"} <= set(workspace):
        raise TypeError("workspace: expected the dict of fused_decode_workspace()")
    h, y, counters = workspace["h"], workspace["y"], workspace["counters"]
    if (h.dtype != torch.bfloat16 or h.dim() != 2 or h.shape[0] < pairs or h.shape[1] != inter
            or not h.is_contiguous() or y.dtype != torch.float32 or y.dim() != 2 or y.shape[0] < pairs
            or y.shape[1] != hidden or not y.is_contiguous() or counters.dtype != torch.int32
            or counters.numel() < counter_slots(groups, num_tokens, hidden)
            or any(t.device != device for t in (h, y, counters))):
        raise ValueError(f"workspace: too small or wrong for T={num_tokens}, S={slots}, G={groups}, H={hidden}, "
                         f"I={inter} on {device}; build it with fused_decode_workspace()")
    return launch_moe_fused_decode(
        hidden_states, w13.data, w13.block_scale, w13.global_scale, w2.data, w2.block_scale, w2.global_scale,
        expert_offsets, row_index, inv_perm, topk_weights, h, y, counters, out,
        swiglu_limit=None if swiglu_limit is None else float(swiglu_limit),
        interpreter=interpreter_enabled() and not hidden_states.is_cuda, phases=phases,
    )
