"""Fused per-token steps of the DeepSeek-V4 attention block: validation and dispatch.

CUDA tensors (or CPU tensors under ``TRITON_INTERPRET=1``) run one Triton launch per call
(``megamoe/kernels/v4_elementwise.py``); CPU tensors otherwise run the PyTorch formulas of
``megamoe/reference/v4_numerics.py`` / ``head_rms_norm``, composed here as ``*_reference`` functions (the layer's
formulas before fusion, and the tests' reference). The kernels equal these formulas bit for bit except for the
float32 summation order of the norms' sums of squares and of the Hadamard product (bounds in the kernel module).

Tables: ``freqs`` is a layer's (n_positions, rope_dim // 2) complex64 RoPE table (``rope_frequencies``), positions
(T,) int32/int64 index its rows. Sync-free, host decisions on shapes only (CUDA-graph capturable).

Out-of-range positions (issue 12, ``megamoe/ops/errors.py``). :func:`q_kv_path`, :func:`index_q_path` and
:func:`output_path`: a position outside ``[0, n_positions)`` (-1 included: these ops compute every row, there is
no "none" marker) reads no table row; its rotation is the complex number 0, so the row's RoPE dims come out as
zeros (signed as the products ``x * 0``; NaN / Inf inputs give NaN) and the other dims as for a valid row. It sets
the flag ``(op, "positions")`` of the error word. :func:`post_pool` clamps ``positions + shift`` into the table
(below 0 is the legitimate window start before the sequence start of a row that does not flush) and flags
``(post_pool, "positions")`` when ``positions + shift >= n_positions`` (the table is too short). The same rule on
both backends (the kernels mask the table read and OR the bit with one predicated atomic per token; the torch path
clamps, selects, and ORs the bit with device ops), so the outputs and the bits agree.
"""
from __future__ import annotations

import torch

from ..reference import v4_numerics as nx
from ..reference.v4_attention import head_rms_norm
from . import errors
from ._dispatch import use_triton
from ._validate import check_real, check_tensor

#: FP8 block of the window kv's non-RoPE dims, FP4 block of the indexer query (official 64 / 32).
KV_FP8_BLOCK = 64
INDEX_FP4_BLOCK = 32


# ------------------------------------------------------------------------------------------------ validation
_tensor = check_tensor


def _rope_inputs(freqs, positions, T: int, device, width: int, name: str) -> tuple[int, torch.Tensor]:
    """Validate the table and positions; returns (rope_dim, positions contiguous: the kernels index positions[t],
    so a strided view is copied, T ints)."""
    _tensor(freqs, "freqs", torch.complex64, 2, device)
    rd = 2 * freqs.shape[1]
    if rd < 2 or rd > width or (width - rd) % 2:
        raise ValueError(f"freqs: rope_dim {rd} must be even and fit the {width} dims of {name}")
    if not isinstance(positions, torch.Tensor) or positions.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"positions: expected an int32/int64 tensor, "
                        f"got {getattr(positions, 'dtype', type(positions))}")
    if tuple(positions.shape) != (T,) or positions.device != device:
        raise ValueError(f"positions: expected shape ({T},) on {device}, got {tuple(positions.shape)} on "
                         f"{positions.device}")
    return rd, positions.contiguous()


def _check_eps(eps) -> None:
    """The norms' epsilon: a finite float >= 0 (0 is allowed: the kernels' exactness tests use it)."""
    check_real(eps, "eps", non_negative=True)


def _positive_int(v, name: str) -> None:
    if not isinstance(v, int) or isinstance(v, bool) or v < 1:
        raise ValueError(f"{name}: expected a positive int, got {v!r}")


def _rows(t: torch.Tensor) -> torch.Tensor:
    """t itself when its last dim has unit stride (the kernels take any row stride: column views of a fused
    projection's output need no copy), else a contiguous copy."""
    return t if t.shape[-1] <= 1 or t.stride(-1) == 1 else t.contiguous()


def _table(freqs: torch.Tensor) -> torch.Tensor:
    return torch.view_as_real(freqs.contiguous())


