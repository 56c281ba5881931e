"""Collective bandwidth table, dptc against torch's gloo: a script front for dptc.bench.

    python benchmarks/collectives.py [options]     # same as: python -m dptc.bench [options]

See dptc/bench.py for the options and the nccl-tests definitions of algbw and busbw.
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from dptc.bench import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
