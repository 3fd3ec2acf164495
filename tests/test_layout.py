"""Rules of the code's layout (issue 32): the library never imports the trainer."""

from __future__ import annotations

import subprocess
import sys

LIBRARY_MODULES = (
    "configuration_nv_esm",
    "modeling_nv_esm",
    "convert_checkpoint",
    "nv_esm.cli",
    "nv_esm.embed",
    "nv_esm.model_card",
    "nv_esm.verification",
    "nv_esm.hub_folder",
    "nv_esm.checkpoint_io",
    "nv_esm.data",
)


def test_the_library_never_imports_the_trainer():
    """Importing every library module (and building its parsers) loads no `nv_esm.train` module: the trainer
    depends on the library, never the other way round."""
    code = (
        f"import importlib, sys\nfor name in {LIBRARY_MODULES!r}:\n    importlib.import_module(name)\n"
        "import convert_checkpoint\nconvert_checkpoint.build_parser()\n"
        "print(sorted(m for m in sys.modules if m.startswith('nv_esm.train')))"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert result.stdout.strip() == "[]", result.stdout
