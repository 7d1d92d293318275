"""Token sampling on the device: greedy, temperature, top-k, top-p; sync-free and CUDA-graph capturable.

* :class:`SamplingParams` -- per-request parameters in device buffers (one row per request slot):
  ``temperature`` fp32 (0 = greedy), ``top_k`` int32 (0 = off), ``top_p`` fp32 in (0, 1] (1 = off), ``seed``
  int64 and the per-request ``step`` counter int64. Set from the host with :meth:`SamplingParams.set`.
* :func:`sample` -- (B, V) logits -> (B,) int64 tokens, row b drawn with parameter row b; advances each
  sampled row's ``step`` by one. No host RNG state: the draw is a function of (logits, parameters, seed,
  step) only, so replaying a request with the same seed reproduces it, and the same seed at the same step
  gives the same token whatever the batch composition.

Semantics (temperature scaling, stable sort, kept prefix, Gumbel-max with counter-based uniforms, tie-break and
NaN / inf policy): ``megamoe/reference/sampling.py``. In short: NaN logits are never sampled; a row whose
logits are all NaN / -inf returns token 0; greedy ties -> the lowest token id.

Paths: when no row uses top-k / top-p, one Triton launch (``megamoe/kernels/sampling.py``) scales, adds the
noise and takes the argmax over the raw logits; otherwise torch sorts each row (device sort, no sync), computes
the kept prefix lengths and the same kernel picks among the sorted candidates. Which path runs is a host
decision on the host-side copy of the parameters (``SamplingParams.any_filter``) or the ``filtering``
argument, never on device values; a captured CUDA graph keeps the path it was captured with, so capture with
``filtering=True`` if rows may enable top-k / top-p later. On CPU without ``TRITON_INTERPRET=1`` the reference
runs (same results up to the last ulp of the logarithms).
"""
from __future__ import annotations

import math

import torch

from ..reference import sampling as _reference
from ._dispatch import interpreter_enabled, resolve_device, use_triton


def _rows_list(rows, batch: int) -> list:
    if isinstance(rows, int) and not isinstance(rows, bool):
        rows = [rows]
    elif isinstance(rows, slice):
        rows = list(range(batch))[rows]
    elif isinstance(rows, torch.Tensor):
        rows = rows.tolist() if rows.dim() else [int(rows)]
    elif isinstance(rows, range):
        rows = list(rows)
    if not isinstance(rows, (list, tuple)) or not all(isinstance(r, int) and not isinstance(r, bool)
                                                       for r in rows):
        raise TypeError(f"rows: expected an int, a slice, a range or a sequence of ints, got {rows!r}")
    bad = [r for r in rows if not 0 <= r < batch]
    if bad:
        raise ValueError(f"rows: expected indices in [0, {batch}), got {bad}")
    return list(rows)


def _per_row(name: str, value, count: int) -> list:
    if isinstance(value, torch.Tensor):
        value = value.tolist()
    if isinstance(value, (list, tuple)):
        if len(value) != count:
            raise ValueError(f"{name}: expected one value per row ({count}), got {len(value)}")
        return list(value)
    return [value] * count


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


# The parameters' values: (rule, what the error says is expected), shared by SamplingParams() and set().
_RULES = {
    "temperature": (lambda v: math.isfinite(v) and v >= 0, "finite values >= 0 (0 = greedy)"),
    "top_k": (lambda v: _is_int(v) and 0 <= v < 2 ** 31, "ints >= 0 (0 = off)"),
    "top_p": (lambda v: 0.0 < v <= 1.0, "values in (0, 1] (1 = off)"),  # also rejects NaN
    "seed": (lambda v: _is_int(v) and -2 ** 63 <= v < 2 ** 63, "64-bit ints"),
    "step": (lambda v: _is_int(v) and 0 <= v < 2 ** 63, "ints >= 0"),
}


def _check_values(name: str, vals: list) -> None:
    rule, expected = _RULES[name]
    if not all(rule(v) for v in vals):
        raise ValueError(f"{name}: expected {expected}, got {vals}")


