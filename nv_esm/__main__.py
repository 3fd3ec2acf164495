"""`python -m nv_esm` runs the `nv-esm` command (the current directory's Python files are not imported:
`keep_imports_installed`)."""

from nv_esm.cli import console, keep_imports_installed

keep_imports_installed()
console()
