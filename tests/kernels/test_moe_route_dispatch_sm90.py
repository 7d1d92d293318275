"""The fused decode route + dispatch kernel builds for sm_90 at the V4 shapes, without local-memory spills."""
import os
import sys

import pytest
import triton

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "ops"))

SIG = dict(x_ptr="*bf16", stride_x="i32", w_ptr="*fp32", stride_g="i32", bias_ptr="*fp32", ws_ptr="*fp32",
           cnt_ptr="*i32", weights_ptr="*fp32", stride_w="i32", ids_ptr="*i32", stride_i="i32",
           token_ids_ptr="*i64", tid2eid_ptr="*i32", vocab="i32", stride_t="i32", offsets_ptr="*i32",
           sorted_expert_ptr="*i32", row_index_ptr="*i32", inv_perm_ptr="*i32", err_ptr="*i32",
           num_tokens="i32", num_experts="i32", hidden="i32", num_groups="i32",
           routed_scaling_factor="fp32")


@pytest.mark.slow
@pytest.mark.parametrize("tokens,experts,hidden,hashed",
                         [(1, 384, 7168, False), (8, 384, 7168, False), (64, 256, 4096, True)])
def test_route_dispatch_kernel_builds_for_sm90(tokens, experts, hidden, hashed):
    from sm90_compile import compile_sm90

    from megamoe.kernels.moe_route_dispatch import plan_route_dispatch

    p = plan_route_dispatch(tokens, experts, hidden, 132)
    consts = dict(TOP_K=6, K_PAD=8, SLOTS=7, S_PAD=8, E_PAD=triton.next_power_of_2(experts), T_PAD=p["T_PAD"],
                  BLOCK_E=p["BLOCK_E"], CHUNK=p["CHUNK"], TB=p["TB"], SPLIT=p["splits"] > 1,
                  SPLITS_PAD=p["SPLITS_PAD"], TBR=p["TBR"], USE_DOT=p["USE_DOT"], BT=p["BT"],
                  BINS=triton.next_power_of_2(experts + 3), SCORING=2, HAS_BIAS=not hashed, NORMALIZE=True,
                  HASH=hashed, FLAG_TOKENS=(1 << 18) if hashed else 0, FLAG_TABLE=(1 << 19) if hashed else 0,
                  FLAG_IDS=1 << 2)
    ptx, res = compile_sm90("megamoe.kernels.moe_route_dispatch", "_route_dispatch_kernel", SIG, consts,
                            p["num_warps"])
    assert res["LOCAL"] == 0 and res["STACK"] == 0, res  # no spills, no stack arrays (local memory)
    assert res["SASS"] < 16000, res  # compact: the finish runs once per launch from a cold instruction cache
    assert "atom.acq_rel.gpu" in ptx or "atom.global.acq_rel.gpu" in ptx or "acq_rel" in ptx
    assert "fma.rn.f32" in ptx  # fp32 FMA accumulation (no tf32 / tensor-core rounding)
    assert "mma" not in ptx.replace("fma", "")
