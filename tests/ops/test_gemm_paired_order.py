"""``nvfp4_grouped_mm(x_order=..., out_order=...)``: the paired order of the mma.sync decode kernel's x (issue 11).

The values are those of the plain order, permuted (megamoe.format.mma_order.to_paired_order); on CUDA the decode
kernel reads / writes it without its byte permutes and gives the same bits; elsewhere the op refuses it."""
import pytest
import torch

from gemm_helpers import offsets_of, random_weight

from megamoe.format.mma_order import from_paired_order, to_paired_order
from megamoe.ops import gemm as ops_gemm


def _case(device, e=6, n=64, k=256, counts=(0, 2, 1, 3, 0, 1)):
    w = random_weight((e, n, k), device, scale_shape=(e, 1, 1))
    t = sum(counts) + 1
    x = torch.randn(t, k, device=device).bfloat16()
    row_index = torch.randperm(t, device=device).to(torch.int32)
    return w, x, row_index, offsets_of(list(counts), device)


def test_paired_orders_are_the_plain_values_permuted():
    w, x, row_index, offsets = _case("cpu")
    kw = dict(row_index=row_index, activation="swiglu", swiglu_limit=7.0, max_rows_per_expert=3)
    plain = ops_gemm.nvfp4_grouped_mm(x, w, offsets, **kw)
    got = ops_gemm.nvfp4_grouped_mm(to_paired_order(x), w, offsets, x_order="paired", **kw)
    assert torch.equal(got, plain)
    out = torch.empty_like(plain)
    got = ops_gemm.nvfp4_grouped_mm(to_paired_order(x), w, offsets, x_order="paired", out_order="paired", out=out,
                                    **kw)
    assert got is out and torch.equal(from_paired_order(out), plain)
    assert not torch.equal(out, plain)
    w2 = random_weight((6, 32, 32), "cpu")  # the next GEMM reads the paired output
    down = ops_gemm.nvfp4_grouped_mm(plain, w2, offsets)
    assert torch.equal(ops_gemm.nvfp4_grouped_mm(out, w2, offsets, x_order="paired"), down)
    assert ops_gemm.paired_order_supported(x, w, plain.shape[0])


def test_paired_order_arguments_are_checked():
    w, x, row_index, offsets = _case("cpu")
    with pytest.raises(ValueError, match="x_order"):
        ops_gemm.nvfp4_grouped_mm(x, w, offsets, x_order="kappa")
    with pytest.raises(ValueError, match="out_order"):
        ops_gemm.nvfp4_grouped_mm(x, w, offsets, out_order="paired")  # no SwiGLU
    w12 = random_weight((6, 24, 256), "cpu")  # N // 2 = 12: not a multiple of 8
    with pytest.raises(ValueError, match="out_order"):
        ops_gemm.nvfp4_grouped_mm(x, w12, offsets, activation="swiglu", out_order="paired")
    with pytest.raises(TypeError, match="index_settled"):
        ops_gemm.nvfp4_grouped_mm(x, w, offsets, index_settled=1)
    plain = ops_gemm.nvfp4_grouped_mm(x, w, offsets)  # the launch-order hint changes no value
    assert torch.equal(ops_gemm.nvfp4_grouped_mm(x, w, offsets, index_settled=True), plain)


@pytest.mark.cuda
@pytest.mark.parametrize("interleave", [1, 4])
@pytest.mark.parametrize("counts", [(0, 2, 1, 3, 0, 1), (1, 1, 1, 1, 1, 1), (0, 0, 8, 0, 0, 0)])
def test_cuda_paired_orders_same_bits(interleave, counts):
    """Decode sizes: gate_up (gathered, SwiGLU) with a paired x and a paired output, then down reading it, give the
    plain path's bits (permuted where the order says so); a GEMM whose plan leaves the decode kernel refuses."""
    device = torch.device("cuda")
    w, x, row_index, offsets = _case(device, n=512, k=512, counts=counts)
    w2 = random_weight((6, 512, 256), device, scale_shape=(6, 1, 1))
    if interleave > 1:
        w, w2 = w.interleave_rows(interleave), w2.interleave_rows(interleave)
    rows = sum(counts) + 1
    kw = dict(activation="swiglu", swiglu_limit=7.0, max_rows_per_expert=max(counts))
    assert ops_gemm.paired_order_supported(x, w, rows, max_rows_per_expert=max(counts))
    plain = ops_gemm.nvfp4_grouped_mm(x, w, offsets, row_index=row_index, **kw)
    inter = ops_gemm.nvfp4_grouped_mm(to_paired_order(x), w, offsets, row_index=row_index, x_order="paired",
                                      out_order="paired", **kw)
    assert torch.equal(from_paired_order(inter), plain)
    down = ops_gemm.nvfp4_grouped_mm(plain, w2, offsets, max_rows_per_expert=max(counts))
    assert torch.equal(ops_gemm.nvfp4_grouped_mm(inter, w2, offsets, max_rows_per_expert=max(counts),
                                                 x_order="paired"), down)
    many = torch.randn(4096, 512, device=device).bfloat16()  # 4096 rows of one expert: the wgmma bands
    big = torch.tensor([0, 0, 4096, 4096, 4096, 4096], dtype=torch.int32, device=device)
    assert not ops_gemm.paired_order_supported(many, w, 4096)
    with pytest.raises(ValueError, match="paired"):
        ops_gemm.nvfp4_grouped_mm(many, w, big, x_order="paired")
