"""Probe: how fast can one H100 wave stream the weight bytes of a 1-token MoE step, by access pattern?

At 1 token (top-8) the grouped GEMMs read 8 experts' packed weights once. The
decode kernels read them as BLOCK_N weight rows x (BLOCK_K/2) bytes per K step,
i.e. many short row segments. This script times pure read kernels (sum of
int32 words, no decode) over the same bytes with:

* ``rows``: the GEMM pattern, each program BLOCK_N rows x SEG bytes per step;
* ``contiguous``: each program reads the same number of bytes as one contiguous
  run (what a tiled weight layout would give);

for a few segment lengths and program counts, against the 3.0 TB/s HBM figure.

Run:  python benchmarks/probe_stream.py [--out FILE.md]
"""
from __future__ import annotations

import argparse
import datetime
import os
import sys

import torch
import triton
import triton.language as tl


@triton.jit
def _rows_kernel(w_ptr, out_ptr, row_bytes, ROWS: tl.constexpr, SEG: tl.constexpr, STEPS: tl.constexpr):
    """Program (p, s) reads ROWS consecutive rows (row_bytes apart) from byte s*SEG*STEPS of each row,
    SEG bytes per step (axis 1 = K splits)."""
    pid = tl.program_id(0)
    rows = pid * ROWS + tl.arange(0, ROWS)
    cols = tl.program_id(1) * (SEG // 4) * STEPS + tl.arange(0, SEG // 4)
    ptrs = w_ptr + rows.to(tl.int64)[:, None] * (row_bytes // 4) + cols[None, :]
    acc = tl.zeros((ROWS, SEG // 4), dtype=tl.int32)
    for s in range(STEPS):
        acc ^= tl.load(ptrs + s * (SEG // 4))
    tl.store(out_ptr + pid * tl.num_programs(1) + tl.program_id(1), tl.sum(tl.sum(acc, 1), 0))


@triton.jit
def _contiguous_kernel(w_ptr, out_ptr, CHUNK: tl.constexpr, STEPS: tl.constexpr):
    """Program p reads CHUNK * STEPS contiguous bytes, CHUNK per step."""
    pid = tl.program_id(0)
    offs = tl.arange(0, CHUNK // 4)
    base = w_ptr + pid.to(tl.int64) * (CHUNK // 4) * STEPS
    acc = tl.zeros((CHUNK // 4,), dtype=tl.int32)
    for s in range(STEPS):
        acc ^= tl.load(base + s * (CHUNK // 4) + offs)
    tl.store(out_ptr + pid, tl.sum(acc, 0))


def main():
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # graph_timing
    from graph_timing import add_flush_argument, use_flush_mode

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default=None)
    add_flush_argument(parser)
    args = parser.parse_args()
    use_flush_mode(args.flush)
    if not torch.cuda.is_available():
        sys.exit("probe_stream.py needs a CUDA GPU")
    experts, n, k = 8, 4096, 7168  # the gate_up weights touched by one token (top-8)
    row_bytes = k // 2
    pools = [torch.randint(-2**31, 2**31 - 1, (experts * n, row_bytes // 4), dtype=torch.int32, device="cuda")
             for _ in range(4)]  # rotate: 4 x 117 MB, far beyond L2
    total = experts * n * row_bytes
    out = torch.empty(1 << 20, dtype=torch.int32, device="cuda")
    it = [0]

    def pool():
        it[0] = (it[0] + 1) % len(pools)
        return pools[it[0]]

    lines = ["# Streaming probe: 8 experts x 4096 rows x 3584 bytes (one token's gate_up weights, 117 MB)", "",
             f"- date: {datetime.datetime.now(datetime.timezone.utc).isoformat(timespec='seconds')}; "
             f"device: {torch.cuda.get_device_name()}; torch {torch.__version__}; triton {triton.__version__}",
             f"- command: `python {' '.join(sys.argv)}`; L2 cleared before each repetition by a {args.flush} flush", "",
             "| pattern | rows per program | bytes per row per step | K splits | programs | warps | us | TB/s "
             "| % of 3.0 TB/s |",
             "|---|---|---|---|---|---|---|---|---|"]
    for rows, seg, warps, splits in [(64, 128, 4, 1), (64, 256, 4, 1), (64, 512, 8, 1), (32, 256, 4, 1),
                                     (128, 128, 4, 1), (16, 512, 4, 1), (64, 256, 4, 2), (64, 256, 4, 4),
                                     (64, 256, 4, 7), (64, 256, 4, 14), (64, 128, 4, 4), (32, 256, 4, 4)]:
        steps = row_bytes // seg // splits
        programs = experts * n // rows
        fn = lambda: _rows_kernel[(programs, splits)](pool(), out, row_bytes, ROWS=rows, SEG=seg,  # noqa: E731
                                                      STEPS=steps, num_warps=warps)
        fn()
        us = triton.testing.do_bench(fn, warmup=10, rep=50, return_mode="median") * 1e3
        lines.append(f"| rows | {rows} | {seg} | {splits} | {programs * splits} | {warps} | {us:.1f} "
                     f"| {total / us / 1e6:.2f} | {100 * total / us / 3e6:.0f}% |")
    # the decode GEMM's own patterns on V4-Flash gate_up (K = 4096: 2048-byte rows, BLOCK_N 128, BLOCK_K 256): row-major
    # (128 rows x 128 B per step) and 4-row interleaved (32 groups of 4 rows x 512 B per step, groups 8 KB apart)
    for row_b, rows, seg, warps in [(2048, 128, 128, 4), (2048, 64, 128, 4), (8192, 32, 512, 4), (8192, 64, 512, 4),
                                    (8192, 16, 512, 4)]:
        steps = row_b // seg
        programs = total // (rows * row_b)
        fn = lambda: _rows_kernel[(programs, 1)](pool(), out, row_b, ROWS=rows, SEG=seg,  # noqa: E731
                                                 STEPS=steps, num_warps=warps)
        fn()
        us = triton.testing.do_bench(fn, warmup=10, rep=50, return_mode="median") * 1e3
        lines.append(f"| rows of {row_b} B | {rows} | {seg} | 1 | {programs} | {warps} | {us:.1f} "
                     f"| {total / us / 1e6:.2f} | {100 * total / us / 3e6:.0f}% |")
    for chunk, steps, warps in [(8192, 28, 4), (16384, 14, 4), (8192, 56, 4), (4096, 56, 4), (16384, 28, 8),
                                (8192, 7, 4), (8192, 2, 4), (16384, 1, 4)]:
        programs = total // (chunk * steps)
        fn = lambda: _contiguous_kernel[(programs,)](pool(), out, CHUNK=chunk, STEPS=steps,  # noqa: E731
                                                     num_warps=warps)
        fn()
        us = triton.testing.do_bench(fn, warmup=10, rep=50, return_mode="median") * 1e3
        lines.append(f"| contiguous | - | {chunk} per step | - | {programs} | {warps} | {us:.1f} "
                     f"| {total / us / 1e6:.2f} | {100 * total / us / 3e6:.0f}% |")
    copy_src, copy_dst = pools[0], torch.empty_like(pools[0])
    us = triton.testing.do_bench(lambda: copy_dst.copy_(copy_src), warmup=10, rep=50, return_mode="median") * 1e3
    lines.append(f"| torch copy_ (read + write) | - | - | - | - | - | {us:.1f} | {2 * total / us / 1e6:.2f} "
                 f"| {100 * 2 * total / us / 3e6:.0f}% |")
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text)


if __name__ == "__main__":
    main()
