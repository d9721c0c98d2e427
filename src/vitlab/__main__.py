"""`python -m vitlab` (also what `torchrun -m vitlab` runs)."""

import sys

from vitlab.cli import main

sys.exit(main())
