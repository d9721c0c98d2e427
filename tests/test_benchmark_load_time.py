"""benchmarks/load_time.py runs here (vitlab's rows only: no timm or transformers in the test environment), and its
rewrite check says what docs/benchmarks.md ("Loading a model") reports for vitlab: the loaded model owns its
memory."""

import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "load_time.py"


def test_load_time_runs_and_vitlab_survives_its_file_being_rewritten():
    done = subprocess.run([sys.executable, str(SCRIPT), "--models", "vit-ti/16", "--rounds", "1", "--rewrite-check"],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    rows = {line.split("  ")[1].strip(): line for line in done.stdout.splitlines() if line.startswith("  vitlab")}
    assert "vitlab.load" in rows and "vitlab: build, initialise, copy in (before)" in rows
    assert "vitlab        after the write: logits unchanged; after the truncation: ran on" in done.stdout
