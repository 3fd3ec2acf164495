"""`python -m nv_esm.train ...` and `torchrun -m nv_esm.train ...`: the training command (`nv-esm train`)."""

import sys

from nv_esm.cli import keep_imports_installed, run_command

if __name__ == "__main__":
    keep_imports_installed()  # before the model code is imported
    sys.exit(run_command("train", sys.argv[1:]))
