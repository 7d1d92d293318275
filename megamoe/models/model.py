"""The DeepSeek-V4 model: embedding -> decoder layers (hyper-connections, attention, MoE) -> head; decode step.

Official ``Transformer.forward``: ``h = embed(ids)`` expanded to ``hc_mult`` copies, the layers, then
``hc_head`` -> final RMSNorm -> ``head`` (float32 logits).

Serving model: requests live in cache slots ``0..max_slots-1``. Host side (outside graphs): :meth:`join` a slot
and :meth:`prefill` its prompt (one request at a time), :meth:`prepare_decode` the pages a step writes.
Device side: :meth:`decode` computes one token per row of a fixed-size :class:`DecodeBatch` (sync-free and
capturable); :meth:`capture_decode` records decode + sampling into one CUDA graph per batch size.

Device index errors (``megamoe/ops/errors.py``): an eager :meth:`decode` / :meth:`prefill` checks the device error
word once, at its end (the layers' own per-layer checks are switched off meanwhile: one host read per step
instead of two per layer) and raises :class:`~megamoe.ops.errors.DeviceIndexError` naming the op and argument
whose out-of-range indices were masked. Skipped while capturing, under ``torch.cuda.set_sync_debug_mode``
(non-zero) and after ``errors.set_eager_checks(False)``. The graphs of :meth:`capture_decode` do not check:
call ``megamoe.check_errors()`` between steps (e.g. every step, or every N steps to amortise the sync).
"""
from __future__ import annotations

import time

import torch

from ..kvcache import DecodeBatch
from ..ops import errors
from ..ops import hyper_connection as hc_ops
from ..ops._dispatch import resolve_device
from ..ops.sampling import SamplingParams, sample
from .config import V4Config
from .decoder import V4DecoderLayer


