#!/bin/bash
# GPU checks of 2026-11-28 (session part 27). Calls:
#   a -> issue 10 / 11 at 9-128 tokens: the shared expert apart runs after the routed GEMMs, serially (~30 us at 64
#        tokens on V4-Flash). Nvfp4MoE(shared_overlap=True) forks it onto a side stream before the routing; so far it
#        kept the grouped GEMMs there (split-K's single-launch reduction shares the device's tile counters). Now the
#        side stream takes split-K above nvfp4_splitk.FUSED_MAX_ROWS rows, where split-K reduces in a second launch
#        without counters (moe.SHARED_OVERLAP_SPLITK). CUDA test of the overlap path (same bits as the separate path,
#        graph == eager, sync-free); the layer A/B at 9-128 tokens, three routings, both models: the defaults, the
#        overlap with split-K, the overlap without it.
#   b -> a: the overlap with split-K is 1.10-1.16x at all-on-k (9-128 tokens, both models) and 1.000-1.039x under the
#        router and Zipf on V4-Flash; V4-Pro router / Zipf 0.89-1.02x with noisy rounds (up to 20% apart). The default
#        layer now overlaps at 9-128 tokens (shared_overlap=None, w4a16, CUDA). CUDA tests of the MoE layer and the V4
#        model (graphs with the fork); the default against shared_overlap=False, 3 rounds.
#   c -> b: the default overlap is 1.00-1.17x at 9-128 tokens against it off (one V4-Pro all-on-k 32 capture 0.92x);
#        22 MoE-layer and 8 V4-model CUDA tests passed. Issue 15 on this GPU: bench_attention.py --layers 8 (eight
#        calls per graph on distinct caches, as eight layers of a decode step; time per call) against --layers 1, floors
#        at this GPU's measured copy rate (--hbm copy), batch 32-128 at 32k / 128k. Issue 10's skew table at 8 / 64
#        tokens with the new default (its floor column uses the H100's 3.0 TB/s).
#   d -> c: eight calls per graph take 2.4-3.8 us off each attention call (the graph launch); floors at the copy rate
#        c measured (2.78 TB/s, a uint8 copy: possibly not this GPU's rate; now float32). Skew table: every routing
#        faster than bf16 (1.77-3.80x). Here: the copy rate by dtype (uint8 / float32 / int64 elements), and the
#        shared-expert overlap beyond its measured range (192 / 256 / 512 tokens), three routings, both models.
#   e -> d: this GPU copies at 2.77 TB/s whatever the element type (so c's floors stand). The overlap at 192-512
#        tokens: V4-Flash 1.004-1.21x, V4-Pro 1.03-1.25x except its router at 192 / 256 (0.986 / 0.970x): the default
#        range is now 9-512 tokens. CUDA tests of the MoE layer and the V4 model again; the README main job on the GPU.
#   f -> e: 22 + 8 CUDA tests passed, generate ran (28 of 43 V4-Flash layers fit this GPU). Where all-on-k's time
#        goes now (the skew point still > 2x its floor): the layer's kernels at 8 / 64 tokens, both models.
#   g -> f: the skew table's V4-Pro uniform 64 tokens ran below its 3.0 TB/s floor (0.96x): this GPU reads faster than
#        its 2.77 TB/s copy rate suggests, so c's copy-rate floors are too low for read streams. The read rate: a
#        torch sum over 4 GiB and probe_stream.py's read kernels, read flush.
#   h -> g: read kernels stream 2.9-3.4 TB/s here (the issue's 3.0 TB/s floor is fair on this GPU). Prefill sizes: the
#        shared expert (route "dense-bf16", cuBLAS) beside the routed pipelined GEMMs at 1024 / 2048 / 4096 tokens,
#        three routings, both models, against the default (apart above 512 tokens).
#   i -> h: prefill sizes 0.94-1.04x with no consistent sign: the default stays 9-512. The overlap tests after their
#        review refactor (one graph helper), and the model's decode graph == eager at 10 requests (the MoE layers fork
#        the shared expert inside the captured step).
#   j -> i: 8 + 2 passed. Issue 10's all-on-k 64-token point: f showed the pipelined 64-row band streaming ~1.3 TB/s.
#        Its ring keeps STAGES - 2 steps in flight, ~32 KB of weights per SM in every 64-row config (the x tile is as
#        large as the weights'), which at ~3 us of loaded latency is ~1.4 TB/s: the ring depth, not the program
#        count. The 256-column 64-row band with 6 stages (209 KB, compiles offline) for both models, and a 1-program
#        8-stage 128-column band, against the defaults at 48 / 64 tokens, three routings.
# At most 8 output files (the device tool's limit).
export PYTHONUNBUFFERED=1
export MEGAMOE_PEERS=${MEGAMOE_PEERS:-$PWD/.peers}
OUT=${OUT:-benchmarks/results/gpu_check_v38}
mkdir -p "$OUT"
nvidia-smi --query-gpu=index,name,clocks.max.sm,memory.total --format=csv,noheader
python -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
# the MoE layer's and the V4 model's CUDA tests into LOG (calls b, e)
layer_and_model_tests() {
  timeout 200 python -m pytest -q -rfE --tb=short -p no:cacheprovider -m cuda tests/layers/test_moe_layer.py > "$1" 2>&1
  tail -1 "$1"
  timeout 160 python -m pytest -q -rfE --tb=short -p no:cacheprovider -m cuda tests/models/test_v4_model.py >> "$1" 2>&1
  tail -1 "$1"
}
case "$1" in
a)
  timeout 150 python -m pytest -q -rfE --tb=short -p no:cacheprovider -m cuda tests/layers/test_moe_layer.py \
    -k "shared_overlap or shared_expert_dense" > "$OUT/a_tests.log" 2>&1
  tail -1 "$OUT/a_tests.log"
  S="base|layer.shared_overlap=True|layer.shared_overlap=True;moe.SHARED_OVERLAP_SPLITK=False"
  timeout 420 python benchmarks/ab_layer_settings.py --configs v4-flash,v4-pro --tokens 9,16,32,64,128 \
    --flush read --rounds 2 --routings router,zipf,all-on-k --settings "$S" --out "$OUT" --tag a_shared_overlap \
    2>&1 | tail -40
  ;;
