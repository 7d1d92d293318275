"""W4A8 (NVFP4 weights x FP8 activations) kernels against ``megamoe/reference/w4a8.py``.

CPU: the Triton interpreter with the interpreter config (32-token tiles as two 16-token sub-tiles, 32
weight rows, 3 persistent programs), so the shapes cross tile and sub-tile edges. The interpreter has no FP8
``tl.dot`` and no inline PTX: there the kernel decodes the weights with the integer E4M3 encoder and
multiplies the exact FP8 values in fp32, so the GPU-only pieces (the PTX decode ``_decode_fp8_pairs_sm90``,
the FP8 wgmma, the hardware E4M3 casts) are checked by the ``cuda`` tests and, for compilation, registers
and instruction selection, by ``test_sm90_compile`` (offline).
"""
import os

import pytest
import torch

from gemm_helpers import every_code_weight, offsets_of, random_codes_weight, random_weight, rel_err
from megamoe.format.tensor import NVFP4Tensor
from megamoe.kernels.fp8_act_quant import launch_fp8_act_quant
from megamoe.ops.gemm import interleave_gate_up, nvfp4_grouped_mm, nvfp4_linear, w4a8_kernel_mode
from megamoe.reference import w4a8 as ref_w4a8
from megamoe.reference.quantize import dequantize, quantize


def _quant(x, mma_order=False):
    """x -> (codes, scales) through the quantizer kernel (``mma_order``: codes in the FP8 MMA K order)."""
    codes = torch.empty(x.shape, dtype=torch.float8_e4m3fn, device=x.device)
    scales = torch.empty(x.shape[0], dtype=torch.float32, device=x.device)
    return launch_fp8_act_quant(x, codes, scales, interpreter=not x.is_cuda, mma_order=mma_order)


def _assert_close_to_reference(out, ref, magnitude=None, far_fraction=0.01):
    """Same numerics up to float32 summation order: most bf16 outputs equal, the rest one rounding apart. On a GPU
    the FP8 tensor cores sum each 128-K block's products in their own order and reduced precision (DeepSeek-V3
    reports ~14 bits kept): outputs near a cancellation may then differ by more than their own rounding, so there
    at most ``far_fraction`` of them (default 1%) may, by at most 2**-10 of ``magnitude`` (default the largest
    output; after an activation, the largest GEMM output times the activation's Lipschitz bound)."""
    cuda = out.is_cuda
    out, ref = out.float().cpu(), ref.float().cpu()
    assert torch.equal(torch.isnan(out), torch.isnan(ref))
    ok = ~torch.isnan(ref)
    # a few bf16 roundings apart (one is 2**-8 of its element); on the GPU also the tensor cores' summation (an
    # H100 run of the SwiGLU test, whose 0.05 clamp leaves small outputs, gave 3.6e-3)
    assert rel_err(out[ok], ref[ok]) < (6e-3 if cuda else 3e-3)
    if not cuda:
        torch.testing.assert_close(out[ok], ref[ok], rtol=2 ** -7, atol=1e-6)
        return
    o, r = out[ok], ref[ok]
    far = (o - r).abs() > 2 ** -7 * r.abs() + 1e-6
    assert int(far.sum()) <= max(1, int(o.numel() * far_fraction)), int(far.sum())
    magnitude = float(r.abs().max()) if magnitude is None else magnitude
    torch.testing.assert_close(o, r, rtol=2 ** -7, atol=2 ** -10 * magnitude)


def test_quantizer_bit_exact(device):
    x = torch.randn(23, 384) * torch.logspace(-6, 6, 23)[:, None]
    x[0] = 0.0
    x[1, 7] = float("nan")
    x[2, 300] = float("inf")
    x[3, 5] = -float("inf")
    x[4] = -0.0
    x[5, :] = 1e-6  # below the 1e-4 amax floor
    x[6, 0] = 3.0e38  # near the bf16 maximum
    x = x.bfloat16().to(device)
    codes, scales = _quant(x)
    rc, rs = ref_w4a8.quantize_activations_fp8(x.cpu())
    assert torch.equal(codes.cpu().view(torch.uint8), rc.view(torch.uint8))
    assert torch.equal(scales.cpu().view(torch.int32), rs.view(torch.int32))
    assert torch.isnan(scales[1:4].cpu()).all() and torch.isfinite(scales[4:].cpu()).all()


