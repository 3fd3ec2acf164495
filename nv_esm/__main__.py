"""`python -m nv_esm` runs the `nv-esm` command."""

import sys

from nv_esm.cli import main

sys.exit(main())
