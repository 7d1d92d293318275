"""Offline sm_90 builds of the decode-path kernels with and without PDL (test helper, run as a script).

Run in a fresh process without ``TRITON_INTERPRET`` (the interpreter replaces ``@triton.jit`` functions, which
the compiler cannot take): ``python tests/kernels/pdl_sm90_compile.py NAME [NAME ...]`` prints one JSON object
``{NAME: {"off": facts, "on": facts}}`` where facts = {"wait": count of ``griddepcontrol.wait``, "launch": count
of ``griddepcontrol.launch_dependents``, "wait_first": the wait comes before the kernel body's first global
memory instruction (ld / st / atom / red / cp.async ... .global), "wait_before_writes": no path of the control-flow
graph reaches a global store / atomic before the wait, "metadata_pdl": the build's ``launch_pdl``}.
Used by ``test_pdl.py``.
"""
import json
import os
import re
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))

import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

_GLOBAL_ACCESS = re.compile(r"^\s*(@!?%p\d+\s+)?(ld|st|atom|red|cp|prefetch|multimem)\.[\w:.]*global", re.M)
_GLOBAL_WRITE = re.compile(r"^\s*(@!?%p\d+\s+)?(st|atom|red|multimem)\.[\w:.]*global", re.M)


_LABEL = re.compile(r"^(\$L__BB\w+):")
_BRANCH = re.compile(r"^(@!?%p\d+\s+)?bra(\.uni)?\s+(\$L__BB\w+);")


def write_reachable_before_wait(body: str) -> bool:
    """Whether some path of the PTX control-flow graph from the kernel's entry reaches a global store / atomic
    before any ``griddepcontrol.wait`` (a path that meets the wait first stops there). Blocks: label to label;
    edges: ``bra`` targets and the fall-through unless the block ends with ``bra.uni`` / an unguarded ``bra`` or
    ``ret``."""
    blocks, order, name = {}, [], "entry"
    blocks[name] = []
    order.append(name)
    for line in body.splitlines():
        t = line.strip()
        label = _LABEL.match(t)
        if label:
            name = label.group(1)
            blocks[name] = []
            order.append(name)
            continue
        blocks[name].append(t)
    seen, todo = set(), ["entry"]
    while todo:
        name = todo.pop()
        if name in seen:
            continue
        seen.add(name)
        falls = True
        for t in blocks[name]:
            if "griddepcontrol.wait" in t:
                falls = False
                break
            if _GLOBAL_WRITE.match(t):
                return True
            branch = _BRANCH.match(t)
            if branch:
                todo.append(branch.group(3))
                if branch.group(1) is None:  # unguarded: no fall-through
                    falls = False
                    break
            if t.startswith("ret"):
                falls = False
                break
        if falls:
            i = order.index(name)
            if i + 1 < len(order):
                todo.append(order[i + 1])
    return False


def facts(compiled) -> dict:
    ptx = compiled.asm["ptx"]
    body = ptx[ptx.index(".entry"):]
    first = _GLOBAL_ACCESS.search(body)
    wait = body.find("griddepcontrol.wait")
    launch = body.find("griddepcontrol.launch_dependents")
    return dict(wait=body.count("griddepcontrol.wait"), launch=body.count("griddepcontrol.launch_dependents"),
                launch_first=launch >= 0 and (first is None or launch < first.start()),
                wait_first=wait >= 0 and (first is None or wait < first.start()),
                wait_before_writes=wait >= 0 and not write_reachable_before_wait(body),
                metadata_pdl=bool(getattr(compiled.metadata, "launch_pdl", False)))


def _triton(kernel, types: dict, constexprs: dict, num_warps: int, pdl: bool, **options):
    consts = dict(constexprs, PDL=pdl)
    sig = {name: ("constexpr" if name in consts else types[name]) for name in kernel.arg_names
           if name in consts or name in types}  # defaulted constexprs left out keep their default
    return triton.compile(ASTSource(kernel, sig, constexprs=consts), target=GPUTarget("cuda", 90, 32),
                          options=dict(num_warps=num_warps, launch_pdl=pdl, **options))


