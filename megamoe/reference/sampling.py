"""Pure-PyTorch reference of the token sampler (greedy, temperature, top-k, top-p), counter-based randomness.

Definition, per row b of ``logits`` (B, V) with parameters ``temperature[b]`` (T), ``top_k[b]`` (k),
``top_p[b]`` (p), ``seed[b]``, ``step[b]``:

1. ``x = float32(logits[b])``; NaN entries become ``-inf`` (never sampled).
2. ``x = x / T`` when ``T > 0``; ``T == 0`` is greedy (x unscaled, no noise).
3. Order: a *stable* descending sort of x -> ``values``, ``ids`` (equal values keep id order, lowest first).
4. Kept prefix: ``n_k = min(k, V)`` (``k == 0``: ``V``, top-k off); with ``p < 1``, ``probs = softmax(values[:n_k])``
   and ``n_p`` = the number of ranks r with ``sum(probs[:r]) < p`` (exclusive prefix sum; rank 0 always kept)
   (``p == 1``: top-p off). ``n_keep = min(n_k, n_p)``: the smallest prefix of the top-k set (renormalised)
   whose mass reaches p.
5. Noise: ``u = counter_uniform(seed, step, token id)`` in (0, 1) and Gumbel ``g = -log(-log(u))`` per token
   (0 when greedy). Sample = ``ids[r*]`` with ``r* = argmax_{r < n_keep} values[r] + g(ids[r])``; ties -> the
   lowest rank (so greedy ties -> the lowest token id). Adding independent Gumbel noise to ``x`` and taking the
   argmax draws from ``softmax(x)`` restricted to the kept tokens (the Gumbel-max trick).
6. After sampling, ``step[b] += 1`` (done by the op; the reference is a pure function).

Special values: a row whose kept logits are all ``-inf``/NaN returns the lowest-ranked kept id (token 0 when every
logit is ``-inf``/NaN); ``+inf`` logits make top-p keep one token and the lowest-id ``+inf`` token wins.

Randomness (no host RNG state): ``counter_uniform`` hashes (seed, step, token id) with a 32-bit integer mixer
(``_mix32``: xor-shift / multiply rounds, all arithmetic modulo 2**32), so a row's draw depends only on its own
seed, its step counter and the token id -- not on the batch, the row's position, the vocabulary order or the
sort. The mantissa keeps 23 random bits: ``u = (2 * (bits >> 9) + 1) * 2**-24``.
"""
from __future__ import annotations

import torch

MASK32 = 0xFFFFFFFF
# Mixer constants (odd multipliers with good avalanche for xor-shift-multiply 32-bit hashes) and the seed offsets.
MIX_MUL_1 = 0x7FEB352D
MIX_MUL_2 = 0x846CA68B
SEED_OFFSET = 0x9E3779B9
TOKEN_OFFSET = 0x632BE5AB


def _mix32(x: torch.Tensor) -> torch.Tensor:
    """32-bit integer mixer on int64 tensors holding values in [0, 2**32)."""
    x = x ^ (x >> 16)
    x = (x * MIX_MUL_1) & MASK32
    x = x ^ (x >> 15)
    x = (x * MIX_MUL_2) & MASK32
    return x ^ (x >> 16)


def row_key(seed: torch.Tensor, step: torch.Tensor) -> torch.Tensor:
    """(B,) int64 seeds and step counters -> (B,) int64 row keys in [0, 2**32)."""
    seed, step = seed.long(), step.long()
    k = _mix32((seed & MASK32) ^ SEED_OFFSET)
    k = _mix32(k ^ ((seed >> 32) & MASK32))
    k = _mix32(k ^ (step & MASK32))
    return _mix32(k ^ ((step >> 32) & MASK32))


