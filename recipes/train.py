"""Train NVEsm with FSDP2: `python recipes/train.py --help`, `torchrun --nproc-per-node N recipes/train.py ...`.

The recipe is `nv_esm.train` (the same command as `python -m nv_esm.train` / `torchrun -m nv_esm.train`).
"""

import sys

from nv_esm.train.loop import main

if __name__ == "__main__":
    sys.exit(main())
