"""Decode MoE in one launch ("MegaMoE" v1): gate_up + SwiGLU, down and the combine of 1-16 tokens.

One kernel family (:func:`_moe_fused_decode_kernel`), one launcher (:func:`launch_moe_fused_decode`).

Inputs are the outputs of the existing routing + dispatch launch (``megamoe.ops.moe.route_dispatch``):
``expert_offsets`` (G,) cumulative row ends of the T*S expert-sorted rows, ``row_index`` (token of each sorted
row), ``inv_perm`` (sorted row of pair ``t*S + j``) and the (T, S) float32 pair weights (S = top-k, plus the
fused shared expert as slot k with weight 1.0 and id E when the layer fuses it). All device values: the grid and
every loop bound below come from host shapes, the schedule is read on the device (sync-free, CUDA-graph safe,
the routing may change between replays).

**Work items.** Every program builds the list of touched experts (a prefix count over ``expert_offsets``, in
registers) and walks one global item list with a grid stride (program ``p`` takes items ``p, p + P, ...`` in
increasing order):

1. items ``[0, n1)``, ``n1 = touched x cdiv(2I, BLOCK_N)``, expert-major: (touched expert, n-tile of the
   interleaved w13 rows). The CUDA-core decode GEMV of ``nvfp4_gemv.py`` (its exact FP4 decode, its load and
   FMA steps: fp32 FMAs, reduction over K inside the program) for the expert's token rows, ``ROWS`` rows per
   pass over the weight slab, the gemv's SwiGLU epilogue (clamp by ``swiglu_limit``), bf16 h stored to the
   workspace at the sorted rows; then a CTA barrier and ``atomic_add(expert counter, 1, release, gpu)``.
2. items ``[n1, n1 + n2)``, ``n2 = touched x cdiv(H, BLOCK_N)``: (touched expert, n-tile of the hidden
   output). Spin (acquire, gpu scope, ``nanosleep`` between polls) until the expert's counter reaches
   ``cdiv(2I, BLOCK_N)`` (all of its h is stored), then the same GEMV over w2 with the h rows as activations
   (loaded ``.cg``: written by other SMs in this launch) -> y (fp32, times the global scale) stored to a
   float32 workspace at the sorted rows. Combine folded in: after a CTA barrier each row draws a ticket on
   its (token, n-tile) counter (``acq_rel``); the row that draws the token's last ticket (count = the
   token's valid pairs) sums ``w[t, j] * y[inv_perm[t*S + j]]`` for ``j = 0..S-1`` in that order (the
   combine's order; the fused shared expert is slot k, added last as in the combine), rounds once to bf16,
   stores the output tile and resets that counter to zero. The order of every sum is fixed by the routing,
   never by arrival order: the same bits on every run, eager or graph replay. No float atomics.

**Deadlock freedom.** A program runs its items in increasing order, and every phase-1 item precedes every
phase-2 item in the list, so a program finishes all its phase-1 items before its first wait; phase-1 items
never wait. The grid is at most the number of programs that fit on the GPU at once (the compiled kernel's
registers / shared memory / warps: ``nvfp4_mma_decode.compiled_residency``), so every program is resident and
every phase-1 item completes. (Other kernels sharing the GPU can delay our programs' start, never block it.)

**Counter reset (graph-safe, no host sync).** ``counters`` (int32, zeros when allocated) holds G expert
counters, one done counter, then T x n-tiles (token, tile) counters. The (token, tile) counters are reset by
their last arriver. The expert counters: each program adds 1 to the done counter when it has finished all of
its items (all of its waits included); the program that draws the last ticket zeroes the expert counters and
the done counter. Every launch thus leaves all counters zero for the next (stream-ordered) launch. One
workspace must not be used by two launches running at the same time (two streams).

**PHASE** (constexpr): 0 = both phases in one launch (GPU); 1 / 2 = one phase per launch, launched in that
order (no expert counters, no spin: the Triton interpreter runs programs one after another, where a spin
would hang; also a GPU debugging switch). The results are the same bits in both modes.

Requirements: H and I multiples of 32, x / w rows 4-byte aligned (``nvfp4_gemv.gemv_supports``), the w13 rows
gate/up interleaved (row 2j = gate j, 2j + 1 = up j: ``megamoe.ops.gemm.interleave_gate_up``), every pair id
valid (a token none of whose pairs has a row in ``[0, expert_offsets[G-1])`` is not written; the layer's
routing never produces one). Corrupt metadata never indexes memory: offsets are clamped to ``[0, T*S]``, pair
rows outside ``[0, expert_offsets[G-1])`` are skipped, and a ``row_index`` entry outside ``[0, T)`` reads zeros in
phase 1 and takes no ticket, pair lookup or output row in phase 2.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .gemm.nvfp4_gemm import _num_sms, global_scale_strides
from .gemm.nvfp4_gemv import _fma_k_loop, _load_step
from .gemm.nvfp4_mma_decode import compiled_residency
from .nvfp4_jit import round_to_bf16

# (ROWS, BLOCK_N, BLOCK_K, num_warps, maxnreg) by the most tokens of a launch. ROWS 1: at 1-16 tokens a routed
# expert has ~1 row (top-6 of 256), and a pass of the gemv decode costs ~5.3 instructions per weight for one
# row vs ~6.6 for two (nvfp4_gemv.py): extra rows only pay for the shared expert's T rows. BLOCK_N 64, 4 warps
# as nvfp4_gemv's 1-row config; BLOCK_K 128 (not its 256): offline sm_90 build of this kernel (both phases) 160
# registers, no spills -> 3 programs / SM; BLOCK_K 256 takes 234 (2 / SM) and spills under a 168 / 128 cap.
# Not measured on a GPU yet (benchmarks/NOTES_moe_decode.md, "Single-launch decode MoE").
FUSED_DECODE_CONFIGS = {
    16: (1, 64, 128, 4, None),
}
# Interpreter (CPU tests): small tiles so that several row passes per expert and many items are exercised.
INTERPRETER_CONFIG = (2, 32, 128, 4, None)
INTERPRETER_PROGRAMS = 5  # programs the interpreter launches (the grid-stride loop gives each several items)
#: Most tokens the launcher takes (the (token, tile) counters and the workspace are sized by it).
FUSED_DECODE_MAX_TOKENS = 16
#: Smallest BLOCK_N of any config: sizes the (token, tile) counters.
MIN_BLOCK_N = 16
SPIN_SLEEP_NS = 200


def select_config(num_tokens: int, interpreter: bool):
    if interpreter:
        return INTERPRETER_CONFIG
    for bound, config in FUSED_DECODE_CONFIGS.items():
        if num_tokens <= bound:
            return config
    raise ValueError(f"num_tokens: the fused decode MoE takes at most {max(FUSED_DECODE_CONFIGS)} tokens, "
                     f"got {num_tokens}")


def counter_slots(num_groups: int, max_tokens: int, hidden: int) -> int:
    """int32 counters a workspace needs: G expert counters, the done counter, T x n-tiles (token, tile) ones."""
    return num_groups + 1 + max_tokens * triton.cdiv(hidden, MIN_BLOCK_N)


@triton.jit
def _spin_until(ptr, target, INTERPRET: tl.constexpr):
    """Wait until the int32 at ``ptr`` is >= ``target`` (acquire, gpu scope; one atomic per poll)."""
    v = tl.atomic_add(ptr, 0, sem="acquire", scope="gpu")
    while v < target:
        if not INTERPRET:
            v = tl.inline_asm_elementwise("nanosleep.u32 200; mov.b32 $0, $1;", "=r,r", [v], dtype=tl.int32,
                                          is_pure=False, pack=1)
        v = tl.atomic_add(ptr, 0, sem="acquire", scope="gpu")


@triton.jit
def _gemv_pass(w_ptrs, s_ptrs, x_ptrs, x_mask, K, ROWS: tl.constexpr, BLOCK_N: tl.constexpr,
               BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr, X_CACHE: tl.constexpr, INTERPRET: tl.constexpr):
    """(ROWS, BLOCK_N) fp32: sum over K of x * W (W carries 2**-8), nvfp4_gemv's steps, hand double-buffered."""
    k_steps = (K + BLOCK_K - 1) // BLOCK_K
    words, scale_bytes, xt = _load_step(w_ptrs, s_ptrs, x_ptrs, x_mask, 0, K, BLOCK_K, EVEN_K, X_CACHE)
    return _fma_k_loop(words, scale_bytes, xt, w_ptrs, s_ptrs, x_ptrs, x_mask, K, k_steps, ROWS, BLOCK_N, BLOCK_K,
                       EVEN_K, INTERPRET, X_CACHE)


