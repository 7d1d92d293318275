#!/bin/bash
# attention v3: ncu source-level warp-stall sampling of one CSA batch-128 call (where do warps wait?)
which ncu || ls /usr/local/cuda*/bin/ncu
NCU=$(which ncu || ls /usr/local/cuda*/bin/ncu | head -1)
MEGAMOE_ATTN_IMPL=ws3 $NCU --kernel-name regex:'sparse_mqa_ws3' --section SourceCounters --section WarpStateStats \
  --section SpeedOfLight --section SchedulerStats --import-source no -f -o $OUT/v3_b128 \
  python benchmarks/probe_attention_ncu.py --cases csa:128:32768 --calls 1 > $OUT/ncu_log.txt 2>&1
tail -5 $OUT/ncu_log.txt
$NCU -i $OUT/v3_b128.ncu-rep --page source --csv --print-source sass > $OUT/v3_b128_source.csv 2>&1
$NCU -i $OUT/v3_b128.ncu-rep --page details --csv > $OUT/v3_b128_details.csv 2>&1
head -3 $OUT/v3_b128_source.csv | cut -c1-600
wc -l $OUT/*.csv
ls -la $OUT
