"""Train NVEsm with FSDP2: `python recipes/train.py --help`, `torchrun --nproc-per-node N recipes/train.py ...`.

The recipe is `nv-esm train` (the same command as `python -m nv_esm.train` / `torchrun -m nv_esm.train`), started as
every entry point starts it (`nv_esm.cli.run_command`: help without importing torch, Ctrl-C during the imports one
line).
"""

import sys

from nv_esm.cli import run_command

if __name__ == "__main__":
    sys.exit(run_command("train", sys.argv[1:]))
