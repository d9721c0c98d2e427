"""Which number format a training run computes in: `--precision auto|fp32|bf16|fp16|bf16-stem`.

The rules live in `vitlab.runtime`, shared with every other command; this module keeps the names that
train/loop.py, the benchmarks and older code import from here.
"""

from vitlab.runtime import (  # noqa: F401  (re-exports)
    CPU_BF16_MIN_SPEEDUP,
    CPU_BF16_MIN_WIDTH,
    _bf16_speedup,
    autocast_context,
    cpu_bf16_speedup,
    cpu_bf16_supported,
    resolve_precision,
    set_stem_precision,
)
