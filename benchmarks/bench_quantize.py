"""Benchmark of the fused NVFP4 quantize / dequantize kernels (H100) + round-trip error statistics.

    python benchmarks/bench_quantize.py [--tune] [--out-dir benchmarks/results] [--tag v1]

For (M, K) in {(1, 7168), (128, 7168), (8192, 7168), (32768, 7168)}, bf16 input:
  * quantize with a given global scale (single pass), per-row dynamic (one
    launch, x swept twice, the second time mostly from L2), per-tensor dynamic
    (two launches: amax partials, then quantize; x read twice from HBM);
  * dequantize to bf16;
  * a plain torch copy of the bf16 input (read + write) as the achievable
    streaming bandwidth, and the PyTorch reference quantize on the GPU (the
    "bf16 PyTorch path");
timed with ``triton.testing.do_bench`` (median; it flushes L2 before every
call) while rotating over enough input sets to exceed L2. Bandwidth = bytes
read + written / time, compared to 3.0 TB/s (HBM roofline) and to the copy.
"minimal" bytes count x once; "actual" bytes count every read of x.
With ``--tune`` it first sweeps tile configurations of each kernel per shape.
Without CUDA it only prints the round-trip error statistics (small shapes).
"""
from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import platform
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import megamoe.ops.quantize  # noqa: E402,F401
import megamoe.reference.quantize  # noqa: E402,F401

ops = sys.modules["megamoe.ops.quantize"]
ref = sys.modules["megamoe.reference.quantize"]

HBM_BYTES_PER_S = 3.0e12
SHAPES = ((1, 7168), (128, 7168), (8192, 7168), (32768, 7168))
TUNE_CANDIDATES = {
    "tiles": ((1, 512, 4), (1, 1024, 4), (1, 2048, 8), (2, 1024, 4), (4, 1024, 8), (8, 512, 4),
              (8, 1024, 8), (4, 2048, 8), (16, 512, 8)),
    "rows": ((1, 512, 4), (1, 1024, 4), (1, 2048, 8), (2, 1024, 4), (2, 2048, 8), (4, 512, 4), (4, 1024, 8),
             (8, 512, 8), (8, 1024, 8)),
    "dequant": ((1, 1024, 4), (2, 1024, 4), (4, 1024, 8), (8, 512, 4), (8, 1024, 8), (16, 512, 8)),
    "amax": ((4096, 4, 512), (8192, 8, 512), (16384, 8, 512), (8192, 4, 1024)),
}


def quantize_bytes(m: int, k: int, x_reads: int = 1) -> int:
    """bf16 x read x_reads times + packed codes + e4m3 scales + global scales written."""
    return x_reads * 2 * m * k + m * k // 2 + m * k // 16 + 4 * m


def dequantize_bytes(m: int, k: int) -> int:
    return m * k // 2 + m * k // 16 + 4 * m + 2 * m * k


def rotating(fn, inputs):
    state = [0]

    def call():
        i = state[0] % len(inputs)
        state[0] += 1
        return fn(inputs[i])

    return call


def bench(fn, quick=False):
    import triton.testing

    return triton.testing.do_bench(fn, warmup=10 if quick else 25, rep=40 if quick else 100,
                                   return_mode="median") * 1e-3


