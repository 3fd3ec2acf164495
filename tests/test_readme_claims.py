"""The README's factual claims that a test can check cheaply on a CPU, each against the code or the files it names.

README.md is the model card and the user's manual; bench/README.md is the log of measurements, each figure linked to
the run folder (bench/results/) that made it. Checked here: the size bound and the front matter; the option tables
(every option of every command, with the parsers' defaults); the option names the prose uses; the files each command
writes (against the code's names, and a real conversion of the bundled checkpoint); what the model returns at
padding; the defaults and numbers the prose states (tolerances, windows, version pins, extras); and that every link,
anchor and bench/results path of both files resolves, every table of bench/README.md names its run, and the README's
speed figures are bench/README.md's. tests/test_readme.py runs the README's commands and snippets."""

from __future__ import annotations

import argparse
import glob
import importlib
import inspect
import json
import re
from collections.abc import Callable
from pathlib import Path
from unittest import mock

import pytest
import torch

from conftest import ROOT, TINY_CHECKPOINT

README = ROOT / "README.md"
BENCH = ROOT / "bench" / "README.md"
README_LIMIT = 42_000  # bytes: a manual and a model card, not a log (the logs are bench/README.md's)
# Options the README uses that belong to other programs (torchrun, pip, accelerate).
FOREIGN_OPTIONS = {"--nproc-per-node", "--index-url", "--config_file"}
FENCE = re.compile(r"^```.*?^```", re.S | re.M)


def text(path: Path = README) -> str:
    return path.read_text(encoding="utf-8")


def flat(words: str) -> str:
    """`words` with every run of white space (line breaks included) as one space."""
    return " ".join(words.split())


def prose(path: Path = README) -> str:
    """The file without its fenced code blocks."""
    return FENCE.sub("", text(path))


def sections(path: Path = README) -> dict[str, str]:
    """Each heading's title (without #'s) -> its text up to the next heading of any level (code blocks kept)."""
    found, title, body = {}, "", []
    inside_code = False
    for line in text(path).splitlines():
        if line.startswith("```"):
            inside_code = not inside_code
        if not inside_code and re.match(r"^#{1,6} ", line):
            found[title] = "\n".join(body)
            title, body = line.lstrip("#").strip(), []
        else:
            body.append(line)
    found[title] = "\n".join(body)
    return found


def section(title: str, path: Path = README) -> str:
    assert title in sections(path), f"{path.name} has no section {title!r}"
    return sections(path)[title]


