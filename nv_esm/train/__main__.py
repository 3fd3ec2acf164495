"""`python -m nv_esm.train ...` and `torchrun -m nv_esm.train ...`: the training command (`nv_esm.train.loop.main`)."""

import sys

from nv_esm.cli import keep_imports_installed

if __name__ == "__main__":
    keep_imports_installed()  # before the model code is imported
    from nv_esm.train.loop import main

    sys.exit(main())
