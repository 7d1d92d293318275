"""The float32 error bound of the fused decode MoE (tests/kernels/test_moe_fused_decode.py, tests/layers).

``fused_bound(layer, x, weights, ids)`` -> (ref, bound, mag), each (T, H) float32: ``ref`` is the layer's float32
oracle (``Nvfp4MoE.reference_forward``, decoded weights, the same routing) and ``bound`` an element-wise bound on
``|fused - ref|`` for ANY fp32 summation order, built from the absolute values of every term:

* gate / up rows (fp32 dot over H): ``|err| <= gamma_H * |W13| @ |x|`` (gamma_n = n u / (1 - n u), u = 2**-24);
* SwiGLU (clamp is 1-Lipschitz, |silu'| <= 1.1): ``|da| <= 1.1 |up| E_gate + |silu(gate)| E_up`` plus 8 u |a|
  for exp / division;
* h rounded to bf16 (the fused and the unfused paths both do): ``|h - a| <= |da| + 2**-8 (|a| + |da|)``
  (bf16 keeps 8 significant bits: round to nearest is within 2**-8 relative);
* down (fp32 dot over I): ``|y - W2 a| <= |W2| @ |h - a| + gamma_I |W2| @ |h|``;
* combine of S pairs in fp32: ``sum_p |w_p| |err y_p| + gamma_S sum_p |w_p| |y_p|``, then one bf16 rounding
  ``2**-8 (|ref| + that)``.

``mag`` = ``sum_p |w_p| |y_p|`` (bound): the unfused path also rounds each y_p to bf16 before its combine, so its
bound is ``bound + 2**-8 mag``.

Why a wrong kernel cannot pass: every term is O(u) or O(2**-8) of the absolute sums, while a missing pair, a
wrong pair weight or a missing shared expert moves the output by O(|w_p y_p|), i.e. by about the size of the
output itself. The tests check that the bound rejects the reference without the shared expert.
"""
from __future__ import annotations

import torch

from megamoe.format.tensor import NVFP4Tensor
from megamoe.reference.quantize import dequantize
from megamoe.reference import moe as moe_reference

U = 2.0 ** -24
BF16_U = 2.0 ** -8  # bf16's unit roundoff (8 significant bits); 2**-9 until 2026-11-28 was half of it


def gamma(n: int) -> float:
    return n * U / (1 - n * U)


def _expert_terms(x, w13, w2, limit):
    """(|y| bound (M, H), |y - W2 a| bound (M, H)) of one expert for rows x (M, H) fp32."""
    h_dim = x.shape[1]
    w13f = dequantize(w13, torch.float32)
    w2f = dequantize(w2, torch.float32)
    inter = w13f.shape[0] // 2
    g_u = x @ w13f.t()
    e_gu = gamma(h_dim) * (x.abs() @ w13f.abs().t())
    gate, up = g_u[:, :inter], g_u[:, inter:]
    e_gate, e_up = e_gu[:, :inter], e_gu[:, inter:]
    a = moe_reference.swiglu(gate, up, limit)
    gate_c = gate if limit is None else torch.clamp(gate, max=limit)
    up_c = up if limit is None else torch.clamp(up, min=-limit, max=limit)
    da = 1.1 * up_c.abs() * e_gate + torch.nn.functional.silu(gate_c).abs() * e_up + 8 * U * a.abs()
    e_h = da + BF16_U * (a.abs() + da)
    h_abs = a.abs() + e_h
    w2a = w2f.abs()
    y_abs = h_abs @ w2a.t()
    e_y = e_h @ w2a.t() + gamma(inter) * y_abs
    return y_abs, e_y


def fused_bound(layer, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor):
    """(ref, bound, mag) (T, H) float32 for the layer's routed (weights, ids) (T, k) (+ its shared expert)."""
    ref = layer.reference_forward(x, (weights, ids))
    xf = x.float()
    limit = layer.config.swiglu_limit
    num_tokens, k = ids.shape
    err = torch.zeros_like(ref)
    mag = torch.zeros_like(ref)
    ids_l = ids.long()
    for e in torch.unique(ids_l).tolist():
        tok, slot = torch.nonzero(ids_l == e, as_tuple=True)
        y_abs, e_y = _expert_terms(xf[tok], moe_reference._expert_slice(layer.w13, e),
                                   moe_reference._expert_slice(layer.w2, e), limit)
        w = weights[tok, slot].float().abs().unsqueeze(1)
        err.index_add_(0, tok, w * e_y)
        mag.index_add_(0, tok, w * y_abs)
    slots = k
    if layer.shared is not None:
        y_abs, e_y = _expert_terms(xf, layer.shared.w13, layer.shared.w2, limit)
        err += e_y
        mag += y_abs
        slots += 1
    err += gamma(slots) * mag
    return ref, err + BF16_U * (ref.abs() + err) + 1e-30, mag


def within(out: torch.Tensor, ref: torch.Tensor, bound: torch.Tensor) -> bool:
    """Every element of ``out`` within ``bound`` of ``ref`` (NaN never is)."""
    return bool(((out.float() - ref).abs() <= bound).all())


def random_nvfp4(experts: int, n: int, k: int, gen: torch.Generator, device) -> NVFP4Tensor:
    """(experts, n, k) NVFP4 drawn directly in the format (every E2M1 code, block scales 2**U(-3, 0) in e4m3,
    per-expert global scale ~ 1 / (3 sqrt(k))): no quantize kernel, so it is cheap under the interpreter."""
    data = torch.randint(0, 256, (experts, n, k // 2), generator=gen, dtype=torch.uint8)
    scale = torch.exp2(-3 * torch.rand((experts, n, k // 16), generator=gen)).to(torch.float8_e4m3fn)
    gs = (1.0 + torch.rand((experts, 1, 1), generator=gen)) / (3.0 * k ** 0.5)
    return NVFP4Tensor(data.to(device), scale.to(device), gs.to(device), (experts, n, k))


def random_layer(config, *, seed: int, max_num_tokens: int, device="cpu", **kwargs):
    """An ``Nvfp4MoE`` with weights drawn by :func:`random_nvfp4` (fast on CPU; ``Nvfp4MoE.random`` quantizes
    bf16 weights, which the interpreter does slowly)."""
    from megamoe.layers import Nvfp4MoE

    c = config
    gen = torch.Generator().manual_seed(seed)
    gate = (torch.randn(c.num_experts, c.hidden_size, generator=gen) * c.hidden_size ** -0.5).bfloat16()
    bias = torch.rand(c.num_experts, generator=gen) * 0.1 if c.use_correction_bias else None
    w13 = random_nvfp4(c.num_experts, 2 * c.intermediate_size, c.hidden_size, gen, device)
    w2 = random_nvfp4(c.num_experts, c.hidden_size, c.intermediate_size, gen, device)
    s13 = s2 = None
    if c.shared_intermediate_size:
        s13 = _single(random_nvfp4(1, 2 * c.shared_intermediate_size, c.hidden_size, gen, device))
        s2 = _single(random_nvfp4(1, c.hidden_size, c.shared_intermediate_size, gen, device))
    layer = Nvfp4MoE(c, max_num_tokens=max_num_tokens, device=device, **kwargs)
    layer.load_weights(gate.to(device), None if bias is None else bias.to(device), w13, w2, s13, s2)
    return layer


def _single(t: NVFP4Tensor) -> NVFP4Tensor:
    return NVFP4Tensor(t.data[0], t.block_scale[0], t.global_scale.reshape(()), tuple(t.shape[1:]))
