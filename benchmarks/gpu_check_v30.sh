#!/bin/bash
# GPU checks of 2026-11-27 (session part 19). Calls:
#   a -> where the time goes now and what no kernel can remove: the fixed cost of a timed graph replay
#        (probe_graph_overhead.py: an empty node, 1-3 dependent DRAM loads, 32 nodes), a fresh decode-step profile
#        (V4-Flash, 4 layers, batch 1 / 8 / 64), and the routed experts against the peer at 1 / 8 / 64 tokens under
#        both flushes (issue 11's 1.2x; not re-measured since the read flush).
#   b -> a: the decode step at batch 8 spends 62 us per CSA + HCA layer pair in cuBLAS float32 GEMV / SGEMM on float32
#        copies of the compressor weights (bf16 in the checkpoint). New: bf16_linear_fp32 (bf16 weights, exact
#        products, float32 sums; split-K kernel up to 64 rows, the router's tile kernel above). Its CUDA tests, the
#        fused-projection / attention CUDA tests, the benchmark against the float32 path and cuBLAS bf16 -> fp32, and
#        the decode-step profile again.
#   c -> b: cuBLAS's bf16 GEMM with float32 output beat the split-K kernel at nearly every shape (1.4-9x over the
#        float32 path): bf16_linear_fp32 now calls it (the router's tile kernel as the fallback), the split-K kernel is
#        dropped. Its CUDA tests (both routes, random-sign and all-positive inputs, V4 shapes, 1-4096 rows), the
#        layer / model CUDA tests, the benchmark and the decode-step profile at batch 1 / 8 / 64.
#   d -> where a prefill goes (the float32 compressor GEMMs were 2.1 ms of a 4096-token CSA layer until c): a prefill
#        profile at 1024 / 4096 tokens (profile_prefill.py), and the hyper-connection chain at batch 1 / 8 / 64
#        (hc_mix_partial: 21.6 us per call at batch 64 in c's decode profile).
#   e -> d: the mixes-partial kernel took 1.1 ms per call at 4096 tokens (22% of the prefill): its float32 FMA tl.dot.
#        New: tensor-core steps from 16 tokens (fn split into three bf16 terms, exact products). The hc CUDA tests,
#        the config sweep against the FMA path (sweep_hc_mix.py), the prefill profile again.
#   f -> e: hc_pre 1349 -> 267 us at 4096 tokens. Now also the q / kv and output kernels with 8 heads per program at
#        prefill sizes: their CUDA tests, the attention layer and model CUDA tests; the mixes' accuracy of both paths
#        in units of sum |x||fn| (sweep_hc_mix.py), the dense projections at prefill sizes against the pipelined
#        kernel as one expert and bf16 (bench_dense_prefill.py), and the prefill profile.
#   g -> f: the pipelined kernel as one expert beat nvfp4_linear's Triton kernel by 1.16-1.57x from 512 rows on all
#        six projection shapes: now the dense route there ("dense-pipe"). The gemm op CUDA tests, the attention layer
#        and model CUDA tests, and the prefill profile at 1024 / 4096 tokens.
#   h -> g: at 1024 tokens the prefill's wall time is 2.6x its GPU busy time (33.8 vs 12.9 ms for 4 layers): the host
#        syncs of one prefill by source line and the torch ops by CPU self time (profile_prefill.py --host).
#   i -> final check of the part's code: the README main job on the GPU, the PDL / tiny-model CUDA tests and the hc
#        kernel CUDA tests (the mixes' tensor-core steps inside a whole model).
# At most 8 output files (the device tool's limit).
export PYTHONUNBUFFERED=1
export MEGAMOE_PEERS=${MEGAMOE_PEERS:-$PWD/.peers}
OUT=${OUT:-benchmarks/results/gpu_check_v30}
mkdir -p "$OUT"
nvidia-smi --query-gpu=index,name,clocks.max.sm --format=csv,noheader
python -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
case "$1" in
a)
  timeout 60 python benchmarks/probe_graph_overhead.py --out "$OUT/a_graph_overhead.md"
  timeout 200 python benchmarks/profile_decode_step.py --layers 4 --batch 1,8,64 > "$OUT/a_profile.log" 2>&1
  tail -5 "$OUT/a_profile.log"
  for fl in read write; do
    timeout 150 python benchmarks/bench_peer.py --configs v4-flash,v4-pro --tokens 1,8,64 --routings uniform \
      --interleaved --no-bf16 --rep-ms 30 --budget-s 120 --flush $fl --out-dir "$OUT" --tag a_peer_decode_$fl \
      2>&1 | tail -12
  done
  ;;