def roundtrip_stats(device: str, rows: int, cols: int) -> list[dict]:
    """Relative RMS error of dequantize(quantize(x)) (float32) for several input distributions."""
    gen = torch.Generator().manual_seed(0)
    inputs = {
        "gaussian": torch.randn(rows, cols, generator=gen),
        "student-t (df=3, heavy-tailed)": torch.distributions.StudentT(3.0).sample((rows, cols)),
        "gaussian, row scales 1e-3..1e3": torch.randn(rows, cols, generator=gen)
        * torch.logspace(-3, 3, rows)[torch.randperm(rows, generator=gen)][:, None],
    }
    out = []
    for name, x in inputs.items():
        x = x.to(torch.bfloat16).to(device)
        xf = x.float()
        for per_row in (False, True):
            back = ops.dequantize(ops.quantize(x, per_row=per_row), torch.float32)
            rel = ((back - xf).norm() / xf.norm()).item()
            row_rel = ((back - xf).norm(dim=1) / xf.norm(dim=1)).median().item()
            out.append({"input": name, "global_scale": "per-row" if per_row else "per-tensor",
                        "rel_rms": rel, "median_row_rel_rms": row_rel})
            print(f"  round trip {name:34s} {'per-row' if per_row else 'per-tensor':10s} "
                  f"rel RMS {rel:.5f}  median per-row rel RMS {row_rel:.5f}", flush=True)
    return out