def build(name: str, pdl: bool):
    if name == "moe_dispatch":
        from megamoe.kernels import moe_dispatch as m
        types = dict(ids_ptr="*i32", offsets_ptr="*i32", sorted_expert_ptr="*i32", row_index_ptr="*i32",
                     inv_perm_ptr="*i32", err_ptr="*i32", num_pairs="i32", num_groups="i32")
        return _triton(m._moe_dispatch_kernel, types, dict(TOP_K=6, BINS=512, P_PAD=512, ERR_FLAG=1), 4, pdl)
    if name == "moe_router":
        from megamoe.kernels import moe_router as m
        types = dict(scores_ptr="*fp32", bias_ptr="*fp32", weights_ptr="*fp32", ids_ptr="*i32", num_experts="i32",
                     stride_s="i32", stride_w="i32", stride_i="i32", routed_scaling_factor="fp32",
                     token_ids_ptr="*i32", tid2eid_ptr="*i32", vocab="i32", stride_t="i32", err_ptr="*i32")
        return _triton(m._moe_topk_kernel, types, dict(TOP_K=6, K_PAD=8, E_PAD=256, HAS_BIAS=True, NORMALIZE=True,
                                                        N_GROUP=1, TOPK_GROUP=1, HASH=True, FLAG_TOKENS=1,
                                                        FLAG_TABLE=2), 1, pdl)
    if name == "moe_combine":
        from megamoe.kernels import moe_combine as m
        types = dict(expert_out_ptr="*bf16", inv_perm_ptr="*i32", weight_ptr="*fp32", shared_ptr="*bf16",
                     out_ptr="*bf16", err_ptr="*i32", H="i32", num_expert_rows="i32", stride_expert_out="i32",
                     stride_shared="i32", stride_out="i32")
        return _triton(m._moe_combine_kernel, types, dict(TOP_K=6, HAS_SHARED=True, BLOCK_H=1024, INTERPRET=False,
                                                           ERR_FLAG=1), 4, pdl)
    if name.startswith("topk_"):
        from megamoe.kernels import topk as m
        kernel, types, consts, warps = {
            "topk_split_max": (m._split_max_kernel, dict(scores_ptr="*fp32", ws_ptr="*i32", T="i32", ws_stride="i32",
                                                         SPAN="i32"), dict(CHUNK=1024), 8),
            "topk_split_rank": (m._split_rank_kernel, dict(out_ptr="*i32", ws_ptr="*i32", T="i32", K="i32",
                                                           ws_stride="i32", UOFF="i32", UMAX="i32"),
                                dict(RCH=32, UT=256), 8),
            "topk_sort": (m._topk_kernel, dict(scores_ptr="*fp32", out_ptr="*i32", scratch_ptr="*i32", T="i32",
                                               scratch_stride="i32", K="i32"),
                          dict(K_P2=16, CAP=16, CHUNK=16, SORT_N=2048), 8),
        }[name]
        return _triton(kernel, types, consts, warps, pdl)
    if name == "indexer_scores":
        from megamoe.kernels.kvcache import indexer as m
        types = dict(q_ptr="*bf16", weights_ptr="*fp32", slots_ptr="*i32", n_entries_ptr="*i32",
                     block_table_ptr="*i32", key_data_ptr="*u8", key_scale_ptr="*u8", scores_ptr="*fp32",
                     max_entries="i32", num_slots="i32", max_lb="i32", num_pages="i32", tile_max_ptr="*i32",
                     tile_max_stride="i32", err_ptr="*i32")
        return _triton(m._indexer_scores_kernel, types, dict(
            H=64, KEY_DIM=128, EPB=64, BLOCK=m.BLOCK_T["gpu"], INTERPRET=False, OFFICIAL=True, TILES=m.MAX_TILES,
            EMIT_MAX=True, FLAG_SLOTS=1 << 15, FLAG_ENTRIES=1 << 16, FLAG_TABLE=1 << 17), 8, pdl)
    if name == "attention_combine":
        from megamoe.kernels import sparse_attention as m
        types = dict(sink_ptr="*fp32", ws_acc_ptr="*fp32", ws_ml_ptr="*fp32", out_ptr="*bf16", H="i32")
        return _triton(m._combine_kernel, types, dict(NUM_SPLITS=4, D=512, BLOCK_H=m.COMBINE_CONFIG["BLOCK_H"],
                                                       BLOCK_D=min(m.COMBINE_CONFIG["BLOCK_D"], 512),
                                                       INTERPRET=False), m.COMBINE_CONFIG["num_warps"], pdl)
    if name == "attention_v1":
        from megamoe.kernels import sparse_attention as m
        return m.compile_sm90(split=True, pdl=pdl)
    if name == "attention_ws":
        from megamoe.kernels import sparse_attention_ws as m
        return m.compile_sm90(split=True, pdl=pdl)
    if name.startswith("hc_"):
        from megamoe.kernels import hyper_connection as m
        kernel = {"hc_partial": "_hc_mix_partial_kernel", "hc_finish": "_hc_pre_finish_kernel",
                  "hc_post": "_hc_post_kernel"}[name]
        return m.compile_sm90(pdl=pdl)[kernel]
    if name.startswith("v4_"):
        from megamoe.kernels import v4_elementwise as m
        return m.compile_sm90(name[3:], pdl=pdl)
    if name.startswith("sample_"):
        from megamoe.kernels import sampling as m
        if name == "sample_merge":
            types = dict(part_best_ptr="*fp32", part_at_ptr="*i32", ids_ptr="*i64", stride_i="i32", step_ptr="*i64",
                         out_ptr="*i64", P="i32")
            return _triton(m._sample_merge_kernel, types, dict(SORTED=True, P_P2=64), 1, pdl)
        types = dict(values_ptr="*fp32", ids_ptr="*i64", n_keep_ptr="*i32", temperature_ptr="*fp32", seed_ptr="*i64",
                     step_ptr="*i64", part_best_ptr="*fp32", part_at_ptr="*i32", N="i32", stride_v="i32",
                     stride_i="i32", P="i32")
        return _triton(m._sample_partial_kernel, types, dict(SORTED=False, BLOCK_V=m.SAMPLE_CONFIG["BLOCK_V"],
                                                              CHUNKS_PER_PART=4), m.SAMPLE_CONFIG["num_warps"], pdl)
    mma_decode_builds = {  # name: (BLOCK_M, BLOCK_N, BLOCK_K), SwiGLU epilogue, constants beyond SPLIT / STAGES / PDL
        "mma_decode": ((8, 128, 256), True, {}),
        # EARLY_READS: the tile table and the first weights before the wait
        "mma_decode_early": ((8, 128, 256), False, dict(EARLY_READS=True, W_IL=4, X_PAIRED=True)),
        # a later band: trigger first, compute, wait for the previous band at exit
        "mma_decode_after_band": ((32, 128, 128), True, dict(AFTER_BAND=pdl, W_IL=4)),
    }
    if name in mma_decode_builds:
        from megamoe.kernels.gemm import nvfp4_gluon_jit
        from megamoe.kernels.gemm import nvfp4_mma_decode as m
        blocks, swiglu, extra = mma_decode_builds[name]
        return nvfp4_gluon_jit.compile_sm90(m._nvfp4_mma_decode_kernel, m.COMPILE_SCALARS, blocks, 4, swiglu=swiglu,
                                            extra_signature=m.COMPILE_EXTRA_POINTERS,
                                            extra_constants=dict(SPLIT=0, STAGES=0, PDL=pdl, **extra))
    if name.startswith("splitk_"):  # the dense split-K GEMM: "_early" loads its first weight step before the wait
        from megamoe.kernels.gemm import nvfp4_splitk as m
        kind, early = name[len("splitk_"):].split("_")[0], name.endswith("_early")
        if kind == "fma":
            return m.compile_partial_for_sm90(m.SPLITK_CONFIGS[1], pdl=pdl, early_reads=early and pdl)
        config = {"mma": m.SPLITK_CONFIGS[8], "wgmma": m.SPLITK_CONFIGS[64]}[kind]
        return m.compile_for_sm90(config, pdl=pdl, early_reads=early and pdl)
    if name == "pipe_after_band":
        from megamoe.kernels.gemm import nvfp4_wgmma_pipe as m
        return m.compile_for_sm90(m.PIPE_BAND64_NARROW_CONFIG, swiglu=True, after_band=pdl)
    raise KeyError(name)


def main(names):
    print(json.dumps({name: {setting: facts(build(name, pdl)) for setting, pdl in (("off", False), ("on", True))}
                      for name in names}))


if __name__ == "__main__":
    main(sys.argv[1:])
