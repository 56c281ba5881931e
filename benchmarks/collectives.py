"""Collective bandwidth table, dptc against torch's gloo: a script front for dptc.bench.

    python benchmarks/collectives.py [options]     # same as: python -m dptc.bench [options]

See dptc/bench.py for the options and the nccl-tests definitions of algbw and busbw.
"""

import os
import sys

from _checkout import put_checkout_on_path

put_checkout_on_path()

from dptc.bench import main  # noqa: E402

if __name__ == "__main__":
    # The ranks run this script too, so that they find dptc as it did.
    sys.exit(main(target=[os.path.abspath(__file__)]))
