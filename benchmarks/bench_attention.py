"""Benchmark: DeepSeek-V4 sparse FP8 MQA attention (decode), H = 64 heads, D = 512, on one GPU.

For batch 1, 8, 32, 64, 128 x context 4k, 32k, 128k and both compressed layer kinds:
* CSA: top-k 512 compressed entries (of context / 4) + a full 128-row window per query;
* HCA: all context / 128 entries of the request + the 128-row window;
it times, from CUDA-graph replays (``triton.testing.do_bench`` medians; the L2 cache is cleared before each
replay, so pool rows come from HBM):
* ``ours``: ``megamoe.ops.attention.sparse_mqa_attention`` (Triton kernel, split-KV chosen from shapes);
* ``torch_bf16``: a bf16 PyTorch path: gather + dequantize the selected entries and window rows to bf16
  (B, W + K, 512), bf16 QK^T, float32 softmax with the sink, bf16 P.V;
and reports the memory floor: bytes of the rows actually read (window rows 1024 B, entries 448 + 7 * 4 + 128 =
604 B) / 3.0e12 B/s (``floor_rows_us``), and with the q / out / index bytes too (``floor_all_us``); TFLOP/s count
4 * H * D flops per (query, valid row).

``--layers N`` (default 1) captures N calls per graph, each on its own case (its own pool, window, queries, the
same shapes), as the N attention layers of one decode step would run, and reports the time per call: the graph's
launch is then paid once per N calls, and every call still reads its own rows from HBM (the L2 is cleared before
each replay and no two calls share data). ``--hbm copy`` measures this GPU's device-to-device copy rate in the same
run (read + write bytes of a 2 GiB copy, graph replay) and uses it for the floors instead of 3.0 TB/s. A copy mixes
reads and writes: on the H200 of results/gpu_check_v38 it ran at 2.77 TB/s while read kernels streamed 2.9-3.4 TB/s,
so the copy rate understates a read-bound kernel's floor there.

Usage: python benchmarks/bench_attention.py [--quick] [--layers N] [--hbm copy] [--batches 32,64]
[--contexts 32768] [--kinds csa,hca] [--out benchmarks/results/attention_v1]
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import sys

import torch
import triton
import triton.testing

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from megamoe.kernels import sparse_attention as kernels  # noqa: E402
from megamoe.ops.attention import attention_workspace, sparse_mqa_attention  # noqa: E402

HBM_BYTES_PER_S = 3.0e12
H, D, ROPE, SB, EPB, WINDOW, TOPK = 64, 512, 64, 64, 64, 128, 512
NOPE = D - ROPE
ENTRY_BYTES = NOPE + 4 * (NOPE // SB) + 2 * ROPE
ROW_BYTES = 2 * D


def copy_bytes_per_s(dev) -> float:
    """This GPU's device-to-device copy rate: (read + write bytes) / median replay time of a 2 GiB copy."""
    src = torch.empty(1 << 29, dtype=torch.float32, device=dev)
    dst = torch.empty_like(src)
    return 2 * src.numel() * src.element_size() / bench_graph(lambda: dst.copy_(src))


def bench_graph(fn) -> float:
    """Median seconds of one CUDA-graph replay of ``fn`` (L2 cleared before each replay)."""
    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return triton.testing.do_bench(graph.replay, warmup=20, rep=200, return_mode="median") * 1e-3


