# A/B of the two-programs-per-SM pipelined configs (MEGAMOE_PIPE_SMALL, NOTES_gemm.md v17): 0 off, 1 on (the default)
timeout 120 python -m pytest -q -m cuda tests/kernels/gemm/test_nvfp4_wgmma_pipe.py 2>&1 | tail -1
for sm in ${LEVELS:-0 1}; do
  MEGAMOE_PIPE_SMALL=$sm MEGAMOE_PEERS=.peers timeout 150 python benchmarks/bench_peer.py --configs ${CONFIGS:-v4-flash,v4-pro} \
    --tokens ${TOKENS:-512,1024,2048} --routings uniform,zipf --rep-ms 10 --no-bf16 --out-dir $OUT --tag l_small$sm 2>&1 | grep "tok:\|Error"
done
