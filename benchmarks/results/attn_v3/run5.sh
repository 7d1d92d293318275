#!/bin/bash
# attention v3 + Q load after the producer's index chain: check, timeline, ncu source-level stalls (CSA B=128)
nvidia-smi --query-gpu=name --format=csv,noheader
python benchmarks/validate_attention_ws.py --variants ws3 --quick --no-timing --timeout 60 --out $OUT/check 2>&1 | grep -v "^{" | grep -v "^PASS" | tail -4
python benchmarks/probe_attention_blocks.py --timeline --batches 32,128 --entries 0,512,1024 --out $OUT/timeline 2>&1 | tail -8
NCU=/usr/local/cuda/bin/ncu
MEGAMOE_ATTN_IMPL=ws3 $NCU --kernel-name regex:'sparse_mqa_ws3' --section SourceCounters --section WarpStateStats --section SpeedOfLight --import-source no -f -o $OUT/v3c python benchmarks/probe_attention_ncu.py --cases csa:128:32768 --calls 1 > $OUT/ncu_log.txt 2>&1
$NCU -i $OUT/v3c.ncu-rep --page source --csv --print-source sass > $OUT/v3c_source.csv 2>&1
$NCU -i $OUT/v3c.ncu-rep --page details --csv > $OUT/v3c_details.csv 2>&1
rm -f $OUT/v3c.ncu-rep
