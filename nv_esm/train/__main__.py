"""`python -m nv_esm.train ...` and `torchrun -m nv_esm.train ...`: the training command (`nv_esm.train.loop.main`)."""

import sys

from nv_esm.cli import asks_for_help, interrupted_start_up, keep_imports_installed, parse_train_args

if __name__ == "__main__":
    keep_imports_installed()  # before the model code is imported
    if asks_for_help(sys.argv[1:]):  # the parser alone (torch is not imported): prints, exits 0
        parse_train_args(sys.argv[1:], "nv-esm train")  # `PROG`, as the trainer names itself
    with interrupted_start_up("nv-esm train"):
        from nv_esm.train.loop import main

    sys.exit(main())