class V4Model:
    """DeepSeek-V4 with NVFP4 experts and projections.

    cfg: :class:`V4Config` (``num_layers`` may be cut to run a prefix of the model on one GPU: pass
    ``num_layers``); max_batch: largest decode batch; max_prefill_tokens: longest prompt; max_slots: concurrent
    requests; max_context: longest request (prompt + generated tokens). head_dtype: float32 (the official
    float32 head; default on CPU) or bfloat16 (half the bytes; default on CUDA). ep_group: a torch.distributed
    process group for expert parallelism (every rank builds the model with the same arguments and runs the same
    calls on the same tokens; each holds E / world_size routed experts per layer,
    :class:`~megamoe.distributed.ep_block.TokenSplitMoE`); None: one process holds everything.
    """

    def __init__(self, cfg: V4Config, *, num_layers: int | None = None, max_batch: int = 8,
                 max_prefill_tokens: int = 512, max_slots: int | None = None, max_context: int | None = None,
                 device="cpu", mode: str = "w4a16", head_dtype: torch.dtype | None = None, ep_group=None):
        if not isinstance(cfg, V4Config):
            raise TypeError(f"cfg: expected a V4Config, got {type(cfg).__name__}")
        if num_layers is not None:
            if not isinstance(num_layers, int) or not 1 <= num_layers <= cfg.num_layers:
                raise ValueError(f"num_layers: expected 1..{cfg.num_layers}, got {num_layers!r}")
            cfg = cfg.replace(num_layers=num_layers, compress_ratios=cfg.compress_ratios[:num_layers],
                              num_hash_layers=min(cfg.num_hash_layers, num_layers))
        self.cfg, self.device = cfg, resolve_device(device)
        self.max_batch, self.max_prefill_tokens = max_batch, max_prefill_tokens
        self.max_slots = max_slots or max_batch
        self.max_context = max_context or cfg.max_seq_len
        if self.max_context > cfg.max_seq_len:
            raise ValueError(f"max_context: {self.max_context} exceeds cfg.max_seq_len={cfg.max_seq_len}")
        if self.max_slots < max_batch:
            raise ValueError(f"max_slots: expected >= max_batch={max_batch}, got {self.max_slots}")
        self.head_dtype = head_dtype or (torch.bfloat16 if self.device.type == "cuda" else torch.float32)
        self.layers = [V4DecoderLayer(cfg, i, max_batch=max_batch, max_prefill_tokens=max_prefill_tokens,
                                      max_slots=self.max_slots, max_context=self.max_context, device=device, mode=mode,
                                      ep_group=ep_group)
                       for i in range(cfg.num_layers)]
        self.positions = [0] * self.max_slots  # host mirror: tokens held by each slot (outside graphs)
        self.embed = self.norm = self.head = None
        self._graphs: dict = {}
        self._decisions: list | None = None  # host flag + log of record_decisions (None: not recording)

    # ------------------------------------------------------------------ weights
    def load_weights(self, tensors, *, progress=None) -> None:
        """tensors: mapping official name -> checkpoint tensor (a dict, or a lazy sharded-checkpoint reader);
        layers are built one at a time (``progress(i)`` is called after each)."""
        self.load_weights_top(tensors)
        for i, layer in enumerate(self.layers):
            layer.load_weights(tensors)
            if progress is not None:
                progress(i)

    def load_weights_top(self, tensors) -> None:
        """The tensors outside the decoder layers: embedding, final norm, head and the head's hyper-connection."""
        cfg, dev = self.cfg, self.device
        self.embed = _expect(tensors, "embed.weight", (cfg.vocab_size, cfg.hidden_size)).to(dev, torch.bfloat16)
        self.norm = _expect(tensors, "norm.weight", (cfg.hidden_size,)).to(dev, torch.float32)
        self.head = _expect(tensors, "head.weight", (cfg.vocab_size, cfg.hidden_size)).to(dev, self.head_dtype)
        hc = cfg.hc_mult
        self.hc_head_fn = _expect(tensors, "hc_head_fn", (hc, hc * cfg.hidden_size)).to(dev, torch.float32)
        self.hc_head_base = _expect(tensors, "hc_head_base", (hc,)).to(dev, torch.float32)
        self.hc_head_scale = _expect(tensors, "hc_head_scale", (1,)).to(dev, torch.float32)

    # ------------------------------------------------------------------ forward pieces
    def _embed(self, token_ids: torch.Tensor) -> torch.Tensor:
        x = torch.nn.functional.embedding(token_ids, self.embed)
        return x.unsqueeze(1).expand(-1, self.cfg.hc_mult, -1).contiguous()

    def _logits(self, h: torch.Tensor) -> torch.Tensor:
        cfg = self.cfg
        x = hc_ops.hc_head(h, self.hc_head_fn, self.hc_head_scale, self.hc_head_base, hc_eps=cfg.hc_eps,
                           norm_eps=cfg.norm_eps, norm_weight=self.norm)  # hc_head + final norm, fused
        return self._head_logits(x)

    def _head_logits(self, x: torch.Tensor) -> torch.Tensor:
        return (x.to(self.head_dtype) @ self.head.t()).float()

    def _head_hc(self) -> dict:
        """The head's hc (+ final norm) as keyword arguments of ``hc_ops.hc_post_pre`` (fused into the last
        layer's hc_post)."""
        cfg = self.cfg
        return dict(hc_fn=self.hc_head_fn, hc_scale=self.hc_head_scale, hc_base=self.hc_head_base, iters=1,
                    hc_eps=cfg.hc_eps, norm_eps=cfg.norm_eps, norm_weight=self.norm, head=True)

    def _layers(self, h: torch.Tensor, attend, token_ids: torch.Tensor, timer, head: bool):
        """The decoder layers with each layer's last hc_post fused with the next layer's first hc_pre (and, with
        ``head``, the last one's with the head's hc + norm). -> h, or (h, the head's normed x) with ``head``."""
        pre = None
        n = len(self.layers)
        record = [] if self._decisions is not None else None  # host flag: nothing extra when not recording
        for i, layer in enumerate(self.layers):
            nxt = self.layers[i + 1].hc_args("attn") if i + 1 < n else (self._head_hc() if head else None)
            h, pre = layer.forward_fused(h, pre, lambda x, a=layer.attn: attend(a, x), token_ids, nxt, timer)
            if record is not None:
                record.append(self._layer_decisions(layer))
        if record is not None:
            self._decisions[-1]["layers"] = record
        return (h, pre[0]) if head else h

    # ------------------------------------------------------------------ discrete decisions (eager diagnostics)
    def record_decisions(self, on: bool = True) -> None:
        """Start (``on``; clears the log) or stop recording the discrete decisions of every eager
        :meth:`prefill` / :meth:`decode`: per layer the MoE's expert ids (``Nvfp4MoE.last_routing``) and a CSA
        layer's compressed-entry top-k (the indexer's selection). Copies to the host after each layer (syncs):
        for tests and diagnostics only, refused inside a CUDA graph capture. When off (the default) the hot paths
        do nothing extra (one host check of a Python attribute per call). Read with :meth:`recorded_decisions`."""
        self._decisions = [] if on else None

    def _layer_decisions(self, layer) -> dict:
        if self.device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            raise RuntimeError("record_decisions: recording is eager only; switch it off before capture_decode")
        k = layer.moe.config.top_k
        ids = layer.moe.last_routing[1][:, :k].to("cpu", torch.int64)
        topk = layer.attn.last_entry_idx if layer.attn.kind == "csa" else None
        return {"moe_ids": ids, "index_topk": None if topk is None else topk.to("cpu", torch.int64)}

    def recorded_decisions(self, slot: int) -> list:
        """The decisions recorded for the request in ``slot`` since :meth:`record_decisions`, by position: a list
        (one per layer) of dicts ``moe_ids`` (N, top_k) int64 (the routed experts of positions 0..N-1, slot order)
        and ``index_topk`` (N, min(index_topk, max_entries)) int64 (CSA layers: the selected entries, best first,
        -1 = none; other layers None), on the CPU. Positions must have been recorded from 0 without gaps (the
        slot's prefill, then its decode rows); inactive decode rows are skipped. The format of
        ``megamoe.reference.v4_model.model_forward``'s ``forced_decisions``."""
        if self._decisions is None:
            raise RuntimeError("recorded_decisions: call record_decisions() before prefill / decode")
        rows = []  # (position, call, row)
        for call in self._decisions:
            for r, (s, p, a) in enumerate(zip(call["slots"], call["positions"], call["active"])):
                if s == slot and a:
                    rows.append((p, call, r))
        rows.sort(key=lambda x: x[0])
        if [p for p, _, _ in rows] != list(range(len(rows))):
            raise ValueError(f"recorded_decisions: slot {slot}: positions {[p for p, _, _ in rows]} are not 0..N-1")
        out = []
        for i in range(len(self.layers)):
            ids = torch.stack([c["layers"][i]["moe_ids"][r] for _, c, r in rows]) if rows else None
            topk = None
            if rows and rows[0][1]["layers"][i]["index_topk"] is not None:
                topk = torch.stack([c["layers"][i]["index_topk"][r] for _, c, r in rows])
            out.append({"moe_ids": ids, "index_topk": topk})
        return out

    # ------------------------------------------------------------------ host side
    def join(self, slot: int) -> None:
        if not isinstance(slot, int) or not 0 <= slot < self.max_slots:
            raise ValueError(f"slot: expected an int in [0, {self.max_slots}), got {slot!r}")
        for layer in self.layers:
            layer.attn.join(slot)
        self.positions[slot] = 0

    def leave(self, slot: int) -> None:
        for layer in self.layers:
            layer.attn.leave(slot)
        self.positions[slot] = 0

    def prefill(self, slot: int, token_ids: torch.Tensor, timer=None) -> torch.Tensor:
        """A fresh request's prompt (T,) int64 on the device -> logits (vocab,) float32 of its last token."""
        if token_ids.dim() != 1 or token_ids.dtype != torch.int64:
            raise TypeError("token_ids: expected a 1-D int64 tensor")
        T = token_ids.shape[0]
        if T < 1:
            raise ValueError("token_ids: expected at least one prompt token")
        if T > self.max_prefill_tokens:
            raise ValueError(f"token_ids: prompt of {T} tokens exceeds max_prefill_tokens={self.max_prefill_tokens}")
        if T >= self.max_context:
            raise ValueError(f"token_ids: prompt of {T} tokens leaves no room in max_context={self.max_context}")
        self.join(slot)
        for layer in self.layers:
            layer.attn.prepare([slot], [0], [T])
        if self._decisions is not None:
            self._decisions.append({"slots": [slot] * T, "positions": list(range(T)), "active": [True] * T})
        with _one_eager_check(self.device):
            h = self._embed(token_ids)
            h = self._layers(h, lambda a, x: a.forward_prefill(slot, x), token_ids, timer, head=False)
            self.positions[slot] = T
            return self._logits(h[-1:])[0]

    def prepare_decode(self, batch: DecodeBatch, slots, active=None) -> None:
        """Host step before a decode replay: rows ``i`` decode slot ``slots[i]`` at its next position; allocate
        the pages this step writes and fill ``batch``. Inactive rows (``active[i]`` False) are padding."""
        B = batch.slots.shape[0]
        if len(slots) != B:
            raise ValueError(f"slots: expected {B} entries (the batch size), got {len(slots)}")
        active = [True] * B if active is None else list(active)
        live = [s for s, a in zip(slots, active) if a]
        if len(set(live)) != len(live):
            raise ValueError(f"slots: an active slot appears twice: {live}")
        positions = [self.positions[s] if a else 0 for s, a in zip(slots, active)]
        for s, p in zip(live, (p for p, a in zip(positions, active) if a)):
            if p + 1 > self.max_context:
                raise ValueError(f"slot {s}: position {p} reached max_context={self.max_context}")
        for layer in self.layers:
            layer.attn.prepare(live, [self.positions[s] for s in live], [self.positions[s] + 1 for s in live])
        batch.set(list(slots), positions, active)
        for s in live:
            self.positions[s] += 1

    # ------------------------------------------------------------------ device side
    def decode(self, batch: DecodeBatch, token_ids: torch.Tensor, timer=None) -> torch.Tensor:
        """token_ids (B,) int64 (the last token of each row) -> logits (B, vocab) float32. Sync-free but for the
        one eager error-word check at the end (module docstring; skipped while capturing)."""
        if self._decisions is not None:  # host flag (recording is eager only)
            if self.device.type == "cuda" and torch.cuda.is_current_stream_capturing():
                raise RuntimeError("record_decisions: recording is eager only; switch it off before capture_decode")
            self._decisions.append({"slots": batch.slots.tolist(), "positions": batch.positions.tolist(),
                                    "active": batch.active.tolist()})
        with _one_eager_check(self.device):
            h = self._embed(token_ids)
            if not self.layers:
                return self._logits(h)
            _, x = self._layers(h, lambda a, x: a.forward_decode(batch, x), token_ids, timer, head=True)
            return self._head_logits(x)

    def capture_decode(self, batch_size: int, *, warmup: int = 1, filtering: bool = False):
        """One CUDA graph of decode + sampling for ``batch_size`` rows.

        Returns ``step(slots, active=None) -> next tokens (B,) int64 on the device``: runs the host step
        (:meth:`prepare_decode`), copies nothing but the batch description, replays. Replays do not check the
        device error word: call ``megamoe.check_errors()`` between steps. Inputs live in
        ``step.tokens`` (B,) int64 (the previous tokens; the graph writes the sampled ones back into it) and
        ``step.params`` (:class:`SamplingParams`, greedy until set otherwise). ``filtering``: capture the sampler's
        top-k / top-p path (a sort of the vocabulary per step); without it the graph ignores top-k / top-p.
        """
        if self.device.type != "cuda":
            raise RuntimeError("capture_decode: CUDA graphs need a CUDA model")
        if not 1 <= batch_size <= self.max_batch:
            raise ValueError(f"batch_size: expected 1..{self.max_batch}, got {batch_size}")
        batch = DecodeBatch.allocate(batch_size, self.device)
        tokens = torch.zeros(batch_size, dtype=torch.int64, device=self.device)
        params = SamplingParams.allocate(batch_size, self.device)
        params.set(range(batch_size), temperature=0.0)
        sampled = torch.zeros(batch_size, dtype=torch.int64, device=self.device)
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):  # all rows inactive: the caches are untouched
            for _ in range(warmup):
                sample(self.decode(batch, tokens), params, out=sampled, filtering=filtering)
        torch.cuda.current_stream().wait_stream(stream)
        params.set(range(batch_size), step=0)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            logits = self.decode(batch, tokens)
            sample(logits, params, out=sampled, filtering=filtering)
            tokens.copy_(sampled)

        def step(slots, active=None) -> torch.Tensor:
            self.prepare_decode(batch, slots, active)
            graph.replay()
            return tokens

        step.graph, step.batch, step.tokens, step.params, step.logits = graph, batch, tokens, params, logits
        # every tensor the graph writes must live as long as the graph: ``sampled`` was a local, freed when this
        # method returned, and each replay then wrote the sampled tokens into whatever the caching allocator
        # handed that block to next (results/gpu_check_v16, NOTES_moe_decode.md)
        step.sampled = sampled
        self._graphs[batch_size] = step
        return step

    def release_graphs(self) -> None:
        """Drop the captured decode graphs (their memory pools and, under expert parallelism, the collectives
        captured on the process group: release them before ``destroy_process_group``)."""
        self._graphs.clear()

    # ------------------------------------------------------------------ accounting
    def memory_bytes(self) -> dict:
        """Device bytes per component: experts (routed + shared), attention projections, caches, embed/head."""
        def nbytes(*ts):
            return sum(t.numel() * t.element_size() for t in ts if t is not None)

        moe = sum(l.moe.weight_bytes() for l in self.layers)
        attn = sum(l.attn.weight_bytes() for l in self.layers)
        caches = 0
        for l in self.layers:
            a = l.attn
            caches += nbytes(a.swa_rows)
            if a.cache is not None:
                caches += nbytes(*a.cache.pool.tensors())
        return {"experts": moe, "attention_weights": attn, "kv_caches": caches,
                "embed_head": nbytes(self.embed, self.head)}


