"""Offline sm_90 build of the peer's MoE GEMM (``triton_kernels`` v3.6.0, MXFP4 on Hopper) for SASS counting.

No GPU needed: the peer's own host code (``matmul_ogs``: opt_flags, layouts, argument packing) runs on CPU
tensors with a fake CUDA driver (target sm_90, 132 SMs, 227 KB opt-in smem, as an H100 SXM reports), and every
Triton launch is turned into a compile-only ``warmup``. The compiled ``_matmul_ogs`` kernel is written as a cubin
and summarised: opt_flags, registers, smem, and the SASS of its K loop by instruction class
(``count_decode_ops.classify``-style), per weight.

Usage (peer found as in bench_peer.py: $MEGAMOE_PEERS or ../shared/peers):
  python benchmarks/peer_sass.py [--tokens 512,4096] [--out-dir DIR] [--dump]
Prints one JSON line per (tokens, GEMM) and writes ``peer_sass_<tokens>_<gemm>.{sass,json}`` under --out-dir
(default /tmp/peer_sass).
"""
from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
from types import SimpleNamespace

import torch

_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(_HERE))
sys.path.insert(0, _HERE)

WEIGHT_EXPERTS = 2
H100 = SimpleNamespace(multi_processor_count=132, shared_memory_per_block_optin=232448, name="fake H100")


def _fake_cuda():
    """Make torch.cuda / the Triton driver answer as an sm_90 H100, compile-only."""
    import triton
    import triton.runtime.jit as jit
    from triton.backends.compiler import GPUTarget

    torch.cuda.get_device_capability = lambda *a, **k: (9, 0)
    torch.cuda.get_device_properties = lambda *a, **k: H100
    torch.cuda.is_available = lambda: False

    class _Driver:
        def get_current_target(self):
            return GPUTarget("cuda", 90, 32)

        def get_current_device(self):
            return 0

        def get_current_stream(self, device=None):
            return 0

        def get_active_torch_device(self):
            return torch.device("cpu")

    triton.runtime.driver.set_active(_Driver())
    compiled = []
    orig_run = jit.JITFunction.run

    def run(self, *args, grid, warmup, **kwargs):
        k = orig_run(self, *args, grid=grid, warmup=True, **kwargs)
        g = grid(None) if callable(grid) else grid
        compiled.append((self._fn_name, k, g))
        return k

    jit.JITFunction.run = run
    return compiled