def tune(kernels, shapes, quick):
    """Sweep the candidates of each kernel on each shape; returns {kind: {shape: [(config, seconds)]}}."""
    results = {}
    for kind, candidates in TUNE_CANDIDATES.items():
        results[kind] = {}
        for m, k in shapes:
            if kind == "amax" and m * k < 1 << 20:
                continue
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            data = torch.empty(m, k // 2, dtype=torch.uint8, device="cuda")
            scale = torch.empty(m, k // 16, dtype=torch.uint8, device="cuda")
            gs_rows = torch.empty(m, device="cuda")
            gs = torch.full((1,), 0.003, device="cuda")
            partials = torch.empty(1024, device="cuda")
            out = torch.empty(m, k, dtype=torch.bfloat16, device="cuda")
            rows = []
            for config in candidates:
                if kind == "tiles":
                    fn = lambda: kernels.launch_quantize(x, data, scale, None, global_scale=gs, config=config)  # noqa
                elif kind == "rows":
                    fn = lambda: kernels.launch_quantize(x, data, scale, gs_rows, per_row=True, config=config)  # noqa
                elif kind == "dequant":
                    fn = lambda: kernels.launch_dequantize(data, scale, gs, out, config=config)  # noqa
                else:
                    def fn(config=config):
                        saved = kernels.QUANTIZE_CONFIGS["amax"]
                        kernels.QUANTIZE_CONFIGS["amax"] = ((1 << 62, config),)
                        try:
                            kernels.launch_quantize(x, data, scale, gs, partials=partials, scale_only=True)
                        finally:
                            kernels.QUANTIZE_CONFIGS["amax"] = saved
                try:
                    seconds = bench(fn, quick=True)
                except Exception as error:  # a config that does not compile is reported, not fatal
                    print(f"  tune {kind} {(m, k)} {config}: failed ({type(error).__name__})", flush=True)
                    continue
                moved = {"tiles": quantize_bytes(m, k), "rows": quantize_bytes(m, k),
                         "dequant": dequantize_bytes(m, k), "amax": 2 * m * k}[kind]
                rows.append({"config": list(config), "us": seconds * 1e6, "GBps": moved / seconds / 1e9})
            rows.sort(key=lambda r: r["us"])
            best = rows[0] if rows else None
            print(f"  tune {kind:8s} {str((m, k)):14s} best {best['config'] if best else None} "
                  f"{best['us'] if best else float('nan'):9.1f} us {best['GBps'] if best else 0:7.0f} GB/s "
                  f"(default {kernels.select_config(kind, m)})", flush=True)
            results[kind][f"{m}x{k}"] = rows
            del x, data, scale, out
    return results


def run_benchmarks(quick: bool):
    rows_out = []
    for m, k in SHAPES:
        set_bytes = 2 * m * k
        n_sets = max(1, min(64, math.ceil(200e6 / set_bytes)))
        xs = [torch.randn(m, k, device="cuda", dtype=torch.bfloat16) for _ in range(n_sets)]
        gs = torch.tensor(0.003, device="cuda")
        outs = {name: ops.quantize(xs[0], **kw) for name, kw in
                (("given", {"global_scale": gs}), ("per_row", {"per_row": True}), ("per_tensor", {}))}
        dst = torch.empty_like(xs[0])
        deq_out = torch.empty(m, k, dtype=torch.bfloat16, device="cuda")
        qs = [ops.quantize(x, gs) for x in xs]
        timings = {
            "copy": bench(rotating(lambda x: dst.copy_(x), xs), quick),
            "given": bench(rotating(lambda x: ops.quantize(x, gs, out=outs["given"]), xs), quick),
            "per_row": bench(rotating(lambda x: ops.quantize(x, per_row=True, out=outs["per_row"]), xs), quick),
            "per_tensor": bench(rotating(lambda x: ops.quantize(x, out=outs["per_tensor"]), xs), quick),
            "dequantize": bench(rotating(lambda q: ops.dequantize(q, torch.bfloat16, out=deq_out), qs), quick),
            "torch_reference_given": bench(rotating(lambda x: ref.quantize(x, gs), xs[:2]), quick),
            "torch_reference_per_tensor": bench(rotating(lambda x: ref.quantize(x), xs[:2]), quick),
        }
        copy_gbps = 4 * m * k / timings["copy"] / 1e9
        minimal = quantize_bytes(m, k)
        entry = {"M": m, "K": k, "input_sets": n_sets, "copy_us": timings["copy"] * 1e6, "copy_GBps": copy_gbps}
        for name, moved, actual in (
            ("given", minimal, minimal),
            ("per_row", minimal, quantize_bytes(m, k, 2)),
            ("per_tensor", minimal, quantize_bytes(m, k, 2)),
            ("dequantize", dequantize_bytes(m, k), dequantize_bytes(m, k)),
        ):
            t = timings[name]
            entry[name] = {
                "us": t * 1e6, "GBps_minimal": moved / t / 1e9, "GBps_actual": actual / t / 1e9,
                "pct_hbm_minimal": 100 * moved / t / HBM_BYTES_PER_S,
                "pct_copy_minimal": 100 * (moved / t / 1e9) / copy_gbps,
            }
        for name in ("torch_reference_given", "torch_reference_per_tensor"):
            entry[name + "_us"] = timings[name] * 1e6
        rows_out.append(entry)
        line = " ".join(f"{n}={entry[n]['us']:.1f}us/{entry[n]['GBps_minimal']:.0f}GB/s"
                        for n in ("given", "per_row", "per_tensor", "dequantize"))
        print(f"  ({m}, {k}) copy {entry['copy_us']:.1f}us {copy_gbps:.0f}GB/s | {line} | torch ref "
              f"{entry['torch_reference_given_us']:.0f}us", flush=True)
        del xs, qs, outs
        torch.cuda.empty_cache()
    return rows_out


def write_markdown(path, meta, results, tuned, stats):
    lines = [
        "# NVFP4 quantize / dequantize kernels: bandwidth and round-trip error",
        "",
        f"- date (UTC): {meta['date']}",
        f"- device: {meta['device']}",
        f"- torch {meta['torch']}, triton {meta['triton']}, python {meta['python']}",
        f"- command: `{meta['command']}`",
        f"- configs: {meta['configs']}",
        "",
        "Bandwidth = bytes read + written / median time (`triton.testing.do_bench`, L2 flushed before each call,",
        "inputs rotated). *minimal* bytes: x (bf16) read once + packed codes + scales written; *actual*: every",
        "read of x counted (per-row and per-tensor dynamic read x twice; per-row's second read mostly hits L2).",
        "% HBM is of 3.0 TB/s; % copy is of the measured bandwidth of a plain bf16 `copy_` (read + write).",
        "",
        "| M x K | copy GB/s | mode | time (us) | GB/s minimal | GB/s actual | % HBM (min.) | % copy (min.) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        for mode in ("given", "per_row", "per_tensor", "dequantize"):
            e = r[mode]
            lines.append(f"| {r['M']} x {r['K']} | {r['copy_GBps']:.0f} | {mode} | {e['us']:.1f} | "
                         f"{e['GBps_minimal']:.0f} | {e['GBps_actual']:.0f} | {e['pct_hbm_minimal']:.1f} | "
                         f"{e['pct_copy_minimal']:.1f} |")
    lines += ["", "PyTorch reference quantize on the same GPU (the unfused bf16/fp32 torch path):", "",
              "| M x K | reference, given scale (us) | reference, per-tensor dynamic (us) | fused given (us) | speed-up |",
              "|---|---|---|---|---|"]
    for r in results:
        lines.append(f"| {r['M']} x {r['K']} | {r['torch_reference_given_us']:.1f} | "
                     f"{r['torch_reference_per_tensor_us']:.1f} | {r['given']['us']:.1f} | "
                     f"{r['torch_reference_given_us'] / r['given']['us']:.1f}x |")
    lines += ["", "## Round-trip error (relative RMS of dequantize(quantize(x)) vs x, bf16 input "
              f"{meta['stats_shape']})", "",
              "| input | global scale | rel. RMS (whole tensor) | median per-row rel. RMS |", "|---|---|---|---|"]
    for s in stats:
        lines.append(f"| {s['input']} | {s['global_scale']} | {s['rel_rms']:.5f} | {s['median_row_rel_rms']:.5f} |")
    if tuned:
        lines += ["", "## Tile sweep (`--tune`): best three per kernel and shape", "",
                  "| kernel | M x K | config (BLOCK_M, BLOCK_K, warps) / amax (BLOCK, warps, partials) | us | GB/s |",
                  "|---|---|---|---|---|"]
        for kind, per_shape in tuned.items():
            for shape, rows in per_shape.items():
                for row in rows[:3]:
                    lines.append(f"| {kind} | {shape} | {tuple(row['config'])} | {row['us']:.1f} | {row['GBps']:.0f} |")
    with open(path, "w") as f:
        f.write("\n".join(lines) + "\n")


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tune", action="store_true", help="sweep tile configurations first")
    parser.add_argument("--quick", action="store_true", help="shorter do_bench runs")
    parser.add_argument("--out-dir", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results"))
    parser.add_argument("--tag", default="v1")
    args = parser.parse_args(argv)
    cuda = torch.cuda.is_available()
    if not cuda:
        os.environ.setdefault("TRITON_INTERPRET", "1")
        print("no CUDA device: round-trip statistics only (small shape, Triton interpreter)")
        roundtrip_stats("cpu", 32, 512)
        return 0
    import triton

    from megamoe.kernels import quantize as kernels

    meta = {
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M"),
        "device": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
        "python": platform.python_version(), "command": "python " + " ".join(sys.argv),
        "configs": {kind: [f"M<={b if b < 1 << 40 else 'inf'}: {c}" for b, c in buckets]
                    for kind, buckets in kernels.QUANTIZE_CONFIGS.items()},
        "stats_shape": "(4096, 7168)",
    }
    print(f"device {meta['device']}, torch {meta['torch']}, triton {meta['triton']}", flush=True)
    tuned = tune(kernels, SHAPES, args.quick) if args.tune else None
    print("bandwidth (median do_bench):", flush=True)
    results = run_benchmarks(args.quick)
    print("round-trip error:", flush=True)
    stats = roundtrip_stats("cuda", 4096, 7168)
    os.makedirs(args.out_dir, exist_ok=True)
    base = os.path.join(args.out_dir, f"quantize_{args.tag}")
    with open(base + ".json", "w") as f:
        json.dump({"meta": meta, "results": results, "roundtrip": stats, "tune": tuned}, f, indent=1)
    write_markdown(base + ".md", meta, results, tuned, stats)
    print(f"wrote {base}.json and {base}.md")
    return 0


if __name__ == "__main__":
    sys.exit(main())