def counter_uniform(seed: torch.Tensor, step: torch.Tensor, token_ids: torch.Tensor) -> torch.Tensor:
    """Uniforms in (0, 1): seed, step (B,) int64; token_ids (B, N) or (N,) int -> (B, N) float32.

    ``bits = mix(mix((token + key) mod 2**32) ^ TOKEN_OFFSET)``, ``u = (2 * (bits >> 9) + 1) * 2**-24``.
    """
    key = row_key(seed, step).unsqueeze(1)
    tok = token_ids.long()
    if tok.dim() == 1:
        tok = tok.unsqueeze(0)
    bits = _mix32(_mix32((tok + key) & MASK32) ^ TOKEN_OFFSET)
    return ((bits >> 9) * 2 + 1).float() * 2.0 ** -24


def scaled_logits(logits: torch.Tensor, temperature: torch.Tensor) -> torch.Tensor:
    """Steps 1-2: (B, V) -> float32 ``x / T`` (T > 0) or ``x`` (greedy rows), NaN -> -inf."""
    x = torch.nan_to_num(logits.float(), nan=float("-inf"), posinf=float("inf"), neginf=float("-inf"))
    t = temperature.float()
    return x / torch.where(t > 0, t, torch.ones_like(t)).unsqueeze(1)


def keep_counts(values: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Step 4: sorted (descending) scaled values (B, V) -> (B,) int32 kept-prefix lengths (>= 1). Sync-free."""
    num_rows, vocab = values.shape
    k = top_k.long()
    n_k = torch.where((k > 0) & (k < vocab), k, torch.full_like(k, vocab))
    ranks = torch.arange(vocab, device=values.device).unsqueeze(0)
    in_k = ranks < n_k.unsqueeze(1)
    shifted = torch.where(in_k, values - values[:, :1], torch.full_like(values, float("-inf")))
    probs = torch.softmax(shifted, dim=1)
    exclusive = torch.cumsum(probs, dim=1) - probs
    n_p = (in_k & (exclusive < top_p.float().unsqueeze(1))).sum(dim=1).clamp(min=1)
    n_keep = torch.where(top_p.float() < 1.0, torch.minimum(n_k, n_p), n_k)
    return n_keep.to(torch.int32)


def sorted_candidates(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor,
                      top_p: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Steps 1-4: -> (values (B, V) fp32 descending, ids (B, V) int64, n_keep (B,) int32)."""
    values, ids = torch.sort(scaled_logits(logits, temperature), dim=1, descending=True, stable=True)
    return values, ids, keep_counts(values, top_k, top_p)


def gumbel_pick(values: torch.Tensor, ids: torch.Tensor | None, n_keep: torch.Tensor | None,
                temperature: torch.Tensor, seed: torch.Tensor, step: torch.Tensor) -> torch.Tensor:
    """Step 5 on candidates (B, N) (``ids`` None: the column is the token id; ``n_keep`` None: all kept).

    Returns (B,) int64 token ids.
    """
    num_rows, n = values.shape
    cols = torch.arange(n, device=values.device)
    tok = cols.unsqueeze(0).expand(num_rows, n) if ids is None else ids
    u = counter_uniform(seed, step, tok)
    noise = -torch.log(-torch.log(u))
    key = values + torch.where(temperature.float().unsqueeze(1) > 0, noise, torch.zeros_like(noise))
    if n_keep is not None:
        key = torch.where(cols.unsqueeze(0) < n_keep.long().unsqueeze(1), key, torch.full_like(key, float("-inf")))
    best = key.max(dim=1, keepdim=True).values
    rank = torch.where(key == best, cols.unsqueeze(0), torch.full_like(cols, n).unsqueeze(0)).min(dim=1).values
    return tok.gather(1, rank.unsqueeze(1)).squeeze(1).long()


def sample(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
           seed: torch.Tensor, step: torch.Tensor) -> torch.Tensor:
    """The whole definition (steps 1-5): logits (B, V) float; per-row parameters (B,) -> (B,) int64 token ids.

    temperature fp32 (>= 0; 0 greedy), top_k int (0 off), top_p fp32 in (0, 1] (1 off), seed / step int64.
    """
    values, ids, n_keep = sorted_candidates(logits, temperature, top_k, top_p)
    return gumbel_pick(values, ids, n_keep, temperature, seed, step)
