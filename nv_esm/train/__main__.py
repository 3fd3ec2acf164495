"""`python -m nv_esm.train ...` and `torchrun -m nv_esm.train ...`: the training command (`nv_esm.train.loop.main`)."""

import sys

from nv_esm.train.loop import main

if __name__ == "__main__":
    sys.exit(main())
