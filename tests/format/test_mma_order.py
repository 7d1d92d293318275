"""The MMA K order of the activations (megamoe/format/mma_order.py): exact, inverse, and the same order the
Gluon kernels' decode produces (the reshape/permute of ``nvfp4_gluon_jit.x_kappa_order``, mirrored in torch)."""
import pytest
import torch

from megamoe.format.mma_order import from_mma_k_order, mma_k_permutation, to_mma_k_order


def test_permutation_formula():
    perm = mma_k_permutation()
    assert sorted(perm.tolist()) == list(range(128))
    for q in range(4):
        for i in range(4):
            for c1 in range(2):
                for c0 in range(2):
                    for nib in range(2):
                        kappa = c0 + 2 * q + 8 * c1 + 16 * nib + 32 * i
                        assert perm[kappa] == 32 * q + 8 * i + 4 * c1 + 2 * c0 + nib


@pytest.mark.parametrize("block_k", [128, 256])
def test_matches_the_kernels_register_permutation(block_k):
    """x_kappa_order: (M, BLOCK_K) memory order -> reshape (m, q, i, c1, c0, nib) -> permute to (m, i, nib, c1,
    q, c0); per K step of the Gluon kernels (BLOCK_K 128: wgmma and mma.sync; 256: the mma.sync decode config)."""
    x = torch.randn(5, 3 * block_k).bfloat16()
    steps = [x[:, s:s + block_k].reshape(5, 4, block_k // 32, 2, 2, 2).permute(0, 2, 5, 3, 1, 4).reshape(5, block_k)
             for s in range(0, 3 * block_k, block_k)]
    assert torch.equal(to_mma_k_order(x, block_k=block_k), torch.cat(steps, 1))
    assert torch.equal(from_mma_k_order(to_mma_k_order(x, block_k=block_k), block_k=block_k), x)
    if block_k == 256:  # a different permutation from the 128 one
        assert not torch.equal(to_mma_k_order(x, block_k=256), to_mma_k_order(x))


def test_roundtrip_out_buffer_and_edges():
    x = torch.randn(7, 256)
    y = to_mma_k_order(x)
    assert not torch.equal(y, x) and torch.equal(from_mma_k_order(y), x)
    out = torch.empty_like(x)
    assert to_mma_k_order(x, out=out) is out and torch.equal(out, y)
    assert to_mma_k_order(torch.empty(0, 128)).shape == (0, 128)
    strided = torch.randn(3, 512)[:, :256]  # rows not contiguous
    assert torch.equal(to_mma_k_order(strided), to_mma_k_order(strided.contiguous()))
    with pytest.raises(ValueError, match="multiple of 128"):
        to_mma_k_order(torch.randn(2, 64))
    with pytest.raises(TypeError, match="2-D"):
        to_mma_k_order(torch.randn(128))
    with pytest.raises(ValueError, match="block_k"):
        to_mma_k_order(x, block_k=64)


@pytest.mark.parametrize("block_k", [128, 256])
def test_paired_order_feeds_the_same_mma_k_order(block_k):
    """The kernel's ``x_paired_order`` (mirrored here: reshape (m, q, i, nib, c1, c0), permute to (m, i, nib, c1, q,
    c0)) of the paired x equals ``x_kappa_order`` of the plain x, per K step; and the pairs (c0) stay whole."""
    from megamoe.format.mma_order import PAIRED_PERM, to_paired_order

    x = torch.randn(3, 2 * block_k).bfloat16()
    xp = to_paired_order(x)
    for s in range(0, 2 * block_k, block_k):
        kappa = x[:, s:s + block_k].reshape(3, 4, block_k // 32, 2, 2, 2).permute(0, 2, 5, 3, 1, 4)
        paired = xp[:, s:s + block_k].reshape(3, 4, block_k // 32, 2, 2, 2).permute(0, 2, 3, 4, 1, 5)
        assert torch.equal(paired.reshape(3, block_k), kappa.reshape(3, block_k))
    assert torch.equal(xp[:, :8], x[:, list(PAIRED_PERM)])
    assert not torch.equal(xp, x)


def test_paired_order_arguments():
    from megamoe.format.mma_order import to_paired_order

    x = torch.arange(32.0).reshape(2, 16)
    out = torch.empty_like(x)
    assert to_paired_order(x, out=out) is out and out[0, :8].tolist() == [0, 2, 4, 6, 1, 3, 5, 7]
    assert to_paired_order(torch.empty(0, 8)).shape == (0, 8)
    with pytest.raises(ValueError, match="multiple of 8"):
        to_paired_order(torch.empty(2, 12))
    with pytest.raises(TypeError, match="2-D"):
        to_paired_order(torch.empty(8))