def peer_problem(tk, tokens: int, experts: int, topk: int, hidden: int, inter: int, seed: int = 0):
    """Uniform routing as bench_moe_skew's (random top-k distinct experts per token), the peer's objects."""
    from bench_peer import peer_routing

    g = torch.Generator().manual_seed(seed)
    ids = torch.stack([torch.randperm(experts, generator=g)[:topk] for _ in range(tokens)])
    wts = torch.rand(tokens, topk, generator=g)
    r = peer_routing(ids, wts, experts)
    meta = tk.make_ragged_tensor_metadata_torch(r["hist"], ids.numel())
    rd = tk.RoutingData(r["gate_scal"], r["hist"], experts, topk, expt_data=meta)
    gi = tk.GatherIndx(src_indx=r["gather_src"], dst_indx=r["gather_dst"])
    si = tk.ScatterIndx(src_indx=r["gather_dst"], dst_indx=r["gather_src"])

    def weight(k, n):
        # downcast_to_mxfp(w.transpose(1, 2), axis=1) layout: (E, K//2, N) views of (E, N, K//2) storage. Only
        # WEIGHT_EXPERTS experts are materialised: the kernel is specialised on strides and flags, not on E.
        quant = torch.randint(0, 256, (WEIGHT_EXPERTS, n, k // 2), dtype=torch.uint8, generator=g).transpose(1, 2)
        scale = torch.randint(118, 130, (WEIGHT_EXPERTS, n, k // 32), dtype=torch.uint8, generator=g).transpose(1, 2)
        w = tk.convert_layout(tk.wrap_torch_tensor(quant, dtype=tk.FP4), tk.HopperMXValueLayout, mx_axis=1)
        s = tk.convert_layout(tk.wrap_torch_tensor(scale), tk.HopperMXScaleLayout, mx_axis=1, num_warps=8)
        return w, tk.PrecisionConfig(weight_scale=s, flex_ctx=tk.FlexCtx(rhs_data=tk.InFlexData()))

    return SimpleNamespace(rd=rd, gi=gi, si=si, hist=r["hist"], up=weight(hidden, 2 * inter), down=weight(inter, hidden))


# ------------------------------------------------------------------------------------------------ SASS analysis
CLASSES = [
    ("hgmma", r"^HGMMA"), ("hmma", r"^HMMA"), ("utmaldg", r"^UTMALDG"), ("ldgsts", r"^LDGSTS"), ("ldg", r"^LDG"),
    ("lds", r"^LDS|^LDSM"), ("sts", r"^STS"), ("stg", r"^STG"), ("hmul2/hfma2", r"^HMUL2|^HFMA2"),
    ("lop3/shf/shl", r"^LOP3|^SHF|^SHL|^SHR|^IMAD\.SHL"), ("prmt", r"^PRMT"), ("bar/sync", r"^BAR|^SYNCS|^WARPSYNC|^DEPBAR|^WARPGROUP"),
    ("mov", r"^MOV|^R2UR|^S2R|^S2UR|^UMOV|^CS2R"), ("int/addr", r"^IADD|^IMAD|^LEA|^ISETP|^UIADD|^ULEA|^UIMAD|^SEL|^USEL|^ISET"),
    ("branch", r"^BRA|^EXIT|^BSYNC|^BSSY|^CALL|^RET"), ("ldl/stl", r"^LDL|^STL"), ("cvt/f2f", r"^F2F|^I2F|^F2I|^F2FP"),
]


def classify(op: str) -> str:
    for name, pat in CLASSES:
        if re.match(pat, op):
            return name
    return "other"


def sass_function(sass: str, name_part: str) -> list:
    """(offset, opcode with modifiers, full text) of the function whose name contains name_part."""
    out, inside = [], False
    for line in sass.splitlines():
        if "Function :" in line:
            inside = name_part in line
            continue
        m = re.match(r"\s*/\*([0-9a-f]{4,})\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]*)(.*);", line)
        if inside and m:
            out.append((int(m.group(1), 16), m.group(2), line.strip()))
    return out


def hottest_loop(instrs: list):
    """The backward branch enclosing the most HGMMA / HMMA (the K loop): (start, end) offsets."""
    best = None
    for off, op, text in instrs:
        m = re.search(r"BRA\s+(?:\S+\s+)?`?\(?\.L_x_\d+\)?`?|BRA\s+0x([0-9a-f]+)", text)
        if not op.startswith("BRA"):
            continue
        t = re.search(r"0x([0-9a-f]+)", text.split("BRA", 1)[1])
        if not t:
            continue
        target = int(t.group(1), 16)
        if target >= off:
            continue
        n = sum(1 for o, p, _ in instrs if target <= o <= off and (p.startswith("HGMMA") or p.startswith("HMMA")))
        if n and (best is None or n > best[2] or (n == best[2] and off - target < best[1] - best[0])):
            best = (target, off, n)
    return best


def summarize_loop(instrs: list, loop) -> dict:
    start, end, _ = loop
    body = [(o, p, t) for o, p, t in instrs if start <= o <= end]
    counts: dict = {}
    for _, op, _ in body:
        c = classify(op)
        counts[c] = counts.get(c, 0) + 1
    shapes = sorted({re.sub(r"\s.*", "", t.split(" ", 1)[1]).strip() if False else p for _, p, t in body
                     if p.startswith("HGMMA") or p.startswith("HMMA")})
    a_regs = sum(1 for _, p, t in body if p.startswith("HGMMA") and re.search(r"HGMMA\S*\s+R\d+,\s*R\d+", t))
    return {"instructions": len(body), "by_class": dict(sorted(counts.items(), key=lambda kv: -kv[1])),
            "mma_ops": shapes, "hgmma_with_A_from_registers": a_regs}


def analyse(kernel, name: str, out_dir: str, tag: str, weights_per_iter: int, warps: int, dump: bool) -> dict:
    import triton

    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    cubin = os.path.join(out_dir, f"{tag}.cubin")
    with open(cubin, "wb") as f:
        f.write(kernel.asm["cubin"])
    usage = subprocess.run([tool, "-res-usage", cubin], capture_output=True, text=True, check=True).stdout
    sass = subprocess.run([tool, "-sass", cubin], capture_output=True, text=True, check=True).stdout
    with open(os.path.join(out_dir, f"{tag}.sass"), "w") as f:
        f.write(sass)
    if dump:
        with open(os.path.join(out_dir, f"{tag}.ptx"), "w") as f:
            f.write(kernel.asm["ptx"])
    reg, stack = re.search(r"REG:(\d+)", usage), re.search(r"STACK:(\d+)", usage)
    instrs = sass_function(sass, name)
    loop = hottest_loop(instrs)
    info = {"kernel": name, "regs": int(reg.group(1)) if reg else None, "stack": int(stack.group(1)) if stack else None,
            "shared_bytes": kernel.metadata.shared, "num_warps": kernel.metadata.num_warps,
            "num_stages": kernel.metadata.num_stages, "total_sass": len(instrs)}
    if loop:
        s = summarize_loop(instrs, loop)
        threads = 32 * warps
        s["weights_per_iteration"] = weights_per_iter
        s["instr_per_weight"] = round(s["instructions"] * threads / weights_per_iter, 3)
        s["by_class_per_weight"] = {k: round(v * threads / weights_per_iter, 3) for k, v in s["by_class"].items()}
        info["k_loop"] = s
    return info


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", default="512,4096")
    p.add_argument("--experts", type=int, default=256)
    p.add_argument("--topk", type=int, default=6)
    p.add_argument("--hidden", type=int, default=4096)
    p.add_argument("--inter", type=int, default=2048)
    p.add_argument("--out-dir", default="/tmp/peer_sass")
    p.add_argument("--dump", action="store_true", help="also write the PTX")
    p.add_argument("--ours", action="store_true", help="our kernels instead (mma decode 32 / 8, wgmma v7)")
    a = p.parse_args(argv)
    os.makedirs(a.out_dir, exist_ok=True)
    if a.ours:
        return ours(a.out_dir, a.dump)
    os.environ.pop("TRITON_INTERPRET", None)
    compiled = _fake_cuda()
    from bench_peer import load_peer

    tk, where = load_peer()
    if tk is None:
        raise SystemExit(f"peer not importable: {where}")
    from triton_kernels.matmul_ogs_details import opt_flags as of

    of.update_opt_flags_constraints({"split_k": 1})
    captured = {}
    orig_make = of.make_opt_flags

    def make(*args, **kw):
        f = orig_make(*args, **kw)
        captured["flags"] = f
        return f

    import triton_kernels.matmul_ogs as mo

    mo.make_opt_flags = make
    results = []
    for t in [int(x) for x in a.tokens.split(",")]:
        prob = peer_problem(tk, t, a.experts, a.topk, a.hidden, a.inter)
        x = torch.randn(t, a.hidden, dtype=torch.bfloat16)
        act = tk.FusedActivation(tk.FnSpecs("swiglu", tk.swiglu_fn, ("alpha", "limit"), reduction_n=2), (1.0, 10.0))
        inter_x = torch.randn(t * a.topk, a.inter, dtype=torch.bfloat16)
        for gemm, call in (("gate_up", lambda: tk.matmul_ogs(x, prob.up[0], None, prob.rd, gather_indx=prob.gi,
                                                               precision_config=prob.up[1], fused_activation=act)),
                           ("down", lambda: tk.matmul_ogs(inter_x, prob.down[0], None, prob.rd, scatter_indx=prob.si,
                                                          precision_config=prob.down[1], gammas=prob.rd.gate_scal))):
            compiled.clear()
            try:
                call()
            except Exception as e:  # noqa: BLE001  (post-processing on fake outputs may fail after the compile)
                import traceback; traceback.print_exc()
            f = captured["flags"]
            mm = [(n, k, g) for n, k, g in compiled if "matmul_ogs" in n]
            if not mm:
                raise SystemExit(f"{t} {gemm}: no matmul kernel was compiled ({[n for n, _, _ in compiled]})")
            name, kern, grid = mm[0]
            n = 2 * a.inter if gemm == "gate_up" else a.hidden
            info = analyse(kern, "matmul_ogs", a.out_dir, f"peer_sass_{t}_{gemm}", f.block_n * f.block_k, f.num_warps,
                           a.dump)
            hist = prob.hist
            info.update(tokens=t, gemm=gemm, kernel_name=name, grid=list(grid) if isinstance(grid, tuple) else grid,
                        opt_flags=dict(block_m=f.block_m, block_n=f.block_n, block_k=f.block_k, num_warps=f.num_warps,
                                       num_stages=f.num_stages, split_k=f.split_k, is_persistent=f.is_persistent,
                                       group_m=f.group_m, epilogue_subtile=f.epilogue_subtile,
                                       w_cache_modifier=f.w_cache_modifier),
                        m_tiles=int(sum((int(h) + f.block_m - 1) // f.block_m for h in hist)), n_tiles=n // f.block_n,
                        rows_per_expert=dict(mean=float(hist.float().mean()), max=int(hist.max())),
                        other_kernels=sorted({nm for nm, _, _ in compiled if nm != name}))
            with open(os.path.join(a.out_dir, f"peer_sass_{t}_{gemm}.json"), "w") as fh:
                json.dump(info, fh, indent=1)
            print(json.dumps(info))
            results.append(info)
    return results




def ours(out_dir: str = "/tmp/peer_sass", dump: bool = False) -> list:
    """The same SASS summary for our kernels at the same shapes (no fake driver needed: compile_for_sm90)."""
    os.environ.pop("TRITON_INTERPRET", None)
    from megamoe.kernels.gemm import nvfp4_mma_decode as mma
    from megamoe.kernels.gemm import nvfp4_wgmma as wg

    os.makedirs(out_dir, exist_ok=True)
    rows = []
    cases = [("mma_decode", mma.compile_for_sm90, cfg, cfg[1] * cfg[2], cfg[3]) for cfg in
             [(32, 128, 128, 4), (8, 128, 256, 4)]]
    cases.append(("wgmma", wg.compile_for_sm90, wg.WGMMA_CONFIG, wg.WGMMA_CONFIG[1] * wg.WGMMA_CONFIG[2],
                  wg.WGMMA_CONFIG[3]))
    for name, fn, cfg, weights, warps in cases:
        for swiglu in (True, False):
            k = fn(cfg, swiglu=swiglu)
            tag = f"ours_{name}_{'x'.join(map(str, cfg))}_{'swiglu' if swiglu else 'plain'}"
            info = analyse(k, "nvfp4", out_dir, tag, weights, warps, dump)
            info.update(config=list(cfg), swiglu=swiglu, tag=tag)
            print(json.dumps(info))
            rows.append(info)
    return rows


if __name__ == "__main__":
    main()