def test_quantizer_empty(device):
    codes, scales = _quant(torch.empty(0, 128, dtype=torch.bfloat16, device=device))
    assert codes.shape == (0, 128) and scales.shape == (0,)


def test_every_code_and_scale_byte_decodes_exactly(device):
    """One-hot activations read single weight operands: kernel == reference bit for bit (no sums)."""
    n, k = 32, 128
    w = every_code_weight(n, k, device)
    x = torch.zeros(k, k)
    x[torch.arange(k), torch.arange(k)] = 1.0  # row j picks weight column j
    x = x.bfloat16().to(device)
    out = nvfp4_grouped_mm(x, w, offsets_of([k], device), mode="w4a8")
    ref = ref_w4a8.w4a8_grouped_mm(x.cpu(), w.to("cpu"), offsets_of([k], "cpu"))
    assert torch.equal(out.cpu().view(torch.int16), ref.view(torch.int16))


@pytest.fixture
def fp8_kernel_everywhere(monkeypatch):
    """On CUDA, small GEMMs of mode "w4a8" keep the w4a16 kernels (W4A8_MIN_ROWS_PER_EXPERT): the tests of the FP8
    kernel's numerics and edge cases at small shapes make it run at every size."""
    from megamoe.kernels.gemm import nvfp4_w4a8

    monkeypatch.setattr(nvfp4_w4a8, "W4A8_MIN_ROWS_PER_EXPERT", 0)


@pytest.mark.usefixtures("fp8_kernel_everywhere")
@pytest.mark.parametrize("counts,scale_kind", [([0, 37, 5, 0, 21], "row"), ([63, 0, 0, 0, 0], "tensor"),
                                               ([1, 1, 1, 1, 2], "expert")])
def test_grouped_matches_reference(device, counts, scale_kind):
    e, n, k = len(counts), 48, 256
    shape = {"tensor": None, "expert": (e, 1, 1), "row": (e, n, 1)}[scale_kind]
    w = random_weight((e, n, k), device, scale_shape=shape)
    t = sum(counts)
    x = (torch.randn(t + 3, k) * torch.logspace(-2, 2, t + 3)[:, None]).bfloat16().to(device)  # 3 padding rows
    offsets = offsets_of(counts, device)
    out = nvfp4_grouped_mm(x, w, offsets, mode="w4a8")
    ref = ref_w4a8.w4a8_grouped_mm(x.cpu(), w.to("cpu"), offsets.cpu())
    _assert_close_to_reference(out, ref)
    assert torch.equal(out[t:].cpu(), torch.zeros(3, n, dtype=torch.bfloat16))