class SamplingParams:
    """Per-request sampling parameters in device buffers, rows = request slots (see the module docstring).

    Attributes (device tensors, shape (batch,)): ``temperature`` fp32, ``top_k`` int32, ``top_p`` fp32,
    ``seed`` int64, ``step`` int64. Defaults: temperature 1.0, top_k 0, top_p 1.0, seed 0, step 0. Kernels
    may capture these buffers in CUDA graphs: :meth:`set` writes them in place.
    """

    def __init__(self, temperature: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor, seed: torch.Tensor,
                 step: torch.Tensor):
        specs = (("temperature", temperature, torch.float32), ("top_k", top_k, torch.int32),
                 ("top_p", top_p, torch.float32), ("seed", seed, torch.int64), ("step", step, torch.int64))
        batch, device = None, None
        for name, t, dtype in specs:
            if not isinstance(t, torch.Tensor):
                raise TypeError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
            if t.dtype != dtype or t.dim() != 1 or not t.is_contiguous():
                raise ValueError(f"{name}: expected a contiguous 1-D {dtype} tensor, got {tuple(t.shape)} {t.dtype}")
            batch = t.shape[0] if batch is None else batch
            device = t.device if device is None else device
            if t.shape[0] != batch or t.device != device:
                raise ValueError(f"{name}: expected ({batch},) on {device}, got {tuple(t.shape)} on {t.device}")
        if batch < 1:
            raise ValueError("temperature, top_k, top_p, seed, step: expected at least one row, got 0")
        # the values are read once here (not a hot path) and checked as set() checks host values; host copies of
        # top_k / top_p are kept by set()
        self._host_top_k, self._host_top_p = top_k.tolist(), top_p.tolist()
        for name, vals in (("temperature", temperature.tolist()), ("top_k", self._host_top_k),
                           ("top_p", self._host_top_p), ("step", step.tolist())):
            _check_values(name, vals)
        self.temperature, self.top_k, self.top_p, self.seed, self.step = temperature, top_k, top_p, seed, step
        self.batch, self.device = batch, device

    @classmethod
    def allocate(cls, batch: int, device="cpu") -> "SamplingParams":
        """Buffers for ``batch`` request slots with the defaults (temperature 1, no top-k / top-p, seed 0)."""
        if not isinstance(batch, int) or isinstance(batch, bool) or batch < 1:
            raise ValueError(f"batch: expected a positive int, got {batch!r}")
        device = resolve_device(device)
        return cls(torch.ones(batch, device=device), torch.zeros(batch, dtype=torch.int32, device=device),
                   torch.ones(batch, device=device), torch.zeros(batch, dtype=torch.int64, device=device),
                   torch.zeros(batch, dtype=torch.int64, device=device))

    @property
    def any_filter(self) -> bool:
        """Whether some row has top-k or top-p enabled (host-side copy of the parameters)."""
        return any(k > 0 or p < 1.0 for k, p in zip(self._host_top_k, self._host_top_p))

    def set(self, rows, *, temperature=None, top_k=None, top_p=None, seed=None, step=None) -> None:
        """Set parameters of ``rows`` (an int, slice, range or sequence) from host values (scalars or one per row).

        temperature: finite >= 0 (0 = greedy). top_k: int >= 0 (0 = off; > V means all). top_p: in (0, 1]
        (1 = off). seed: int in [-2**63, 2**63); setting a seed also resets the rows' step counters to 0
        unless ``step`` is given. step: int >= 0. Not for hot paths (host -> device copies).
        """
        rows = _rows_list(rows, self.batch)
        n = len(rows)
        updates = []
        if seed is not None and step is None:
            step = 0
        for name, value, buffer in (("temperature", temperature, self.temperature), ("top_k", top_k, self.top_k),
                                    ("top_p", top_p, self.top_p), ("seed", seed, self.seed), ("step", step, self.step)):
            if value is not None:
                vals = _per_row(name, value, n)
                if buffer.dtype == torch.float32:
                    vals = [float(v) for v in vals]
                _check_values(name, vals)
                updates.append((buffer, vals))
        index = torch.tensor(rows, dtype=torch.long, device=self.device)
        for buffer, vals in updates:
            buffer.index_copy_(0, index, torch.tensor(vals, dtype=buffer.dtype).to(self.device))
        for host, name, value in ((self._host_top_k, "top_k", top_k), (self._host_top_p, "top_p", top_p)):
            if value is not None:
                for r, v in zip(rows, _per_row(name, value, n)):
                    host[r] = v