def slug(title: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation dropped (hyphens and underscores kept), spaces to -."""
    return re.sub(r"[^\w\- ]", "", title.strip().lower()).replace(" ", "-")


def anchors(path: Path) -> set[str]:
    seen: dict[str, int] = {}
    result = set()
    for title in list(sections(path))[1:]:
        base = slug(title)
        count = seen.get(base, 0)
        result.add(base if count == 0 else f"{base}-{count}")
        seen[base] = count + 1
    return result


def numbers(cell: str) -> list[float]:
    return [float(number) for number in re.findall(r"\d+(?:\.\d+)?(?:e-?\d+)?", cell)]


def table_rows(body: str) -> list[list[str]]:
    """The cells of every table row of `body` (header and separator rows included)."""
    return [
        [cell.strip() for cell in line.strip().strip("|").split("|")]
        for line in body.splitlines()
        if line.startswith("|")
    ]


# ---------------------------------------------------------------------------------------------------------------
# The parsers, as the commands build them
# ---------------------------------------------------------------------------------------------------------------


class _Built(Exception):
    pass


def built_parser(parse: Callable[[list[str], str], object]) -> argparse.ArgumentParser:
    """The parser a `nv_esm.cli.parse_*_args` function builds (it parses at once: stopped there)."""
    built = []

    def stop(self: argparse.ArgumentParser, *args: object, **kwargs: object) -> None:
        built.append(self)
        raise _Built

    with mock.patch.object(argparse.ArgumentParser, "parse_args", stop), pytest.raises(_Built):
        parse([], "nv-esm")
    return built[0]


@pytest.fixture(scope="module")
def parsers() -> dict[str, argparse.ArgumentParser]:
    from convert_checkpoint import build_parser as convert_parser
    from nv_esm import cli
    from nv_esm.train.config import build_parser as train_parser

    return {
        "convert": convert_parser(),
        "embed": built_parser(cli.parse_embed_args),
        "score": built_parser(cli.parse_score_args),
        "proteingym": built_parser(cli.parse_proteingym_args),
        "train": train_parser(),
        "train export": built_parser(cli.parse_export_args),
    }


def options(parser: argparse.ArgumentParser) -> dict[str, argparse.Action]:
    """Each option string of `parser` -> its action, old names (`RENAMED`, hidden from --help) and -h left out."""
    from nv_esm.vocabulary import RENAMED

    return {
        name: action
        for action in parser._actions
        for name in action.option_strings
        if name not in RENAMED and not isinstance(action, argparse._HelpAction)
    }


def help_text(parser: argparse.ArgumentParser, action: argparse.Action) -> str:
    formatter = parser._get_formatter()
    return formatter._expand_help(action) if action.help else ""


def one_of_required(parser: argparse.ArgumentParser, action: argparse.Action) -> bool:
    return any(group.required and action in group._group_actions for group in parser._mutually_exclusive_groups)


# The README's sections whose tables document each command's options.
OPTION_SECTIONS = {
    "convert": ["`nv-esm convert`"],
    "embed": ["`nv-esm embed`", "Options of embed, score and proteingym"],
    "score": ["`nv-esm score`", "Options of embed, score and proteingym"],
    "proteingym": ["`nv-esm proteingym`", "Options of embed, score and proteingym"],
    "train": ["`nv-esm train`"],
}
INLINE_OPTIONS = re.compile(r"((?:`--[\w-]+`(?: / )?)+) \(([^()]*)\)")


def documented(command: str) -> list[tuple[list[str], str]]:
    """(option names, default as written) of every option the README's tables give for `command`: rows of
    `| option | default | ... |` tables, and `--option (default)` items of `| group | options (default) |` tables."""
    rows = []
    for title in OPTION_SECTIONS[command]:
        table = table_rows(section(title))
        if not table:
            continue
        header = table[0]
        assert header[:2] in (["option", "default"], ["group", "options (default)"]), (title, header)
        for cells in table[2:]:
            if header[0] == "option":
                rows.append((re.findall(r"`(--[\w-]+)`", cells[0]), cells[1]))
            else:
                for names, default in INLINE_OPTIONS.findall(cells[1]):
                    rows.append((re.findall(r"`(--[\w-]+)`", names), default))
    return rows


def default_agrees(parser: argparse.ArgumentParser, action: argparse.Action, written: str) -> str | None:
    """Why the README's default `written` for `action` is not the parser's (None: it is)."""
    written = written.replace("`", "").strip()
    value = written.split(":")[0].strip()  # "0: no LoRA" -> "0"
    if action.required or one_of_required(parser, action):
        return None if "required" in written else f"README says {written!r}, the option is required"
    if "required" in written:
        return f"README says required, the parser's default is {action.default!r}"
    default = action.default
    if default is None:  # the help says in words what happens without it: the README's words must be among them
        words = set(re.findall(r"[a-z0-9_]+", help_text(parser, action).lower()))
        missing = [
            w for w in re.findall(r"[a-z0-9_]+", written.lower()) if (len(w) > 1 or w.isdigit()) and w not in words
        ]
        return f"README says {written!r}; the help says {help_text(parser, action)!r}" if missing else None
    if isinstance(default, bool):
        expected = "on" if default else "off"
        return None if value == expected else f"README says {written!r}, the parser's default is {expected}"
    if isinstance(default, (list, tuple)):
        expected = " ".join(map(str, default)) or "none"
        return None if value == expected else f"README says {written!r}, the parser's default is {expected!r}"
    if isinstance(default, (int, float)):
        try:
            agrees = float(value.replace(",", "")) == float(default)
        except ValueError:
            agrees = False
        return None if agrees else f"README says {written!r}, the parser's default is {default!r}"
    return None if value == str(default) else f"README says {written!r}, the parser's default is {default!r}"


@pytest.mark.parametrize("command", list(OPTION_SECTIONS))
def test_the_option_tables_list_every_option_with_the_parsers_default(parsers, command):
    """The README says its tables list every option of each command with its default: each one named is the
    parser's, each of the parser's is named, and each default written is the one `--help` gives."""
    parser = parsers[command]
    known = options(parser)
    rows = documented(command)
    assert rows, f"no option table for nv-esm {command}"
    named = [name for names, _ in rows for name in names]
    assert not [name for name in named if name not in known], f"nv-esm {command} has no such option"
    undocumented = {known[name].option_strings[0] for name in set(known) - set(named)}
    assert not undocumented, f"nv-esm {command}: options missing from the README's tables: {sorted(undocumented)}"
    for names, written in rows:  # `--cuda-graphs` / `--no-cuda-graphs`: one option; `--model` / `--config`: two
        for name in names:
            problem = default_agrees(parser, known[name], written)
            assert problem is None, f"nv-esm {command} {name}: {problem}"


def test_train_export_has_the_one_option_the_readme_gives(parsers):
    assert set(options(parsers["train export"])) == {"--overwrite"}
    assert parsers["train export"]._option_string_actions["--overwrite"].default is False
    assert "unless `--overwrite` (default off)" in flat(section("`nv-esm train`"))


def test_every_option_the_readme_names_exists(parsers):
    """An option the prose or a command line of the README names (renamed ones included) is some command's."""
    from nv_esm.vocabulary import RENAMED

    known = {name for parser in parsers.values() for name in parser._option_string_actions} | set(RENAMED)
    named = set(re.findall(r"(?<![\w-])--[a-z][\w-]*", text()))
    assert not named - known - FOREIGN_OPTIONS, sorted(named - known - FOREIGN_OPTIONS)


def test_the_old_option_names_and_fp8_scalings_are_the_vocabulary():
    from nv_esm.vocabulary import FP8_RECIPES, FP8_SCALINGS, RENAMED

    vocabulary = flat(section("One vocabulary"))
    said = re.search(r"Old names still work, with a one-line `note:` on stderr: (.*?)\. ", vocabulary).group(1)
    assert set(re.findall(r"`(--[\w-]+)`", said)) == set(RENAMED)
    assert f"(train: {', '.join(FP8_RECIPES)}; embed, score, proteingym: {', '.join(FP8_SCALINGS)})" in vocabulary


def test_every_command_has_its_section_and_its_methods():
    from nv_esm.cli import COMMANDS
    from nv_esm.vocabulary import PROTEINGYM_METHODS, SCORE_METHODS

    for command in COMMANDS:
        assert f"`nv-esm {command}`" in sections(), command
    for method in SCORE_METHODS:
        assert method in section("`nv-esm score`"), method
    for method in PROTEINGYM_METHODS:
        assert method in section("`nv-esm proteingym`"), method


# ---------------------------------------------------------------------------------------------------------------
# What the commands write
# ---------------------------------------------------------------------------------------------------------------


def as_pattern(name: str) -> str:
    """A name the README writes with placeholders (NNNNN, *, <DMS_id>) as a regular expression."""
    pattern = re.escape(name).replace("NNNNNNN", r"\d{7}").replace("NNNNN", r"\d{5,}")
    return pattern.replace(r"\*", r"[^/]*").replace("<DMS_id>", "[^/]+")


def test_embed_writes_what_the_readme_says():
    from nv_esm.embed_output import CONTACTS_PICTURE, INDEX_NAME, MANIFEST_NAME, checksum_path, shard_name

    says = section("`nv-esm embed`")
    for name in (INDEX_NAME, MANIFEST_NAME, CONTACTS_PICTURE):
        assert f"`{name}`" in says, name
    assert re.fullmatch(as_pattern("embeddings-NNNNN.safetensors"), shard_name(7))
    assert re.fullmatch(as_pattern("embeddings-NNNNN.safetensors.sha256"), checksum_path(Path(shard_name(7))).name)
    assert "`embeddings-NNNNN.safetensors`" in says and "`embeddings-NNNNN.safetensors.sha256`" in says


def test_the_index_columns_are_the_readmes(tmp_path):
    from nv_esm.embed_output import write_index

    write_index(tmp_path, [], 1000, 1022)
    columns = (tmp_path / "index.tsv").read_text().splitlines()[0].split("\t")
    assert f"`index.tsv` ({', '.join(columns)};" in flat(section("`nv-esm embed`"))


def test_score_writes_what_the_readme_says():
    from nv_esm.score import PLL_COLUMNS, STATUS_COLUMN, parts_folder, scatter_path

    says = flat(section("`nv-esm score`"))
    assert f"OUTPUT's columns are {', '.join(('id', 'residues', *PLL_COLUMNS, STATUS_COLUMN))}." in says
    assert (
        "(`gfp_scores.csv` -> `gfp_scores.png`" in says
        and scatter_path(Path("gfp_scores.csv")).name == "gfp_scores.png"
    )
    assert "`OUTPUT.parts/`" in says and parts_folder(Path("OUTPUT")).name == "OUTPUT.parts"
    assert "pll, pseudo_perplexity, status per record" in text()  # the Quick start's comment


def test_proteingym_writes_what_the_readme_says():
    from nv_esm import proteingym
    from nv_esm.embed_output import MANIFEST_NAME
    from nv_esm.proteingym_output import INPUTS_FOLDER, SUMMARY_FOLDER, assay_path, inputs_path

    says = section("`nv-esm proteingym`")
    assert "`<DMS_id>.csv`" in says and assay_path(Path("OUT"), "X").name == "X.csv"
    assert f"`{INPUTS_FOLDER}/<DMS_id>.json`" in says
    assert inputs_path(Path("OUT"), "X").relative_to("OUT").as_posix() == f"{INPUTS_FOLDER}/X.json"
    assert f"`{MANIFEST_NAME}`" in says and f"`{SUMMARY_FOLDER}/`" in says
    source = inspect.getsource(proteingym)
    assert '"Spearman.png"' in source and "`Spearman.png`" in says
    assert 'f"{chosen}.png"' in source and "`<DMS_id>.png`" in says


def test_train_writes_what_the_readme_says():
    from nv_esm.train import checkpoint

    says = section("`nv-esm train`")
    for name in checkpoint.RUN_OUTPUTS:
        assert re.search(rf"`{re.escape(name)}[/`]", says), name
    for name in (checkpoint.TRAIN_STATE, checkpoint.CHECKSUMS):
        assert f"`{name}`" in says, name
    for name in (checkpoint.RNG_FILE, checkpoint.FP8_FILE):
        assert f"`{name.format(rank='*')}`" in says, name
    assert f"`checkpoints/{checkpoint.CHECKPOINT_PREFIX}NNNNNNN/`" in says
    assert re.search(r"\{CHECKPOINT_PREFIX\}\{step:07d\}", inspect.getsource(checkpoint))
    assert "`profile/rank*.json.gz`" in says and "rank{world.rank}.json.gz" in inspect.getsource(
        importlib.import_module("nv_esm.train.metrics")
    )


@pytest.fixture(scope="module")
def converted(tmp_path_factory) -> Path:
    """The bundled tiny checkpoint converted as the README's Quick start does."""
    from convert_checkpoint import main as convert

    out = tmp_path_factory.mktemp("readme_claims") / "esm2_nv"
    assert convert(["hf-to-te", str(TINY_CHECKPOINT), str(out)]) == 0
    return out


def test_convert_writes_the_files_the_readme_lists(converted):
    says = section("`nv-esm convert`")
    writes = says[says.index("**Writes**") : says.index("**`verify SRC OUT`**")]
    names = re.findall(r"`([\w.*]+\.(?:json|py|safetensors|txt|md))`", writes) + re.findall(r"`(LICENSE)`", writes)
    written = sorted(path.name for path in converted.iterdir())
    unlisted = [name for name in written if not any(re.fullmatch(as_pattern(n), name) for n in names)]
    never = [n for n in names if not any(re.fullmatch(as_pattern(n), name) for name in written)]
    assert not unlisted and not never, (unlisted, never)


# ---------------------------------------------------------------------------------------------------------------
# What the model returns, and the numbers the prose states
# ---------------------------------------------------------------------------------------------------------------


def test_padding_positions_hold_zeros_and_one_constant_logit_row(converted):
    """The README: hidden states and attention maps are zeros at padding, logits one constant row there (the head
    applied to a zero hidden state), not zeros."""
    from modeling_nv_esm import NVEsmForMaskedLM
    from tokenization_nv_esm import NVEsmTokenizer

    says = flat(section("The model in Python"))
    assert (
        "At padding positions hidden states and attention maps are zeros, and logits are the head applied to a "
        "zero hidden state: one constant row" in says
    )
    assert "hidden states there are zeros and logits one constant row" in flat(section("Limitations"))
    assert "logits are zeros" not in text() and "its logits are zeros" not in text()
    tokenizer = NVEsmTokenizer.from_pretrained(converted)
    model = NVEsmForMaskedLM.from_pretrained(converted, backend="torch").eval()
    batch = tokenizer(["MKTAYIAKQRQISFVKSHFSRQ", "MSKG"], padding=True, return_tensors="pt")
    padding = batch["attention_mask"] == 0
    assert padding.any()
    with torch.no_grad():
        out = model(**batch, output_hidden_states=True, output_attentions=True)
        zero_state = model.lm_head(torch.zeros(1, model.config.hidden_size))[0, : out.logits.shape[-1]]
    assert all(states[padding].abs().max() == 0 for states in out.hidden_states)
    assert all(maps.transpose(1, 2)[padding].abs().max() == 0 for maps in out.attentions)  # padded queries
    rows = out.logits[padding]
    assert rows.abs().max() > 0
    torch.testing.assert_close(rows, zero_state.expand_as(rows))


def test_the_stated_defaults_and_tolerances_are_the_codes():
    from configuration_nv_esm import RunOptions
    from modeling_nv_esm import NVEsmModel
    from nv_esm import scoring
    from nv_esm.verification import DEFAULT_VERIFY_ATOL, TE_FP32_VERIFY_ATOL

    says = flat(text())
    max_protein_length = RunOptions().max_protein_length
    assert max_protein_length == 8192 and "included; default 8192;" in says
    embed = inspect.signature(NVEsmModel.embed).parameters
    assert (embed["layer"].default, embed["pooling"].default, embed["max_tokens_per_batch"].default) == (
        -1,
        "mean",
        16384,
    )
    assert 'model.esm.embed(sequences, tokenizer, layer=-1, pooling="mean")' in says
    assert "`max_tokens_per_batch=16384`" in says
    for function in (scoring.score_variants, scoring.pseudo_log_likelihood):
        assert inspect.signature(function).parameters["max_tokens_per_batch"].default == 16384
    assert "`max_tokens_per_batch` (16,384)" in says
    tiny = json.loads((TINY_CHECKPOINT / "config.json").read_text())  # ESM-2's position table, as in facebook/esm2_*
    window = min(tiny["max_position_embeddings"], max_protein_length) - 2
    assert f"{window:,} for ESM-2" in says
    rows = table_rows(section("Numerics"))
    tolerances = {cells[0]: numbers(cells[1]) for cells in rows if cells[0] in ("float32", "bfloat16", "float16")}
    assert tolerances == {
        "float32": [DEFAULT_VERIFY_ATOL["float32"], TE_FP32_VERIFY_ATOL],  # "(5e-2 when Transformer Engine runs)"
        "bfloat16": [DEFAULT_VERIFY_ATOL["bfloat16"]],
        "float16": [DEFAULT_VERIFY_ATOL["float16"]],
    }


def test_the_fp32_tolerance_and_the_verification_proteins():
    from conftest import ATOL_FP32

    assert numbers(re.search(r"asserted ≤ (\S+) \|", section("Numerics")).group(1)) == [ATOL_FP32]
    proteins = len(re.findall(r"^>", (ROOT / "nv_esm" / "proteins.fasta").read_text(), re.M))
    said = [int(n) for n in re.findall(r"(\d+) real proteins", flat(text()))]
    assert len(said) >= 2 and set(said) == {proteins}, said


def test_install_names_the_extras_and_the_pins():
    """The extras the README installs exist, and "lower bounds only, except transformers" is pyproject.toml's."""
    pyproject = (ROOT / "pyproject.toml").read_text()
    extras = set(
        re.findall(r"^(\w+) = \[", pyproject.split("[project.optional-dependencies]")[1].split("\n[")[0], re.M)
    )
    named = set(re.findall(r'pip install "\.\[(\w+)\]"', text()))
    assert named and named <= extras, named - extras
    dependencies = re.findall(r'^\s+"([^"]+)",?$', pyproject.split("dependencies = [")[1].split("]")[0], re.M)
    upper = {re.split(r"[<>=]", spec)[0]: spec for spec in dependencies if "<" in spec}
    assert list(upper) == ["transformers"], upper
    spec = upper["transformers"][len("transformers") :]
    assert f"Dependencies have lower bounds only, except transformers (`{spec}`)" in flat(section("Install"))
    oldest = re.search(r"^TRANSFORMERS_OLDEST := (\S+)$", (ROOT / "Makefile").read_text(), re.M).group(1)
    assert f"`>={oldest}," in f"`{spec}" and f"transformers {oldest}, the lowest" in flat(section("Developer set-up"))


def test_the_first_run_is_the_two_make_commands():
    block = re.findall(r"^```bash\n(.*?)^```", section("First run (offline, two commands)"), re.S | re.M)
    assert len(block) == 1
    commands = [line.split("#")[0].strip() for line in block[0].splitlines()]
    assert commands == ["make demo", "make test"]
    makefile = (ROOT / "Makefile").read_text()
    assert re.search(r"^demo:", makefile, re.M) and re.search(r"^test:", makefile, re.M)


def test_the_front_matter_is_a_model_card():
    import huggingface_hub

    card = huggingface_hub.metadata_load(README)
    license_name = re.search(r'^license = "(\w+)"', (ROOT / "pyproject.toml").read_text(), re.M).group(1)
    assert card["license"] == license_name.lower()
    assert (card["library_name"], card["pipeline_tag"]) == ("transformers", "fill-mask")


def test_the_readme_is_a_manual_not_a_log():
    assert len(README.read_bytes()) < README_LIMIT, "measurement logs belong in bench/README.md"


def test_the_python_names_the_readme_cites_exist():
    names = {n for n in re.findall(r"`((?:nv_esm|modeling_nv_esm)(?:\.\w+)+)", text()) if not n.endswith(".py")}
    assert names
    for name in sorted(names):
        parts = name.split(".")
        for cut in range(len(parts), 0, -1):
            try:
                found = importlib.import_module(".".join(parts[:cut]))
            except ModuleNotFoundError:
                continue
            for attribute in parts[cut:]:
                found = getattr(found, attribute)
            break
        else:
            pytest.fail(f"README names {name}, which does not import")


def test_the_layout_names_existing_paths():
    for cells in table_rows(section("Layout"))[2:]:
        for path in re.findall(r"`([\w./*-]+)`", cells[0]):
            assert glob.glob(str(ROOT / path)), path


def test_each_decision_names_a_place_that_exists():
    """The map of where each decision lives names existing code: `module.name` or `module.Class.attribute`, and the
    methods listed after a class."""
    import importlib

    rows = table_rows(section("Where each decision lives"))[2:]
    assert rows
    for _, place in rows:
        names = re.findall(r"`([\w.]+)`", place)
        owner = None
        for name in names:
            module_name, _, attribute = name.partition(".")
            if attribute and importlib.util.find_spec(module_name) is not None:
                target = importlib.import_module(module_name)
                for part in attribute.split("."):
                    target = getattr(target, part)
                owner = target
            else:  # a class's method, listed after the class
                assert owner is not None and hasattr(owner, name), (place, name)


# ---------------------------------------------------------------------------------------------------------------
# Links, and the runs behind the numbers
# ---------------------------------------------------------------------------------------------------------------


def links(path: Path) -> list[str]:
    return re.findall(r"\]\(([^)\s]+)\)", prose(path))


@pytest.mark.parametrize("path", [README, BENCH], ids=["README.md", "bench/README.md"])
def test_relative_links_and_anchors_resolve(path):
    found = links(path)
    assert found
    for target in found:
        if re.match(r"\w+://", target):
            continue
        file, _, anchor = target.partition("#")
        where = (path.parent / file).resolve() if file else path
        assert where.exists(), f"{path.name}: {target}"
        if anchor:
            assert anchor in anchors(where), f"{path.name}: {target}: no such heading"


@pytest.mark.parametrize("path", [README, BENCH], ids=["README.md", "bench/README.md"])
def test_every_bench_results_path_exists(path):
    """Links into bench/results/ and the paths written as `bench/results/...`: each names a file or folder there."""
    named = [t for t in links(path) if "results/" in t]
    named = [str((path.parent / t).resolve().relative_to(ROOT)) for t in named]
    named += re.findall(r"(bench/results/[\w./*-]*[\w/*])", text(path))
    assert named or path == README
    missing = [name for name in named if not glob.glob(str(ROOT / name))]
    assert not missing, missing


def test_every_table_of_the_measurements_names_its_run():
    """Each section of bench/README.md that holds a table links a run folder (or says its figures have none)."""
    for title, body in sections(BENCH).items():
        if table_rows(body) and title != "Contents":
            assert "](results/" in body or "no stored run" in body, f"bench/README.md: {title!r} names no run"


def test_the_readmes_speed_figures_are_the_logs():
    """The README's headline speed tables copy bench/README.md's figures, and link the runs they come from."""
    speed, log = section("Speed"), text(BENCH)
    figures = [f for cells in table_rows(speed) for cell in cells for f in re.findall(r"\d+\.\d+", cell)]
    assert len(figures) > 20
    assert not [f for f in figures if f not in log], [f for f in figures if f not in log]
    assert len(re.findall(r"\]\(bench/results/", speed)) >= 2
    assert "bench/README.md" in speed
