"""Rules of the code's layout: the library never imports the trainer, the remote code's flat siblings
import only downward and are all installed and copied, and no source file outgrows the size rule."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# Every module of the library: the top-level files pyproject.toml installs and the package's modules outside the
# trainer (`nv_esm/train/`), found on disk so that a new one is covered without being listed.
LIBRARY_MODULES = (
    *(path.stem for path in sorted(ROOT.glob("*.py")) if path.stem.startswith(("modeling_", "configuration_"))),
    "tokenization_nv_esm",
    "convert_checkpoint",
    *(f"nv_esm.{path.stem}" for path in sorted((ROOT / "nv_esm").glob("*.py")) if path.stem != "__main__"),
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


def test_the_remote_code_files_are_installed_and_import_only_downward():
    """`REMOTE_CODE_FILES` (what the converter writes and `trust_remote_code` loads) are the py-modules pyproject.toml
    installs, and each imports only files listed before it, relatively (with the top-level fallback for scripts):
    no cycles, and transformers' loader finds every sibling from `modeling_nv_esm.py`."""
    import ast

    import tomllib

    from nv_esm.hub_folder import MODEL_CODE_FILES, REMOTE_CODE_FILES

    assert set(REMOTE_CODE_FILES) - set(MODEL_CODE_FILES) == {"tokenization_nv_esm.py"}  # loaded on its own
    modules = [name.removesuffix(".py") for name in MODEL_CODE_FILES]
    installed = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["py-modules"]
    assert set(installed) == {name.removesuffix(".py") for name in REMOTE_CODE_FILES} | {"convert_checkpoint"}
    imported_by_model = set()
    for position, module in enumerate(modules):
        tree = ast.parse((ROOT / f"{module}.py").read_text())
        relative = {node.module for node in ast.walk(tree) if isinstance(node, ast.ImportFrom) and node.level == 1}
        absolute = {node.module for node in ast.walk(tree) if isinstance(node, ast.ImportFrom) and node.level == 0}
        siblings = absolute & set(modules)
        assert relative == siblings, module  # every sibling import has its relative form
        assert relative <= set(modules[:position]), (module, relative - set(modules[:position]))
        if module == "modeling_nv_esm":
            imported_by_model = relative
    # transformers 5.6 copies only the model file's direct relative imports into its modules cache
    assert imported_by_model == set(modules) - {"modeling_nv_esm"}


def test_the_remote_code_requires_nothing_beyond_torch_and_transformers():
    """transformers checks every remote-code file of a Hub repository before it loads one (`check_imports`: each
    package imported outside a `try` block must be installed): an optional package such as Triton or Transformer
    Engine imported outside one would make every CPU-only user's `from_pretrained` fail."""
    from transformers.dynamic_module_utils import get_imports

    from nv_esm.hub_folder import REMOTE_CODE_FILES

    allowed = set(sys.stdlib_module_names) | {"torch", "transformers", "tqdm"}  # tqdm: a transformers requirement
    for name in REMOTE_CODE_FILES:
        assert set(get_imports(ROOT / name)) <= allowed, (name, set(get_imports(ROOT / name)) - allowed)


def test_source_files_keep_to_the_size_rule():
    """`modeling_nv_esm.py` at most 1,000 lines, every other source file of the package and the remote code at most
    700 (tests and benchmarks aside)."""
    sources = [*ROOT.glob("*.py"), *ROOT.glob("nv_esm/**/*.py")]
    sizes = {path.relative_to(ROOT).as_posix(): len(path.read_text().splitlines()) for path in sources}
    too_long = {name: n for name, n in sizes.items() if n > (1000 if name == "modeling_nv_esm.py" else 700)}
    assert not too_long


def test_each_relative_import_block_and_its_fallback_import_the_same_names():
    """The remote code imports its siblings relatively (as Hub remote code, a package) and, where that fails, as
    top-level modules (the installed distribution, tests, scripts): each `try` block of relative imports and its
    `except ImportError` block must import the same names from the same files, so the two cannot drift apart."""
    import ast

    from nv_esm.hub_folder import MODEL_CODE_FILES

    def imports(statements: list[ast.stmt], level: int) -> list[tuple[str | None, list[str]]]:
        return [
            (node.module, sorted(alias.asname or alias.name for alias in node.names))
            for node in statements
            if isinstance(node, ast.ImportFrom) and node.level == level
        ]

    checked = 0
    for name in MODEL_CODE_FILES:
        tree = ast.parse((ROOT / name).read_text())
        blocks = [node for node in tree.body if isinstance(node, ast.Try) and imports(node.body, 1)]
        relative = [node for node in ast.walk(tree) if isinstance(node, ast.ImportFrom) and node.level == 1]
        assert sum(len(imports(block.body, 1)) for block in blocks) == len(relative), name  # all in such blocks
        checked += len(blocks)
        for block in blocks:
            (handler,) = block.handlers
            assert ast.unparse(handler.type) == "ImportError", name
            assert imports(block.body, 1) == imports(handler.body, 0), name
            assert len(block.body) == len(handler.body), name  # nothing else in either block
    assert checked >= 5  # the files that import siblings (most of them)
