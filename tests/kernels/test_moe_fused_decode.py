"""Single-launch decode MoE (megamoe/kernels/moe_fused_decode.py) vs the float32 oracle and the unfused path.

CPU: the Triton interpreter (two launches, PHASE 1 then 2) at small shapes. CUDA (marked ``cuda``): V4-Flash
shapes, one launch, against the existing path; graph == eager, sync-free, same bits twice, counters reset.
Bound: tests/moe_fused_helpers.py (element-wise, any fp32 summation order).
"""
import os
import sys

import pytest
import torch

from megamoe.layers import Nvfp4MoE
from megamoe.models import MoEConfig
from megamoe.ops import moe as moe_ops
from megamoe.ops.moe_fused_decode import fused_decode_workspace, moe_fused_decode
from moe_fused_helpers import BF16_U, fused_bound, random_layer, within
from sync_helpers import no_host_syncs

SMALL = MoEConfig(hidden_size=256, intermediate_size=128, num_experts=16, top_k=4, shared_intermediate_size=128,
                  scoring_func="sqrtsoftplus", routed_scaling_factor=1.5, swiglu_limit=10.0, name="fused-small")
ODD = MoEConfig(hidden_size=160, intermediate_size=96, num_experts=8, top_k=2, shared_intermediate_size=96,
                scoring_func="sqrtsoftplus", routed_scaling_factor=1.0, swiglu_limit=None, name="fused-odd")


def _device():
    return "cuda" if torch.cuda.is_available() else "cpu"


@pytest.fixture(scope="module")
def small():
    return random_layer(SMALL, seed=11, max_num_tokens=16, device=_device())


@pytest.fixture(scope="module")
def small_no_shared():
    return random_layer(SMALL.replace(shared_intermediate_size=0), seed=12, max_num_tokens=16, device=_device())


def _pairs(layer, x):
    """(routed weights, ids) and the fused op's inputs: the dispatch of the (T, S) pairs (S = k + the fused
    shared expert as id E with weight 1.0) over the layer's groups."""
    c = layer.config
    w, ids = layer.route(x)
    t = x.shape[0]
    if layer.fused_shared:
        ids_ext = torch.cat([ids, torch.full((t, 1), c.num_experts, dtype=torch.int32, device=x.device)], 1)
        w_ext = torch.cat([w, torch.ones((t, 1), device=x.device)], 1).contiguous()
    else:
        ids_ext, w_ext = ids, w.contiguous()
    d = moe_ops.dispatch(ids_ext.contiguous(), layer._groups)
    return w, ids, (d["expert_offsets"], d["row_index"], d["inv_perm"], w_ext)


def _run(layer, x, workspace=None, **kwargs):
    _, _, (offsets, row_index, inv_perm, w_ext) = _pairs(layer, x)
    return moe_fused_decode(x, layer._w13_kernel, layer._w2_kernel, offsets, row_index, inv_perm, w_ext,
                            swiglu_limit=layer.config.swiglu_limit, workspace=workspace, **kwargs)


@pytest.mark.parametrize("tokens", [1, 3, 16])
def test_matches_float32_oracle(small, tokens):
    x = torch.randn(tokens, SMALL.hidden_size, device=small.device).bfloat16()
    ws = fused_decode_workspace(16, small._slots, small._groups, SMALL.hidden_size, SMALL.intermediate_size,
                                small.device)
    w, ids, _ = _pairs(small, x)
    out = _run(small, x, ws).clone()
    ref, bound, _ = fused_bound(small, x, w, ids)
    assert within(out, ref, bound), (out.float() - ref).abs().max()
    # the bound is tight enough that a wrong pipeline fails it: the reference without the shared expert
    assert not within(ref - small.shared.reference_forward(x), ref, bound)
    assert bool((ws["counters"] == 0).all())  # every launch leaves its counters zero
    if tokens == 3:  # deterministic: the same bits again (and through a reused workspace)
        assert torch.equal(_run(small, x, ws), out)


def test_without_shared_expert(small_no_shared):
    lay = small_no_shared
    x = torch.randn(5, SMALL.hidden_size, device=lay.device).bfloat16()
    w, ids, _ = _pairs(lay, x)
    ref, bound, _ = fused_bound(lay, x, w, ids)
    assert within(_run(lay, x), ref, bound)


def test_odd_shapes_ragged_k():
    """H = 160, I = 96: K edges (not a multiple of the interpreter's BLOCK_K 128), no SwiGLU clamp, top-2."""
    lay = random_layer(ODD, seed=5, max_num_tokens=8, device=_device())
    x = torch.randn(3, ODD.hidden_size, device=lay.device).bfloat16()
    w, ids, _ = _pairs(lay, x)
    ref, bound, _ = fused_bound(lay, x, w, ids)
    assert within(_run(lay, x), ref, bound)


