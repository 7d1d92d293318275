"""Probe: can one H100 kernel stream one token's MoE gate_up weights (117 MB) near 3.0 TB/s through the TMA engine?

``probe_stream.py`` timed read-only kernels built from per-thread loads at 2.2-2.5 TB/s (74-84% of 3.0 TB/s),
while a many-wave ``torch copy_`` reaches 2.84 TB/s. This script times the same bytes read by:

* ``tma_ring`` (Gluon): a persistent grid (1 or 2 programs per SM); the buffer is viewed as a 2-D int32 tensor
  of ROW bytes per row and cut into BLOCK_R x BLOCK_C-byte tiles numbered row-block-major (ROW == BLOCK_C makes
  every tile one contiguous run). Program p owns a contiguous range of tiles and streams them through a
  STAGES-deep shared-memory ring: one TMA load (``cp.async.bulk.tensor``) and one mbarrier per slot
  (expect-tx of the tile's bytes, wait on the slot's phase). The consumer loads the tile from shared memory into
  registers and xors it into an accumulator, then the slot is refilled with tile i + STAGES. One int32 (the xor
  of everything the program read) is stored per program and checked against the buffer's xor on the host.
* ``tma_ring_noconsume``: the same ring, the consumer only waits the barrier and refills the slot (no shared
  memory reads): the TMA engine's own rate.
* ``bulk_prefetch_then_load`` (Triton): probe_stream's ``contiguous`` loop (CHUNK bytes per step, per-thread
  loads), preceded by ``cp.async.bulk.prefetch.L2.global`` of the program's slice: in P phases, every thread
  prefetching slice / P / threads bytes; phase j + 1 is prefetched when phase j starts being read (P = 1: the
  whole slice up front). Kept in Triton so its load loop is the reference loop's code.

References in the same run: probe_stream's ``contiguous`` kernel (the prefetch rows' loop and its two best rows) and
``torch copy_`` (read + write bytes). Each row is the median of ``triton.testing.do_bench`` (L2 flushed by a
256 MB write before every repetition) over four rotating 117 MB buffers.

Run:  python benchmarks/probe_stream_tma.py [--out FILE.md]   (also writes FILE.json)
      python benchmarks/probe_stream_tma.py --compile-only     (no GPU: compile every config for sm_90)
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile

import torch
import triton
import triton.language as tl
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, mbarrier, tma

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from probe_stream import _contiguous_kernel  # noqa: E402  (the reference loop, imported unchanged)

EXPERTS, N_ROWS, ROW_BYTES = 8, 4096, 7168 // 2  # one token's gate_up weights (top-8): 8 x 4096 x 3584 bytes
TOTAL = EXPERTS * N_ROWS * ROW_BYTES
HBM_TBS = 3.0
SMEM_PER_SM = 228 * 1024  # H100: 228 KB per SM, at most 227 KB per block (1 KB per block reserved)

# (pattern, BLOCK_R, BLOCK_C bytes, view row bytes, STAGES, programs per SM, swizzle bytes)
TMA_CONFIGS = [
    ("tma_ring", 64, 128, 128, 4, 1, 128),
    ("tma_ring", 64, 128, 128, 8, 1, 128),
    ("tma_ring", 64, 128, 128, 8, 2, 128),
    ("tma_ring", 128, 128, 128, 2, 1, 128),
    ("tma_ring", 128, 128, 128, 4, 1, 128),
    ("tma_ring", 128, 128, 128, 6, 1, 128),
    ("tma_ring", 128, 128, 128, 8, 1, 128),
    ("tma_ring", 128, 128, 128, 6, 2, 128),
    ("tma_ring", 128, 128, 3584, 8, 1, 128),
    ("tma_ring", 128, 256, 256, 4, 1, 0),
    ("tma_ring", 128, 256, 256, 6, 1, 0),
    ("tma_ring", 128, 256, 256, 3, 2, 0),
    ("tma_ring_noconsume", 128, 128, 128, 4, 1, 128),
    ("tma_ring_noconsume", 128, 128, 128, 8, 1, 128),
    ("tma_ring_noconsume", 128, 256, 256, 6, 1, 0),
]
# (CHUNK bytes per step, STEPS, phases P, warps): slice = CHUNK * STEPS bytes per program
PREFETCH_CONFIGS = [(8192, 28, 1, 4), (8192, 28, 4, 4), (8192, 28, 14, 4), (16384, 14, 7, 4)]
# probe_stream's contiguous rows: the loop the prefetch rows wrap (8192 x 28) and its two best; (CHUNK, STEPS, warps)
CONTIGUOUS_REFS = [(8192, 28, 4), (16384, 14, 4), (16384, 1, 4)]
WARPS = 4


# ----------------------------------------------------------------------------------------------------------------
# Gluon: TMA ring
# ----------------------------------------------------------------------------------------------------------------
@gluon.jit
def _tma_ring_kernel(desc, out_ptr, num_tiles, tiles_per_prog, BLOCK_R: gl.constexpr, BLOCK_C: gl.constexpr,
                     COL_TILES: gl.constexpr, STAGES: gl.constexpr, SWIZZLE: gl.constexpr, CONSUME: gl.constexpr,
                     num_warps: gl.constexpr):
    """Program p streams tiles [p * tiles_per_prog, min(num_tiles, (p + 1) * tiles_per_prog)); tile t is
    (row block t // COL_TILES, column block t % COL_TILES) of the int32 view; BLOCK_C is in bytes."""
    WORDS: gl.constexpr = BLOCK_C // 4
    TILE_BYTES: gl.constexpr = BLOCK_R * BLOCK_C
    smem_layout: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=SWIZZLE, element_bitwidth=32, rank=2)
    # 16 bytes per thread along a row: one ld.shared.v4 per thread per row it covers
    reg_layout: gl.constexpr = gl.BlockedLayout(size_per_thread=[1, 4],
                                                threads_per_warp=[32 // (WORDS // 4), WORDS // 4],
                                                warps_per_cta=[num_warps, 1], order=[1, 0])
    pid = gl.program_id(0)
    first = pid * tiles_per_prog
    count = gl.minimum(tiles_per_prog, num_tiles - first)

    ring = gl.allocate_shared_memory(gl.int32, [STAGES, BLOCK_R, WORDS], smem_layout)
    bars = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(STAGES):
        mbarrier.init(bars.index(i), count=1)
    fence_async_shared()

    for i in gl.static_range(STAGES):  # fill the ring
        t = first + i
        live = i < count
        mbarrier.expect(bars.index(i), TILE_BYTES, pred=live)
        tma.async_copy_global_to_shared(desc, [(t // COL_TILES) * BLOCK_R, (t % COL_TILES) * WORDS], bars.index(i),
                                        ring.index(i), pred=live)

    acc = gl.zeros([BLOCK_R, WORDS], gl.int32, reg_layout)
    for i in range(count):
        s = i % STAGES
        mbarrier.wait(bars.index(s), (i // STAGES) & 1)
        if CONSUME:
            acc ^= ring.index(s).load(reg_layout)
        # every warp has passed the wait (and read the slot) before the slot is re-armed and overwritten
        gl.thread_barrier()
        if CONSUME:
            fence_async_shared()  # order the generic-proxy reads before the async-proxy (TMA) write
        nxt = i + STAGES
        live = nxt < count
        t = first + nxt
        mbarrier.expect(bars.index(s), TILE_BYTES, pred=live)
        tma.async_copy_global_to_shared(desc, [(t // COL_TILES) * BLOCK_R, (t % COL_TILES) * WORDS], bars.index(s),
                                        ring.index(s), pred=live)

    for i in gl.static_range(STAGES):
        mbarrier.invalidate(bars.index(i))
    gl.store(out_ptr + pid, gl.xor_sum(gl.xor_sum(acc, 1), 0))


# ----------------------------------------------------------------------------------------------------------------
# Triton: L2 bulk prefetch, then probe_stream's contiguous loop
# ----------------------------------------------------------------------------------------------------------------
@triton.jit
def _bulk_prefetch_l2(addr, nbytes):
    """``cp.async.bulk.prefetch.L2.global [addr], nbytes`` per element (addr int64, 16-byte aligned; nbytes int32,
    a multiple of 16)."""
    return tl.inline_asm_elementwise("cp.async.bulk.prefetch.L2.global [$1], $2;\n\tmov.u32 $0, 0;", "=r,l,r",
                                     [addr, nbytes], dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def _prefetch_contiguous_kernel(w_ptr, out_ptr, CHUNK: tl.constexpr, STEPS: tl.constexpr, PHASES: tl.constexpr,
                                THREADS: tl.constexpr):
    """Program p reads CHUNK * STEPS contiguous bytes, CHUNK per step, in PHASES phases of STEPS // PHASES steps;
    phase 0 is prefetched to L2 first, phase j + 1 when phase j starts (each thread one bulk prefetch)."""
    STEPS_PER_PHASE: tl.constexpr = STEPS // PHASES
    PHASE_WORDS: tl.constexpr = (CHUNK // 4) * STEPS_PER_PHASE
    PER_THREAD: tl.constexpr = CHUNK * STEPS_PER_PHASE // THREADS  # bytes each thread prefetches per phase
    tl.static_assert(STEPS % PHASES == 0)
    tl.static_assert(PER_THREAD % 16 == 0)
    pid = tl.program_id(0)
    offs = tl.arange(0, CHUNK // 4)
    base = w_ptr + pid.to(tl.int64) * (CHUNK // 4) * STEPS
    thread_addr = (base + tl.arange(0, THREADS) * (PER_THREAD // 4)).to(tl.int64)
    size = tl.full([THREADS], PER_THREAD, tl.int32)
    _bulk_prefetch_l2(thread_addr, size)
    acc = tl.zeros((CHUNK // 4,), dtype=tl.int32)
    # one loop over all steps, as the reference's (nested per-phase loops get fully unrolled by LLVM: 255 registers)
    for s in range(STEPS):
        if s % STEPS_PER_PHASE == 0:
            nxt = s // STEPS_PER_PHASE + 1
            if nxt < PHASES:
                _bulk_prefetch_l2(thread_addr + nxt * PHASE_WORDS * 4, size)
        acc ^= tl.load(base + s * (CHUNK // 4) + offs)
    tl.store(out_ptr + pid, tl.xor_sum(acc, 0))


# ----------------------------------------------------------------------------------------------------------------
# host helpers
# ----------------------------------------------------------------------------------------------------------------
def _smem_layout(swizzle: int):
    return gl.NVMMASharedLayout(swizzle_byte_width=swizzle, element_bitwidth=32, rank=2)


def _tma_geometry(block_r, block_c, row, num_sms, per_sm):
    rows = TOTAL // row
    assert TOTAL % row == 0 and rows % block_r == 0 and row % block_c == 0
    num_tiles = (rows // block_r) * (row // block_c)
    tiles_per_prog = triton.cdiv(num_tiles, num_sms * per_sm)
    return rows, num_tiles, tiles_per_prog, triton.cdiv(num_tiles, tiles_per_prog)


def _tma_constants(cfg):
    pattern, block_r, block_c, row, stages, _per_sm, swizzle = cfg
    return dict(BLOCK_R=block_r, BLOCK_C=block_c, COL_TILES=row // block_c, STAGES=stages, SWIZZLE=swizzle,
                CONSUME=pattern == "tma_ring", num_warps=WARPS)


def _tma_label(cfg):
    pattern, block_r, block_c, row, stages, per_sm, swizzle = cfg
    return (f"| {pattern} | {block_r}x{block_c} B tile, row {row} B, swizzle {swizzle} | STAGES {stages} "
            f"({stages * block_r * block_c // 1024} KB) | {per_sm}/SM")


def _xor_all(t: torch.Tensor) -> int:
    """xor of every int32 word of ``t`` (halving on the device)."""
    x = t.reshape(-1).clone()
    while x.numel() > 1:
        if x.numel() % 2:
            x[0] ^= x[-1]
            x = x[:-1]
        half = x.numel() // 2
        x = x[:half] ^ x[half:]
    return int(x.item())


def _xor_host(values: torch.Tensor) -> int:
    acc = 0
    for v in values.tolist():
        acc ^= v & 0xFFFFFFFF
    return acc - (1 << 32) if acc >= 1 << 31 else acc


# ----------------------------------------------------------------------------------------------------------------
# offline: compile every config for sm_90
# ----------------------------------------------------------------------------------------------------------------
def _compile_tma(cfg):
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource

    _pattern, block_r, block_c, _row, _stages, _per_sm, swizzle = cfg
    constants = _tma_constants(cfg)
    desc = f"tensordesc<i32[{block_r}, {block_c // 4}],{_smem_layout(swizzle)!r}>"
    signature = dict(desc=desc, out_ptr="*i32", num_tiles="i32", tiles_per_prog="i32",
                     **{name: "constexpr" for name in constants})
    attrs = {(_tma_ring_kernel.arg_names.index("out_ptr"),): [["tt.divisibility", 16]]}
    source = GluonASTSource(_tma_ring_kernel, signature=signature, constexprs=constants, attrs=attrs)
    return triton.compile(source, target=GPUTarget("cuda", 90, 32), options={"num_warps": WARPS})


def _compile_triton(kernel, constants, warps):
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    signature = dict(w_ptr="*i32", out_ptr="*i32", **{name: "constexpr" for name in constants})
    attrs = {(kernel.arg_names.index(name),): [["tt.divisibility", 16]] for name in ("w_ptr", "out_ptr")}
    source = ASTSource(kernel, signature=signature, constexprs=constants, attrs=attrs)
    return triton.compile(source, target=GPUTarget("cuda", 90, 32), options={"num_warps": warps})


def _cuobjdump():
    path = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    return path if os.path.exists(path) else shutil.which("cuobjdump")


SASS_OPS = ["UTMALDG", "UBLKPF", "UBLKCP", "SYNCS", "LDS", "LDG", "BAR", "CCTL"]
PTX_OPS = ["cp.async.bulk.tensor", "cp.async.bulk.prefetch", "mbarrier.try_wait", "mbarrier.arrive.expect_tx",
           "ld.shared", "ld.global", "fence.proxy.async"]


def _inspect(compiled):
    """Registers / local memory (``cuobjdump -res-usage``), dynamic shared memory (the launch metadata) and counts
    of key PTX and SASS instructions of a compiled kernel."""
    info = dict(regs=None, local=None, shared=compiled.metadata.shared)
    ptx = compiled.asm["ptx"]
    info["ptx"] = {op: len(re.findall(re.escape(op), ptx)) for op in PTX_OPS}
    tool = _cuobjdump()
    if tool:
        with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
            f.write(compiled.asm["cubin"])
            f.flush()
            usage = subprocess.run([tool, "-res-usage", f.name], capture_output=True, text=True, check=True).stdout
            sass = subprocess.run([tool, "-sass", f.name], capture_output=True, text=True, check=True).stdout
        for key, name in (("regs", "REG"), ("local", "LOCAL")):
            m = re.search(name + r":(\d+)", usage)
            info[key] = int(m.group(1)) if m else None
        info["sass"] = {op: len(re.findall(r"\b" + op + r"\b", sass)) for op in SASS_OPS}
    return info


def compile_all_for_sm90():
    """Compile every kernel configuration the GPU run launches, for sm_90, without a GPU; print registers,
    shared memory and key PTX / SASS instruction counts. Returns the list of result dicts."""
    results = []

    def report(label, compiled):
        info = _inspect(compiled)
        info["config"] = label
        results.append(info)
        sass = " ".join(f"{k}={v}" for k, v in info.get("sass", {}).items() if v)
        ptx = " ".join(f"{k}={v}" for k, v in info["ptx"].items() if v)
        print(f"{label}: regs {info['regs']}, local {info['local']} B, smem {info['shared']} B\n"
              f"    SASS: {sass or '(no cuobjdump)'}\n    PTX:  {ptx}")

    for cfg in TMA_CONFIGS:
        compiled = _compile_tma(cfg)
        report(_tma_label(cfg).strip("| ").replace(" | ", ", "), compiled)
        per_sm = cfg[5]
        if compiled.metadata.shared * per_sm > SMEM_PER_SM - 1024 * per_sm:
            print(f"    WARNING: {per_sm} programs x {compiled.metadata.shared} B do not fit one SM")
    for chunk, steps, phases, warps in PREFETCH_CONFIGS:
        compiled = _compile_triton(_prefetch_contiguous_kernel,
                                   dict(CHUNK=chunk, STEPS=steps, PHASES=phases, THREADS=32 * warps), warps)
        report(f"bulk_prefetch_then_load, {chunk} B x {steps} steps, {phases} phases, {warps} warps", compiled)
    for chunk, steps, warps in CONTIGUOUS_REFS:
        compiled = _compile_triton(_contiguous_kernel, dict(CHUNK=chunk, STEPS=steps), warps)
        report(f"contiguous (probe_stream), {chunk} B x {steps} steps, {warps} warps", compiled)
    return results


# ----------------------------------------------------------------------------------------------------------------
# GPU run
# ----------------------------------------------------------------------------------------------------------------
def main():
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # graph_timing
    from graph_timing import add_flush_argument, use_flush_mode

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default=None, help="markdown file (a .json with the same stem is written too)")
    parser.add_argument("--compile-only", action="store_true", help="compile every config for sm_90 (no GPU)")
    add_flush_argument(parser)
    args = parser.parse_args()
    if args.compile_only:
        compile_all_for_sm90()
        return
    if not torch.cuda.is_available():
        sys.exit("probe_stream_tma.py needs a CUDA GPU (use --compile-only to compile the kernels offline)")
    if torch.cuda.get_device_capability()[0] != 9:
        sys.exit("probe_stream_tma.py needs an sm_90 (Hopper) GPU")
    use_flush_mode(args.flush)
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    num_sms = torch.cuda.get_device_properties(0).multi_processor_count
    pools = [torch.randint(-2**31, 2**31 - 1, (EXPERTS * N_ROWS, ROW_BYTES // 4), dtype=torch.int32, device="cuda")
             for _ in range(4)]  # rotate: 4 x 117 MB, far beyond L2
    pool_xor = [_xor_all(p) for p in pools]
    out = torch.empty(1 << 20, dtype=torch.int32, device="cuda")
    it = [0]

    def bench(launch):
        """launch(i) runs on pools[i]; returns the median us over rotating pools and the last check (or None)."""
        def fn():
            it[0] = (it[0] + 1) % len(pools)
            launch(it[0])
        fn()
        return triton.testing.do_bench(fn, warmup=10, rep=50, return_mode="median") * 1e3

    def checked(launch, programs):
        """Run once on pools[0]; whether the xor of the programs' words equals the buffer's."""
        out[:programs].zero_()
        launch(0)
        torch.cuda.synchronize()
        return _xor_host(out[:programs].cpu()) == pool_xor[0]

    rows = []

    def add(label, programs, us, check, nbytes=TOTAL):
        tbs = nbytes / us / 1e6
        rows.append(dict(label=label, programs=programs, us=round(us, 2), tbs=round(tbs, 3),
                         pct=round(100 * tbs / HBM_TBS, 1), check=check))
        print(f"{label} | {programs} | {us:.1f} | {tbs:.2f} | {100 * tbs / HBM_TBS:.0f}% | {check}", flush=True)

    for chunk, steps, warps in CONTIGUOUS_REFS:
        programs = TOTAL // (chunk * steps)

        def launch(i, chunk=chunk, steps=steps, warps=warps, programs=programs):
            _contiguous_kernel[(programs,)](pools[i], out, CHUNK=chunk, STEPS=steps, num_warps=warps)
        add(f"| contiguous (probe_stream) | {chunk} B per step x {steps} | - | -", programs, bench(launch), "-")

    for cfg in TMA_CONFIGS:
        _pattern, block_r, block_c, row, stages, per_sm, swizzle = cfg
        n_rows, num_tiles, tiles_per_prog, programs = _tma_geometry(block_r, block_c, row, num_sms, per_sm)
        layout = _smem_layout(swizzle)
        descs = [TensorDescriptor(p.view(n_rows, row // 4), [n_rows, row // 4], [row // 4, 1], [block_r, block_c // 4],
                                  layout) for p in pools]
        consts = _tma_constants(cfg)

        def launch(i, descs=descs, programs=programs, num_tiles=num_tiles, tiles_per_prog=tiles_per_prog,
                   consts=consts):
            _tma_ring_kernel[(programs,)](descs[i], out, num_tiles, tiles_per_prog, **consts)
        check = checked(launch, programs) if consts["CONSUME"] else "-"
        add(_tma_label(cfg), programs, bench(launch), check)

    for chunk, steps, phases, warps in PREFETCH_CONFIGS:
        programs = TOTAL // (chunk * steps)

        def launch(i, chunk=chunk, steps=steps, phases=phases, warps=warps, programs=programs):
            _prefetch_contiguous_kernel[(programs,)](pools[i], out, CHUNK=chunk, STEPS=steps, PHASES=phases,
                                                     THREADS=32 * warps, num_warps=warps)
        add(f"| bulk_prefetch_then_load | {chunk} B per step x {steps}, {warps} warps | {phases} phases "
            f"({chunk * steps // phases // 1024} KB each) | -", programs, bench(launch), checked(launch, programs))

    copy_src, copy_dst = pools[0], torch.empty_like(pools[0])
    us = triton.testing.do_bench(lambda: copy_dst.copy_(copy_src), warmup=10, rep=50, return_mode="median") * 1e3
    add("| torch copy_ (read + write bytes) | - | - | -", "-", us, "-", nbytes=2 * TOTAL)

    date = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    header = [f"# TMA streaming probe: {EXPERTS} experts x {N_ROWS} rows x {ROW_BYTES} bytes "
              f"(one token's gate_up weights, {TOTAL / 1e6:.0f} MB), read-only", "",
              f"- date: {date}; device: {torch.cuda.get_device_name()} ({num_sms} SMs); torch {torch.__version__}; "
              f"triton {triton.__version__}",
              f"- command: `python {' '.join(sys.argv)}`",
              f"- median of triton.testing.do_bench (L2 flushed by a {args.flush} flush before every repetition), 4 "
              "rotating buffers; "
              "check: xor of the words each program read == xor of the buffer", "",
              "| pattern | tile / access | depth | programs per SM | programs | us | TB/s | % of 3.0 TB/s | check |",
              "|---|---|---|---|---|---|---|---|---|"]
    lines = header + [f"{r['label']} | {r['programs']} | {r['us']:.1f} | {r['tbs']:.2f} | {r['pct']:.0f}% "
                      f"| {r['check']} |" for r in rows]
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text)
        meta = dict(date=date, device=torch.cuda.get_device_name(), num_sms=num_sms, torch=torch.__version__,
                    triton=triton.__version__, command=" ".join(sys.argv), total_bytes=TOTAL, rows=rows)
        with open(os.path.splitext(args.out)[0] + ".json", "w") as f:
            json.dump(meta, f, indent=1)


if __name__ == "__main__":
    main()
