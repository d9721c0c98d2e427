"""benchmarks/serve_memory.py runs here (vitlab's rows only: no timm or transformers in the test environment) and
reads each real server's memory, in sizes that add up (docs/benchmarks.md, "Serving memory")."""

import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "serve_memory.py"


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/PID/status")
def test_serve_memory_measures_each_engine(tmp_path):
    pytest.importorskip("onnxruntime")
    done = subprocess.run([sys.executable, str(SCRIPT), "--model", "vit-ti/16", "--engines", "torch,onnxruntime",
                           "--no-peers", "--max-batch", "2", "--work", str(tmp_path)],
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    rows = {line.split("|")[1].strip(): [int(v) for v in line.split("|")[2:8]]
            for line in done.stdout.splitlines() if line.startswith("| vitlab serve")}
    assert set(rows) == {"vitlab serve --engine torch (this checkout)", "vitlab serve --engine onnxruntime (this checkout)"}
    for rss, anon, mapped, busy_rss, busy_anon, peak in rows.values():
        assert 100 < rss <= peak and anon + mapped <= rss + 1
        assert 100 < busy_rss <= peak and busy_anon < busy_rss