def make_case(batch: int, context: int, kind: str, dev):
    """Pool of ``batch`` requests at ``context`` tokens (random FP8 bytes, power-of-two scales), one query each."""
    ratio = 4 if kind == "csa" else 128
    entries = context // ratio
    pages = -(-entries // EPB)
    P = batch * pages
    fp8 = torch.randint(0, 0x7F, (P, EPB, NOPE), dtype=torch.uint8, device=dev)
    fp8 |= torch.randint(0, 2, fp8.shape, dtype=torch.uint8, device=dev) << 7      # no NaN codes
    scale = torch.full((P, EPB, NOPE // SB), 2.0 ** -8, device=dev)
    rope = torch.randn((P, EPB, ROPE), device=dev).to(torch.bfloat16)
    block_table = torch.randperm(P, device=dev).to(torch.int32).view(batch, pages).contiguous()
    slots = torch.arange(batch, dtype=torch.int32, device=dev)
    if kind == "csa":
        k = min(TOPK, entries)
        entry_idx = torch.argsort(torch.rand(batch, entries, device=dev), dim=1)[:, :k].to(torch.int32).contiguous()
    else:
        entry_idx = torch.arange(entries, dtype=torch.int32, device=dev).expand(batch, -1).contiguous()
    window_kv = torch.randn((batch * WINDOW, D), device=dev).to(torch.bfloat16)
    window_idx = (slots[:, None] * WINDOW + torch.arange(WINDOW, device=dev)[None, :]).to(torch.int32).contiguous()
    q = torch.randn((batch, H, D), device=dev).to(torch.bfloat16)
    sink = torch.randn(H, device=dev)
    return dict(q=q, attn_sink=sink, window_kv=window_kv, window_idx=window_idx,
                entries_fp8=fp8.view(torch.float8_e4m3fn), entries_scale=scale, entries_rope=rope,
                block_table=block_table, slots=slots, entry_idx=entry_idx)


def torch_bf16_path(c, out):
    """Gather + dequantize to bf16, bf16 matmuls, float32 softmax with the sink (capturable, sync-free)."""
    e = c["entry_idx"].long()
    valid_e = e >= 0
    lp = torch.where(valid_e, e // EPB, 0)
    page = c["block_table"].long().gather(1, lp.clamp(max=c["block_table"].shape[1] - 1))
    valid_e = valid_e & (page >= 0)
    flat = torch.where(valid_e, page * EPB + e % EPB, 0)
    fp8 = c["entries_fp8"].view(-1, NOPE)[flat]
    scale = c["entries_scale"].view(-1, NOPE // SB)[flat].repeat_interleave(SB, dim=-1)
    nope = (fp8.float() * scale).to(torch.bfloat16)
    rows_e = torch.cat([nope, c["entries_rope"].view(-1, ROPE)[flat]], dim=-1)
    w = c["window_idx"].long()
    valid_w = w >= 0
    rows_w = c["window_kv"][w.clamp(min=0)]
    kv = torch.cat([rows_w, rows_e], dim=1)
    valid = torch.cat([valid_w, valid_e], dim=1)
    logits = torch.matmul(c["q"], kv.transpose(1, 2)).float() * D ** -0.5
    logits = logits.masked_fill(~valid[:, None, :], float("-inf"))
    sink = c["attn_sink"][None, :, None].expand(logits.shape[0], -1, 1)
    p = torch.softmax(torch.cat([logits, sink], dim=-1), dim=-1)[..., :-1]
    out.copy_(torch.matmul(p.to(torch.bfloat16), kv))
    return out


def main():
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # graph_timing
    from graph_timing import add_flush_argument, use_flush_mode

    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--out", default="benchmarks/results/attention_v1")
    ap.add_argument("--layers", type=int, default=1, help="calls per graph, each on its own case (time per call)")
    ap.add_argument("--hbm", default="3.0e12", help="bytes/s of the floors, or 'copy': this GPU's measured copy rate")
    ap.add_argument("--batches", default=None, help="comma-separated batch sizes (default: 1,8,32,64,128)")
    ap.add_argument("--contexts", default=None, help="comma-separated contexts (default: 4096,32768,131072)")
    ap.add_argument("--kinds", default="csa,hca")
    add_flush_argument(ap)
    args = ap.parse_args()
    if args.layers < 1:
        raise SystemExit("--layers: expected >= 1")
    use_flush_mode(args.flush)
    dev = torch.device("cuda")
    hbm = copy_bytes_per_s(dev) if args.hbm == "copy" else float(args.hbm)
    torch.cuda.empty_cache()  # the copy's 4 GiB
    print(f"floors at {hbm / 1e12:.3f} TB/s ({'measured copy' if args.hbm == 'copy' else 'given'})", flush=True)
    batches = [1, 8, 32, 64, 128] if not args.quick else [1, 64]
    contexts = [4096, 32768, 131072] if not args.quick else [4096, 131072]
    if args.batches:
        batches = [int(v) for v in args.batches.split(",")]
    if args.contexts:
        contexts = [int(v) for v in args.contexts.split(",")]
    rows = []
    for kind in args.kinds.split(","):
        for ctx in contexts:
            for B in batches:
                cases = [make_case(B, ctx, kind, dev) for _ in range(args.layers)]
                c = cases[0]
                K = c["entry_idx"].shape[1]
                splits, _ = kernels.choose_num_splits(B, H, WINDOW, K, block_n=kernels.main_block_n())
                ws = attention_workspace(B, H, D, WINDOW, K, dev)
                outs = [torch.empty_like(c["q"]) for _ in cases]
                ref_outs = [torch.empty_like(c["q"]) for _ in cases]

                def ours():
                    for case, o in zip(cases, outs):
                        kw = {k: v for k, v in case.items() if k not in ("q", "attn_sink")}
                        sparse_mqa_attention(case["q"], case["attn_sink"], D ** -0.5, out=o, workspace=ws, **kw)

                def torch_path():
                    for case, o in zip(cases, ref_outs):
                        torch_bf16_path(case, o)

                t_ours = bench_graph(ours) / args.layers
                t_torch = bench_graph(torch_path) / args.layers
                err = max(((o.float() - r.float()).norm() / r.float().norm()).item() for o, r in zip(outs, ref_outs))
                n_rows = WINDOW + K
                row_bytes = B * (WINDOW * ROW_BYTES + K * ENTRY_BYTES)
                all_bytes = row_bytes + B * (2 * H * D * 2 + 4 * (WINDOW + K))
                flops = 4 * B * n_rows * H * D
                row = dict(kind=kind, batch=B, context=ctx, entries=K, window=WINDOW, splits=splits,
                           layers=args.layers, ours_us=t_ours * 1e6, torch_bf16_us=t_torch * 1e6,
                           floor_rows_us=row_bytes / hbm * 1e6,
                           floor_all_us=all_bytes / hbm * 1e6,
                           ours_tflops=flops / t_ours / 1e12, ours_hbm_frac=all_bytes / t_ours / hbm,
                           speedup_vs_torch=t_torch / t_ours, rel_fro_vs_torch=err)
                rows.append(row)
                print({k: (round(v, 3) if isinstance(v, float) else v) for k, v in row.items()}, flush=True)
                c = cases = ws = outs = ref_outs = None  # free this point's buffers
                torch.cuda.empty_cache()

    meta = dict(date=datetime.datetime.now().isoformat(timespec="seconds"),
                device=torch.cuda.get_device_name(0), torch=torch.__version__, triton=triton.__version__,
                python=platform.python_version(), command="python " + " ".join(sys.argv),
                config=kernels.ATTENTION_CONFIG, hbm_bytes_per_s=hbm, hbm_source=args.hbm, layers=args.layers,
                flush=args.flush)
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    with open(args.out + ".json", "w") as f:
        json.dump(dict(meta=meta, rows=rows), f, indent=1)
    lines = [f"# Sparse FP8 MQA attention (H={H}, D={D}, window {WINDOW})", "",
             f"{meta['date']} | {meta['device']} | torch {meta['torch']} | triton {meta['triton']} | "
             f"`{meta['command']}`", "",
             f"CUDA-graph replay medians, L2 cleared before each replay ({args.flush} flush); "
             f"{args.layers} call(s) per graph on distinct cases, time per call. floor = bytes / {hbm / 1e12:.3f} TB/s "
             f"({'this GPU measured copy rate' if args.hbm == 'copy' else 'given'}; rows: window + entries read; "
             "all: + q, out, indices).", "",
             "| kind | batch | context | entries | splits | ours us | torch bf16 us | floor rows us | floor all us "
             "| ours TFLOP/s | ours / floor_all | speedup vs torch |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['kind']} | {r['batch']} | {r['context']} | {r['entries']} | {r['splits']} | "
                     f"{r['ours_us']:.1f} | {r['torch_bf16_us']:.1f} | {r['floor_rows_us']:.2f} | "
                     f"{r['floor_all_us']:.2f} | {r['ours_tflops']:.0f} | {r['ours_us'] / r['floor_all_us']:.1f}x | "
                     f"{r['speedup_vs_torch']:.2f} |")
    with open(args.out + ".md", "w") as f:
        f.write("\n".join(lines) + "\n")
    print(f"wrote {args.out}.json / .md")


if __name__ == "__main__":
    main()
