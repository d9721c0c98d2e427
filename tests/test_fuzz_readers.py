"""Bounded fuzzing of every reader (tests/fuzz_readers.py): seeded mutations of valid files must each end
in a load or a one-line VitlabError / bad-file refusal, within 10 s and 1.5 GB per case.

8 s in CI; VITLAB_FUZZ_SECONDS=600 (and VITLAB_FUZZ_SEED) for a longer run (docs/weights.md, "Fuzzing")."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).with_name("fuzz_readers.py")


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="uses /proc, RLIMIT_AS and SIGALRM")
def test_mutated_files_load_or_fail_in_one_line():
    seconds = float(os.environ.get("VITLAB_FUZZ_SECONDS", "8"))  # the suite's share; set more for a deeper run
    seed = os.environ.get("VITLAB_FUZZ_SEED", "0")
    env = dict(os.environ, OMP_NUM_THREADS="1", MALLOC_ARENA_MAX="2")
    proc = subprocess.run([sys.executable, str(SCRIPT), "--seconds", str(seconds), "--seed", seed],
                          capture_output=True, text=True, env=env, timeout=seconds + 300)
    assert proc.stdout.strip(), proc.stderr[-3000:]
    summary = json.loads(proc.stdout.strip().splitlines()[-1])
    assert summary["findings"] == [], json.dumps(summary["findings"][:10], indent=1)
    assert proc.returncode == 0
    per_reader = summary["per_reader"]
    assert len(per_reader) == 12
    for name, outcomes in per_reader.items():
        # every reader was exercised, and the mutations were neither all harmless nor all fatal
        assert sum(outcomes.values()) >= 20 * seconds / 30, (name, outcomes)
        assert outcomes.get("refused", 0) > 0, (name, outcomes)
