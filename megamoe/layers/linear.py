"""A dense projection whose weight is NVFP4 (through ``nvfp4_linear``) or kept in bf16/fp32 by the checkpoint."""
from __future__ import annotations

import torch

from ..format.tensor import NVFP4Tensor
from ..ops import gemm as gemm_ops


class DenseLinear:
    """``y = x @ W.T`` for a weight of logical shape (out_features, in_features).

    weight: an :class:`NVFP4Tensor` (runs ``megamoe.nvfp4_linear``, bf16 in, bf16 out, float32 accumulation; its
    global scale is read to the host here, once, for the op's prefill route "dense-bf16"),
    a bf16 tensor (``torch.matmul`` in bf16, float32 accumulation inside cuBLAS) or a float32 tensor (float32
    matmul on ``x.float()``).
    out_dtype: None (the weight's result dtype above) or ``torch.float32`` with a bf16 weight: a float32 linear whose
    weight the checkpoint holds in bf16 (the official compressor projections: ``x.float()`` through float32
    linears), run by ``megamoe.ops.gemm.bf16_linear_fp32`` on the bf16 weight (exact products, float32 sums; half
    the bytes of a float32 copy). x must then be bf16 (a float32 x would have to be rounded: TypeError).
    """

    def __init__(self, weight, *, name: str = "weight", out_dtype: torch.dtype | None = None):
        if isinstance(weight, NVFP4Tensor):
            if len(weight.shape) != 2:
                raise ValueError(f"{name}: expected a 2-D NVFP4 weight, got shape {tuple(weight.shape)}")
        elif isinstance(weight, torch.Tensor):
            if weight.dim() != 2 or weight.dtype not in (torch.bfloat16, torch.float32):
                raise TypeError(f"{name}: expected a 2-D bf16/fp32 tensor or an NVFP4Tensor, got "
                                f"{weight.dtype} of shape {tuple(weight.shape)}")
            weight = weight.contiguous()
        else:
            raise TypeError(f"{name}: expected a torch.Tensor or NVFP4Tensor, got {type(weight).__name__}")
        if out_dtype is not None and (out_dtype != torch.float32 or isinstance(weight, NVFP4Tensor)
                                      or weight.dtype != torch.bfloat16):
            raise ValueError(f"{name}: out_dtype={out_dtype} is for bf16 weights with float32 results (got "
                             f"{type(weight).__name__ if isinstance(weight, NVFP4Tensor) else weight.dtype})")
        self.weight, self.name = weight, name
        # NVFP4: the global scale read to the host once, here (a device sync at construction): prefill-sized calls
        # then run as bf16 cuBLAS on the exactly dequantized weight (``nvfp4_linear``'s route "dense-bf16")
        self.host_scale = gemm_ops.host_global_scale(weight) if isinstance(weight, NVFP4Tensor) else None
        self.fp32_out = out_dtype == torch.float32
        self.out_features, self.in_features = int(weight.shape[0]), int(weight.shape[1])

    @property
    def nvfp4(self) -> bool:
        return isinstance(self.weight, NVFP4Tensor)

    def __call__(self, x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """x (M, in) float (bf16 / fp16 / fp32; cast to the weight's compute dtype) -> (M, out): bf16 for NVFP4/bf16
        weights, float32 for float32 weights. out: optional (M, out) tensor of that dtype on x's device."""
        self._check_call(x, out)
        if self.nvfp4:
            # the weight is this module's parameter, final long before the call: split-K launches with PDL may
            # read it before their wait (``nvfp4_linear(weight_settled=True)``)
            return gemm_ops.nvfp4_linear(x.to(torch.bfloat16), self.weight, out=out, host_scale=self.host_scale,
                                         weight_settled=True)
        if self.fp32_out:
            return gemm_ops.bf16_linear_fp32(x, self.weight, out=out)
        if self.weight.dtype == torch.float32:
            y = x.float() @ self.weight.t()
        else:
            y = x.to(torch.bfloat16) @ self.weight.t()
        if out is not None:
            out.copy_(y)
            return out
        return y

    def _check_call(self, x, out) -> None:
        """Host metadata only: x a 2-D float tensor with in_features columns; out (M, out_features) of the result
        dtype on x's device (a wrong one would be broadcast or cast into silently)."""
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"x: expected a torch.Tensor, got {type(x).__name__}")
        if not x.is_floating_point():
            raise TypeError(f"x: expected a float tensor (bf16 / fp16 / fp32), got {x.dtype}")
        if x.dim() != 2 or x.shape[1] != self.in_features:
            raise ValueError(f"x: expected shape (M, {self.in_features}) for {self.name}, got {tuple(x.shape)}")
        if self.fp32_out and x.dtype != torch.bfloat16:
            raise TypeError(f"x: expected bfloat16 for {self.name} (bf16 weight, float32 results), got {x.dtype}")
        if out is None:
            return
        if not isinstance(out, torch.Tensor):
            raise TypeError(f"out: expected a torch.Tensor or None, got {type(out).__name__}")
        dtype = torch.float32 if self.fp32_out or (not self.nvfp4 and self.weight.dtype == torch.float32) \
            else torch.bfloat16
        if out.dtype != dtype:
            raise TypeError(f"out: expected dtype {dtype} for {self.name}, got {out.dtype}")
        if tuple(out.shape) != (x.shape[0], self.out_features) or out.device != x.device:
            raise ValueError(f"out: expected shape ({x.shape[0]}, {self.out_features}) on {x.device}, got "
                             f"{tuple(out.shape)} on {out.device}")

    def nbytes(self) -> int:
        if self.nvfp4:
            return self.weight.nbytes()
        return self.weight.numel() * self.weight.element_size()