def sample(logits: torch.Tensor, params: SamplingParams, out: torch.Tensor | None = None, *,
           filtering: bool | None = None) -> torch.Tensor:
    """Draw one token per row: logits (B, V) fp32/bf16/fp16 on ``params.device``, B <= params.batch (row b uses
    parameter row b) -> (B,) int64 (``out`` when given: a (B,) int64 tensor). Advances ``params.step[:B]``.

    filtering: None -> ``params.any_filter`` (host copy); True -> the sort path (top-k / top-p honoured);
    False -> the one-pass path, which ignores top-k / top-p. Sync-free; graph-capturable (see the module
    docstring about the path in a captured graph).
    """
    if not isinstance(params, SamplingParams):
        raise TypeError(f"params: expected a SamplingParams, got {type(params).__name__}")
    if not isinstance(logits, torch.Tensor):
        raise TypeError(f"logits: expected a torch.Tensor, got {type(logits).__name__}")
    if logits.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise TypeError(f"logits: expected float32/bfloat16/float16, got {logits.dtype}")
    if logits.dim() != 2 or logits.shape[1] < 1:
        raise ValueError(f"logits: expected shape (B, V) with V >= 1, got {tuple(logits.shape)}")
    num_rows, vocab = logits.shape
    if num_rows > params.batch:
        raise ValueError(f"logits: {num_rows} rows exceed the {params.batch} parameter rows")
    if logits.device != params.device:
        raise ValueError(f"logits: expected device {params.device} (the parameters'), got {logits.device}")
    if out is None:
        out = torch.empty(num_rows, dtype=torch.int64, device=logits.device)
    elif not isinstance(out, torch.Tensor):
        raise TypeError(f"out: expected a torch.Tensor, got {type(out).__name__}")
    elif out.dtype != torch.int64 or tuple(out.shape) != (num_rows,) or out.device != logits.device \
            or not out.is_contiguous():
        raise ValueError(f"out: expected a contiguous ({num_rows},) int64 tensor on {logits.device}, got "
                         f"{tuple(out.shape)} {out.dtype} on {out.device}")
    if filtering is not None and not isinstance(filtering, bool):
        raise TypeError(f"filtering: expected a bool or None, got {filtering!r}")
    if filtering is None:
        filtering = params.any_filter
    p = params
    temperature, top_k, top_p = p.temperature[:num_rows], p.top_k[:num_rows], p.top_p[:num_rows]
    seed, step = p.seed[:num_rows], p.step[:num_rows]
    if num_rows == 0:
        return out
    if not use_triton(logits):
        if filtering:
            tokens = _reference.sample(logits, temperature, top_k, top_p, seed, step)
        else:
            tokens = _reference.gumbel_pick(_reference.scaled_logits(logits, temperature), None, None,
                                            temperature, seed, step)
        out.copy_(tokens)
        step.add_(1)
        return out
    from ..kernels.sampling import launch_sample

    interp = interpreter_enabled() and not logits.is_cuda
    if filtering:
        # the sorted candidates inherit the logits' layout; the kernel reads them as contiguous rows
        values, ids, n_keep = _reference.sorted_candidates(logits.contiguous(), temperature, top_k, top_p)
        return launch_sample(values, ids, n_keep, temperature, seed, step, out, interpreter=interp)
    if logits.stride(1) != 1:  # the one-pass kernel takes any row stride
        logits = logits.contiguous()
    return launch_sample(logits, None, None, temperature, seed, step, out, interpreter=interp)
