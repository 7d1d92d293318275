"""NVFP4 format: constants, E2M1 encoding, the tensor container, scale layouts."""
from .constants import (  # noqa: F401
    AMAX_FLOOR,
    BLOCK_SIZE,
    E2M1_MAX,
    E2M1_VALUES,
    E4M3_MAX,
    GLOBAL_SCALE_DIVISOR,
)
from .e2m1 import e2m1_decode, e2m1_encode, pack_nibbles, unpack_nibbles  # noqa: F401
from .layouts import (  # noqa: F401
    from_swizzled_128x4,
    from_triton_5d,
    swizzled_128x4_shape,
    to_swizzled_128x4,
    to_triton_5d,
)
from .tensor import NVFP4Tensor  # noqa: F401