def _kind(weight) -> str:
    """The storage kind of a projection weight: "nvfp4" or the dense dtype's name."""
    return "nvfp4" if isinstance(weight, NVFP4Tensor) else str(weight.dtype)


def concat_rows(weights):
    """Row-concatenate 2-D weights of one kind and one ``in_features`` into one weight of the same kind.

    NVFP4: data and block scales concatenated; the global scale stays 0-d when every part has the same 0-d
    value (a host read, load time only), else becomes per row (N, 1) float32 (each part's scale expanded over its
    rows), which every dense NVFP4 GEMM route reads (``nvfp4_linear``: global_scale 0-d or (N, 1)).
    Dense tensors: ``torch.cat`` (same dtype).
    """
    weights = list(weights)
    if not weights:
        raise ValueError("concat_rows: expected at least one weight")
    if len(weights) == 1:
        return weights[0]
    if len({_kind(w) for w in weights}) != 1 or len({int(w.shape[1]) for w in weights}) != 1:
        raise ValueError("concat_rows: expected weights of one kind and one in_features, got "
                         + ", ".join(f"{_kind(w)} {tuple(w.shape)}" for w in weights))
    if not isinstance(weights[0], NVFP4Tensor):
        return torch.cat([w.contiguous() for w in weights])
    n = sum(int(w.shape[0]) for w in weights)
    k = int(weights[0].shape[1])
    scales = [w.global_scale for w in weights]
    if all(s.dim() == 0 for s in scales) and len({s.item() for s in scales}) == 1:
        gs = scales[0].clone()
    else:
        gs = torch.cat([s.reshape(-1, 1).expand(int(w.shape[0]), 1) for s, w in zip(scales, weights)])
    return NVFP4Tensor(torch.cat([w.data for w in weights]), torch.cat([w.block_scale for w in weights]),
                       gs.contiguous(), (n, k))


def row_slice(weight, start: int, stop: int):
    """Rows [start, stop) of a 2-D weight as views (NVFP4: data, block scales and a per-row global scale)."""
    if not isinstance(weight, NVFP4Tensor):
        return weight[start:stop]
    gs = weight.global_scale
    if gs.dim() != 0 and gs.shape[0] != 1:
        gs = gs[start:stop]
    return NVFP4Tensor(weight.data[start:stop], weight.block_scale[start:stop], gs,
                       (stop - start, int(weight.shape[1])))