def test_every_token_on_the_same_experts():
    lay = random_layer(SMALL, seed=3, max_num_tokens=16, device=_device())
    bias = torch.zeros(SMALL.num_experts, device=lay.device)
    bias[[2, 5, 9, 14]] = 100.0  # every token picks these four: one expert holds every token's pair
    lay.correction_bias = bias
    x = torch.randn(8, SMALL.hidden_size, device=lay.device).bfloat16()
    w, ids, _ = _pairs(lay, x)
    assert sorted(torch.unique(ids).tolist()) == [2, 5, 9, 14]
    ref, bound, _ = fused_bound(lay, x, w, ids)
    assert within(_run(lay, x), ref, bound)


def test_single_launch_code_with_one_program(small):
    """PHASE 0 (the GPU's single launch: expert counters, waits, done counter, reset) under the interpreter: one
    program runs every phase-1 item before its first wait. Same bits as the two-launch mode; counters zero."""
    from megamoe.kernels.moe_fused_decode import launch_moe_fused_decode

    x = torch.randn(3, SMALL.hidden_size, device=small.device).bfloat16()
    _, _, (offsets, row_index, inv_perm, w_ext) = _pairs(small, x)
    ws = fused_decode_workspace(4, small._slots, small._groups, SMALL.hidden_size, SMALL.intermediate_size,
                                small.device)
    interp = not x.is_cuda
    outs = []
    for phases in (1, 2):
        out = torch.empty_like(x)
        w13, w2 = small._w13_kernel, small._w2_kernel
        launch_moe_fused_decode(x, w13.data, w13.block_scale, w13.global_scale, w2.data, w2.block_scale,
                                w2.global_scale, offsets, row_index, inv_perm, w_ext, ws["h"], ws["y"],
                                ws["counters"], out, swiglu_limit=SMALL.swiglu_limit, interpreter=interp,
                                phases=phases, num_programs=1)
        assert bool((ws["counters"] == 0).all())
        outs.append(out)
    assert torch.equal(outs[0], outs[1])
    assert torch.equal(outs[0], _run(small, x))  # and the op's (several programs)


def test_nan_token_stays_in_its_row(small):
    x = torch.randn(4, SMALL.hidden_size, device=small.device).bfloat16()
    clean = _run(small, x).clone()
    x[1, 7] = float("nan")
    out = _run(small, x)
    assert torch.isnan(out[1]).all()
    assert torch.equal(out[[0, 2, 3]], clean[[0, 2, 3]])


@pytest.mark.parametrize("bad", [10 ** 6, -5, 4])
def test_out_of_range_row_index_is_masked(small, bad):
    """A sorted row whose token id (``row_index``) is outside [0, T) -- corrupt routing metadata -- reads zeros in
    phase 1 and takes no ticket, pair lookup or output row in phase 2 (it used to index the ticket counters, the
    pair table and the output with it: a crash or an out-of-bounds write); the other tokens keep their bits."""
    x = torch.randn(4, SMALL.hidden_size, device=small.device).bfloat16()
    _, _, (offsets, row_index, inv_perm, w_ext) = _pairs(small, x)
    clean = moe_fused_decode(x, small._w13_kernel, small._w2_kernel, offsets, row_index, inv_perm, w_ext,
                             swiglu_limit=SMALL.swiglu_limit).clone()
    victim = int(row_index[0])
    corrupt = row_index.clone()
    corrupt[0] = bad
    out = moe_fused_decode(x, small._w13_kernel, small._w2_kernel, offsets, corrupt, inv_perm, w_ext,
                           swiglu_limit=SMALL.swiglu_limit)
    keep = [t for t in range(4) if t != victim]
    assert torch.equal(out[keep], clean[keep])


def test_zero_tokens_returns_at_once(small):
    x = torch.empty(0, SMALL.hidden_size, device=small.device).bfloat16()
    offsets = torch.zeros(small._groups, dtype=torch.int32, device=small.device)
    empty = torch.empty(0, dtype=torch.int32, device=small.device)
    out = moe_fused_decode(x, small._w13_kernel, small._w2_kernel, offsets, empty, empty,
                           torch.empty(0, small._slots, device=small.device), swiglu_limit=10.0)
    assert out.shape == (0, SMALL.hidden_size)


