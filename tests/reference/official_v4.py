"""Test-side transcription of the official DeepSeek-V4 inference code, stateful, one sequence (batch 1).

Source: the vendored DeepSeek-V4-Flash ``inference/model.py`` (read with the ``read_file`` tool, id
"70831076062": ``Compressor``, ``Indexer``, ``Attention``, ``Gate``, ``Expert``, ``MoE``, ``Block``,
``ParallelHead``, ``Transformer``) and the ``kernel.py`` semantics summarised in ``/work/plan/NUMERICS.md``
(``act_quant``, ``fp4_act_quant``, ``sparse_attn``, ``hc_split_sinkhorn``). Written for these tests, not copied;
it keeps the official control flow (prefill ``start_pos == 0`` / decode ``start_pos > 0`` branches, the
``kv_state`` / ``score_state`` buffers, the window ring buffer, in-place RoPE / quantization on slices) so that
the stateless references in ``megamoe.reference.v4_attention`` / ``v4_model`` can be checked against it.

Deliberate differences from the official file:

* no batch dimension and no tensor parallelism;
* weights are float32 (exactly decoded NVFP4 / bf16), so a ``Linear`` is ``F.linear(x.float(), W)`` cast to the
  activation dtype ``dtype`` (bf16 = the official ``default_dtype``; float32 gives an all-float32 model). Every
  other op runs as the official code runs it, in the activation dtype with torch's own bf16 ops (e.g. q's
  per-head norm, the indexer's einsum / ReLU / weighting / head sum);
* the elementwise kernels are re-implemented here independently of ``megamoe.reference.v4_numerics``
  (frexp-based power-of-two scales, brute-force E2M1 rounding, butterfly Hadamard, the block-online
  ``sparse_attn`` with bf16 P) so that the comparison also checks that module;
* the head returns logits for every position (the official ``get_logits`` keeps the last one);
* equal indexer scores are ordered towards the lower entry index (``torch.topk`` leaves ties unspecified).
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F

# ----------------------------------------------------------------------------------------------
# kernel.py semantics (NUMERICS.md), implemented independently
# ----------------------------------------------------------------------------------------------
E2M1_GRID = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])


def pow2_ceil(t: torch.Tensor) -> torch.Tensor:
    """2**ceil(log2 t) for positive float32 t, exact (frexp: t = m * 2**e, m in [0.5, 1))."""
    m, e = torch.frexp(t)
    e = e - (m == 0.5).to(e.dtype)
    return torch.ldexp(torch.ones_like(t), e)


def e2m1_round(v: torch.Tensor) -> torch.Tensor:
    """Nearest E2M1 value of v (|v| <= 6), ties to the even code (grid index)."""
    a = v.abs().unsqueeze(-1)
    dist = (a - E2M1_GRID).abs()
    best = dist.min(dim=-1, keepdim=True).values
    even = (torch.arange(8) % 2 == 0).to(torch.float32)
    pick = ((dist == best).to(torch.float32) * (1 + even)).argmax(dim=-1)
    return torch.copysign(E2M1_GRID[pick], v)


def act_quant_(x: torch.Tensor, block: int) -> None:
    """kernel ``act_quant(x, block, "ue8m0", inplace=True)`` on a view: FP8 E4M3 round trip with power-of-two
    scales per ``block`` elements of the last dim."""
    g = x.float().unflatten(-1, (-1, block))
    s = pow2_ceil(g.abs().amax(-1, keepdim=True).clamp_min(1e-4) * torch.tensor(1 / 448, dtype=torch.float32))
    q = (g / s).clamp(-448, 448).to(torch.float8_e4m3fn).float() * s
    x.copy_(q.flatten(-2))


def fp4_act_quant_(x: torch.Tensor, block: int) -> None:
    """kernel ``fp4_act_quant(x, block, inplace=True)``: E2M1 round trip with power-of-two scales."""
    g = x.float().unflatten(-1, (-1, block))
    s = pow2_ceil(g.abs().amax(-1, keepdim=True).clamp_min(6 * 2.0 ** -126) * torch.tensor(1 / 6, dtype=torch.float32))
    x.copy_((e2m1_round((g / s).clamp(-6, 6)) * s).flatten(-2))


def rotate_activation(x: torch.Tensor) -> torch.Tensor:
    """``hadamard_transform(x, scale=d**-0.5)``: Walsh-Hadamard butterfly in float32, cast back."""
    d = x.shape[-1]
    y = x.float().clone()
    h = 1
    while h < d:
        y = y.unflatten(-1, (-1, 2, h))
        a, b = y[..., 0, :], y[..., 1, :]
        y = torch.stack([a + b, a - b], dim=-2).flatten(-3)
        h *= 2
    return (y * d ** -0.5).to(x.dtype)


def hc_split_sinkhorn(mixes, hc_scale, hc_base, hc: int, iters: int, eps: float):
    pre = torch.sigmoid(mixes[..., :hc] * hc_scale[0] + hc_base[:hc]) + eps
    post = 2 * torch.sigmoid(mixes[..., hc:2 * hc] * hc_scale[1] + hc_base[hc:2 * hc])
    logits = mixes[..., 2 * hc:] * hc_scale[2] + hc_base[2 * hc:]
    comb = torch.softmax(logits.view(*logits.shape[:-1], hc, hc), dim=-1) + eps
    comb = comb / (comb.sum(dim=-2, keepdim=True) + eps)
    for _ in range(iters - 1):
        comb = comb / (comb.sum(dim=-1, keepdim=True) + eps)
        comb = comb / (comb.sum(dim=-2, keepdim=True) + eps)
    return pre, post, comb


def sparse_attn(q: torch.Tensor, kv: torch.Tensor, attn_sink: torch.Tensor, topk_idxs: torch.Tensor,
                scale: float) -> torch.Tensor:
    """kernel ``sparse_attn``: q (S, H, D), kv (N, D), topk_idxs (S, K) (-1 skipped) -> (S, H, D) in q.dtype.

    Online softmax over blocks of 64 selected rows as the TileLang kernel: fp32 logits, running max, P cast to
    the activation dtype (bf16) for P @ V, the sink added to the denominator at the end.
    """
    S, H, D = q.shape
    K = topk_idxs.shape[1]
    qf = q.float()
    acc_o = torch.zeros(S, H, D)
    sum_exp = torch.zeros(S, H)
    m = torch.full((S, H), float("-inf"))
    for start in range(0, K, 64):
        idx = topk_idxs[:, start:start + 64].long()
        valid = idx != -1
        rows = torch.where(valid[..., None], kv[idx.clamp_min(0)], torch.zeros((), dtype=kv.dtype)).float()
        s = torch.einsum("shd,sjd->shj", qf, rows)
        s = s.masked_fill(~valid[:, None, :], float("-inf")) * torch.tensor(scale, dtype=torch.float32)
        m_new = torch.maximum(m, s.amax(-1))
        safe = torch.where(torch.isfinite(m_new), m_new, torch.zeros_like(m_new))
        rescale = torch.exp(m - safe)
        p = torch.exp(s - safe[..., None])
        sum_exp = sum_exp * rescale + p.sum(-1)
        acc_o = acc_o * rescale[..., None] + torch.einsum("shj,sjd->shd", p.to(q.dtype).float(), rows)
        m = m_new
    sum_exp = sum_exp + torch.exp(attn_sink.float() - m)
    return (acc_o / sum_exp[..., None]).to(q.dtype)


# ----------------------------------------------------------------------------------------------
# model.py helpers
# ----------------------------------------------------------------------------------------------
def precompute_freqs_cis(dim, seqlen, original_seq_len, base, factor, beta_fast, beta_slow) -> torch.Tensor:
    freqs = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
    if original_seq_len > 0:
        def corr(rot):
            return dim * math.log(original_seq_len / (rot * 2 * math.pi)) / (2 * math.log(base))
        low, high = max(math.floor(corr(beta_fast)), 0), min(math.ceil(corr(beta_slow)), dim - 1)
        if low == high:
            high += 0.001
        smooth = 1 - torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
        freqs = freqs / factor * (1 - smooth) + freqs * smooth
    return torch.polar(torch.ones(seqlen, dim // 2), torch.outer(torch.arange(seqlen).float(), freqs))


def apply_rotary_emb_(x: torch.Tensor, freqs_cis: torch.Tensor, inverse: bool = False) -> None:
    """In place on a view x (S, [H,] rd): adjacent pairs as complex numbers times freqs_cis (S, rd/2)."""
    z = torch.view_as_complex(x.float().unflatten(-1, (-1, 2)))
    f = freqs_cis.conj() if inverse else freqs_cis
    f = f.view(z.shape[0], *([1] * (z.dim() - 2)), z.shape[-1])
    x.copy_(torch.view_as_real(z * f).flatten(-2))


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    xf = x.float()
    return (weight * (xf * torch.rsqrt(xf.square().mean(-1, keepdim=True) + eps))).to(x.dtype)


def window_topk_idxs(window: int, seqlen: int, start_pos: int) -> torch.Tensor:
    if start_pos >= window - 1:
        p = start_pos % window
        return torch.cat([torch.arange(p + 1, window), torch.arange(0, p + 1)]).unsqueeze(0)
    if start_pos > 0:
        return F.pad(torch.arange(start_pos + 1), (0, window - start_pos - 1), value=-1).unsqueeze(0)
    base = torch.arange(seqlen).unsqueeze(1)
    m = (base - window + 1).clamp(0) + torch.arange(min(seqlen, window))
    return torch.where(m > base, -1, m)


def compress_topk_idxs(ratio: int, seqlen: int, start_pos: int, offset: int) -> torch.Tensor:
    if start_pos > 0:
        return (torch.arange(0, (start_pos + 1) // ratio) + offset).unsqueeze(0)
    m = torch.arange(seqlen // ratio).repeat(seqlen, 1)
    return torch.where(m >= torch.arange(1, seqlen + 1).unsqueeze(1) // ratio, -1, m + offset)


class _Module:
    """Weight access by official module path."""

    def __init__(self, w, prefix: str, dtype):
        self.w, self.prefix, self.dtype = w, prefix, dtype

    def p(self, name: str) -> torch.Tensor:
        return self.w[self.prefix + name]

    def linear(self, x: torch.Tensor, name: str) -> torch.Tensor:
        """A bf16-default ``Linear``: float32 weights, output in the activation dtype."""
        return F.linear(x.float(), self.p(name + ".weight")).to(self.dtype)


# ----------------------------------------------------------------------------------------------
# attention
# ----------------------------------------------------------------------------------------------
class Compressor(_Module):
    def __init__(self, cfg, w, prefix, ratio, head_dim, rotate, dtype, kv_cache, freqs_cis):
        super().__init__(w, prefix, dtype)
        self.ratio, self.head_dim, self.rd, self.eps = ratio, head_dim, cfg.rope_dim, cfg.norm_eps
        self.overlap = ratio == 4
        self.rotate = rotate
        coff = 1 + self.overlap
        self.kv_state = torch.zeros(coff * ratio, coff * head_dim)
        self.score_state = torch.full((coff * ratio, coff * head_dim), float("-inf"))
        self.kv_cache, self.freqs_cis = kv_cache, freqs_cis

    def overlap_transform(self, t: torch.Tensor, value) -> torch.Tensor:
        n, r, d = t.shape[0], self.ratio, self.head_dim
        out = t.new_full((n, 2 * r, d), value)
        out[:, r:] = t[:, :, d:]
        out[1:, :r] = t[:-1, :, :d]
        return out

    def forward(self, x: torch.Tensor, start_pos: int):
        seqlen, r, d, rd = x.shape[0], self.ratio, self.head_dim, self.rd
        ape = self.p("ape")
        xf = x.float()
        kv = F.linear(xf, self.p("wkv.weight"))
        score = F.linear(xf, self.p("wgate.weight"))
        if start_pos == 0:
            should_compress = seqlen >= r
            remainder = seqlen % r
            cutoff = seqlen - remainder
            offset = r if self.overlap else 0
            if self.overlap and cutoff >= r:
                self.kv_state[:r] = kv[cutoff - r:cutoff]
                self.score_state[:r] = score[cutoff - r:cutoff] + ape
            if remainder:
                self.kv_state[offset:offset + remainder] = kv[cutoff:]
                self.score_state[offset:offset + remainder] = score[cutoff:] + ape[:remainder]
                kv, score = kv[:cutoff], score[:cutoff]
            kv = kv.unflatten(0, (-1, r))
            score = score.unflatten(0, (-1, r)) + ape
            if self.overlap:
                kv = self.overlap_transform(kv, 0)
                score = self.overlap_transform(score, float("-inf"))
            kv = (kv * score.softmax(dim=1)).sum(dim=1)
        else:
            should_compress = (start_pos + 1) % r == 0
            score = score + ape[start_pos % r]
            if self.overlap:
                self.kv_state[r + start_pos % r] = kv[0]
                self.score_state[r + start_pos % r] = score[0]
                if should_compress:
                    kvs = torch.cat([self.kv_state[:r, :d], self.kv_state[r:, d:]])
                    scs = torch.cat([self.score_state[:r, :d], self.score_state[r:, d:]])
                    kv = (kvs * scs.softmax(dim=0)).sum(dim=0, keepdim=True)
                    self.kv_state[:r] = self.kv_state[r:].clone()
                    self.score_state[:r] = self.score_state[r:].clone()
            else:
                self.kv_state[start_pos % r] = kv[0]
                self.score_state[start_pos % r] = score[0]
                if should_compress:
                    kv = (self.kv_state * self.score_state.softmax(dim=0)).sum(dim=0, keepdim=True)
        if not should_compress:
            return None
        kv = rms_norm(kv.to(self.dtype), self.p("norm.weight"), self.eps)
        freqs = self.freqs_cis[:cutoff:r] if start_pos == 0 else self.freqs_cis[start_pos + 1 - r].unsqueeze(0)
        apply_rotary_emb_(kv[..., -rd:], freqs)
        if self.rotate:
            kv = rotate_activation(kv)
            fp4_act_quant_(kv, 32)
        else:
            act_quant_(kv[..., :-rd], 64)
        if start_pos == 0:
            self.kv_cache[:seqlen // r] = kv
        else:
            self.kv_cache[start_pos // r] = kv[0]
        return kv


class Indexer(_Module):
    def __init__(self, cfg, w, prefix, dtype, freqs_cis, max_seq_len):
        super().__init__(w, prefix, dtype)
        self.n_heads, self.head_dim, self.rd = cfg.index_n_heads, cfg.index_head_dim, cfg.rope_dim
        self.index_topk, self.ratio = cfg.index_topk, 4
        self.softmax_scale = self.head_dim ** -0.5
        self.kv_cache = torch.zeros(max_seq_len // 4, self.head_dim, dtype=dtype)
        self.freqs_cis = freqs_cis
        self.compressor = Compressor(cfg, w, prefix + "compressor.", 4, self.head_dim, True, dtype, self.kv_cache,
                                     freqs_cis)
        self.last_scores = None

    def forward(self, x, qr, start_pos: int, offset: int) -> torch.Tensor:
        seqlen, rd, r = x.shape[0], self.rd, self.ratio
        end_pos = start_pos + seqlen
        freqs = self.freqs_cis[start_pos:end_pos]
        q = self.linear(qr, "wq_b").unflatten(-1, (self.n_heads, self.head_dim))
        apply_rotary_emb_(q[..., -rd:], freqs)
        q = rotate_activation(q)
        fp4_act_quant_(q, 32)
        self.compressor.forward(x, start_pos)
        weights = self.linear(x, "weights_proj") * (self.softmax_scale * self.n_heads ** -0.5)
        score = torch.einsum("shd,td->sht", q, self.kv_cache[:end_pos // r])
        score = (score.relu_() * weights.unsqueeze(-1)).sum(dim=1)
        if start_pos == 0:
            mask = torch.arange(seqlen // r).repeat(seqlen, 1) >= torch.arange(1, seqlen + 1).unsqueeze(1) // r
            score += torch.where(mask, float("-inf"), 0.0)
        self.last_scores = score
        # official: score.topk(k)[1]; torch.topk leaves the order of equal scores unspecified, so ties are broken
        # here towards the lower entry index (the reference's rule) to make the comparison deterministic
        k = min(self.index_topk, end_pos // r)
        idx = torch.sort(score, dim=-1, descending=True, stable=True).indices[:, :k]
        if start_pos == 0:
            return torch.where(idx >= torch.arange(1, seqlen + 1).unsqueeze(1) // r, -1, idx + offset)
        return idx + offset


class Attention(_Module):
    def __init__(self, cfg, layer: int, w, dtype=torch.bfloat16, max_seq_len: int | None = None):
        super().__init__(w, f"layers.{layer}.attn.", dtype)
        self.cfg = cfg
        max_seq_len = max_seq_len or cfg.max_seq_len
        self.n_heads, self.head_dim, self.rd = cfg.num_heads, cfg.head_dim, cfg.rope_dim
        self.n_groups, self.o_lora_rank = cfg.o_groups, cfg.o_lora_rank
        self.window, self.eps = cfg.window_size, cfg.norm_eps
        self.ratio = cfg.compress_ratios[layer]
        self.softmax_scale = self.head_dim ** -0.5
        self.kv_cache = torch.zeros(self.window + (max_seq_len // self.ratio if self.ratio else 0), self.head_dim,
                                    dtype=dtype)
        if self.ratio:
            osl, theta = cfg.original_seq_len, cfg.compress_rope_theta
        else:
            osl, theta = 0, cfg.rope_theta
        self.freqs_cis = precompute_freqs_cis(self.rd, max_seq_len, osl, theta, cfg.rope_factor, cfg.beta_fast,
                                              cfg.beta_slow)
        self.compressor = self.indexer = None
        if self.ratio:
            self.compressor = Compressor(cfg, w, self.prefix + "compressor.", self.ratio, self.head_dim, False, dtype,
                                         self.kv_cache[self.window:], self.freqs_cis)
            if self.ratio == 4:
                self.indexer = Indexer(cfg, w, self.prefix + "indexer.", dtype, self.freqs_cis, max_seq_len)
        self.last_topk = None

    def forward(self, x: torch.Tensor, start_pos: int) -> torch.Tensor:
        seqlen, win, ratio, rd = x.shape[0], self.window, self.ratio, self.rd
        freqs = self.freqs_cis[start_pos:start_pos + seqlen]
        qr = q = rms_norm(self.linear(x, "wq_a"), self.p("q_norm.weight"), self.eps)
        q = self.linear(q, "wq_b").unflatten(-1, (self.n_heads, self.head_dim))
        q = q * torch.rsqrt(q.square().mean(-1, keepdim=True) + self.eps)
        apply_rotary_emb_(q[..., -rd:], freqs)
        kv = rms_norm(self.linear(x, "wkv"), self.p("kv_norm.weight"), self.eps)
        apply_rotary_emb_(kv[..., -rd:], freqs)
        act_quant_(kv[..., :-rd], 64)
        topk = window_topk_idxs(win, seqlen, start_pos)
        if ratio:
            offset = seqlen if start_pos == 0 else win
            if self.indexer is not None:
                ctopk = self.indexer.forward(x, qr, start_pos, offset)
            else:
                ctopk = compress_topk_idxs(ratio, seqlen, start_pos, offset)
            topk = torch.cat([topk, ctopk], dim=-1)
        self.last_topk = topk.int()
        if start_pos == 0:
            if seqlen <= win:
                self.kv_cache[:seqlen] = kv
            else:
                cutoff = seqlen % win
                self.kv_cache[cutoff:win], self.kv_cache[:cutoff] = kv[-win:].split([win - cutoff, cutoff])
            if ratio:
                kv_compress = self.compressor.forward(x, start_pos)
                if kv_compress is not None:
                    kv = torch.cat([kv, kv_compress])
            o = sparse_attn(q, kv, self.p("attn_sink"), self.last_topk, self.softmax_scale)
        else:
            self.kv_cache[start_pos % win] = kv[0]
            if ratio:
                self.compressor.forward(x, start_pos)
            o = sparse_attn(q, self.kv_cache, self.p("attn_sink"), self.last_topk, self.softmax_scale)
        apply_rotary_emb_(o[..., -rd:], freqs, inverse=True)
        o = o.view(seqlen, self.n_groups, -1)
        wo_a = self.p("wo_a.weight").view(self.n_groups, self.o_lora_rank, -1)
        o = torch.einsum("sgd,grd->sgr", o.float(), wo_a).to(self.dtype)
        return self.linear(o.flatten(1), "wo_b")


# ----------------------------------------------------------------------------------------------
# MoE, block, model
# ----------------------------------------------------------------------------------------------
class Gate(_Module):
    def __init__(self, cfg, layer: int, w, dtype):
        super().__init__(w, f"layers.{layer}.ffn.gate.", dtype)
        m = cfg.moe
        self.topk, self.score_func, self.route_scale = m.top_k, m.scoring_func, m.routed_scaling_factor
        self.hash = layer < cfg.num_hash_layers

    def forward(self, x: torch.Tensor, input_ids: torch.Tensor):
        scores = F.linear(x.float(), self.p("weight").float())
        if self.score_func == "softmax":
            scores = scores.softmax(dim=-1)
        elif self.score_func == "sigmoid":
            scores = scores.sigmoid()
        else:
            scores = F.softplus(scores).sqrt()
        original = scores
        if not self.hash:
            scores = scores + self.p("bias")
            indices = scores.topk(self.topk, dim=-1)[1]
        else:
            indices = self.p("tid2eid")[input_ids].long()
        weights = original.gather(1, indices)
        if self.score_func != "softmax":
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return weights * self.route_scale, indices


class Expert(_Module):
    def __init__(self, w, prefix, dtype, swiglu_limit):
        super().__init__(w, prefix, dtype)
        self.swiglu_limit = swiglu_limit or 0

    def forward(self, x, weights=None):
        gate = self.linear(x, "w1").float()
        up = self.linear(x, "w3").float()
        if self.swiglu_limit > 0:
            up = torch.clamp(up, min=-self.swiglu_limit, max=self.swiglu_limit)
            gate = torch.clamp(gate, max=self.swiglu_limit)
        y = F.silu(gate) * up
        if weights is not None:
            y = weights * y
        return self.linear(y.to(self.dtype), "w2")


class MoE:
    def __init__(self, cfg, layer: int, w, dtype):
        m = cfg.moe
        p = f"layers.{layer}.ffn."
        self.gate = Gate(cfg, layer, w, dtype)
        self.experts = [Expert(w, f"{p}experts.{e}.", dtype, m.swiglu_limit) for e in range(m.num_experts)]
        self.shared = Expert(w, p + "shared_experts.", dtype, m.swiglu_limit) if m.shared_intermediate_size else None
        self.n = m.num_experts

    def forward(self, x, input_ids):
        weights, indices = self.gate.forward(x, input_ids)
        self.last_routing = (weights, indices)
        y = torch.zeros(x.shape, dtype=torch.float32)
        counts = torch.bincount(indices.flatten(), minlength=self.n).tolist()
        for i in range(self.n):
            if counts[i]:
                idx, top = torch.where(indices == i)
                y[idx] += self.experts[i].forward(x[idx], weights[idx, top, None])
        if self.shared is not None:
            y += self.shared.forward(x)
        return y.type_as(x)


class Block(_Module):
    def __init__(self, cfg, layer: int, w, dtype, max_seq_len):
        super().__init__(w, f"layers.{layer}.", dtype)
        self.cfg = cfg
        self.attn = Attention(cfg, layer, w, dtype, max_seq_len)
        self.ffn = MoE(cfg, layer, w, dtype)

    def hc_pre(self, x, part: str):
        shape, dtype = x.shape, x.dtype
        xf = x.flatten(1).float()
        rsqrt = torch.rsqrt(xf.square().mean(-1, keepdim=True) + self.cfg.norm_eps)
        mixes = F.linear(xf, self.p(f"hc_{part}_fn")) * rsqrt
        pre, post, comb = hc_split_sinkhorn(mixes, self.p(f"hc_{part}_scale"), self.p(f"hc_{part}_base"),
                                            self.cfg.hc_mult, self.cfg.hc_sinkhorn_iters, self.cfg.hc_eps)
        y = torch.sum(pre.unsqueeze(-1) * xf.view(shape), dim=1)
        return y.to(dtype), post, comb

    @staticmethod
    def hc_post(x, residual, post, comb):
        y = post.unsqueeze(-1) * x.unsqueeze(-2) + torch.sum(comb.unsqueeze(-1) * residual.unsqueeze(-2), dim=1)
        return y.type_as(x)

    def forward(self, x, start_pos: int, input_ids):
        eps = self.cfg.norm_eps
        residual = x
        x, post, comb = self.hc_pre(x, "attn")
        x = self.attn.forward(rms_norm(x, self.p("attn_norm.weight"), eps), start_pos)
        x = self.hc_post(x, residual, post, comb)
        residual = x
        x, post, comb = self.hc_pre(x, "ffn")
        x = self.ffn.forward(rms_norm(x, self.p("ffn_norm.weight"), eps), input_ids)
        return self.hc_post(x, residual, post, comb)


class Transformer:
    def __init__(self, cfg, w, dtype=torch.bfloat16, max_seq_len: int | None = None):
        self.cfg, self.w, self.dtype = cfg, w, dtype
        max_seq_len = max_seq_len or cfg.max_seq_len
        self.layers = [Block(cfg, i, w, dtype, max_seq_len) for i in range(cfg.num_layers)]

    def hc_head(self, x):
        xf = x.flatten(1).float()
        rsqrt = torch.rsqrt(xf.square().mean(-1, keepdim=True) + self.cfg.norm_eps)
        mixes = F.linear(xf, self.w["hc_head_fn"]) * rsqrt
        pre = torch.sigmoid(mixes * self.w["hc_head_scale"] + self.w["hc_head_base"]) + self.cfg.hc_eps
        return torch.sum(pre.unsqueeze(-1) * xf.view(x.shape), dim=1).to(x.dtype)

    def forward(self, input_ids: torch.Tensor, start_pos: int = 0) -> torch.Tensor:
        """Logits (S, vocab) float32 for the S new tokens (prefill when start_pos == 0, else one decode step)."""
        h = self.w["embed.weight"][input_ids].to(self.dtype)
        h = h.unsqueeze(1).repeat(1, self.cfg.hc_mult, 1)
        for layer in self.layers:
            h = layer.forward(h, start_pos, input_ids)
        x = rms_norm(self.hc_head(h), self.w["norm.weight"], self.cfg.norm_eps)
        return F.linear(x.float(), self.w["head.weight"])
