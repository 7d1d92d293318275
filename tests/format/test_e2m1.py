import torch

from megamoe.format.e2m1 import e2m1_decode, e2m1_encode, pack_nibbles, unpack_nibbles


def test_pack_low_nibble_is_even_element():
    codes = torch.tensor([[1, 2, 15, 8]], dtype=torch.uint8)
    packed = pack_nibbles(codes)
    assert packed.tolist() == [[0x21, 0x8F]]
    assert torch.equal(unpack_nibbles(packed), codes)


def test_pack_matches_torch_float4_layout():
    # torch.float4_e2m1fn_x2 keeps element 0 in the low nibble, like ModelOpt checkpoints
    codes = torch.randint(0, 16, (5, 32), dtype=torch.uint8)
    packed = pack_nibbles(codes)
    assert torch.equal(unpack_nibbles(packed), codes)
    assert packed.view(torch.float4_e2m1fn_x2).shape == (5, 16)


def test_decode_encode_round_trip_all_codes():
    codes = torch.arange(16, dtype=torch.uint8)
    values = e2m1_decode(codes)
    assert values.tolist() == [0, .5, 1, 1.5, 2, 3, 4, 6, -0.0, -.5, -1, -1.5, -2, -3, -4, -6]
    assert torch.equal(e2m1_encode(values), codes)