def test_bad_arguments_raise(small):
    x = torch.randn(2, SMALL.hidden_size, device=small.device).bfloat16()
    _, _, (offsets, row_index, inv_perm, w_ext) = _pairs(small, x)
    w13, w2 = small._w13_kernel, small._w2_kernel

    def call(**kw):
        args = dict(hidden_states=x, w13=w13, w2=w2, expert_offsets=offsets, row_index=row_index, inv_perm=inv_perm,
                    topk_weights=w_ext)
        opts = {k: kw.pop(k) for k in ("workspace", "out", "phases") if k in kw}
        args.update(kw)
        return moe_fused_decode(*args.values(), swiglu_limit=10.0, **opts)

    with pytest.raises(TypeError, match="hidden_states"):
        call(hidden_states=x.float())
    with pytest.raises(TypeError, match="w13"):
        call(w13=torch.zeros(1))
    with pytest.raises(ValueError, match="w2"):
        call(w2=w13)
    with pytest.raises(TypeError, match="inv_perm"):
        call(inv_perm=inv_perm.long())
    with pytest.raises(ValueError, match="row_index"):
        call(row_index=row_index[:3])
    with pytest.raises(ValueError, match="expert_offsets"):
        call(expert_offsets=offsets[:-1])
    with pytest.raises(ValueError, match="topk_weights"):
        call(topk_weights=w_ext[:1])
    with pytest.raises(TypeError, match="topk_weights"):
        call(topk_weights=w_ext.double())
    with pytest.raises(ValueError, match="phases"):
        call(phases=3)
    with pytest.raises(ValueError, match="out"):
        call(out=torch.empty(2, 8, dtype=torch.bfloat16, device=x.device))
    with pytest.raises(ValueError, match="workspace"):
        call(workspace=fused_decode_workspace(1, 2, 3, 64, 32, x.device))
    many = torch.randn(17, SMALL.hidden_size, device=x.device).bfloat16()
    with pytest.raises(ValueError, match="at most 16"):
        moe_fused_decode(many, w13, w2, offsets, torch.zeros(17 * small._slots, dtype=torch.int32, device=x.device),
                         torch.zeros(17 * small._slots, dtype=torch.int32, device=x.device),
                         torch.ones(17, small._slots, device=x.device), swiglu_limit=10.0)


# ---------------------------------------------------------------- CUDA: real shapes, graphs, sync-free, bits
@pytest.fixture(scope="module")
def flash():
    from megamoe.models.config import DEEPSEEK_V4_FLASH

    return Nvfp4MoE.random(DEEPSEEK_V4_FLASH, seed=0, max_num_tokens=16, device="cuda", fused_decode=True)


@pytest.mark.cuda
@pytest.mark.parametrize("tokens", [1, 4, 8, 16])
def test_cuda_v4_flash_against_existing_path(flash, tokens):
    x = torch.randn(tokens, flash.config.hidden_size, device="cuda").bfloat16()
    flash.fused_decode = False
    base = flash.forward(x).clone()
    flash.fused_decode = True
    fused = flash.forward(x).clone()
    w, ids = flash.last_routing
    ref, bound, mag = fused_bound(flash, x, w, ids)
    assert within(fused, ref, bound), (fused.float() - ref).abs().max()
    # the unfused path rounds y to bf16 as well (+ 2**-8 mag) and accumulates on tensor cores (not IEEE fp32
    # additions: twice the fp32 terms)
    assert within(base, ref, 2 * bound + BF16_U * mag)
    assert within(fused, base.float(), 3 * bound + BF16_U * mag)
    assert torch.equal(flash.forward(x), fused)  # same bits twice: the counters were reset
    assert bool((flash._fused_ws["counters"] == 0).all())


@pytest.mark.cuda
@pytest.mark.parametrize("tokens", [1, 16])
def test_cuda_graph_equals_eager_sync_free(flash, tokens):
    flash.fused_decode = True
    x = torch.randn(tokens, flash.config.hidden_size, device="cuda").bfloat16()
    eager = flash.forward(x).clone()
    torch.cuda.synchronize()
    with no_host_syncs():
        flash.forward(x)
    replay = flash.capture(tokens)
    for _ in range(50):  # many replays: the counters come back to zero every time, the bits never move
        assert torch.equal(replay(x), eager)
    x2 = torch.randn_like(x)  # other routing, same graph
    eager2 = flash.forward(x2).clone()
    assert torch.equal(replay(x2), eager2)
    assert bool((flash._fused_ws["counters"] == 0).all())


@pytest.mark.cuda
def test_cuda_two_phase_mode_same_bits(flash):
    x = torch.randn(8, flash.config.hidden_size, device="cuda").bfloat16()
    one = _run(flash, x, flash._fused_ws).clone()
    two = _run(flash, x, flash._fused_ws, phases=2)
    assert torch.equal(one, two)


# ---------------------------------------------------------------- offline sm_90 build
@pytest.mark.slow
@pytest.mark.parametrize("phase", [0, 1])
def test_builds_for_sm90_without_spills(phase):
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "ops"))
    from sm90_compile import compile_sm90

    from megamoe.kernels.moe_fused_decode import sm90_build

    sig, consts, warps = sm90_build(phase=phase)
    ptx, res = compile_sm90("megamoe.kernels.moe_fused_decode", "_moe_fused_decode_kernel", sig, consts, warps)
    assert res["LOCAL"] == 0 and res["STACK"] == 0, res  # no spills
    assert res["REG"] <= 168, res  # >= 3 programs of 4 warps per SM
    assert "fma.rn.f32" in ptx
    if phase == 0:
        assert "nanosleep" in ptx and ".acquire" in ptx and ".release" in ptx
    else:
        assert "nanosleep" not in ptx