class _one_eager_check:
    """Within: the layers' eager error checks are off; on a clean exit: one ``check_errors_eager`` (if checks were
    on before). An exception inside propagates unchanged (the word is left for the caller's check)."""

    def __init__(self, device):
        self.device = device

    def __enter__(self):
        self.previous = errors.set_eager_checks(False)

    def __exit__(self, exc_type, exc, tb):
        errors.set_eager_checks(self.previous)
        if exc_type is None:
            errors.check_errors_eager(self.device)
        return False


def _expect(tensors, name: str, shape: tuple) -> torch.Tensor:
    if name not in tensors:
        raise ValueError(f"checkpoint: missing tensor {name!r}")
    t = tensors[name]
    if tuple(t.shape) != tuple(shape):
        raise ValueError(f"checkpoint: {name!r} has shape {tuple(t.shape)}, expected {tuple(shape)}")
    return t


class PhaseTimer:
    """Accumulates wall time per phase name between calls (eager profiling only: synchronizes the device)."""

    def __init__(self, device):
        self.device, self.totals, self._t = torch.device(device), {}, None

    def _now(self) -> float:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return time.perf_counter()

    def start(self) -> None:
        self._t = self._now()

    def __call__(self, phase: str) -> None:
        now = self._now()
        self.totals[phase] = self.totals.get(phase, 0.0) + now - self._t
        self._t = now