class FusedLinear:
    """Projections that read the same input, run as ONE :class:`DenseLinear` over their row-concatenated weights.

    parts: (name, weight) pairs with one ``in_features``; of one kind (all NVFP4, or all dense of one dtype) they
    are fused (``concat_rows``); of mixed kinds (a checkpoint that left one unquantized) each runs alone, as
    before fusion (:attr:`fused` False). A call returns one output per part, in order: column views ``y[:, a:b]``
    of the fused (M, sum of out_features) output (no copies; rows keep their stride ``sum of out_features``, unit
    stride along the last dim; at M == 1 every view is contiguous). ``part(name)``: that projection alone as a
    DenseLinear over its rows of the fused weight (views, no extra memory; tests and diagnostics, not the hot path).
    out_dtype: :class:`DenseLinear`'s, for every part (``torch.float32``: all parts bf16).

    Numerics: each output element is the same dot product as the separate projection's; the GEMM route and its
    split-K / tile choices follow the fused N, so float32 summation order (and thus the last bits) can differ.
    """

    def __init__(self, parts, *, name: str | None = None, out_dtype: torch.dtype | None = None):
        parts = list(parts)
        if not parts:
            raise ValueError("FusedLinear: expected at least one (name, weight) part")
        self.names = tuple(n for n, _ in parts)
        for n, w in parts:
            if not isinstance(w, (torch.Tensor, NVFP4Tensor)) or len(w.shape) != 2:
                raise ValueError(f"{n}: expected a 2-D tensor or NVFP4Tensor, got "
                                 f"{getattr(w, 'shape', type(w).__name__)}")
        self.sizes = tuple(int(w.shape[0]) for _, w in parts)
        self.name = name or "+".join(self.names)
        in_features = {n: int(w.shape[1]) for n, w in parts}
        if len(set(in_features.values())) != 1:
            raise ValueError(f"{self.name}: the parts read one input but have in_features {in_features}")
        self.out_dtype = out_dtype
        if len({_kind(w) for _, w in parts}) == 1:
            self.linear, self.separate = DenseLinear(concat_rows(w for _, w in parts), name=self.name,
                                                     out_dtype=out_dtype), None
        else:  # mixed kinds (e.g. one part left unquantized by the checkpoint): one launch per part, as before
            self.linear, self.separate = None, [DenseLinear(w, name=n, out_dtype=out_dtype) for n, w in parts]
        starts = [0]
        for s in self.sizes:
            starts.append(starts[-1] + s)
        self.ranges = {n: (starts[i], starts[i + 1]) for i, n in enumerate(self.names)}
        self.in_features = int(parts[0][1].shape[1])
        self.out_features = starts[-1]

    @property
    def fused(self) -> bool:
        """True when one GEMM computes every part (False only for parts of mixed kinds)."""
        return self.linear is not None

    def __call__(self, x: torch.Tensor) -> tuple:
        """x (M, in) -> one (M, out_features of the part) output per part (views of one GEMM's output)."""
        if self.linear is None:
            return tuple(p(x) for p in self.separate)
        return tuple(self.linear(x).split(self.sizes, dim=1))

    def part(self, name: str) -> DenseLinear:
        if name not in self.ranges:
            raise KeyError(f"{self.name}: no part {name!r} (parts: {', '.join(self.names)})")
        if self.linear is None:
            return self.separate[self.names.index(name)]
        start, stop = self.ranges[name]
        return DenseLinear(row_slice(self.linear.weight, start, stop), name=name, out_dtype=self.out_dtype)

    def nbytes(self) -> int:
        if self.linear is None:
            return sum(p.nbytes() for p in self.separate)
        return self.linear.nbytes()
