"""Benchmark the NVFP4 GEMMs against the bf16 PyTorch path and the two rooflines.

DeepSeek-V4 expert shapes: hidden 7168, expert intermediate 2048, 256 experts,
top-8 routing; gate_up is (E, N=4096, K=7168), down is (E, N=7168, K=2048).
For each token count (1, 8, 64, 512, 4096, 16384) the routed rows T = 8 *
tokens are sorted by expert and timed with ``triton.testing.do_bench``
(median) for:

* ``nvfp4``: ``megamoe.ops.nvfp4_grouped_mm`` (w4a16);
* ``nvfp4_swiglu`` (gate_up only): the same with the fused SwiGLU epilogue;
* ``bf16``: ``torch._grouped_mm`` on the dequantized bf16 weights;
* up to 64 tokens, the NVFP4 kernels called directly: the Triton tensor-core
  GEMM (``nvfp4_gemm``), the CUDA-core decode kernel (``nvfp4_gemv``) and the
  Gluon tensor-core decode kernel (``nvfp4_mma_decode``, up to 512 tokens),
  and which one the op routes to; ``--gemv-tune`` / ``--mma-tune`` sweep the
  decode kernels' configs, ``--dense`` adds dense decode GEMMs (M <= 16)
  against ``F.linear``;
* HBM roofline: bytes of the *touched* experts' weights + scales + activations
  in + outputs / 3.0 TB/s; tensor-core roofline: 2*T*N*K / 749 TFLOP/s.

Input sets are rotated (several x buffers) so that L2 does not flatter the
small cases; weights are far larger than L2 anyway.

Writes ``benchmarks/results/gemm_<date>.json``, ``gemm_<date>.md`` and
``gemm_<date>.png`` (roofline plot), or the paths given. ``--tune`` also
sweeps the config candidates below per shape and records the best.

``--dense-splitk`` runs only the dense split-K comparison instead: the issue shapes (N x K) at
M = 1, 8, 16, 32, 64, 128, 256, each timed as CUDA-graph replay (32 calls per graph over > 96 MB of
weight copies): the split-K kernel, the route the op took before it, bf16 ``F.linear``, the HBM floor
and the % of it; ``--splitk-sweep`` adds the two-launch reduction, split counts 1..32 and the
alternative configs of ``SPLITK_SWEEP_CONFIGS`` and prints the best knob per shape; writes
``gemm_dense_splitk_<date>.{json,md}`` (``--tag`` names them, e.g. ``gemm_dense_v13``).

``--w4a8`` runs only the W4A8 comparison instead (issue 13): V4-Flash (4096 / 16384 tokens) and V4-Pro
(4096 / 8192 tokens) expert shapes, uniform top-k routing, gate_up with the fused SwiGLU and down, each
timed as ``nvfp4_grouped_mm`` in w4a16 and in w4a8 (FP8 quantizer + W4A8 kernel), plus the W4A8 kernel
alone (pre-quantized activations); TFLOP/s, the w4a8 / w4a16 speedup, and the error of each mode against
the float32 w4a16 product; writes ``gemm_w4a8_<date>.{json,md}`` (``--tag`` names them).

Run:  PYTHONUNBUFFERED=1 python benchmarks/bench_gemm.py [--tune] [--gemv-tune] [--dense] [--tokens 1 8 ...] [--out-dir DIR]
      python benchmarks/bench_gemm.py --plot-only results/gemm_X.json   (redraw the PNG)
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # run from a checkout

HBM_BYTES_PER_S = 3.0e12
BF16_FLOPS = 749e12
HIDDEN, INTER, EXPERTS, TOPK = 7168, 2048, 256, 8
PROJECTIONS = {"gate_up": (2 * INTER, HIDDEN), "down": (HIDDEN, INTER)}
TOKENS = (1, 8, 64, 512, 4096, 16384)

# Config candidates for --tune:
# (BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages, programs_per_sm, split_even_odd)
DECODE_CANDIDATES = [
    (16, 64, 128, 4, 3, 4, True),
    (16, 64, 128, 4, 3, 4, False),
    (16, 128, 64, 4, 3, 4, False),
    (32, 64, 128, 4, 3, 4, True),
]
# Decode kernel (megamoe/kernels/gemm/nvfp4_gemv.py) candidates for --gemv-tune:
# (ROWS, BLOCK_N, BLOCK_K, num_warps, num_stages, maxnreg)
GEMV_CANDIDATES = [
    (1, 64, 256, 4, 1, 128),
    (1, 64, 256, 4, 1, None),
    (1, 32, 256, 2, 1, 128),
    (1, 64, 512, 8, 1, 128),
    (2, 64, 256, 4, 1, 168),
    (2, 64, 256, 4, 1, None),
    (2, 64, 128, 4, 1, None),
    (2, 32, 256, 2, 1, None),
    (4, 32, 128, 2, 1, None),
]
# Gluon tensor-core decode kernel (megamoe/kernels/gemm/nvfp4_mma_decode.py) candidates for --mma-tune:
# (BLOCK_M, BLOCK_N, BLOCK_K, num_warps)
MMA_CANDIDATES = [
    (8, 128, 256, 4),
    (8, 64, 256, 4),
    (8, 128, 128, 4),
    (16, 128, 256, 4),
    (16, 128, 128, 4),
    (32, 128, 128, 4),
]
MMA_MAX_TOKENS = 512  # the Gluon decode kernel is timed up to this many tokens
# dense (nvfp4_linear) decode shapes: more, smaller programs (a dense GEMM has only N / BLOCK_N of them)
MMA_DENSE_CANDIDATES = [
    (8, 128, 256, 4),
    (8, 64, 256, 4),
    (8, 32, 256, 2),
    (8, 16, 256, 1),
    (8, 16, 128, 1),
    (16, 32, 256, 2),
]
# Gluon wgmma (prefill) kernel candidates for --wgmma-tune: (BLOCK_M, BLOCK_N, BLOCK_K, num_warps, programs per SM)
WGMMA_CANDIDATES = [
    (128, 128, 128, 8, 1),
    (128, 128, 64, 8, 1),
    (64, 128, 128, 8, 1),
    (128, 64, 128, 4, 2),
    (64, 64, 128, 4, 2),
]
WGMMA_MIN_TOKENS = 64  # the Gluon wgmma kernel is timed from this many tokens
DENSE_SHAPES = ((4096, 7168), (7168, 2048))  # (N, K) of dense decode GEMMs timed with --dense
DENSE_ROWS = (1, 2, 4, 8, 16)
GEMV_MAX_TOKENS = 64  # the decode kernel is timed up to this many tokens
PREFILL_CANDIDATES = [
    (128, 128, 128, 8, 3, 1, False),
    (256, 128, 64, 8, 3, 1, False),
    (128, 128, 128, 8, 3, 1, True),
]


class Progress:
    """tqdm when available, else a plain text bar on stderr."""

    def __init__(self, total: int, desc: str):
        try:
            from tqdm import tqdm

            self._bar = tqdm(total=total, desc=desc, file=sys.stderr)
        except ImportError:
            self._bar = None
        self.total, self.done, self.desc = total, 0, desc

    def update(self, note: str = ""):
        self.done += 1
        if self._bar is not None:
            self._bar.set_postfix_str(note)
            self._bar.update(1)
        else:
            filled = int(30 * self.done / self.total)
            print(f"\r{self.desc} [{'#' * filled}{'.' * (30 - filled)}] {self.done}/{self.total} {note}",
                  end="" if self.done < self.total else "\n", file=sys.stderr, flush=True)


def route(tokens: int, generator: torch.Generator):
    """Uniform top-8-of-256 routing -> per-expert row counts (host) for T = 8 * tokens rows."""
    scores = torch.rand(tokens, EXPERTS, generator=generator)
    experts = scores.topk(TOPK, dim=1).indices.flatten()
    return torch.bincount(experts, minlength=EXPERTS)


def make_weights(n: int, k: int, device):
    """Random NVFP4 (E, N, K) weights built directly in the packed format (fast, no quantize pass)."""
    from megamoe.format.tensor import NVFP4Tensor

    data = torch.randint(0, 256, (EXPERTS, n, k // 2), dtype=torch.uint8, device=device)
    scale_bytes = torch.randint(0x20, 0x48, (EXPERTS, n, k // 16), dtype=torch.uint8, device=device)
    gs = (torch.rand(EXPERTS, 1, 1, device=device) + 0.5) * 1e-3
    return NVFP4Tensor(data, scale_bytes.view(torch.float8_e4m3fn), gs, (EXPERTS, n, k))


def dequantize_bf16(w):
    from megamoe.format.tensor import NVFP4Tensor
    from megamoe.reference.quantize import dequantize

    out = torch.empty(w.shape, dtype=torch.bfloat16, device=w.device)
    for e in range(w.shape[0]):  # one expert at a time: the float32 temporaries stay small
        out[e] = dequantize(NVFP4Tensor(w.data[e], w.block_scale[e], w.global_scale[e], w.shape[1:]), torch.bfloat16)
    return out


def rooflines(counts: torch.Tensor, n: int, k: int, out_cols: int):
    rows = int(counts.sum())
    touched = int((counts > 0).sum())
    weight_bytes = touched * (n * k // 2 + n * k // 16 + 4)
    act_bytes = rows * k * 2 + rows * out_cols * 2 + EXPERTS * 4
    hbm_s = (weight_bytes + act_bytes) / HBM_BYTES_PER_S
    bf16_hbm_s = (touched * n * k * 2 + act_bytes) / HBM_BYTES_PER_S
    flop_s = 2.0 * rows * n * k / BF16_FLOPS
    return dict(rows=rows, touched_experts=touched, hbm_bytes=weight_bytes + act_bytes,
                hbm_roofline_us=hbm_s * 1e6, bf16_hbm_roofline_us=bf16_hbm_s * 1e6,
                tc_roofline_us=flop_s * 1e6, flops=2.0 * rows * n * k)


def sweep(tuning, name, candidates, launch, proj, tokens, rep):
    """Time ``launch(cfg)`` for every candidate; record each in ``tuning``; return (best config, us)."""
    best = None
    for cfg in candidates:
        try:
            launch(cfg)
            us = bench(lambda cfg=cfg: launch(cfg), rep)
        except Exception as exc:  # noqa: BLE001 (a config that does not compile or fit)
            us = float("inf")
            print(f"\n  {name} config {cfg} failed: {type(exc).__name__}: {str(exc)[:200]}", file=sys.stderr)
        tuning.append(dict(projection=proj, tokens=tokens, kernel=name, config=list(cfg), us=us))
        if best is None or us < best[1]:
            best = (cfg, us)
    return list(best[0]), best[1]


def bench(fn, rep_ms: int):
    import triton.testing

    return triton.testing.do_bench(fn, warmup=max(5, rep_ms // 4), rep=rep_ms, return_mode="median") * 1e3  # us


def run(args):
    import triton

    from megamoe.kernels.gemm import nvfp4_gemm as kern, nvfp4_gemv as gemv, nvfp4_mma_decode as mma, nvfp4_wgmma as wgmma
    from megamoe.kernels.gemm.nvfp4_gluon_jit import gluon_supports
    from megamoe.ops.gemm import decode_route, interleave_gate_up, nvfp4_grouped_mm

    device = torch.device("cuda")
    gen = torch.Generator().manual_seed(0)
    records, tuning = [], []
    steps = len(PROJECTIONS) * len(args.tokens)
    progress = Progress(steps, "gemm bench")
    for proj, (n, k) in PROJECTIONS.items():
        w = make_weights(n, k, device)
        w_bf16 = dequantize_bf16(w)
        w_bf16_t = w_bf16.transpose(1, 2)  # (E, K, N) view for torch._grouped_mm
        wi = interleave_gate_up(w) if proj == "gate_up" else None
        for tokens in args.tokens:
            counts = route(tokens, gen)
            offsets = counts.cumsum(0).to(torch.int32).to(device)
            t = int(counts.sum())
            n_sets = max(2, min(8, int(2e8 // max(1, t * k * 2))))  # rotate inputs where they are small
            xs = [torch.randn(t, k, device=device).bfloat16() for _ in range(n_sets)]
            out = torch.empty(t, n, dtype=torch.bfloat16, device=device)
            out_sw = torch.empty(t, n // 2, dtype=torch.bfloat16, device=device)
            it = [0]

            def next_x():
                it[0] = (it[0] + 1) % n_sets
                return xs[it[0]]

            rep = args.rep_ms if t < 20000 else max(args.rep_ms, 200)
            rec = dict(projection=proj, tokens=tokens, n=n, k=k)
            rec.update(rooflines(counts, n, k, n))

            # correctness spot check of this exact problem against the bf16 path
            ref = torch._grouped_mm(xs[0], w_bf16_t, offs=offsets)
            got = nvfp4_grouped_mm(xs[0], w, offsets)
            rec["rel_err_vs_bf16_path"] = ((got.float() - ref.float()).norm() / ref.float().norm()).item()

            if args.tune:
                rows_per_expert = max(1, t // EXPERTS)
                cands = DECODE_CANDIDATES if rows_per_expert <= 32 else PREFILL_CANDIDATES
                best = None
                for cfg in cands:
                    try:
                        fn = lambda cfg=cfg: kern.launch_nvfp4_gemm(  # noqa: E731
                            next_x(), w.data, w.block_scale, w.global_scale, out,
                            expert_offsets=offsets, config=cfg)
                        fn()
                        us = bench(fn, rep)
                    except Exception as exc:  # noqa: BLE001 (a config that does not compile/fit)
                        us = float("inf")
                        print(f"\n  config {cfg} failed: {type(exc).__name__}: {str(exc)[:200]}", file=sys.stderr)
                    tuning.append(dict(projection=proj, tokens=tokens, config=list(cfg), us=us))
                    if best is None or us < best[1]:
                        best = (cfg, us)
                rec["tuned_best_config"], rec["tuned_best_us"] = list(best[0]), best[1]

            if tokens <= GEMV_MAX_TOKENS:
                # both kernels called directly (whatever the op routes to), same inputs
                rec["tc_us"] = bench(lambda: kern.launch_nvfp4_gemm(
                    next_x(), w.data, w.block_scale, w.global_scale, out, expert_offsets=offsets), rep)
                got_v = gemv.launch_nvfp4_gemv(xs[0], w.data, w.block_scale, w.global_scale, out,
                                               expert_offsets=offsets)
                rec["gemv_rel_err_vs_bf16_path"] = ((got_v.float() - ref.float()).norm() / ref.float().norm()).item()
                rec["gemv_us"] = bench(lambda: gemv.launch_nvfp4_gemv(
                    next_x(), w.data, w.block_scale, w.global_scale, out, expert_offsets=offsets), rep)
                rec["gemv_config"] = list(gemv.select_gemv_config(
                    triton.cdiv(t, min(EXPERTS, t)), False))
                if wi is not None:
                    rec["gemv_swiglu_us"] = bench(lambda: gemv.launch_nvfp4_gemv(
                        next_x(), wi.data, wi.block_scale, wi.global_scale, out_sw, expert_offsets=offsets,
                        swiglu=True, swiglu_limit=10.0), rep)
                if args.gemv_tune:
                    rec["gemv_best_config"], rec["gemv_best_us"] = sweep(
                        tuning, "gemv", GEMV_CANDIDATES, lambda cfg: gemv.launch_nvfp4_gemv(
                            next_x(), w.data, w.block_scale, w.global_scale, out, expert_offsets=offsets,
                            config=cfg), proj, tokens, rep)
            if tokens <= MMA_MAX_TOKENS and gluon_supports(xs[0], w.data):
                got_m = mma.launch_nvfp4_mma_decode(xs[0], w.data, w.block_scale, w.global_scale, out,
                                                    expert_offsets=offsets)
                rec["mma_rel_err_vs_bf16_path"] = ((got_m.float() - ref.float()).norm() / ref.float().norm()).item()
                rec["mma_us"] = bench(lambda: mma.launch_nvfp4_mma_decode(
                    next_x(), w.data, w.block_scale, w.global_scale, out, expert_offsets=offsets), rep)
                rec["mma_config"] = list(mma.select_mma_decode_config(triton.cdiv(t, min(EXPERTS, t)), k))
                rec.setdefault("tc_us", float("nan"))
                rec.setdefault("gemv_us", float("nan"))
                if wi is not None:
                    rec["mma_swiglu_us"] = bench(lambda: mma.launch_nvfp4_mma_decode(
                        next_x(), wi.data, wi.block_scale, wi.global_scale, out_sw, expert_offsets=offsets,
                        swiglu=True, swiglu_limit=10.0), rep)
                if args.mma_tune:
                    rec["mma_best_config"], rec["mma_best_us"] = sweep(
                        tuning, "mma", MMA_CANDIDATES, lambda cfg: mma.launch_nvfp4_mma_decode(
                            next_x(), w.data, w.block_scale, w.global_scale, out, expert_offsets=offsets,
                            config=cfg), proj, tokens, rep)
            if tokens >= WGMMA_MIN_TOKENS and gluon_supports(xs[0], w.data):
                got_w = wgmma.launch_nvfp4_wgmma(xs[0], w.data, w.block_scale, w.global_scale, out,
                                               expert_offsets=offsets)
                rec["wgmma_rel_err_vs_bf16_path"] = ((got_w.float() - ref.float()).norm() / ref.float().norm()).item()
                rec["wgmma_us"] = bench(lambda: wgmma.launch_nvfp4_wgmma(
                    next_x(), w.data, w.block_scale, w.global_scale, out, expert_offsets=offsets), rep)
                if "tc_us" not in rec:  # the Triton tensor-core kernel on the same problem, for the crossover
                    rec["tc_us"] = bench(lambda: kern.launch_nvfp4_gemm(
                        next_x(), w.data, w.block_scale, w.global_scale, out, expert_offsets=offsets), rep)
                if wi is not None:
                    rec["wgmma_swiglu_us"] = bench(lambda: wgmma.launch_nvfp4_wgmma(
                        next_x(), wi.data, wi.block_scale, wi.global_scale, out_sw, expert_offsets=offsets,
                        swiglu=True, swiglu_limit=10.0), rep)
                if args.wgmma_tune:
                    rec["wgmma_best_config"], rec["wgmma_best_us"] = sweep(
                        tuning, "wgmma", WGMMA_CANDIDATES, lambda cfg: wgmma.launch_nvfp4_wgmma(
                            next_x(), w.data, w.block_scale, w.global_scale, out, expert_offsets=offsets,
                            config=cfg), proj, tokens, rep)
            rec["route"] = decode_route(xs[0], w.data, t, EXPERTS, n, k)
            rec["nvfp4_us"] = bench(lambda: nvfp4_grouped_mm(next_x(), w, offsets, out=out), rep)
            if wi is not None:
                rec["nvfp4_swiglu_us"] = bench(
                    lambda: nvfp4_grouped_mm(next_x(), wi, offsets, out=out_sw, activation="swiglu", swiglu_limit=10.0),
                    rep)
            rec["bf16_grouped_mm_us"] = bench(lambda: torch._grouped_mm(next_x(), w_bf16_t, offs=offsets), rep)
            rec["config"] = list(kern.select_config(max(1, t // EXPERTS), False))
            rec["hbm_roofline_fraction"] = rec["hbm_roofline_us"] / rec["nvfp4_us"]
            rec["speedup_vs_bf16"] = rec["bf16_grouped_mm_us"] / rec["nvfp4_us"]
            rec["nvfp4_tflops"] = rec["flops"] / rec["nvfp4_us"] / 1e6
            rec["bf16_tflops"] = rec["flops"] / rec["bf16_grouped_mm_us"] / 1e6
            records.append(rec)
            progress.update(f"{proj} T={t}: {rec['nvfp4_us']:.1f}us vs bf16 {rec['bf16_grouped_mm_us']:.1f}us")
            del xs, out, out_sw
        del w, w_bf16, w_bf16_t, wi
        torch.cuda.empty_cache()

    dense = run_dense(args) if args.dense else []
    meta = dict(
        date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        device=torch.cuda.get_device_name(), torch=torch.__version__, triton=triton.__version__,
        python=platform.python_version(), command="python " + " ".join(sys.argv),
        hbm_tb_s=HBM_BYTES_PER_S / 1e12, bf16_tflops=BF16_FLOPS / 1e12,
        weight_bytes_nvfp4_per_expert_gate_up=4096 * 7168 * 9 // 16,
        weight_bytes_bf16_per_expert_gate_up=4096 * 7168 * 2,
    )
    return dict(meta=meta, records=records, tuning=tuning, dense=dense)


def run_dense(args):
    """Dense decode GEMMs: tensor-core kernel vs decode kernel (both direct), the op, bf16 F.linear."""
    from megamoe.format.tensor import NVFP4Tensor
    from megamoe.kernels.gemm import nvfp4_gemm as kern, nvfp4_gemv as gemv, nvfp4_mma_decode as mma
    from megamoe.ops.gemm import decode_route, nvfp4_linear
    from megamoe.reference.quantize import dequantize

    device = torch.device("cuda")
    rows = []
    for n, k in DENSE_SHAPES:
        data = torch.randint(0, 256, (n, k // 2), dtype=torch.uint8, device=device)
        sb = torch.randint(0x20, 0x48, (n, k // 16), dtype=torch.uint8, device=device).view(torch.float8_e4m3fn)
        w = NVFP4Tensor(data, sb, torch.tensor(1e-3, device=device), (n, k))
        w_bf16 = dequantize(w, torch.bfloat16)
        for m in DENSE_ROWS:
            xs = [torch.randn(m, k, device=device).bfloat16() for _ in range(4)]
            out = torch.empty(m, n, dtype=torch.bfloat16, device=device)
            it = [0]

            def next_x():
                it[0] = (it[0] + 1) % len(xs)
                return xs[it[0]]

            ref = torch.nn.functional.linear(xs[0], w_bf16).float()
            got = gemv.launch_nvfp4_gemv(xs[0], data, sb, w.global_scale, out).float()
            roof = dense_floor_us(n, m, k)
            rows.append(dict(
                n=n, k=k, m=m, hbm_roofline_us=roof,
                gemv_rel_err_vs_bf16=((got - ref).norm() / ref.norm()).item(),
                tc_us=bench(lambda: kern.launch_nvfp4_gemm(next_x(), data, sb, w.global_scale, out), args.rep_ms),
                gemv_us=bench(lambda: gemv.launch_nvfp4_gemv(next_x(), data, sb, w.global_scale, out), args.rep_ms),
                mma_us=bench(lambda: mma.launch_nvfp4_mma_decode(next_x(), data, sb, w.global_scale, out),
                             args.rep_ms),
                mma_sweep={str(cfg): bench(lambda cfg=cfg: mma.launch_nvfp4_mma_decode(
                    next_x(), data, sb, w.global_scale, out, config=cfg), args.rep_ms)
                    for cfg in (MMA_DENSE_CANDIDATES if args.mma_tune else [])},
                op_us=bench(lambda: nvfp4_linear(next_x(), w, out=out), args.rep_ms),
                bf16_us=bench(lambda: torch.nn.functional.linear(next_x(), w_bf16), args.rep_ms),
                route=decode_route(xs[0], data, m, None, n, k),
            ))
        del data, sb, w, w_bf16
    return rows


SPLITK_SHAPES = [(4096, 4096), (1024, 4096), (18432, 7168), (32768, 1024), (4096, 8192)]  # (N, K)
SPLITK_ROWS = (1, 8, 16, 32, 64, 128, 256)
SPLITK_SWEEP_SPLITS = (1, 2, 4, 8, 16, 32)
# --splitk-sweep: alternative configs per M (kind, BLOCK_M, BLOCK_N, BLOCK_K, num_warps, programs_per_sm, maxnreg),
# each at its planned split count; the default config also at every count of SPLITK_SWEEP_SPLITS.
SPLITK_SWEEP_CONFIGS = {
    1: [("fma", 1, 64, 256, 4, 2, 128), ("fma", 1, 64, 256, 4, 8, 128), ("fma", 1, 32, 256, 2, 8, 128)],
    8: [("mma", 8, 128, 256, 4, 6, None), ("mma", 8, 64, 256, 4, 4, None), ("wgmma", 32, 64, 128, 4, 3, None)],
    16: [("mma", 16, 128, 128, 4, 4, None), ("wgmma", 32, 64, 128, 4, 3, None)],
    32: [("wgmma", 32, 64, 128, 4, 4, None), ("wgmma", 32, 64, 128, 4, 2, None), ("mma", 32, 128, 128, 4, 2, None)],
    64: [("wgmma", 64, 64, 128, 4, 3, None), ("wgmma", 64, 64, 128, 4, 1, None), ("wgmma", 64, 128, 128, 8, 1, None),
         ("wgmma", 32, 64, 128, 4, 3, None)],
    128: [("wgmma", 64, 64, 128, 4, 2, None), ("wgmma", 128, 128, 128, 8, 2, None)],
    256: [("wgmma", 64, 64, 128, 4, 2, None), ("wgmma", 128, 128, 128, 8, 2, None)],
}
GRAPH_CALLS = 32  # calls per captured graph (the per-call time is the replay time / GRAPH_CALLS)
GRAPH_BYTES = 96 << 20  # weight copies cycled inside a graph: at least this many bytes (> the 50 MB L2)


def _graph_time(make_call, copies: int, rep_ms: int) -> float:
    """us per call: GRAPH_CALLS calls (cycling over ``copies`` weight copies) captured in one CUDA graph,
    ``do_bench`` median of the replay (L2 flushed before each replay) / GRAPH_CALLS."""
    calls = [make_call(i % copies) for i in range(GRAPH_CALLS)]
    for call in calls[:copies]:  # compile / warm up outside the capture
        call()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for call in calls:
            call()
    return bench(graph.replay, rep_ms) / GRAPH_CALLS


def dense_floor_us(n: int, m: int, k: int) -> float:
    """HBM floor of a dense (M, K) x (N, K)^T NVFP4 GEMM in us: weights + scales + bf16 activations in and out."""
    return (n * k * 9 // 16 + m * (k + n) * 2) / HBM_BYTES_PER_S * 1e6


def dense_weight_copies(n: int, k: int, device):
    """Random (N, K) NVFP4 weights, enough copies to cycle >= GRAPH_BYTES in a graph, and their bf16 dequantisations
    (again >= GRAPH_BYTES): (NVFP4 copies, bf16 copies)."""
    from megamoe.format.tensor import NVFP4Tensor
    from megamoe.reference.quantize import dequantize

    copies = max(1, min(GRAPH_CALLS, -(-GRAPH_BYTES // (n * k * 9 // 16))))
    ws = []
    for _ in range(copies):
        data = torch.randint(0, 256, (n, k // 2), dtype=torch.uint8, device=device)
        sb = torch.randint(0x20, 0x48, (n, k // 16), dtype=torch.uint8, device=device).view(torch.float8_e4m3fn)
        ws.append(NVFP4Tensor(data, sb, torch.full((n, 1), 1e-3, device=device), (n, k)))
    bf16_copies = max(1, min(GRAPH_CALLS, -(-GRAPH_BYTES // (2 * n * k))))
    return ws, [dequantize(ws[i % copies], torch.bfloat16) for i in range(bf16_copies)]


def timed_checked(times: dict, name: str, make_call, copies: int, rep_ms: int, ref=None, max_rel_err: float = 1e-2):
    """times[name] = :func:`_graph_time` of ``make_call`` (us per call), after checking ``make_call(0)()`` against
    ``ref`` (relative Frobenius error < ``max_rel_err``; None: unchecked); a wrong result or a config the shape cannot
    take is recorded as a string, not raised (sweeps go on)."""
    try:
        if ref is not None:
            got = make_call(0)().float()
            err = ((got - ref).norm() / ref.norm()).item()
            if not err < max_rel_err:
                times[name] = f"wrong: rel err {err:.2e}"
                return
        times[name] = _graph_time(make_call, copies, rep_ms)
    except Exception as e:  # noqa: BLE001 - a config the shape cannot take: report, go on
        times[name] = f"{type(e).__name__}: {str(e)[:100]}"


def dense_sweep_case(ws: list, n: int, k: int, m: int, device):
    """One (N, K, M) point of a dense sweep over the weight copies ``ws`` (:func:`dense_weight_copies`): (x (M, K) bf16,
    out (M, N) bf16, the op's float result on ``ws[0]`` as the reference, the row dict {n, k, m, floor_us, times})."""
    from megamoe.ops import gemm as ops_gemm

    x = torch.randn(m, k, device=device).bfloat16()
    out = torch.empty(m, n, dtype=torch.bfloat16, device=device)
    ref = ops_gemm.nvfp4_linear(x, ws[0]).float()
    return x, out, ref, dict(n=n, k=k, m=m, floor_us=dense_floor_us(n, m, k), times={})


def sweep_meta(t0: float) -> dict:
    """Date, device, versions, command and wall time of a sweep started at ``time.time()`` = ``t0``."""
    import triton

    return dict(date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                device=torch.cuda.get_device_name(), torch=torch.__version__, triton=triton.__version__,
                command="python " + " ".join(sys.argv), wall_s=round(time.time() - t0, 1))


def dense_sweep_table(rows: list) -> list:
    """Markdown table lines of dense sweep rows (dicts with n, k, m, floor_us and times {name: us or a string}):
    us per call and its % of the HBM floor."""
    names = list(rows[0]["times"])
    lines = ["| N x K | M | floor us | " + " | ".join(names) + " |", "|" + "---|" * (3 + len(names))]
    for r in rows:
        cells = []
        for name in names:
            v = r["times"].get(name)
            cells.append(f"{v:.1f} ({100 * r['floor_us'] / v:.0f}%)" if isinstance(v, float) else str(v))
        lines.append(f"| {r['n']}x{r['k']} | {r['m']} | {r['floor_us']:.1f} | " + " | ".join(cells) + " |")
    return lines


def run_dense_splitk(args):
    """Dense NVFP4 linear at M = 1..256: split-K kernel vs the previous route vs bf16 F.linear (graph replay)."""
    from megamoe.kernels.gemm import nvfp4_splitk as sk
    from megamoe.ops import gemm as ops_gemm

    device = torch.device("cuda")
    rows = []
    shapes = ([tuple(int(v) for v in shape.split("x")) for shape in args.splitk_shapes.split(",")]
              if args.splitk_shapes else SPLITK_SHAPES)
    for n, k in shapes:
        ws, w_bf16 = dense_weight_copies(n, k, device)
        copies, bf16_copies = len(ws), len(w_bf16)
        for m in ([int(v) for v in args.splitk_rows.split(",")] if args.splitk_rows else SPLITK_ROWS):
            x = torch.randn(m, k, device=device).bfloat16()
            out = torch.empty(m, n, dtype=torch.bfloat16, device=device)
            saved, sk.SPLITK_MAX_ROWS = sk.SPLITK_MAX_ROWS, 0  # the route the op took before split-K
            try:
                prev_name = ops_gemm.decode_route(x, ws[0].data, m, None, n, k)
            finally:
                sk.SPLITK_MAX_ROWS = saved
            prev_launch = ops_gemm._launcher(prev_name)

            def splitk(i, splits=None, config=None, fused=None):
                w = ws[i]
                return lambda: sk.launch_nvfp4_splitk(x, w.data, w.block_scale, w.global_scale, out, splits=splits,
                                                      config=config, fused=fused)

            def previous(i):
                w = ws[i]
                return lambda: prev_launch(x, w.data, w.block_scale, w.global_scale, out)

            ref = torch.nn.functional.linear(x, w_bf16[0]).float()
            got = sk.launch_nvfp4_splitk(x, ws[0].data, ws[0].block_scale, ws[0].global_scale, out).float()
            cfg = sk.select_splitk_config(m, False, True, n, k)
            m_tiles = -(-m // cfg[1]) if cfg[0] == "wgmma" else 1
            planned = sk.plan_splitk(m, n, k, cfg[2], cfg[3], max(1, sk._num_sms(0) * cfg[5] // m_tiles))[0]
            floor = dense_floor_us(n, m, k)
            row = dict(n=n, k=k, m=m, hbm_floor_us=floor, config=list(cfg), splits=planned,
                       rel_err_vs_bf16=((got - ref).norm() / ref.norm()).item(),
                       splitk_us=_graph_time(splitk, copies, args.rep_ms),
                       previous_route=prev_name,
                       previous_us=_graph_time(previous, copies, args.rep_ms),
                       bf16_us=_graph_time(lambda i: (lambda w=w_bf16[i]: torch.nn.functional.linear(x, w)),
                                           bf16_copies, args.rep_ms),
                       op_route=ops_gemm.decode_route(x, ws[0].data, m, None, n, k))
            if args.splitk_sweep:
                sweep = {"two-launch": _graph_time(lambda i: splitk(i, fused=False), copies, args.rep_ms)}
                for s in SPLITK_SWEEP_SPLITS:
                    sweep[f"splits={s}"] = _graph_time(lambda i, s=s: splitk(i, splits=s), copies, args.rep_ms)
                key = next(bound for bound in SPLITK_SWEEP_CONFIGS if m <= bound)
                for alt in SPLITK_SWEEP_CONFIGS[key]:
                    try:
                        sweep[str(alt)] = _graph_time(lambda i, c=alt: splitk(i, config=c), copies, args.rep_ms)
                    except Exception as e:  # noqa: BLE001 - a config the shape cannot take: report, go on
                        print(f"  sweep {alt}: {type(e).__name__}: {e}", flush=True)
                best = min(sweep, key=sweep.get)
                row["splits_sweep"] = sweep
                row["sweep_best"] = dict(knob=best, us=sweep[best], vs_default=row["splitk_us"] / sweep[best])
            row["pct_of_floor"] = 100 * floor / row["splitk_us"]
            rows.append(row)
            print(f"N={n:6d} K={k:5d} M={m:4d}  split-K {row['splitk_us']:8.1f} us ({cfg[0]} {cfg[1]}, splits {planned:2d}, "
                  f"{row['pct_of_floor']:5.1f}% of floor {floor:6.1f})  {prev_name} {row['previous_us']:8.1f}  "
                  f"bf16 {row['bf16_us']:8.1f} ({row['bf16_us'] / row['splitk_us']:.2f}x)  op->{row['op_route']}  "
                  f"err {row['rel_err_vs_bf16']:.1e}"
                  + (f"  best {row['sweep_best']['knob']} {row['sweep_best']['us']:.1f}" if args.splitk_sweep else ""),
                  flush=True)
        del ws, w_bf16
    return rows


def write_dense_splitk_markdown(rows, meta, path):
    lines = [f"# Dense NVFP4 linear, split-K ({meta['date']}, {meta['device']}, torch {meta['torch']}, "
             f"triton {meta['triton']})", "", f"Command: `{meta['command']}` (wall {meta.get('wall_s', '?')} s)", "",
             f"Graph replay: {GRAPH_CALLS} calls per CUDA graph over weight copies of >= {GRAPH_BYTES >> 20} MB "
             "(L2 flushed before each replay), do_bench median / calls. Floor: (N*K*9/16 + activations) / 3.0 TB/s.",
             "", "| N x K | M | split-K us | kind, rows | splits | % of floor | previous route | previous us | bf16 us "
             "| floor us | vs bf16 | op route |", "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['n']}x{r['k']} | {r['m']} | {r['splitk_us']:.1f} | {r['config'][0]} {r['config'][1]} "
                     f"| {r['splits']} | {r['pct_of_floor']:.0f}% "
                     f"| {r['previous_route']} | {r['previous_us']:.1f} | {r['bf16_us']:.1f} | {r['hbm_floor_us']:.1f} "
                     f"| {r['bf16_us'] / r['splitk_us']:.2f}x | {r['op_route']} |")
    if any("splits_sweep" in r for r in rows):
        lines += ["", "## --splitk-sweep: best knob per shape (default = the table config at its planned splits)", "",
                  "| N x K | M | default us | best knob | best us | default / best | two-launch us |",
                  "|---|---|---|---|---|---|---|"]
        for r in rows:
            if "sweep_best" in r:
                b = r["sweep_best"]
                lines.append(f"| {r['n']}x{r['k']} | {r['m']} | {r['splitk_us']:.1f} | {b['knob']} | {b['us']:.1f} "
                             f"| {b['vs_default']:.2f}x | {r['splits_sweep']['two-launch']:.1f} |")
    with open(path, "w") as f:
        f.write("\n".join(lines) + "\n")


W4A8_CASES = (("v4-flash", (4096, 16384)), ("v4-pro", (4096, 8192)))


def run_w4a8(args):
    """w4a16 vs w4a8 grouped GEMMs on the V4-Flash / V4-Pro expert shapes (issue 13); rows of records."""
    from megamoe.format.tensor import NVFP4Tensor
    from megamoe.kernels.fp8_act_quant import launch_fp8_act_quant
    from megamoe.kernels.gemm.nvfp4_w4a8 import launch_nvfp4_w4a8, select_w4a8_config
    from megamoe.kernels.gemm.nvfp4_w4a8_pipe import launch_nvfp4_w4a8_pipe, w4a8_pipe_supported
    from megamoe.models.config import PRESETS
    from megamoe.ops.gemm import interleave_gate_up, nvfp4_grouped_mm
    from megamoe.reference.quantize import dequantize

    device = torch.device("cuda")
    gen = torch.Generator().manual_seed(0)
    rows = []
    for preset, token_counts in W4A8_CASES:
        c = PRESETS[preset]
        e, h, i, topk = c.num_experts, c.hidden_size, c.intermediate_size, c.top_k
        for proj, (n, k) in (("gate_up", (2 * i, h)), ("down", (h, i))):
            data = torch.randint(0, 256, (e, n, k // 2), dtype=torch.uint8, device=device)
            scale_bytes = torch.randint(0x20, 0x48, (e, n, k // 16), dtype=torch.uint8, device=device)
            gs = (torch.rand(e, 1, 1, device=device) + 0.5) * 1e-3
            w = NVFP4Tensor(data, scale_bytes.view(torch.float8_e4m3fn), gs, (e, n, k))
            swiglu = proj == "gate_up"
            if swiglu:
                w = interleave_gate_up(w)
            n_out = n // 2 if swiglu else n
            act = dict(activation="swiglu", swiglu_limit=10.0) if swiglu else {}
            for tokens in token_counts:
                experts = torch.rand(tokens, e, generator=gen).topk(topk, dim=1).indices.flatten()
                counts = torch.bincount(experts, minlength=e)
                offsets = counts.cumsum(0).to(torch.int32).to(device)
                t = int(counts.sum())
                x = torch.randn(t, k, device=device).bfloat16()
                out = torch.empty(t, n_out, dtype=torch.bfloat16, device=device)
                xq = torch.empty(t, k, dtype=torch.float8_e4m3fn, device=device)
                xs = torch.empty(t, dtype=torch.float32, device=device)
                launch_fp8_act_quant(x, xq, xs)
                rep = max(args.rep_ms, 100)
                rec = dict(config=preset, projection=proj, tokens=tokens, rows=t, n=n, k=k, swiglu=swiglu,
                           flops=2.0 * t * n * k, w4a8_config=list(select_w4a8_config(max(1, t // e), False)))
                rec["w4a16_us"] = bench(lambda: nvfp4_grouped_mm(x, w, offsets, out=out, **act), rep)
                rec["w4a8_us"] = bench(lambda: nvfp4_grouped_mm(x, w, offsets, out=out, mode="w4a8", **act), rep)
                # the layer's default layout (Nvfp4MoE row_interleave 4): both modes read 4-row interleaved weights
                w_il = w.interleave_rows(4)
                rec["w4a16_il_us"] = bench(lambda: nvfp4_grouped_mm(x, w_il, offsets, out=out, **act), rep)
                rec["w4a8_il_us"] = bench(lambda: nvfp4_grouped_mm(x, w_il, offsets, out=out, mode="w4a8", **act),
                                          rep)
                rec["speedup_w4a8_vs_w4a16_il"] = rec["w4a16_il_us"] / rec["w4a8_il_us"]
                del w_il
                rec["w4a8_kernel_us"] = bench(lambda: launch_nvfp4_w4a8(
                    xq, xs, w.data, w.block_scale, w.global_scale, out, expert_offsets=offsets,
                    swiglu=swiglu, swiglu_limit=10.0 if swiglu else None), rep)
                rec["quantizer_us"] = bench(lambda: launch_fp8_act_quant(x, xq, xs), rep)
                keys = ["w4a16", "w4a8", "w4a8_kernel"]
                if w4a8_pipe_supported(x, w.data):  # w4a8 v2 alone, on activations quantized in its K order
                    xq2 = torch.empty_like(xq)
                    launch_fp8_act_quant(x, xq2, xs, mma_order=True)
                    rec["w4a8_pipe_kernel_us"] = bench(lambda: launch_nvfp4_w4a8_pipe(
                        xq2, xs, w.data, w.block_scale, w.global_scale, out, expert_offsets=offsets,
                        swiglu=swiglu, swiglu_limit=10.0 if swiglu else None), rep)
                    keys.append("w4a8_pipe_kernel")
                for key in keys:
                    rec[key + "_tflops"] = rec["flops"] / rec[key + "_us"] / 1e6
                rec["speedup_w4a8_vs_w4a16"] = rec["w4a16_us"] / rec["w4a8_us"]
                # error vs the float32 w4a16 product on the first rows of the busiest expert (cheap)
                top = int(counts.argmax())
                start = int(offsets[top - 1]) if top else 0
                sub = slice(start, start + min(256, int(counts[top])))
                w_e = dequantize(NVFP4Tensor(w.data[top], w.block_scale[top], w.global_scale[top], (n, k)),
                                 torch.float32)
                ref = x[sub].float() @ w_e.t()
                if swiglu:
                    gate, up = ref[:, 0::2].clamp(max=10.0), ref[:, 1::2].clamp(-10.0, 10.0)
                    ref = gate * torch.sigmoid(gate) * up
                for mode in ("w4a16", "w4a8"):
                    got = nvfp4_grouped_mm(x, w, offsets, mode=mode, **act)[sub].float()
                    rec[mode + "_rel_err_vs_f32"] = ((got - ref).norm() / ref.norm()).item()
                rows.append(rec)
                print(f"{preset} {proj} {tokens} tokens: w4a16 {rec['w4a16_us']:.1f} us "
                      f"({rec['w4a16_tflops']:.0f} TFLOP/s), w4a8 {rec['w4a8_us']:.1f} us "
                      f"({rec['w4a8_tflops']:.0f} TFLOP/s; v1 kernel {rec['w4a8_kernel_tflops']:.0f}, "
                      f"v2 kernel {rec.get('w4a8_pipe_kernel_tflops', 0):.0f}), "
                      f"{rec['speedup_w4a8_vs_w4a16']:.2f}x, err w4a8 {rec['w4a8_rel_err_vs_f32']:.2e}", flush=True)
                del x, out, xq, xs
            del w, data, scale_bytes
            torch.cuda.empty_cache()
    return rows


def write_w4a8_markdown(rows, meta, path):
    lines = ["# W4A8 vs W4A16 grouped GEMMs (issue 13)", "",
             f"- date: {meta['date']}; device: {meta['device']}; torch {meta['torch']}; triton {meta['triton']}",
             f"- command: `{meta['command']}`",
             "- w4a8 = FP8 quantizer + the W4A8 kernel the op routes to (v2, the pipelined kernel, where it applies); "
             "v1 / v2 kernel = that kernel alone on pre-quantized activations; "
             "TFLOP/s = 2*rows*N*K / time; errors vs the float32 w4a16 product (busiest expert, <= 256 rows); "
             "il = the same op on 4-row interleaved weights (the MoE layer's default layout)", "",
             "| config | proj | tokens | rows | w4a16 us | w4a8 us | v1 kernel us | v2 kernel us | quantizer us "
             "| w4a16 TFLOP/s | w4a8 TFLOP/s | v1 kernel TFLOP/s | v2 kernel TFLOP/s | w4a8 / w4a16 speedup | w4a16 err "
             "| w4a8 err | v1 config | w4a16 il us | w4a8 il us | w4a8 / w4a16, il |",
             "|" + "---|" * 20]
    for r in rows:
        lines.append(
            f"| {r['config']} | {r['projection']}{' +swiglu' if r['swiglu'] else ''} | {r['tokens']} | {r['rows']} "
            f"| {r['w4a16_us']:.1f} | {r['w4a8_us']:.1f} | {r['w4a8_kernel_us']:.1f} "
            f"| {r.get('w4a8_pipe_kernel_us', float('nan')):.1f} | {r['quantizer_us']:.1f} "
            f"| {r['w4a16_tflops']:.0f} | {r['w4a8_tflops']:.0f} | {r['w4a8_kernel_tflops']:.0f} "
            f"| {r.get('w4a8_pipe_kernel_tflops', float('nan')):.0f} "
            f"| {r['speedup_w4a8_vs_w4a16']:.2f}x | {r['w4a16_rel_err_vs_f32']:.1e} | {r['w4a8_rel_err_vs_f32']:.1e} "
            f"| {tuple(r['w4a8_config'])} | {r.get('w4a16_il_us', float('nan')):.1f} "
            f"| {r.get('w4a8_il_us', float('nan')):.1f} | {r.get('speedup_w4a8_vs_w4a16_il', float('nan')):.2f}x |")
    with open(path, "w") as f:
        f.write("\n".join(lines) + "\n")


def write_markdown(result, path):
    m = result["meta"]
    lines = [
        "# NVFP4 grouped GEMM benchmark (DeepSeek-V4 experts, 256 experts, top-8)",
        "",
        f"- date: {m['date']}; device: {m['device']}; torch {m['torch']}; triton {m['triton']}",
        f"- command: `{m['command']}`",
        f"- rooflines: HBM {m['hbm_tb_s']} TB/s (touched weights + scales + activations), "
        f"bf16 tensor cores {m['bf16_tflops']} TFLOP/s; times are do_bench medians in microseconds",
        "",
        "| proj | tokens | rows | experts touched | nvfp4 us | best tuned us | swiglu us | bf16 _grouped_mm us "
        "| HBM roofline us | TC roofline us | % of HBM roofline | speedup vs bf16 | nvfp4 TFLOP/s | bf16 TFLOP/s "
        "| rel err vs bf16 |",
        "|" + "---|" * 15,
    ]
    for r in result["records"]:
        sw = f"{r['nvfp4_swiglu_us']:.1f}" if "nvfp4_swiglu_us" in r else "-"
        tuned = f"{r['tuned_best_us']:.1f}" if "tuned_best_us" in r else "-"
        lines.append(
            f"| {r['projection']} | {r['tokens']} | {r['rows']} | {r['touched_experts']} | {r['nvfp4_us']:.1f} | {tuned} | {sw} "
            f"| {r['bf16_grouped_mm_us']:.1f} | {r['hbm_roofline_us']:.1f} | {r['tc_roofline_us']:.1f} "
            f"| {100 * r['hbm_roofline_fraction']:.0f}% | {r['speedup_vs_bf16']:.2f}x | {r['nvfp4_tflops']:.0f} "
            f"| {r['bf16_tflops']:.0f} | {r['rel_err_vs_bf16_path']:.1e} |"
        )
    dec = [r for r in result["records"] if "gemv_us" in r or "mma_us" in r]
    if dec:
        lines += ["", "## Decode kernels called directly: Triton tensor-core, CUDA-core (gemv), Gluon mma (mma)", "",
                  "| proj | tokens | rows | tensor-core us | gemv us (config) | gemv best tuned us (config) "
                  "| gemv swiglu us | mma us (config) | mma best tuned us (config) | mma swiglu us "
                  "| HBM roofline us | gemv % of roofline | mma % of roofline | gemv / mma rel err vs bf16 "
                  "| op routes to |",
                  "|" + "---|" * 15]

        def cell(r, key, cfg_key=None):
            if key not in r or r[key] != r[key]:  # missing or NaN
                return "-"
            return f"{r[key]:.1f}" + (f" {tuple(r[cfg_key])}" if cfg_key and cfg_key in r else "")

        def pct(r, key):
            return f"{100 * r['hbm_roofline_us'] / r[key]:.0f}%" if key in r and r[key] == r[key] else "-"

        for r in dec:
            errs = " / ".join(f"{r[k]:.1e}" for k in ("gemv_rel_err_vs_bf16_path", "mma_rel_err_vs_bf16_path") if k in r)
            lines.append(
                f"| {r['projection']} | {r['tokens']} | {r['rows']} | {cell(r, 'tc_us')} "
                f"| {cell(r, 'gemv_us', 'gemv_config')} | {cell(r, 'gemv_best_us', 'gemv_best_config')} "
                f"| {cell(r, 'gemv_swiglu_us')} | {cell(r, 'mma_us', 'mma_config')} "
                f"| {cell(r, 'mma_best_us', 'mma_best_config')} | {cell(r, 'mma_swiglu_us')} "
                f"| {r['hbm_roofline_us']:.1f} | {pct(r, 'gemv_us')} | {pct(r, 'mma_us')} | {errs} | {r['route']} |")
    pre = [r for r in result["records"] if "wgmma_us" in r]
    if pre:
        lines += ["", "## Gluon wgmma kernel (called directly) vs the op and bf16 `torch._grouped_mm`", "",
                  "| proj | tokens | rows | op us (route) | wgmma us | wgmma best tuned us (config) | wgmma swiglu us "
                  "| Triton tensor-core us | bf16 us | TC roofline us | wgmma TFLOP/s | wgmma time / bf16 time "
                  "| wgmma rel err vs bf16 |",
                  "|" + "---|" * 13]
        for r in pre:
            best = (f"{r['wgmma_best_us']:.1f} {tuple(r['wgmma_best_config'])}" if "wgmma_best_us" in r else "-")
            sw = f"{r['wgmma_swiglu_us']:.1f}" if "wgmma_swiglu_us" in r else "-"
            lines.append(
                f"| {r['projection']} | {r['tokens']} | {r['rows']} | {r['nvfp4_us']:.1f} ({r['route']}) "
                f"| {r['wgmma_us']:.1f} | {best} | {sw} | {r.get('tc_us', float('nan')):.1f} "
                f"| {r['bf16_grouped_mm_us']:.1f} | {r['tc_roofline_us']:.1f} "
                f"| {r['flops'] / r['wgmma_us'] / 1e6:.0f} | {r['wgmma_us'] / r['bf16_grouped_mm_us']:.2f} "
                f"| {r['wgmma_rel_err_vs_bf16_path']:.1e} |")
    if result.get("dense"):
        lines += ["", "## Dense decode (nvfp4_linear): the kernels called directly", "",
                  "| N | K | M | tensor-core us | gemv us | mma us | mma sweep us (config) | op us | bf16 F.linear us "
                  "| HBM roofline us | gemv % of roofline | gemv rel err vs bf16 | op routes to |", "|" + "---|" * 13]
        for r in result["dense"]:
            lines.append(
                f"| {r['n']} | {r['k']} | {r['m']} | {r['tc_us']:.1f} | {r['gemv_us']:.1f} "
                f"| {r.get('mma_us', float('nan')):.1f} "
                f"| {', '.join(f'{us:.1f} {cfg}' for cfg, us in r.get('mma_sweep', {}).items()) or '-'} "
                f"| {r['op_us']:.1f} "
                f"| {r['bf16_us']:.1f} | {r['hbm_roofline_us']:.1f} | {100 * r['hbm_roofline_us'] / r['gemv_us']:.0f}% "
                f"| {r['gemv_rel_err_vs_bf16']:.1e} | {r['route']} |")
    if result.get("tuning"):
        lines += ["", "## Config sweep (--tune / --gemv-tune / --mma-tune / --wgmma-tune)", "",
                  "| proj | tokens | kernel | config | us |", "|---|---|---|---|---|"]
        for t in result["tuning"]:
            lines.append(f"| {t['projection']} | {t['tokens']} | {t.get('kernel', 'tensor-core')} "
                         f"| {tuple(t['config'])} | {t['us']:.1f} |")
    with open(path, "w") as f:
        f.write("\n".join(lines) + "\n")


def write_plot(result, path):
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib not installed: no plot written (redraw with --plot-only on a machine that has it)")
        return False
    fig, axes = plt.subplots(1, 2, figsize=(13, 5))
    for ax, proj in zip(axes, PROJECTIONS):
        recs = [r for r in result["records"] if r["projection"] == proj]
        if not recs:
            continue
        toks = [r["tokens"] for r in recs]
        roof = [max(r["hbm_roofline_us"], r["tc_roofline_us"]) for r in recs]
        ax.plot(toks, [r["nvfp4_us"] for r in recs], "o-", label="nvfp4 (ours, w4a16)")
        ax.plot(toks, [r["bf16_grouped_mm_us"] for r in recs], "s-", label="bf16 torch._grouped_mm")
        ax.plot(toks, [r["hbm_roofline_us"] for r in recs], "--", label="HBM roofline (nvfp4 bytes, 3.0 TB/s)")
        ax.plot(toks, [r["bf16_hbm_roofline_us"] for r in recs], ":", label="HBM roofline (bf16 bytes)")
        ax.plot(toks, [r["tc_roofline_us"] for r in recs], "-.", label="bf16 tensor-core roofline (749 TFLOP/s)")
        ax.plot(toks, roof, color="gray", alpha=0.3, linewidth=6, label="max(rooflines)")
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        n, k = PROJECTIONS[proj]
        ax.set_title(f"{proj}: (256, N={n}, K={k}), top-8")
        ax.set_xlabel("tokens (rows = 8 x tokens)")
        ax.set_ylabel("time (us), lower is better")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=7)
    fig.suptitle(f"NVFP4 grouped GEMM on {result['meta']['device']} ({result['meta']['date']})")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    return True


def main():
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # graph_timing
    from graph_timing import add_flush_argument, use_flush_mode

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, nargs="+", default=list(TOKENS))
    parser.add_argument("--tune", action="store_true", help="sweep the config candidates per shape")
    parser.add_argument("--dense", action="store_true", help="also time dense decode GEMMs (M <= 16)")
    parser.add_argument("--gemv-tune", action="store_true", help="sweep the decode-kernel candidates (<= 64 tokens)")
    parser.add_argument("--mma-tune", action="store_true", help="sweep the Gluon decode-kernel candidates")
    parser.add_argument("--wgmma-tune", action="store_true", help="sweep the Gluon wgmma-kernel candidates")
    parser.add_argument("--dense-splitk", action="store_true",
                        help="only the dense split-K comparison (issue shapes, M = 1..256, graph replay)")
    parser.add_argument("--splitk-sweep", action="store_true",
                        help="with --dense-splitk: also sweep the split count, configs, two-launch reduction")
    parser.add_argument("--splitk-shapes", default=None, help='with --dense-splitk: "NxK,..." instead of the issue shapes')
    parser.add_argument("--splitk-rows", default=None, help='with --dense-splitk: "M,..." instead of 1..256')
    parser.add_argument("--w4a8", action="store_true",
                        help="only the w4a16 vs w4a8 comparison (V4-Flash 4096/16384, V4-Pro 4096/8192 tokens)")
    parser.add_argument("--rep-ms", type=int, default=60)
    parser.add_argument("--out-dir", default=os.path.join(os.path.dirname(__file__), "results"))
    parser.add_argument("--tag", default=None, help="file name stem (default gemm_<UTC date-time>)")
    parser.add_argument("--plot-only", default=None, help="redraw the PNG (and markdown) from a JSON result")
    add_flush_argument(parser)
    args = parser.parse_args()
    use_flush_mode(args.flush)
    if args.plot_only:
        with open(args.plot_only) as f:
            result = json.load(f)
        stem = os.path.splitext(args.plot_only)[0]
        write_markdown(result, stem + ".md")
        write_plot(result, stem + ".png")
        return
    if not torch.cuda.is_available():
        sys.exit("bench_gemm.py needs a CUDA GPU")
    t0 = time.time()
    if args.w4a8:
        import triton

        meta = dict(date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                    device=torch.cuda.get_device_name(), torch=torch.__version__, triton=triton.__version__,
                    command="python benchmarks/bench_gemm.py " + " ".join(sys.argv[1:]))
        rows = run_w4a8(args)
        meta["wall_s"] = round(time.time() - t0, 1)
        os.makedirs(args.out_dir, exist_ok=True)
        stem = os.path.join(args.out_dir, args.tag or "gemm_w4a8_"
                            + datetime.datetime.now(datetime.timezone.utc).strftime("%Y%m%d_%H%M"))
        with open(stem + ".json", "w") as f:
            json.dump(dict(meta=meta, rows=rows), f, indent=1)
        write_w4a8_markdown(rows, meta, stem + ".md")
        with open(stem + ".md") as f:
            print(f.read())
        return
    if args.dense_splitk:
        import triton

        meta = dict(date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                    device=torch.cuda.get_device_name(), torch=torch.__version__, triton=triton.__version__,
                    command="python benchmarks/bench_gemm.py " + " ".join(sys.argv[1:]))
        rows = run_dense_splitk(args)
        meta["wall_s"] = round(time.time() - t0, 1)
        os.makedirs(args.out_dir, exist_ok=True)
        stem = os.path.join(args.out_dir, args.tag or "gemm_dense_splitk_"
                            + datetime.datetime.now(datetime.timezone.utc).strftime("%Y%m%d_%H%M"))
        with open(stem + ".json", "w") as f:
            json.dump(dict(meta=meta, rows=rows), f, indent=1)
        write_dense_splitk_markdown(rows, meta, stem + ".md")
        with open(stem + ".md") as f:
            print(f.read())
        return
    result = run(args)
    result["meta"]["wall_s"] = round(time.time() - t0, 1)
    os.makedirs(args.out_dir, exist_ok=True)
    stem = os.path.join(args.out_dir, args.tag or "gemm_" + datetime.datetime.now(datetime.timezone.utc).strftime("%Y%m%d_%H%M"))
    with open(stem + ".json", "w") as f:
        json.dump(result, f, indent=1)
    write_markdown(result, stem + ".md")
    write_plot(result, stem + ".png")
    with open(stem + ".md") as f:
        print(f.read())


if __name__ == "__main__":
    main()