def rope_rows(freqs: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """The drop rule's table rows (module docstring): ``freqs[positions]`` (T, rope_dim // 2) complex64, the
    complex 0 for a position outside ``[0, n_positions)`` (clamp + where: no out-of-range read, no host sync)."""
    n = freqs.shape[0]
    pos = positions.long()
    rows = freqs.index_select(0, pos.clamp(0, max(n - 1, 0)))
    return torch.where(((pos >= 0) & (pos < n))[:, None], rows, torch.zeros((), dtype=freqs.dtype,
                                                                            device=freqs.device))


def flag_positions(op: str, positions: torch.Tensor, n_positions: int, *, shift: int | None = None) -> None:
    """Torch path: OR ``(op, "positions")`` into the error word of ``positions.device`` for a position outside
    ``[0, n_positions)`` (``shift`` given: for ``positions + shift >= n_positions`` only, :func:`post_pool`'s rule)."""
    pos = positions.long()
    bad = pos + shift >= n_positions if shift is not None else (pos < 0) | (pos >= n_positions)
    errors.record(errors.error_word(positions.device), errors.flag(op, "positions"), bad)


# ------------------------------------------------------------------------------------------------ formulas
def q_path_reference(q: torch.Tensor, freqs: torch.Tensor, positions: torch.Tensor, *, num_heads: int,
                     eps: float) -> torch.Tensor:
    """(T, H * D) bf16 -> official bf16 per-head norm -> RoPE -> (T, H, D) bf16."""
    q = q.view(q.shape[0], num_heads, q.shape[1] // num_heads)  # explicit head dim: T = 0 works too
    return nx.apply_rope(head_rms_norm(q, eps), rope_rows(freqs, positions))


def kv_path_reference(kv: torch.Tensor, weight: torch.Tensor, freqs: torch.Tensor, positions: torch.Tensor, *,
                      eps: float) -> torch.Tensor:
    """(T, D) bf16 -> RMSNorm(weight) -> RoPE -> FP8 64-block simulation of the non-RoPE dims -> (T, D) bf16."""
    kv = nx.apply_rope(nx.rms_norm(kv, weight, eps), rope_rows(freqs, positions))
    nope = kv.shape[1] - 2 * freqs.shape[1]
    return torch.cat([nx.fp8_block_simulate(kv[:, :nope], KV_FP8_BLOCK), kv[:, nope:]], dim=-1)


def index_q_reference(q: torch.Tensor, weights: torch.Tensor, freqs: torch.Tensor, positions: torch.Tensor, *,
                      n_heads: int, weight_scale: float):
    """(T, n * Di) bf16, (T, n) bf16 -> (FP4-simulated Hadamard of RoPE(q) (T, n, Di) bf16,
    ``(weights * weight_scale).float()`` (T, n) float32)."""
    q = nx.apply_rope(q.view(q.shape[0], n_heads, q.shape[1] // n_heads), rope_rows(freqs, positions))
    q = nx.fp4_block_simulate(nx.hadamard_rotate(q), INDEX_FP4_BLOCK)
    return q, (weights * weight_scale).float()


def output_reference(o: torch.Tensor, freqs: torch.Tensor, positions: torch.Tensor, *, groups: int) -> torch.Tensor:
    """(T, H, D) bf16 -> inverse RoPE -> (G, T, H * D // G) bf16 (rows of group g = heads g*H/G ... )."""
    T, H, D = o.shape
    o = nx.apply_rope(o, rope_rows(freqs, positions), inverse=True)
    return o.reshape(T, groups, H * D // groups).transpose(0, 1).contiguous()  # explicit width: T = 0 works too


# ------------------------------------------------------------------------------------------------ ops
def rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    """RMSNorm over the last dim (``nx.rms_norm``): x (R, N) bf16, weight (N,) float32 or None -> (R, N) bf16;
    eps: a finite float >= 0."""
    _tensor(x, "x", torch.bfloat16, 2)
    _check_eps(eps)
    if weight is not None:
        _tensor(weight, "weight", torch.float32, 1, x.device)
        if weight.shape[0] != x.shape[1]:
            raise ValueError(f"weight: expected ({x.shape[1]},), got {tuple(weight.shape)}")
    if use_triton(x):
        from ..kernels.v4_elementwise import launch_rms_norm

        return launch_rms_norm(_rows(x), None if weight is None else weight.contiguous(), eps)
    return nx.rms_norm(x, weight, eps)


def q_kv_path(q: torch.Tensor | None, kv: torch.Tensor | None, kv_weight: torch.Tensor | None,
              freqs: torch.Tensor, positions: torch.Tensor, *, num_heads: int, eps: float):
    """The attention block's query heads and window kv row in one launch.

    q: (T, H * D) bf16 (``wq_b`` output) or None -> (T, H, D) bf16 :func:`q_path_reference`;
    kv: (T, D) bf16 (``wkv`` output) or None, kv_weight (D,) float32 -> (T, D) bf16 :func:`kv_path_reference`
    (D - rope_dim a multiple of 64). Returns (q, kv), None for an input that was None.
    positions: (T,) int32/int64 rows of freqs (any stride); one outside ``[0, n_positions)`` gives its token's RoPE
    dims the rotation 0 (zeros) and flags ``(q_kv_path, "positions")`` (module docstring; both backends).
    eps: a finite float >= 0. T = 0 gives empty outputs on both paths.
    """
    if q is None and kv is None:
        raise ValueError("q, kv: expected at least one tensor")
    _positive_int(num_heads, "num_heads")
    src = q if q is not None else kv
    T, dev = src.shape[0] if isinstance(src, torch.Tensor) else 0, getattr(src, "device", None)
    D = None
    if q is not None:
        _tensor(q, "q", torch.bfloat16, 2)
        if q.shape[1] % num_heads:
            raise ValueError(f"q: {q.shape[1]} columns are not a multiple of num_heads={num_heads}")
        D = q.shape[1] // num_heads
    if kv is not None:
        _tensor(kv, "kv", torch.bfloat16, 2, dev)
        if kv.shape[0] != T or (D is not None and kv.shape[1] != D):
            raise ValueError(f"kv: expected shape ({T}, {D if D is not None else 'D'}), got {tuple(kv.shape)}")
        D = kv.shape[1]
        _tensor(kv_weight, "kv_weight", torch.float32, 1, dev)
        if tuple(kv_weight.shape) != (D,):
            raise ValueError(f"kv_weight: expected ({D},), got {tuple(kv_weight.shape)}")
    rd, positions = _rope_inputs(freqs, positions, T, dev, D, "a head")
    if kv is not None and (D - rd) % KV_FP8_BLOCK:
        raise ValueError(f"kv: the {D - rd} non-RoPE dims are not a multiple of the FP8 block {KV_FP8_BLOCK}")
    _check_eps(eps)
    if use_triton(src):
        from ..kernels.v4_elementwise import launch_q_kv

        return launch_q_kv(None if q is None else _rows(q), None if kv is None else _rows(kv),
                           None if kv is None else kv_weight.contiguous(), _table(freqs), positions,
                           num_heads=num_heads, head_dim=D, eps=eps)
    flag_positions("q_kv_path", positions, freqs.shape[0])
    return (None if q is None else q_path_reference(q, freqs, positions, num_heads=num_heads, eps=eps),
            None if kv is None else kv_path_reference(kv, kv_weight, freqs, positions, eps=eps))


def index_q_path(q: torch.Tensor, weights: torch.Tensor, freqs: torch.Tensor, positions: torch.Tensor, *,
                 n_heads: int, weight_scale: float):
    """The indexer query and head weights (:func:`index_q_reference`): q (T, n_heads * Di) bf16, weights
    (T, n_heads) bf16 -> ((T, n_heads, Di) bf16, (T, n_heads) float32). Di a power of two >= 32; weight_scale a
    finite Python float. A position outside
    ``[0, n_positions)``: rotation 0 (zero RoPE dims before the Hadamard), flags ``(index_q_path, "positions")``."""
    _tensor(q, "q", torch.bfloat16, 2)
    _positive_int(n_heads, "n_heads")
    T = q.shape[0]
    if q.shape[1] % n_heads:
        raise ValueError(f"q: {q.shape[1]} columns are not a multiple of n_heads={n_heads}")
    Di = q.shape[1] // n_heads
    if Di < INDEX_FP4_BLOCK or Di & (Di - 1):
        raise ValueError(f"q: index head dim {Di} must be a power of two >= {INDEX_FP4_BLOCK}")
    _tensor(weights, "weights", torch.bfloat16, 2, q.device)
    if tuple(weights.shape) != (T, n_heads):
        raise ValueError(f"weights: expected shape {(T, n_heads)}, got {tuple(weights.shape)}")
    positions = _rope_inputs(freqs, positions, T, q.device, Di, "an index head")[1]
    check_real(weight_scale, "weight_scale")
    if use_triton(q):
        from ..kernels.v4_elementwise import launch_index_q

        return launch_index_q(_rows(q), _rows(weights), _table(freqs), positions, n_heads=n_heads,
                              weight_scale=float(weight_scale))
    flag_positions("index_q_path", positions, freqs.shape[0])
    return index_q_reference(q, weights, freqs, positions, n_heads=n_heads, weight_scale=weight_scale)


def output_path(o: torch.Tensor, freqs: torch.Tensor, positions: torch.Tensor, *, groups: int) -> torch.Tensor:
    """Inverse RoPE of the attention output in the grouped layout of ``wo_a`` (:func:`output_reference`):
    o (T, H, D) bf16 -> (groups, T, H * D // groups) bf16 contiguous (``view(groups * T, -1)``: rows by group;
    T = 0: an empty result on both paths).
    A position outside ``[0, n_positions)``: rotation 0 (zero RoPE dims), flags ``(output_path, "positions")``."""
    _tensor(o, "o", torch.bfloat16, 3)
    _positive_int(groups, "groups")
    T, H, D = o.shape
    if H % groups:
        raise ValueError(f"groups: {groups} does not divide the {H} heads")
    positions = _rope_inputs(freqs, positions, T, o.device, D, "a head")[1]
    if use_triton(o):
        from ..kernels.v4_elementwise import launch_output

        return launch_output(o.contiguous(), _table(freqs), positions, groups=groups)
    flag_positions("output_path", positions, freqs.shape[0])
    return output_reference(o, freqs, positions, groups=groups)


def post_pool_reference(pooled: torch.Tensor, weight: torch.Tensor, freqs: torch.Tensor, positions: torch.Tensor, *,
                        shift: int, eps: float, rotate: bool) -> torch.Tensor:
    """(N, D) float32 -> bf16 -> RMSNorm(weight) -> RoPE with table row ``clamp(positions + shift, 0, n - 1)`` ->
    Hadamard when ``rotate`` -> (N, D) bf16 (the compressed cache's post-pool formula)."""
    start = (positions.to(torch.int64) + shift).clamp_(0, freqs.shape[0] - 1)
    x = nx.apply_rope(nx.rms_norm(pooled.to(torch.bfloat16), weight, eps), freqs.index_select(0, start))
    return nx.hadamard_rotate(x) if rotate else x


def post_pool(pooled: torch.Tensor, weight: torch.Tensor, freqs: torch.Tensor, positions: torch.Tensor,
              out: torch.Tensor, *, shift: int, eps: float, rotate: bool) -> torch.Tensor:
    """The compressed cache's post-pool steps of a decode step in one launch (:func:`post_pool_reference`).

    pooled: (N, D) float32 pooled rows; weight: (D,) float32 (the compressor's norm); freqs: (n, rope_dim // 2)
    complex64; positions: (N,) int32/int64, RoPE row ``clamp(positions + shift, 0, n - 1)`` (decode: shift
    ``1 - ratio``, the window start; ``positions + shift >= n`` flags ``(post_pool, "positions")``, the row still
    clamped; below 0 is not an error); out: (N, D) bf16 contiguous, written and returned; eps: a finite float >= 0;
    rotate: a bool, Hadamard of the indexer keys (D a power of two). Kernel vs formula: the norm's sum of squares
    and the Hadamard sums in another float32 order (module docstring of ``megamoe/kernels/v4_elementwise.py``); all
    else bit for bit.
    """
    _tensor(pooled, "pooled", torch.float32, 2)
    N, D = pooled.shape
    _tensor(weight, "weight", torch.float32, 1, pooled.device)
    if tuple(weight.shape) != (D,):
        raise ValueError(f"weight: expected ({D},), got {tuple(weight.shape)}")
    _tensor(out, "out", torch.bfloat16, 2, pooled.device)
    if tuple(out.shape) != (N, D) or not out.is_contiguous():
        raise ValueError(f"out: expected a contiguous ({N}, {D}) tensor, got {tuple(out.shape)}")
    positions = _rope_inputs(freqs, positions, N, pooled.device, D, "a pooled row")[1]
    if not isinstance(shift, int) or isinstance(shift, bool):
        raise TypeError(f"shift: expected an int, got {type(shift).__name__}")
    _check_eps(eps)
    if not isinstance(rotate, bool):
        raise TypeError(f"rotate: expected a bool, got {rotate!r}")
    if rotate and D & (D - 1):
        raise ValueError(f"pooled: the Hadamard rotation needs a power-of-two width, got {D}")
    if freqs.shape[0] < 1:
        raise ValueError("freqs: expected at least one table row")
    if use_triton(pooled):
        from ..kernels.v4_elementwise import launch_post_pool

        return launch_post_pool(pooled.contiguous(), weight.contiguous(), _table(freqs), positions, out, shift=shift,
                                eps=eps, rotate=rotate)
    flag_positions("post_pool", positions, freqs.shape[0], shift=shift)
    out.copy_(post_pool_reference(pooled, weight, freqs, positions, shift=shift, eps=eps, rotate=rotate))
    return out
