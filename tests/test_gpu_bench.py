"""bench/gpu.py runs end to end on CPU with a tiny model (--smoke): tokenpulse's real training process
packed and padded, and the plain hand-written loop packed and padded, measured side by side in one
table, so a lent GPU's minutes go to running it, not to fixing it."""
import json
import subprocess
import sys

from conftest import ROOT


def test_gpu_bench_smoke_prints_its_table(tmp_path):
    out = tmp_path / "gpu.json"
    r = subprocess.run([sys.executable, str(ROOT / "bench" / "gpu.py"), "--smoke", "--work", str(tmp_path / "w"),
                        "--json", str(out)], capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    got = json.loads(out.read_text())
    cases = got["cases"]
    assert list(cases) == ["tp-pack", "tp-pad", "plain-pack", "plain-pad"]
    assert all(c["tokens_per_s"] > 0 for c in cases.values()), cases
    assert cases["tp-pack"]["padding"] == "pack" and cases["tp-pad"]["padding"] == "dynamic"
    # packed rows carry (nearly) no pad tokens; padding each micro-batch to its longest example does
    assert cases["tp-pack"]["padding_frac"] < 0.05 < cases["tp-pad"]["padding_frac"]
    assert cases["plain-pack"]["padding_frac"] < 0.05 < cases["plain-pad"]["padding_frac"]
    assert cases["tp-pack"]["own_mfu"] is not None and got["flops_per_token"] > 0 and got["peak_flops"] > 0
    table = r.stdout[r.stdout.index("model: Qwen2"):]
    for case in cases:
        assert f"\n{case} " in table, table