@triton.jit
def _gate_up_item(x32_ptr, row_index_ptr, w_ptr, s_ptr, g_ptr, h_ptr, expert, row_start, row_end, tile,
                  num_tokens, N, K, swiglu_limit, stride_xm, stride_we, stride_wn, stride_se, stride_sn,
                  stride_ge, stride_gn, stride_hm,
                  ROWS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr,
                  HAS_LIMIT: tl.constexpr, INTERPRET: tl.constexpr):
    """Phase-1 item: h[rows, tile] = swiglu(W13[expert, tile rows] @ x[row_index[rows]]) (bf16)."""
    offs_r = tl.arange(0, ROWS)
    offs_n = tl.arange(0, BLOCK_N)
    offs_w = tl.arange(0, BLOCK_K // 8)
    offs_g = tl.arange(0, BLOCK_K // 16)
    offs_q = tl.arange(0, 4)
    cols = tile * BLOCK_N + offs_n
    w_cols = tl.minimum(cols, N - 1).to(tl.int64)
    w_ptrs = w_ptr + expert * stride_we + w_cols[None, :, None] * stride_wn + offs_w[None, None, :]
    s_ptrs = s_ptr + expert * stride_se + w_cols[None, :, None] * stride_sn + offs_g[None, None, :]
    gscale = tl.load(g_ptr + expert * stride_ge + w_cols * stride_gn) * 256.0  # the decode carries 2**-8
    half_cols = tile * (BLOCK_N // 2) + tl.arange(0, BLOCK_N // 2)
    r0 = row_start
    while r0 < row_end:
        rows = r0 + offs_r
        row_mask = rows < row_end
        src = tl.load(row_index_ptr + rows, mask=row_mask, other=0).to(tl.int64)
        src_ok = row_mask & (src >= 0) & (src < num_tokens)  # a bad row index reads zeros (dispatch flags it)
        src = tl.where(src_ok, src, 0)
        x_ptrs = (x32_ptr + src[:, None, None, None] * stride_xm
                  + 4 * offs_w[None, None, :, None] + offs_q[None, None, None, :])
        acc = _gemv_pass(w_ptrs, s_ptrs, x_ptrs, src_ok[:, None, None, None], K, ROWS, BLOCK_N, BLOCK_K, EVEN_K,
                         "", INTERPRET) * gscale[None, :]
        gate, up = tl.split(acc.reshape(ROWS, BLOCK_N // 2, 2))
        if HAS_LIMIT:  # nvfp4_gemv's epilogue, the same formula
            gate = tl.where(gate > swiglu_limit, swiglu_limit, gate)
            up = tl.where(up > swiglu_limit, swiglu_limit, up)
            up = tl.where(up < -swiglu_limit, -swiglu_limit, up)
        y = gate / (1.0 + tl.exp(-gate)) * up
        tl.store(h_ptr + rows.to(tl.int64)[:, None] * stride_hm + half_cols[None, :], round_to_bf16(y, INTERPRET),
                 mask=row_mask[:, None] & (half_cols < N // 2)[None, :])
        r0 += ROWS


@triton.jit
def _down_item(h32_ptr, row_index_ptr, inv_perm_ptr, weights_ptr, w_ptr, s_ptr, g_ptr, y_ptr, out_ptr, tcnt_ptr,
               expert, row_start, row_end, tile, total_rows, num_tokens, n_tiles, N, K,
               stride_h32, stride_we, stride_wn, stride_se, stride_sn, stride_ge, stride_gn, stride_ym,
               stride_wt, stride_om,
               SLOTS: tl.constexpr, S_PAD: tl.constexpr, ROWS: tl.constexpr, BLOCK_N: tl.constexpr,
               BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr, INTERPRET: tl.constexpr):
    """Phase-2 item: y[rows, tile] = W2[expert, tile rows] @ h[rows] (fp32); each row's token is combined by
    the row that draws its last (token, tile) ticket. A row whose token id is outside [0, num_tokens) takes no
    ticket and indexes nothing with it (its token, if any, is then not written: corrupt routing metadata)."""
    offs_r = tl.arange(0, ROWS)
    offs_n = tl.arange(0, BLOCK_N)
    offs_w = tl.arange(0, BLOCK_K // 8)
    offs_g = tl.arange(0, BLOCK_K // 16)
    offs_q = tl.arange(0, 4)
    offs_j = tl.arange(0, S_PAD)
    cols = tile * BLOCK_N + offs_n
    col_mask = cols < N
    w_cols = tl.minimum(cols, N - 1).to(tl.int64)
    w_ptrs = w_ptr + expert * stride_we + w_cols[None, :, None] * stride_wn + offs_w[None, None, :]
    s_ptrs = s_ptr + expert * stride_se + w_cols[None, :, None] * stride_sn + offs_g[None, None, :]
    gscale = tl.load(g_ptr + expert * stride_ge + w_cols * stride_gn) * 256.0
    r0 = row_start
    while r0 < row_end:
        rows = r0 + offs_r
        row_mask = rows < row_end
        rows64 = rows.to(tl.int64)
        x_ptrs = (h32_ptr + rows64[:, None, None, None] * stride_h32
                  + 4 * offs_w[None, None, :, None] + offs_q[None, None, None, :])
        y = _gemv_pass(w_ptrs, s_ptrs, x_ptrs, row_mask[:, None, None, None], K, ROWS, BLOCK_N, BLOCK_K, EVEN_K,
                       ".cg", INTERPRET) * gscale[None, :]
        tl.store(y_ptr + rows64[:, None] * stride_ym + cols[None, :], y, mask=row_mask[:, None] & col_mask[None, :])
        tl.debug_barrier()  # every thread's y stores precede the release below
        tok = tl.load(row_index_ptr + rows, mask=row_mask, other=0).to(tl.int64)
        tok_ok = row_mask & (tok >= 0) & (tok < num_tokens)
        tok = tl.where(tok_ok, tok, 0)
        ticket = tl.atomic_add(tcnt_ptr + tok * n_tiles + tile, 1, mask=tok_ok, sem="acq_rel", scope="gpu")
        # the token's valid pairs (rows inside [0, total_rows)): the tickets its tile expects
        pair_rows = tl.load(inv_perm_ptr + tok[:, None] * SLOTS + offs_j[None, :],
                            mask=tok_ok[:, None] & (offs_j < SLOTS)[None, :], other=-1)
        valid = ((pair_rows >= 0) & (pair_rows < total_rows)).to(tl.int32)
        last = tok_ok & (ticket == tl.sum(valid, axis=1) - 1)
        if tl.max(last.to(tl.int32), axis=0) > 0:
            acc = tl.zeros((ROWS, BLOCK_N), dtype=tl.float32)
            for j in tl.static_range(SLOTS):  # the combine's order: slot 0, 1, ..., the fused shared expert last
                pr = tl.load(inv_perm_ptr + tok * SLOTS + j, mask=last, other=-1).to(tl.int64)
                ok = last & (pr >= 0) & (pr < total_rows)
                wj = tl.load(weights_ptr + tok * stride_wt + j, mask=ok, other=0.0)
                yj = tl.load(y_ptr + tl.where(ok, pr, 0)[:, None] * stride_ym + cols[None, :],
                             mask=ok[:, None] & col_mask[None, :], other=0.0, cache_modifier=".cg")
                acc += tl.where(ok[:, None], wj[:, None] * yj, 0.0)
            tl.store(out_ptr + tok[:, None] * stride_om + cols[None, :], round_to_bf16(acc, INTERPRET),
                     mask=last[:, None] & col_mask[None, :])
            tl.store(tcnt_ptr + tok * n_tiles + tile, 0, mask=last)  # only this row touches it from here on
        r0 += ROWS


@triton.jit(do_not_specialize=["num_tokens", "num_groups", "num_programs"])
def _moe_fused_decode_kernel(
    x32_ptr, row_index_ptr, offsets_ptr, inv_perm_ptr, weights_ptr,
    w13_ptr, s13_ptr, g13_ptr, w2_ptr, s2_ptr, g2_ptr,
    h_ptr, h32_ptr, y_ptr, out_ptr, cnt_ptr,
    num_tokens, num_groups, hidden, inter, num_programs, swiglu_limit,
    stride_xm, stride_w13e, stride_w13n, stride_s13e, stride_s13n, stride_g13e, stride_g13n,
    stride_w2e, stride_w2n, stride_s2e, stride_s2n, stride_g2e, stride_g2n,
    stride_hm, stride_ym, stride_wt, stride_om,
    SLOTS: tl.constexpr, S_PAD: tl.constexpr, ROWS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    BLOCK_E: tl.constexpr, EVEN_H: tl.constexpr, EVEN_I: tl.constexpr, HAS_LIMIT: tl.constexpr,
    PHASE: tl.constexpr, INTERPRET: tl.constexpr,
):
    pid = tl.program_id(0)
    num_rows = num_tokens * SLOTS
    # ---- the touched experts, in expert order (prefix count over the offsets, once per program)
    lane = tl.arange(0, BLOCK_E)
    in_g = lane < num_groups
    ends = tl.load(offsets_ptr + lane, mask=in_g, other=0)
    starts = tl.load(offsets_ptr + lane - 1, mask=(lane >= 1) & in_g, other=0)
    ends = tl.minimum(tl.maximum(ends, 0), num_rows)
    starts = tl.minimum(tl.maximum(starts, 0), num_rows)
    active = in_g & (ends > starts)
    rank = tl.where(active, tl.cumsum(active.to(tl.int32), 0), 0)  # 1-based rank of each touched expert
    touched = tl.sum(active.to(tl.int32), 0)
    total_rows = tl.minimum(tl.maximum(tl.load(offsets_ptr + num_groups - 1), 0), num_rows)
    n_tiles1 = (2 * inter + BLOCK_N - 1) // BLOCK_N
    n_tiles2 = (hidden + BLOCK_N - 1) // BLOCK_N
    n1 = touched * n_tiles1
    n_end = n1 + touched * n_tiles2
    if PHASE == 1:
        n_end = n1
    tcnt_ptr = cnt_ptr + num_groups + 1  # (token, tile) counters after the expert counters and the done counter
    i = pid
    if PHASE == 2:
        i = pid + n1
    while i < n_end:
        is_p1 = i < n1
        j = tl.where(is_p1, i, i - n1)
        per = tl.where(is_p1, n_tiles1, n_tiles2)
        slot = j // per
        tile = j - slot * per
        sel = rank == slot + 1
        expert = tl.sum(tl.where(sel, lane, 0), 0)
        row_start = tl.sum(tl.where(sel, starts, 0), 0)
        row_end = tl.sum(tl.where(sel, ends, 0), 0)
        e64 = expert.to(tl.int64)
        if is_p1:
            _gate_up_item(x32_ptr, row_index_ptr, w13_ptr, s13_ptr, g13_ptr, h_ptr, e64, row_start, row_end, tile,
                          num_tokens, 2 * inter, hidden, swiglu_limit, stride_xm, stride_w13e, stride_w13n,
                          stride_s13e, stride_s13n, stride_g13e, stride_g13n, stride_hm,
                          ROWS, BLOCK_N, BLOCK_K, EVEN_H, HAS_LIMIT, INTERPRET)
            if PHASE == 0:
                tl.debug_barrier()  # every thread's h stores precede the release
                tl.atomic_add(cnt_ptr + expert, 1, sem="release", scope="gpu")
        else:
            if PHASE == 0:
                _spin_until(cnt_ptr + expert, n_tiles1, INTERPRET)
            _down_item(h32_ptr, row_index_ptr, inv_perm_ptr, weights_ptr,
                       w2_ptr, s2_ptr, g2_ptr, y_ptr, out_ptr, tcnt_ptr, e64, row_start, row_end, tile,
                       total_rows, num_tokens, n_tiles2, hidden, inter, stride_hm // 2, stride_w2e, stride_w2n,
                       stride_s2e, stride_s2n, stride_g2e, stride_g2n, stride_ym, stride_wt, stride_om,
                       SLOTS, S_PAD, ROWS, BLOCK_N, BLOCK_K, EVEN_I, INTERPRET)
        i += num_programs
    if PHASE == 0:
        # the last program to finish (all of its waits done, as every other's) zeroes the expert counters
        tl.debug_barrier()
        done = tl.atomic_add(cnt_ptr + num_groups, 1, sem="acq_rel", scope="gpu")
        if done == num_programs - 1:
            tl.store(cnt_ptr + lane, 0, mask=in_g)
            tl.store(cnt_ptr + num_groups, 0)


def launch_moe_fused_decode(
    x: torch.Tensor,
    w13_data: torch.Tensor, w13_scale: torch.Tensor, w13_gs: torch.Tensor,
    w2_data: torch.Tensor, w2_scale: torch.Tensor, w2_gs: torch.Tensor,
    expert_offsets: torch.Tensor, row_index: torch.Tensor, inv_perm: torch.Tensor, topk_weights: torch.Tensor,
    h: torch.Tensor, y: torch.Tensor, counters: torch.Tensor, out: torch.Tensor, *,
    swiglu_limit: float | None, interpreter: bool = False, phases: int = 1, config=None,
    num_programs: int | None = None,
) -> torch.Tensor:
    """Launch the fused decode MoE (inputs validated by ``megamoe.ops.moe_fused_decode``).

    x (T, H) bf16; w13_* the interleaved (G, 2I, H) NVFP4 parts (data uint8 (G, 2I, H/2), block scale e4m3
    (G, 2I, H/16), global scale 0-d / (G, 1, 1) / (G, 2I, 1)); w2_* (G, H, I); expert_offsets (G,) int32;
    row_index (>= T*S,) int32; inv_perm (T*S,) int32; topk_weights (T, S) fp32 (unit column stride);
    h (>= T*S, I) bf16 and y (>= T*S, H) fp32 workspaces; counters (>= :func:`counter_slots`) int32 zeros;
    out (T, H) bf16. phases: 1 (one launch, PHASE 0) or 2 (PHASE 1 then PHASE 2; forced by ``interpreter``
    unless ``num_programs == 1``: one program does every phase-1 item before its first wait, so the single-launch
    code runs under the interpreter too). num_programs: override the grid (tests; must stay <= the resident
    programs for one launch).
    """
    num_tokens, slots = topk_weights.shape
    hidden, inter = x.shape[1], w2_data.shape[-1] * 2
    num_groups = expert_offsets.shape[0]
    if num_tokens == 0:
        return out
    rows, block_n, block_k, num_warps, maxnreg = tuple(config or select_config(num_tokens, interpreter))
    if interpreter and not (phases == 1 and num_programs == 1):
        phases = 2  # programs run one after another: a spin would hang (one program: its waits pass at once)
    stride_g13e, stride_g13n = global_scale_strides(w13_gs, True)
    stride_g2e, stride_g2n = global_scale_strides(w2_gs, True)
    w13_32, w2_32 = w13_data.view(torch.int32), w2_data.view(torch.int32)
    s13, s2 = w13_scale.view(torch.uint8), w2_scale.view(torch.uint8)
    n_tiles1, n_tiles2 = triton.cdiv(2 * inter, block_n), triton.cdiv(hidden, block_n)
    touched_bound = min(num_groups, num_tokens * slots)
    items_bound = touched_bound * (n_tiles1 + n_tiles2)
    consts = dict(SLOTS=slots, S_PAD=triton.next_power_of_2(slots), ROWS=rows, BLOCK_N=block_n, BLOCK_K=block_k,
                  BLOCK_E=max(triton.next_power_of_2(num_groups), 32 * num_warps),
                  EVEN_H=hidden % block_k == 0, EVEN_I=inter % block_k == 0, HAS_LIMIT=swiglu_limit is not None,
                  INTERPRET=interpreter, num_warps=num_warps)
    if maxnreg is not None and not interpreter:
        consts["maxnreg"] = maxnreg

    def arguments(programs):
        return (x.view(torch.int32), row_index, expert_offsets, inv_perm, topk_weights,
                w13_32, s13, w13_gs, w2_32, s2, w2_gs, h, h.view(torch.int32), y, out, counters,
                num_tokens, num_groups, hidden, inter, programs,
                float(swiglu_limit) if swiglu_limit is not None else 0.0,
                x.stride(0) // 2, w13_32.stride(0), w13_32.stride(1), s13.stride(0), s13.stride(1),
                stride_g13e, stride_g13n, w2_32.stride(0), w2_32.stride(1), s2.stride(0), s2.stride(1),
                stride_g2e, stride_g2n, h.stride(0), y.stride(0), topk_weights.stride(0), out.stride(0))

    if interpreter:
        programs = num_programs or INTERPRETER_PROGRAMS
    else:
        resident = compiled_residency(_moe_fused_decode_kernel, (1,), arguments(1),
                                      dict(consts, PHASE=0 if phases == 1 else 1))
        programs = num_programs or min(items_bound, resident * _num_sms(x.device.index or 0))
    programs = max(1, programs)
    args = arguments(programs)
    if phases == 1:
        _moe_fused_decode_kernel[(programs,)](*args, PHASE=0, **consts)
    else:
        _moe_fused_decode_kernel[(programs,)](*args, PHASE=1, **consts)
        _moe_fused_decode_kernel[(programs,)](*args, PHASE=2, **consts)
    return out


def sm90_build(config=FUSED_DECODE_CONFIGS[16], *, slots=7, num_groups=257, phase=0, even=True,
               has_limit=True):
    """(signature, constexprs, num_warps) of an offline sm_90 build (tests/ops/sm90_compile.py's compile_sm90)."""
    rows, block_n, block_k, num_warps, _ = config
    consts = dict(SLOTS=slots, S_PAD=triton.next_power_of_2(slots), ROWS=rows, BLOCK_N=block_n, BLOCK_K=block_k,
                  BLOCK_E=max(triton.next_power_of_2(num_groups), 32 * num_warps), EVEN_H=even, EVEN_I=even,
                  HAS_LIMIT=has_limit, PHASE=phase, INTERPRET=False)
    return kernel_signature(), consts, num_warps


def kernel_signature() -> dict:
    """The runtime arguments' types (offline compiles)."""
    ptrs = dict(x32_ptr="*i32", row_index_ptr="*i32", offsets_ptr="*i32", inv_perm_ptr="*i32", weights_ptr="*fp32",
                w13_ptr="*i32", s13_ptr="*u8", g13_ptr="*fp32", w2_ptr="*i32", s2_ptr="*u8", g2_ptr="*fp32",
                h_ptr="*bf16", h32_ptr="*i32", y_ptr="*fp32", out_ptr="*bf16", cnt_ptr="*i32")
    scalars = ["num_tokens", "num_groups", "hidden", "inter", "num_programs"]
    strides = ["stride_xm", "stride_w13e", "stride_w13n", "stride_s13e", "stride_s13n", "stride_g13e",
               "stride_g13n", "stride_w2e", "stride_w2n", "stride_s2e", "stride_s2n", "stride_g2e", "stride_g2n",
               "stride_hm", "stride_ym", "stride_wt", "stride_om"]
    return dict(ptrs, **{s: "i32" for s in scalars}, swiglu_limit="fp32", **{s: "i32" for s in strides})