b)
  layer_and_model_tests "$OUT/b_tests.log"
  timeout 220 python benchmarks/ab_layer_settings.py --configs v4-flash,v4-pro --tokens 9,16,32,64,128 \
    --flush read --rounds 3 --routings router,zipf,all-on-k --settings "base|layer.shared_overlap=False" --out "$OUT" \
    --tag b_overlap_default 2>&1 | tail -3
  ;;
c)
  for n in 1 8; do
    timeout 200 python benchmarks/bench_attention.py --layers $n --hbm copy --flush read --batches 32,64,128 \
      --contexts 32768,131072 --out "$OUT/c_attention_layers$n" 2>&1 | grep -v "^{" | tail -2
  done
  timeout 170 python benchmarks/bench_moe_skew.py --configs v4-flash,v4-pro --tokens 8,64 \
    --routings uniform,zipf,all-on-k --out-dir "$OUT" --tag c_moe_skew 2>&1 | tail -13
  ;;
d)
  timeout 60 python - <<'PY'
import sys, torch
sys.path.insert(0, "benchmarks")
from bench_attention import bench_graph
for dt in (torch.uint8, torch.float32, torch.int64):
    src = torch.empty((1 << 31) // torch.tensor([], dtype=dt).element_size(), dtype=dt, device="cuda")
    dst = torch.empty_like(src)
    t = bench_graph(lambda: dst.copy_(src))
    print(f"copy 2 GiB of {dt}: {t * 1e6:.1f} us, {2 * (1 << 31) / t / 1e12:.3f} TB/s (read + write)")
    del src, dst
PY
  timeout 400 python benchmarks/ab_layer_settings.py --configs v4-flash,v4-pro --tokens 192,256,512 \
    --flush read --rounds 2 --routings router,zipf,all-on-k --settings "base|layer.shared_overlap=True" --out "$OUT" \
    --tag d_overlap_large 2>&1 | tail -36
  ;;
e)
  layer_and_model_tests "$OUT/e_tests.log"
  timeout 220 python -m megamoe generate > "$OUT/e_generate.log" 2>&1; tail -14 "$OUT/e_generate.log"
  ;;
f)
  timeout 300 python benchmarks/probe_moe_decode.py --configs v4-flash,v4-pro --tokens 8,64 --row-interleave 4 \
    --routing all-on-k --out "$OUT" --tag f_all_on_k 2>&1 | tail -4
  ;;
g)
  timeout 60 python - <<'PY'
import sys, torch
sys.path.insert(0, "benchmarks")
from graph_timing import use_flush_mode
use_flush_mode("read")
from bench_attention import bench_graph
x = torch.ones(1 << 30, dtype=torch.float32, device="cuda")
out = torch.empty((), dtype=torch.float32, device="cuda")
t = bench_graph(lambda: torch.sum(x, out=out))
print(f"torch.sum over 4 GiB float32 (read flush): {t * 1e6:.1f} us, {4 * (1 << 30) / t / 1e12:.3f} TB/s read")
PY
  timeout 200 python benchmarks/probe_stream.py --out "$OUT/g_probe_stream.md" 2>&1 | tail -25
  ;;
h)
  timeout 480 python benchmarks/ab_layer_settings.py --configs v4-flash,v4-pro --tokens 1024,2048,4096 \
    --flush read --rounds 2 --routings router,zipf,all-on-k --settings "base|layer.shared_overlap=True" --out "$OUT" \
    --tag h_overlap_prefill 2>&1 | tail -36
  ;;
i)
  timeout 150 python -m pytest -q -rfE --tb=short -p no:cacheprovider -m cuda tests/layers/test_moe_layer.py \
    -k "overlap" > "$OUT/i_tests.log" 2>&1
  tail -1 "$OUT/i_tests.log"
  timeout 150 python -m pytest -q -rfE --tb=short -p no:cacheprovider -m cuda tests/models/test_v4_model.py \
    -k "graph_replay_equals_eager" >> "$OUT/i_tests.log" 2>&1
  tail -1 "$OUT/i_tests.log"
  ;;
j)
  S="base|gemm.PIPE_ABOVE_WIDE_N=4096|pipe.PIPE_BAND_CONFIGS[64]=(64,256,128,8,6);gemm.PIPE_ABOVE_WIDE_N=4096"
  S="$S|pipe.PIPE_BAND64_NARROW_CONFIG=(64,128,128,4,8,1)"
  timeout 200 python benchmarks/ab_layer_settings.py --configs v4-flash,v4-pro --tokens 48,64 --flush read \
    --rounds 2 --routings all-on-k,zipf,router --settings "$S" --out "$OUT" --tag j_band64_ring 2>&1 | tail -48
  ;;
esac
