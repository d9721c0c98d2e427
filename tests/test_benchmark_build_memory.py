"""benchmarks/build_memory.py runs here on a small model: the export succeeds and its process tree's peak memory is
read (docs/benchmarks.md, "Building the ONNX Runtime graph: memory")."""

import re
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "build_memory.py"


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_build_memory_measures_an_export(tmp_path):
    pytest.importorskip("onnxruntime")
    done = subprocess.run([sys.executable, str(SCRIPT), "--models", "vit-ti/16", "--work", str(tmp_path / "w")],
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    (row,) = [line for line in done.stdout.splitlines() if "vit-ti/16" in line]
    peak = float(re.search(r"peak\s+([\d.]+) GiB", row).group(1))
    assert 0.1 < peak < 8 and re.search(r"graph [0-9a-f]{16}$", row), row
    assert not (tmp_path / "w").exists()  # the scratch folder is removed
