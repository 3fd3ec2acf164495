"""`python -m nv_esm` runs the `nv-esm` command."""

from nv_esm.cli import console

console()
