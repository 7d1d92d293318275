"""Compile the compressed-cache Triton kernels for sm_90 without a GPU and report ptxas resource usage.

Run as a script with ``TRITON_INTERPRET=0`` (the interpreter replaces ``@triton.jit`` helpers, which the
compiler cannot take); prints one JSON object ``{kernel_variant: {"regs", "spill_bytes", "wgmma"}}``.
Used by ``test_kvcache_sm90.py``; ``python tests/kvcache/kvcache_sm90_compile.py`` from the repo root.
"""
import json
import os
import re
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))

import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from megamoe.kernels.kvcache import (compress as kvcache_compress, flush as kvcache_flush,  # noqa: E402
                                     gather as kvcache_gather, indexer)

PTXAS = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas")


def compile_sm90(kernel, types: dict, constexprs: dict, num_warps: int = 4):
    sig = {name: ("constexpr" if name in constexprs else types[name]) for name in kernel.arg_names
           if name in constexprs or name in types}  # defaulted constexprs left out (e.g. PDL) keep their default
    consts = {(kernel.arg_names.index(k),): v for k, v in constexprs.items()}
    return triton.compile(ASTSource(kernel, sig, constexprs=consts), target=GPUTarget("cuda", 90, 32),
                          options={"num_warps": num_warps})


def ptxas_usage(compiled) -> dict:
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "k.ptx")
        with open(path, "w") as f:
            f.write(compiled.asm["ptx"])
        out = subprocess.run([PTXAS, "-v", "-arch=sm_90a", path, "-o", os.path.join(d, "k.cubin")],
                             capture_output=True, text=True, check=True).stderr
    regs = int(re.search(r"Used (\d+) registers", out).group(1))
    spills = sum(int(x) for x in re.findall(r"(\d+) bytes spill (?:stores|loads)", out))
    return {"regs": regs, "spill_bytes": spills, "wgmma": "wgmma" in compiled.asm["ptx"]}


def main():
    report = {}
    flush_types = dict(entry_ptr="*bf16", entry_bits_ptr="*i16", key_ptr="*bf16", flush_ptr="*i8",
                       slots_ptr="*i32", positions_ptr="*i32", block_table_ptr="*i32", fp8_ptr="*u8",
                       scale_ptr="*fp32", rope_ptr="*i16", key_data_ptr="*u8", key_scale_ptr="*u8",
                       err_ptr="*i32", num_slots="i32", max_lb="i32", num_pages="i32")
    for official in (True, False):
        cols = 7 if official else 1
        k = compile_sm90(kvcache_flush._flush_write_kernel, flush_types, dict(
            RATIO=4, EPB=64, NOPE=448, ROPE=64, ROPE_P2=64, SCALE_COLS=cols, COLS_P2=triton.next_power_of_2(cols),
            SB_P2=triton.next_power_of_2(448 // cols), OFFICIAL_ENTRY=official, HAS_KEY=True, KEY_DIM=128,
            OFFICIAL_KEY=official, FLAG_SLOTS=1 << 10, FLAG_POSITIONS=1 << 11, FLAG_TABLE=1 << 12))
        report[f"flush_{'official' if official else 'per_entry_nvfp4'}"] = ptxas_usage(k)
    gather_types = dict(indices_ptr="*i32", slots_ptr="*i32", block_table_ptr="*i32", fp8_ptr="*u8",
                        scale_ptr="*fp32", rope_ptr="*i16", out_ptr="*i16", err_ptr="*i32", K="i32", num_slots="i32",
                        max_lb="i32", num_pages="i32")
    for cols in (7, 1):
        k = compile_sm90(kvcache_gather._gather_entries_kernel, gather_types, dict(
            EPB=64, NOPE=448, ROPE=64, SCALE_COLS=cols, NOPE_P2=512, ROPE_P2=64, BLOCK=kvcache_gather.BLOCK_K,
            FLAG_INDICES=8, FLAG_SLOTS=16, FLAG_TABLE=32))
        report[f"gather_cols{cols}"] = ptxas_usage(k)
    index_types = dict(q_ptr="*bf16", weights_ptr="*fp32", slots_ptr="*i32", n_entries_ptr="*i32",
                       block_table_ptr="*i32", key_data_ptr="*u8", key_scale_ptr="*u8", scores_ptr="*fp32",
                       max_entries="i32", num_slots="i32", max_lb="i32", num_pages="i32", tile_max_ptr="*i32",
                       tile_max_stride="i32", err_ptr="*i32")
    for official, emit_max in ((True, False), (False, False), (True, True)):
        k = compile_sm90(indexer._indexer_scores_kernel, index_types, dict(
            H=64, KEY_DIM=128, EPB=64, BLOCK=indexer.BLOCK_T["gpu"], INTERPRET=False, OFFICIAL=official,
            TILES=indexer.MAX_TILES, EMIT_MAX=emit_max, FLAG_SLOTS=1 << 15, FLAG_ENTRIES=1 << 16,
            FLAG_TABLE=1 << 17),
            num_warps=8)
        report[f"indexer_{'official' if official else 'nvfp4'}{'_tile_max' if emit_max else ''}"] = ptxas_usage(k)
    compress_types = dict(kv_ptr="*fp32", score_ptr="*fp32", ape_ptr="*fp32", slots_ptr="*i32", positions_ptr="*i32",
                          active_ptr="*i8", tail_k_ptr="*fp32", tail_z_ptr="*fp32", tail_kb_ptr="*fp32",
                          tail_zb_ptr="*fp32", tail_len_ptr="*i32", pooled_ptr="*fp32", flush_ptr="*i8",
                          err_ptr="*i32", num_slots="i32", stride_kv="i32", stride_z="i32")
    for m, overlap, width in ((4, True, 512), (4, True, 128), (128, False, 512)):
        bd = kvcache_compress._BLOCK_D["small_m" if m <= 16 else "large_m"]
        k = compile_sm90(kvcache_compress._compress_step_kernel, compress_types,
                         dict(M=m, D=width, OVERLAP=overlap, M_P2=m, BLOCK_D=min(bd, width), HAS_APE=True,
                              FLAG_SLOTS=1 << 13, FLAG_POSITIONS=1 << 14))
        report[f"compress_m{m}_d{width}"] = ptxas_usage(k)
    print(json.dumps(report))


if __name__ == "__main__":
    main()
