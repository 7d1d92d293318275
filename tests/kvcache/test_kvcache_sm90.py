"""The compressed-cache kernels compile for sm_90 (offline, no GPU) at V4 dims without register spills;
the indexer's dots lower to wgmma."""
import json
import os
import subprocess
import sys


def test_kernels_compile_for_sm90_without_spills():
    script = os.path.join(os.path.dirname(__file__), "kvcache_sm90_compile.py")
    env = dict(os.environ, TRITON_INTERPRET="0")
    out = subprocess.run([sys.executable, script], capture_output=True, text=True, env=env, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    report = json.loads(out.stdout.strip().splitlines()[-1])
    assert len(report) == 10
    for name, usage in report.items():
        assert usage["spill_bytes"] == 0, (name, usage)
        assert usage["regs"] <= 255, (name, usage)
    assert report["indexer_official"]["wgmma"] and report["indexer_nvfp4"]["wgmma"]
    assert report["indexer_official_tile_max"]["wgmma"]  # v3: the tile-maxima variant (fused top-k)