b)
  timeout 240 python -m pytest -q -rfE --tb=short -p no:cacheprovider -m cuda tests/kernels/gemm/test_bf16_splitk.py \
    tests/layers/test_fused_projections.py tests/layers/test_attention_layer.py > "$OUT/b_tests.log" 2>&1
  tail -3 "$OUT/b_tests.log"
  timeout 200 python benchmarks/bench_bf16_linear.py --flush read --sweep --rep-ms 20 --out "$OUT/b_bf16_linear.md" \
    > "$OUT/b_bench.log" 2>&1; tail -3 "$OUT/b_bench.log"
  timeout 120 python benchmarks/profile_decode_step.py --layers 4 --batch 1,8 > "$OUT/b_profile.log" 2>&1
  grep -E "^## batch|gemvx|sgemm|gemmSN|bf16_splitk|router_logits" "$OUT/b_profile.log"
  ;;
c)
  timeout 300 python -m pytest -q -rfE --tb=short -p no:cacheprovider -m cuda tests/ops/test_bf16_linear.py \
    tests/layers/test_fused_projections.py tests/layers/test_attention_layer.py tests/models > "$OUT/c_tests.log" 2>&1
  tail -3 "$OUT/c_tests.log"
  timeout 150 python benchmarks/bench_bf16_linear.py --flush read --rep-ms 20 --out "$OUT/c_bf16_linear.md" \
    > "$OUT/c_bench.log" 2>&1; tail -3 "$OUT/c_bench.log"
  timeout 150 python benchmarks/profile_decode_step.py --layers 4 --batch 1,8,64 > "$OUT/c_profile.log" 2>&1
  grep -E "^## batch|gemvx|sgemm|gemmSN|xmma|nvjet" "$OUT/c_profile.log"
  ;;
d)
  timeout 300 python benchmarks/profile_prefill.py --layers 4 --tokens 1024,4096 --out "$OUT/d_prefill.md" \
    > "$OUT/d_prefill.log" 2>&1; tail -40 "$OUT/d_prefill.log"
  timeout 200 python benchmarks/bench_hyper_connection.py --batch 1,8,64 > "$OUT/d_hc.log" 2>&1; tail -30 "$OUT/d_hc.log"
  ;;
e)
  timeout 240 python -m pytest -q -rfE --tb=short -p no:cacheprovider -m cuda tests/kernels/test_hyper_connection_kernels.py \
    tests/ops/test_hyper_connection.py > "$OUT/e_tests.log" 2>&1; tail -3 "$OUT/e_tests.log"
  timeout 150 python benchmarks/sweep_hc_mix.py --flush read --out "$OUT/e_sweep_hc_mix.md" 2>&1 | tail -10
  timeout 150 python benchmarks/profile_prefill.py --layers 4 --tokens 4096 --top 20 --out "$OUT/e_prefill.md" \
    2>&1 | tail -24
  ;;
f)
  timeout 280 python -m pytest -q -rfE --tb=short -p no:cacheprovider -m cuda tests/kernels/test_v4_elementwise.py \
    tests/layers/test_attention_layer.py tests/models > "$OUT/f_tests.log" 2>&1; tail -3 "$OUT/f_tests.log"
  timeout 100 python benchmarks/sweep_hc_mix.py --flush read --configs-default-only --out "$OUT/f_sweep_hc_mix.md" 2>&1 | tail -9
  timeout 120 python benchmarks/bench_dense_prefill.py --flush read --out "$OUT/f_dense_prefill.md" 2>&1 | tail -25
  timeout 80 python benchmarks/profile_prefill.py --layers 4 --tokens 4096 --top 16 --out "$OUT/f_prefill.md" 2>&1 | tail -20
  ;;
g)
  timeout 300 python -m pytest -q -rfE --tb=short -p no:cacheprovider -m cuda tests/ops/test_gemm.py \
    tests/layers/test_attention_layer.py tests/layers/test_fused_projections.py tests/models > "$OUT/g_tests.log" 2>&1
  tail -3 "$OUT/g_tests.log"
  timeout 150 python benchmarks/profile_prefill.py --layers 4 --tokens 1024,4096 --top 24 --out "$OUT/g_prefill.md" \
    2>&1 | tail -28
  ;;
h)
  timeout 200 python benchmarks/profile_prefill.py --layers 4 --tokens 1024 --top 20 --host --out "$OUT/h_prefill_host.md" \
    2>&1 | tail -50
  ;;
i)
  timeout 300 python -m megamoe generate > "$OUT/i_generate.log" 2>&1; tail -12 "$OUT/i_generate.log"
  timeout 200 python -m pytest -q -rfE --tb=short -p no:cacheprovider -m cuda tests/kernels/test_pdl.py \
    tests/kernels/test_hyper_connection_kernels.py > "$OUT/i_tests.log" 2>&1; tail -3 "$OUT/i_tests.log"
  ;;
*)
  echo "unknown call $1"; exit 2;;
esac