@pytest.mark.usefixtures("fp8_kernel_everywhere")
def test_grouped_row_index_swiglu_skewed(device):
    """Fused gather + SwiGLU + clamp, skewed routing (one hot expert), T not a multiple of the tile."""
    e, n, k, s = 4, 64, 384, 29
    w = interleave_gate_up(random_weight((e, n, k), device, scale_shape=(e, n, 1)))
    x = (torch.randn(s, k) * 3).bfloat16().to(device)
    counts = [45, 2, 0, 6]
    row_index = torch.randint(0, s, (sum(counts),), dtype=torch.int32).to(device)
    offsets = offsets_of(counts, device)
    out = nvfp4_grouped_mm(x, w, offsets, mode="w4a8", row_index=row_index, activation="swiglu",
                           swiglu_limit=0.05)
    ref = ref_w4a8.w4a8_grouped_mm(x.cpu(), w.to("cpu"), offsets.cpu(), row_index=row_index.cpu(),
                                   activation="swiglu", swiglu_limit=0.05)
    assert out.shape == (sum(counts), n // 2)
    pre = ref_w4a8.w4a8_grouped_mm(x.cpu(), w.to("cpu"), offsets.cpu(), row_index=row_index.cpu())
    # SwiGLU with limit L moves by at most (1.1 L + 0.28) x its inputs' error (|silu'| <= 1.1, |clamp(u)| <= L,
    # |silu(min(g, L))| <= max(0.28, L))
    _assert_close_to_reference(out, ref, magnitude=float(pre.float().abs().max()) * (1.1 * 0.05 + 0.28))


def test_grouped_empty_and_zero(device):
    w = random_weight((3, 32, 128), device)
    x = torch.empty(0, 128, dtype=torch.bfloat16, device=device)
    assert nvfp4_grouped_mm(x, w, offsets_of([0, 0, 0], device), mode="w4a8").shape == (0, 32)
    x = torch.zeros(20, 128, dtype=torch.bfloat16, device=device)
    out = nvfp4_grouped_mm(x, w, offsets_of([10, 0, 10], device), mode="w4a8")
    assert torch.equal(out.cpu(), torch.zeros(20, 32, dtype=torch.bfloat16))
    zero = NVFP4Tensor(torch.zeros_like(w.data), torch.zeros_like(w.block_scale), w.global_scale, w.shape)
    out = nvfp4_grouped_mm(torch.randn(20, 128).bfloat16().to(device), zero, offsets_of([10, 0, 10], device),
                           mode="w4a8")
    assert torch.equal(out.cpu(), torch.zeros(20, 32, dtype=torch.bfloat16))


@pytest.mark.usefixtures("fp8_kernel_everywhere")
def test_nan_inf_policy(device):
    """A non-finite activation makes its token's outputs NaN; a NaN block scale its weight row's outputs."""
    n, k = 32, 256
    src = torch.randn(2, n, k) * 0.05
    src[1, 7, 130:140] = float("nan")
    w = quantize(src).to(device)
    x = torch.randn(12, k)
    x[2, 3] = float("nan")
    x[9, 200] = float("inf")
    x = x.bfloat16().to(device)
    out = nvfp4_grouped_mm(x, w, offsets_of([6, 6], device), mode="w4a8").cpu()
    bad_rows = torch.tensor([2, 9])
    assert torch.isnan(out[bad_rows]).all()
    good = torch.ones(12, dtype=torch.bool)
    good[bad_rows] = False
    assert torch.isnan(out[6:][good[6:]][:, 7]).all()
    cols = torch.arange(n) != 7
    assert torch.isfinite(out[good][:, cols]).all() and torch.isfinite(out[:6][good[:6]]).all()


@pytest.mark.parametrize("m", [1, 45])
def test_linear_matches_reference(device, m):
    n, k = 40, 256
    w = random_weight((n, k), device, per_row_scale=True)
    x = torch.randn(m, k).bfloat16().to(device)
    bias = torch.randn(n).bfloat16().to(device)
    out = nvfp4_linear(x, w, bias, mode="w4a8")
    if w4a8_kernel_mode(x, m, None) == "w4a16":  # CUDA decode sizes keep the w4a16 kernels
        ref = x.float().cpu() @ dequantize(w.to("cpu"), torch.float32).t() + bias.float().cpu()
        assert rel_err(out, ref) < 4e-3
        return
    _assert_close_to_reference(out, ref_w4a8.w4a8_linear(x.cpu(), w.to("cpu"), bias.cpu()))


def test_error_vs_float32_w4a16_is_measured():
    """The W4A8 rounding (FP8 activations + FP8 weight operands) is real and bounded: one GEMM (references,
    whose agreement with the kernels the tests above check), N(0, 1) activations: ~3.4e-2 (E4M3 alone
    ~2.7e-2, weight operands alone ~2.1e-2; w4a4 ~9e-2)."""
    from megamoe.reference.gemm import nvfp4_linear as reference_linear

    n, k = 256, 1024
    w = random_weight((n, k), "cpu")
    x = torch.randn(128, k).bfloat16()
    exact = x.float() @ dequantize(w, torch.float32).t()
    err8 = rel_err(ref_w4a8.w4a8_linear(x, w), exact)
    err_act = rel_err(ref_w4a8.fake_quant_activations(x) @ dequantize(w, torch.float32).t(), exact)
    err_w = rel_err(x.float() @ ref_w4a8.effective_weight(w).t(), exact)
    err4 = rel_err(reference_linear(x, w, mode="w4a4"), exact)
    assert 2e-2 < err8 < 4.5e-2 and 1.5e-2 < err_act < 3.5e-2 and 1e-2 < err_w < 3e-2 and err8 < err4 / 2


def test_validation(device):
    w = random_weight((2, 32, 64), device)
    x = torch.randn(4, 64).bfloat16().to(device)
    with pytest.raises(ValueError, match="K % 128"):
        nvfp4_grouped_mm(x, w, offsets_of([2, 2], device), mode="w4a8")
    with pytest.raises(ValueError, match="K % 128"):
        nvfp4_linear(x, random_weight((32, 64), device), mode="w4a8")
    with pytest.raises(ValueError, match="w4a8"):
        nvfp4_linear(x, random_weight((32, 64), device), mode="w8a8")


def test_host_rule():
    x = torch.empty(1, device="meta")
    cpu = torch.empty(1)
    assert w4a8_kernel_mode(cpu, 1, 256) == "w4a8"  # CPU / interpreter: always the w4a8 numerics
    if torch.cuda.is_available():
        g = torch.empty(1, device="cuda")
        assert w4a8_kernel_mode(g, 47 * 256, 256) == "w4a16"
        assert w4a8_kernel_mode(g, 48 * 256, 256) == "w4a8"
        assert w4a8_kernel_mode(g, 47, None) == "w4a16" and w4a8_kernel_mode(g, 48, None) == "w4a8"
    del x


# ---------------------------------------------------------------- sm_90 offline compile


_W4A8_SIGNATURE = {
    "xq_ptr": "*fp8e4nv", "xs_ptr": "*fp32", "row_index_ptr": "*i32", "w_ptr": "*u8", "scale_ptr": "*u8",
    "global_scale_ptr": "*fp32", "offsets_ptr": "*i32", "bias_ptr": "*fp32", "out_ptr": "*bf16", "err_ptr": "*i32",
    "num_rows": "i32", "N": "i32", "K": "i32", "num_experts": "i32", "swiglu_limit": "fp32", "num_programs": "i32",
    "num_src_rows": "i32", "stride_xm": "i32", "stride_we": "i64", "stride_wn": "i32", "stride_se": "i64",
    "stride_sn": "i32", "stride_ge": "i32", "stride_gn": "i32", "stride_om": "i32",
}
# arguments the JIT specialises as multiples of 16 at run time (pointers, K, N and the strides of V4 shapes)
_DIV16 = ("xq_ptr", "xs_ptr", "row_index_ptr", "w_ptr", "scale_ptr", "global_scale_ptr", "offsets_ptr",
          "bias_ptr", "out_ptr", "err_ptr", "N", "K", "stride_xm", "stride_we", "stride_wn", "stride_se",
          "stride_sn", "stride_om")

_COMPILE_SCRIPT = r"""
import json, os, re, subprocess, sys
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from megamoe.kernels.gemm import nvfp4_w4a8 as m
sig, div16, const, num_warps, num_stages = json.loads(sys.argv[1])
names = list(sig)
attrs = {(names.index(n),): [["tt.divisibility", 16]] for n in div16}
c = triton.compile(ASTSource(m._nvfp4_w4a8_kernel, dict(sig, **{k: "constexpr" for k in const}), const, attrs),
                   target=GPUTarget("cuda", 90, 32), options={"num_warps": num_warps, "num_stages": num_stages})
tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
open(sys.argv[2], "wb").write(c.asm["cubin"])
usage = subprocess.run([tool, "-res-usage", sys.argv[2]], capture_output=True, text=True, check=True).stdout
reg, stack = re.search(r"REG:(\d+) STACK:(\d+)", usage).groups()
ptx = c.asm["ptx"]
print(json.dumps({"reg": int(reg), "stack": int(stack), "wgmma": sorted(set(re.findall(r"wgmma\.mma_async\S*", ptx))),
                  "cvt": ptx.count("cvt.rn.satfinite.e4m3x2.f16x2"), "cp_async": ptx.count("cp.async")}))
"""


@pytest.mark.slow
@pytest.mark.parametrize("rows_per_expert", [64, 4096])
def test_sm90_compile(rows_per_expert, tmp_path):
    """Production configs compile for sm_90: FP8 wgmma (e4m3 x e4m3 -> f32), the PTX decode, cp.async
    pipelining, <= 255 registers and no spills (grouped, row_index gather, SwiGLU + clamp, device guard)."""
    import json
    import subprocess
    import sys

    import triton

    from megamoe.kernels.gemm.nvfp4_w4a8 import select_w4a8_config

    if not os.path.exists(os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")):
        pytest.skip("cuobjdump not available")
    block_m, block_n, split_m, num_warps, num_stages, _ = select_w4a8_config(rows_per_expert, False)
    const = dict(BLOCK_M=block_m, BLOCK_N=block_n, SPLIT_M=split_m, BLOCK_E=512, GROUPED=True, HAS_ROW_INDEX=True,
                 HAS_BIAS=False, SWIGLU=True, HAS_LIMIT=True, EVEN_N=True, INTERPRET=False, ERR_FLAG=1)
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    env["PYTHONPATH"] = root + os.pathsep + env.get("PYTHONPATH", "")
    args = json.dumps([_W4A8_SIGNATURE, list(_DIV16), const, num_warps, num_stages])
    run = subprocess.run([sys.executable, "-c", _COMPILE_SCRIPT, args, str(tmp_path / "k.cubin")], env=env,
                         cwd=root, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-2000:]
    info = json.loads(run.stdout.strip().splitlines()[-1])
    assert info["wgmma"] and all(".e4m3.e4m3" in w and ".f32." in w for w in info["wgmma"]), info
    assert info["cvt"] > 0 and info["cp_async"] > 0, info
    assert info["reg"] <= 255 and info["stack"] == 0, info


# ---------------------------------------------------------------- CUDA (lead's H100 run)


@pytest.mark.cuda
@pytest.mark.parametrize("preset,tokens", [("v4-flash", 4096), ("v4-pro", 4096)])
def test_cuda_v4_shapes_match_reference_graph_and_sync_free(preset, tokens):
    """Real V4 expert shapes (gate_up + SwiGLU with the fused gather, down): kernel vs reference on the busiest
    expert (the FP8 wgmma sums each 128-K step in reduced precision, hence 2e-3), no host syncs, graph
    replay == eager after the inputs and the routing change in place."""
    from gemm_helpers import check_sync_free_and_graph
    from megamoe.models.config import PRESETS

    c = PRESETS[preset]
    e, h, i = c.num_experts, c.hidden_size, c.intermediate_size
    for proj, (n, k) in (("gate_up", (2 * i, h)), ("down", (h, i))):
        w = random_codes_weight((e, n, k), "cuda", scale_shape=(e, 1, 1))  # quantize: minutes at these shapes
        swiglu = proj == "gate_up"
        if swiglu:
            w = interleave_gate_up(w)
        experts = torch.rand(tokens, e).topk(c.top_k, dim=1).indices.flatten()
        counts = torch.bincount(experts, minlength=e)
        offsets = offsets_of(counts.tolist(), "cuda")
        t = int(counts.sum())
        x = torch.randn(tokens if swiglu else t, k, device="cuda").bfloat16()
        row_index = torch.randint(0, tokens, (t,), dtype=torch.int32, device="cuda") if swiglu else None
        act = dict(activation="swiglu", swiglu_limit=10.0) if swiglu else {}
        out = torch.empty(t, n // 2 if swiglu else n, dtype=torch.bfloat16, device="cuda")

        def launch():
            return nvfp4_grouped_mm(x, w, offsets, mode="w4a8", out=out, row_index=row_index, **act)

        eager = launch().clone()
        top = int(counts.argmax())
        start = int(counts[:top].sum())
        sub = slice(start, start + min(192, int(counts[top])))
        # the reference runs on the GPU too (pure torch): on the CPU the V4-Pro expert took minutes (gpu_check_v9)
        w_e = NVFP4Tensor(w.data[top:top + 1], w.block_scale[top:top + 1], w.global_scale[top:top + 1], (1, n, k))
        xs = x if row_index is None else x[row_index.long()]
        ref = ref_w4a8.w4a8_grouped_mm(xs[sub], w_e, torch.tensor([sub.stop - sub.start], dtype=torch.int32,
                                                                  device="cuda"), **act)
        assert rel_err(eager[sub], ref) < 2e-3
        check_sync_free_and_graph(launch, x, offsets, t)


@pytest.mark.cuda
def test_cuda_quantizer_bit_exact_large():
    x = (torch.randn(4099, 7168, device="cuda") * torch.logspace(-8, 8, 4099, device="cuda")[:, None]).bfloat16()
    codes, scales = _quant(x)
    rc, rs = ref_w4a8.quantize_activations_fp8(x)
    assert torch.equal(codes.view(torch.uint8), rc.view(torch.uint8)) and torch.equal(scales, rs)
