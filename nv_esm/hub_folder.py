"""A Hub-ready NVEsm model folder: config.json with the `auto_map` of the remote code, tokenizer, the remote code
itself and LICENSE; written in a staging folder and moved into place atomically; a Hub id resolved to a local
snapshot, and a finished folder pushed to the Hub.

Both the checkpoint converter and the trainer's export write their folders with these functions.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import socket
import sys
import tempfile
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import huggingface_hub
from huggingface_hub.errors import EntryNotFoundError

from nv_esm.alphabet import ESM_VOCAB
from nv_esm.checkpoint_io import WEIGHTS_INDEX_NAME, WEIGHTS_NAME, format_bytes, read_json, umask

if TYPE_CHECKING:
    from configuration_nv_esm import NVEsmConfig

# The remote code of an NVEsm folder, and the `auto_map` of its config.json that points AutoConfig/AutoModel*
# at it (the repository's own config.json carries the same; tests/test_hub.py checks that).
# The model file imports its flat siblings (transformers' loader copies what it imports relatively), each only the
# ones listed before it. pyproject.toml's py-modules installs the same files (tests/test_layout.py checks both).
MODEL_CODE_FILES = (
    "configuration_nv_esm.py",
    "modeling_nv_esm_batch.py",
    "modeling_nv_esm_kernels.py",
    "modeling_nv_esm_layout.py",
    "modeling_nv_esm_lora.py",
    "modeling_nv_esm_layers.py",
    "modeling_nv_esm_parallel.py",
    "modeling_nv_esm_graphs.py",
    "modeling_nv_esm_plan.py",
    "modeling_nv_esm_encoder.py",
    "modeling_nv_esm.py",
)
# The tokenizer's remote code, which tokenizer_config.json's `auto_map` names (imports only transformers).
TOKENIZER_CODE_FILE = "tokenization_nv_esm.py"
REMOTE_CODE_FILES = (*MODEL_CODE_FILES, TOKENIZER_CODE_FILE)
AUTO_MAP = {
    "AutoConfig": "configuration_nv_esm.NVEsmConfig",
    "AutoModel": "modeling_nv_esm.NVEsmModel",
    "AutoModelForMaskedLM": "modeling_nv_esm.NVEsmForMaskedLM",
    "AutoModelForTokenClassification": "modeling_nv_esm.NVEsmForTokenClassification",
    "AutoModelForSequenceClassification": "modeling_nv_esm.NVEsmForSequenceClassification",
}
TOKENIZER_SETTINGS_FILES = ("tokenizer_config.json", "special_tokens_map.json")
# What the output's tokenizer takes from a source folder's tokenizer files; nothing else of them is written
# (an `auto_map` there would make AutoTokenizer(..., trust_remote_code=True) run code from another repository).
SPECIAL_TOKENS = ("cls_token", "pad_token", "eos_token", "unk_token", "mask_token")
ESM_SPECIAL_TOKENS = dict(zip(SPECIAL_TOKENS, ("<cls>", "<pad>", "<eos>", "<unk>", "<mask>")))
MIT_LICENSE = """MIT License

Copyright (c) Meta Platforms, Inc. and affiliates (ESM-2 model weights).{code_copyright}

Permission is hereby granted, free of charge, to any person obtaining a copy
of this software and associated documentation files (the "Software"), to deal
in the Software without restriction, including without limitation the rights
to use, copy, modify, merge, publish, distribute, sublicense, and/or sell
copies of the Software, and to permit persons to whom the Software is
furnished to do so, subject to the following conditions:

The above copyright notice and this permission notice shall be included in all
copies or substantial portions of the Software.

THE SOFTWARE IS PROVIDED "AS IS", WITHOUT WARRANTY OF ANY KIND, EXPRESS OR
IMPLIED, INCLUDING BUT NOT LIMITED TO THE WARRANTIES OF MERCHANTABILITY,
FITNESS FOR A PARTICULAR PURPOSE AND NONINFRINGEMENT. IN NO EVENT SHALL THE
AUTHORS OR COPYRIGHT HOLDERS BE LIABLE FOR ANY CLAIM, DAMAGES OR OTHER
LIABILITY, WHETHER IN AN ACTION OF CONTRACT, TORT OR OTHERWISE, ARISING FROM,
OUT OF OR IN CONNECTION WITH THE SOFTWARE OR THE USE OR OTHER DEALINGS IN THE
SOFTWARE.
"""
CODE_COPYRIGHT = (
    "\nCopyright (c) the nv-esm contributors (configuration_nv_esm.py, modeling_nv_esm*.py, tokenization_nv_esm.py)."
)


# --------------------------------------------------------------------------------------------------------------
# The folder's files
# --------------------------------------------------------------------------------------------------------------


def nv_config_dict(config: NVEsmConfig, architecture: str = "NVEsmForMaskedLM") -> dict:
    """config.json of an NVEsm folder: the config as `save_pretrained` writes it (no load-time options, no
    default labels), its architecture (a class of modeling_nv_esm) and the `auto_map` of the remote code."""
    config_dict = config.to_saved_dict()
    config_dict.update(auto_map=AUTO_MAP, architectures=[architecture])
    return config_dict


def write_tokenizer(out: Path, source_folder: Path | None, vocab_size: int, remote_code: bool) -> None:
    """The tokenizer (`write_esm_tokenizer`) with the vocabulary and settings of the checkpoint in `source_folder`,
    checked; ESM-2's when there is no source folder or it has no vocab.txt (fair-esm checkpoints carry no tokenizer).
    The source's tokenizer files are read, never copied (`read_tokenizer_settings`: ESM-2's special tokens and
    ids), and only `model_max_length` is taken from them."""
    if source_folder is None or not (source_folder / "vocab.txt").exists():
        write_esm_tokenizer(out, remote_code=remote_code)
        return
    vocab = read_vocab(source_folder / "vocab.txt", vocab_size)
    settings = read_tokenizer_settings([source_folder / name for name in TOKENIZER_SETTINGS_FILES], vocab)
    write_esm_tokenizer(out, vocab, remote_code=remote_code, **settings)


def read_tokenizer_settings(paths: list[Path], vocab: list[str]) -> dict[str, Any]:
    """The `SPECIAL_TOKENS` and `model_max_length` that the tokenizer files `paths` (tokenizer_config.json,
    special_tokens_map.json; those absent skipped) set, checked against ESM-2's and the vocabulary `vocab`:
    ValueError naming the file when a special token is not ESM-2's (a `<cls>` as `mask_token`), `model_max_length`
    is not a count, or an `added_tokens_decoder` entry gives an id of `vocab` to another token (the tokenizer would
    then write ids that the weights read as other tokens)."""
    settings: dict[str, Any] = {}
    for path in (path for path in paths if path.exists()):
        data = read_json(path)
        for key in (*SPECIAL_TOKENS, "model_max_length"):
            value = data.get(key)
            if isinstance(value, dict):  # an AddedToken's fields
                value = value.get("content")
            if value is None:
                continue
            if key in SPECIAL_TOKENS and value != ESM_SPECIAL_TOKENS[key]:
                raise ValueError(f"{path}: {key} {value!r} is not ESM-2's {ESM_SPECIAL_TOKENS[key]!r}.")
            if key == "model_max_length" and (type(value) is not int or value < 1):
                raise ValueError(f"{path}: {key} {value!r} is not a count.")
            settings[key] = value
        added = data.get("added_tokens_decoder") or {}
        for token_id, token in added.items() if isinstance(added, dict) else ():
            content = token.get("content") if isinstance(token, dict) else token
            index = int(token_id) if str(token_id).isdigit() else None
            if index is None or (index < len(vocab) and content != vocab[index]):
                holds = f"vocab.txt's id {index} is {vocab[index]!r}" if index is not None else "it is not an id"
                raise ValueError(
                    f"{path}: added_tokens_decoder gives {token_id!r} to {content!r}, but {holds}; the tokenizer's ids "
                    "would not match the weights."
                )
    return settings


def read_vocab(path: Path, vocab_size: int) -> list[str]:
    """The tokens of a vocab.txt, one a line, as `EsmTokenizer` reads them; ValueError unless they are distinct
    words without spaces whose ids fit the model's `vocab_size` and the first of them are ESM-2's alphabet in its
    order (`ESM_VOCAB`: the ids the weights were trained with; tokens added after it are kept)."""
    try:
        tokens = [line.strip() for line in path.read_text(encoding="utf-8").splitlines()]
    except UnicodeDecodeError as error:
        reason = f"{error.reason} at byte {error.start}"
        raise ValueError(f"{path} is not a vocabulary: not UTF-8 text ({reason}).") from None
    bad = [token for token in tokens if not token or len(token.split()) != 1]
    if bad or len(set(tokens)) != len(tokens) or not 0 < len(tokens) <= vocab_size:
        raise ValueError(
            f"{path} is not a vocabulary of this model: {len(tokens)} lines ({len(set(tokens))} distinct, "
            f"{len(bad)} empty or with spaces) for vocab_size {vocab_size}."
        )
    moved = esm_tokens_out_of_place({token: index for index, token in enumerate(tokens)})  # tokens: distinct
    if moved:
        index = ESM_VOCAB.index(moved[0])
        found = repr(tokens[index]) if index < len(tokens) else "nothing"
        raise ValueError(
            f"{path} is not ESM-2's vocabulary: line {index + 1} holds {found} where ESM-2 has {moved[0]!r} "
            f"({len(moved)} of its {len(ESM_VOCAB)} tokens out of place); its ids would not match the weights."
        )
    return tokens


def esm_tokens_out_of_place(ids: Mapping[str, Any]) -> list[str]:
    """ESM-2's tokens (`ESM_VOCAB`, in its order) that a vocabulary (`ids`: token -> id; a vocab.txt's line
    numbers from 0, a tokenizer.json's ids) does not give the id the weights were trained with."""
    return [token for index, token in enumerate(ESM_VOCAB) if ids.get(token) != index]


# The tokenizer_config.json `auto_map` of an NVEsm folder: AutoTokenizer(..., trust_remote_code=True) loads
# tokenization_nv_esm.NVEsmTokenizer (either case, no silent <unk>); without trust_remote_code it refuses in one line.
TOKENIZER_AUTO_MAP = {"AutoTokenizer": ["tokenization_nv_esm.NVEsmTokenizer", None]}


def write_esm_tokenizer(folder: Path, vocab: list[str] = ESM_VOCAB, *, remote_code: bool, **settings: Any) -> None:
    """vocab.txt (default: the ESM-2 alphabet) and the tokenizer files that AutoTokenizer loads: NVEsm's
    `NVEsmTokenizer` (`remote_code`; its file is one of `REMOTE_CODE_FILES`, which `copy_remote_code` writes), or
    transformers' `EsmTokenizer` for a transformers folder. `settings` are `EsmTokenizer` arguments (special tokens,
    `model_max_length`)."""
    from transformers import EsmTokenizer

    from tokenization_nv_esm import NVEsmTokenizer

    folder.mkdir(parents=True, exist_ok=True)
    (folder / "vocab.txt").write_text("\n".join(vocab) + "\n")
    tokenizer_class = NVEsmTokenizer if remote_code else EsmTokenizer
    tokenizer_class(str(folder / "vocab.txt"), **settings).save_pretrained(folder)
    if remote_code:
        path = folder / "tokenizer_config.json"
        path.write_text(json.dumps({**read_json(path), "auto_map": TOKENIZER_AUTO_MAP}, indent=2) + "\n")


# The remote-code files lie beside the nv_esm package: at the top of a checkout (editable install) and in
# site-packages (`pip install .`), whatever the current directory holds.
REMOTE_CODE_FOLDER = Path(__file__).resolve().parents[1]


def copy_remote_code(out: Path) -> None:
    """The files that `trust_remote_code=True` loads (`REMOTE_CODE_FILES`), copied from beside the installed nv_esm
    package: their bytes only, so that they get the umask's permissions as every other file written (the installed
    files' own, 0644 say, would make them readable by all under `umask 077`)."""
    for name in REMOTE_CODE_FILES:
        if not (REMOTE_CODE_FOLDER / name).is_file():
            raise FileNotFoundError(f"{REMOTE_CODE_FOLDER / name} is missing; reinstall nv-esm (pip install .).")
        shutil.copyfile(REMOTE_CODE_FOLDER / name, out / name)


def remote_code_differences(checkpoint: str | Path) -> list[str]:
    """The model-code files (`MODEL_CODE_FILES`) of a checkpoint folder or Hub id that differ from the installed
    package's own; a file the checkpoint lacks counts as the same (the installed one runs either way). The tokenizer's
    file is not among them: the commands read a checkpoint's vocabulary with the installed `NVEsmTokenizer` and never
    run its tokenizer code. Only reads."""
    differing = []
    for name in MODEL_CODE_FILES:
        path = checkpoint_file(checkpoint, name)
        if path is not None and path.read_bytes() != (REMOTE_CODE_FOLDER / name).read_bytes():
            differing.append(name)
    return differing


def checkpoint_file(checkpoint: str | Path, name: str) -> Path | None:
    """File `name` of a checkpoint folder, or of a Hub id (downloaded to the cache), or None where it has none."""
    folder = Path(checkpoint).expanduser()
    if folder.is_dir():
        return folder / name if (folder / name).is_file() else None
    try:
        return Path(huggingface_hub.hf_hub_download(str(checkpoint), name))
    except EntryNotFoundError:
        return None


def check_vocabulary(checkpoint: str | Path, vocab_size: int) -> None:
    """Refuse a checkpoint whose vocab.txt is not ESM-2's vocabulary (`read_vocab`), or whose tokenizer files name
    other special tokens or give the vocabulary's ids to other tokens (`read_tokenizer_settings`): the commands
    tokenize with ESM-2's ids, which its weights would then not match. A checkpoint without vocab.txt claims no other
    ids than ESM-2's."""
    path = checkpoint_file(checkpoint, "vocab.txt")
    vocab = ESM_VOCAB if path is None else read_vocab(path, vocab_size)
    settings_files = (checkpoint_file(checkpoint, name) for name in TOKENIZER_SETTINGS_FILES)
    read_tokenizer_settings([path for path in settings_files if path is not None], vocab)


def write_license(out: Path, with_code: bool) -> None:
    """ESM-2's MIT license for the weights, naming this project's remote code when the folder holds it."""
    (out / "LICENSE").write_text(MIT_LICENSE.format(code_copyright=CODE_COPYRIGHT if with_code else ""))


# --------------------------------------------------------------------------------------------------------------
# Writing atomically: a staging folder beside OUT, renamed into place
# --------------------------------------------------------------------------------------------------------------


# The files a model folder write makes (the converter's both ways, `nv-esm train export`): all that `--overwrite` may
# replace. Weight shards are `SHARD_NAME`.
HUB_FOLDER_FILES = frozenset(
    {
        "config.json",
        "vocab.txt",
        "README.md",
        "LICENSE",
        WEIGHTS_NAME,
        WEIGHTS_INDEX_NAME,
        *TOKENIZER_SETTINGS_FILES,
        *REMOTE_CODE_FILES,
        "adapter_config.json",  # a converted PEFT adapter folder (`nv_esm.conversion.convert_adapter`)
        "adapter_model.safetensors",
    }
)
SHARD_NAME = re.compile(r"model-\d{5}-of-\d{5}\.safetensors")


def check_out(out: Path, force: bool) -> None:
    """Refuse a file as OUT, a non-empty OUT without `force`, and, with it, an OUT holding anything a model folder
    write does not make (`HUB_FOLDER_FILES`, weight shards; links and folders included): replacing it would delete
    files that are not an earlier conversion's or export's (a `.git` of a cloned repository, the user's notes)."""
    if out.exists() and not out.is_dir():
        raise ValueError(f"{out} exists and is not a folder.")
    if not out.exists() or not any(out.iterdir()):
        return
    if not force:
        raise ValueError(f"{out} is not empty; pass --overwrite to replace it, or choose another folder.")
    foreign = sorted(
        path.name
        for path in out.iterdir()
        if path.is_symlink()
        or not path.is_file()
        or (path.name not in HUB_FOLDER_FILES and not SHARD_NAME.fullmatch(path.name))
    )
    if foreign:
        listed = ", ".join(foreign[:3]) + (", ..." if len(foreign) > 3 else "")
        raise ValueError(
            f"{out} holds {len(foreign)} entries that no model folder write makes ({listed}); --overwrite replaces "
            "only an earlier conversion or export: choose another folder, or move them away first."
        )


# Staging folders are named `.OUT.partial-HOST-PID-XXXXXXXX` (PID: the writing process), and an OUT that --overwrite
# replaces is set aside as `.OUT.old-HOST-PID-XXXXXXXX` until the new one is in place, so a later run can tell those
# of runs that died (kill -9, a crash, a power cut) from those of runs still going.
STAGING_NAME = re.compile(r"\.(?P<out>.*)\.(?P<kind>partial|old)-(?P<host>[\w.-]*)-(?P<pid>\d+)-[a-z0-9_]{8}")


def _host() -> str:
    return re.sub(r"[^\w.-]", "_", socket.gethostname())


def _process_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    return True


def remove_stale_staging(parent: Path) -> None:
    """Clean up after the runs in `parent` whose process, on this host, has ended: delete their staging folders,
    and put back an OUT that one of them had set aside to replace it and died before the new one was in place (if
    OUT is there again, the set-aside copy is deleted)."""
    for path in sorted(parent.iterdir()):
        match = STAGING_NAME.fullmatch(path.name)
        if not match or match["host"] != _host() or not path.is_dir() or _process_alive(int(match["pid"])):
            continue
        out = parent / match["out"]
        if match["kind"] == "old" and not out.exists():
            print(f"restoring {out}, set aside by an interrupted run (process {match['pid']})", file=sys.stderr)
            path.rename(out)
            continue
        print(f"removing {path}, left by an interrupted run (process {match['pid']})", file=sys.stderr)
        shutil.rmtree(path, ignore_errors=True)


@contextlib.contextmanager
def staging_folder(out: Path, force: bool) -> Iterator[Path]:
    """A new folder next to `out`, moved to `out` when the block succeeds and deleted when it fails; staging
    folders of ended runs in the same parent are deleted first. The folder gets the umask's permissions (mkdtemp
    makes it 0700), as do the files the block writes with `open`, `shutil.copyfile` or `save_pretrained`: under
    `umask 077` nothing of it is readable by others, under 022 all of it is."""
    out.parent.mkdir(parents=True, exist_ok=True)
    remove_stale_staging(out.parent)
    prefix = f".{out.name}.partial-{_host()}-{os.getpid()}-"
    staging = Path(tempfile.mkdtemp(prefix=prefix, dir=out.parent))
    staging.chmod(0o777 & ~umask())
    try:
        yield staging
        check_out(out, force)
        replace_folder(staging, out)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise


def replace_folder(staging: Path, out: Path) -> None:
    """Rename `staging` to `out`; an existing `out` is set aside first and deleted only once the rename worked."""
    if not out.exists():
        staging.rename(out)
        return
    old = Path(tempfile.mkdtemp(prefix=f".{out.name}.old-{_host()}-{os.getpid()}-", dir=out.parent))
    old.rmdir()
    out.rename(old)
    try:
        staging.rename(out)
    except BaseException:
        old.rename(out)
        raise
    shutil.rmtree(old, ignore_errors=True)


# --------------------------------------------------------------------------------------------------------------
# The Hub
# --------------------------------------------------------------------------------------------------------------


def hub_id_of(folder: Path) -> str | None:
    """The Hub id of a folder inside the Hugging Face cache (`models--org--name/snapshots/<commit>`), else None."""
    for part in folder.resolve().parts:
        if part.startswith("models--"):
            return part[len("models--") :].replace("--", "/")
    return None


def resolve_source(source: str, revision: str | None = None) -> Path:
    """A local folder, or a Hub id downloaded with `huggingface_hub.snapshot_download` (token and cache from the
    usual `HF_TOKEN`/`HF_HOME` settings); either way checked by `check_contained`."""
    path = Path(source).expanduser()
    if path.is_dir():
        return check_contained(path)
    if path.exists():
        raise ValueError(f"{source} is a file; pass the folder that holds config.json and the weights.")
    if source.startswith((".", "/", "~")) or source.count("/") > 1:
        raise ValueError(f"{source}: no such folder.")
    try:
        folder = Path(
            huggingface_hub.snapshot_download(
                source, revision=revision, allow_patterns=["*.json", "*.safetensors", "*.txt"]
            )
        )
    except Exception as error:
        raise ValueError(
            f"{source} is neither a local folder nor a Hub repository that can be reached "
            f"(revision {revision or 'main'}): {type(error).__name__}: {error}\n"
            "Check the id and the network; private or gated repositories need HF_TOKEN or `hf auth login`."
        ) from error
    return check_contained(folder)


def check_contained(folder: Path) -> Path:
    """`folder`, after checking that nothing in it is a link leading out of it: a file read from a checkpoint
    folder must be that folder's own, or a link to a file elsewhere (`vocab.txt -> ~/.ssh/id_rsa`) would be read,
    copied into the output and uploaded with it. The one exception is the Hugging Face cache, whose snapshot
    folders (`models--org--name/snapshots/<commit>`) link to the files of `models--org--name/blobs`."""
    root = folder.resolve()
    allowed = [root]
    if root.parent.name == "snapshots" and root.parents[1].name.startswith("models--"):
        allowed.append(root.parents[1] / "blobs")
    for directory, folders, files in os.walk(folder):
        for name in [*folders, *files]:
            path = Path(directory, name)
            target = path.resolve()
            if not any(target == place or place in target.parents for place in allowed):
                raise ValueError(
                    f"{path} leads out of {folder} (to {target}); a checkpoint folder's files must lie in it: copy "
                    "the file in instead of linking it."
                )
    return folder


def file_listing(folder: Path) -> tuple[str, list[str]]:
    """The files under `folder`: a summary ("N files (SIZE)") and one line per file, its path and size."""
    files = sorted(path for path in folder.rglob("*") if path.is_file())
    total = sum(path.stat().st_size for path in files)
    width = max((len(str(path.relative_to(folder))) for path in files), default=0)
    lines = [f"  {str(p.relative_to(folder)):<{width}}  {format_bytes(p.stat().st_size):>10}" for p in files]
    return f"{len(files)} files ({format_bytes(total)})", lines


def push_to_hub(folder: Path, repo_id: str, private: bool, commit_message: str, dry_run: bool) -> None:
    """Upload `folder` to a Hub model repository (created if needed); `dry_run` only lists what would go."""
    summary, lines = file_listing(folder)
    visibility = "private" if private else "default visibility"
    if dry_run:
        print(f"dry run: would upload {summary} to {repo_id} ({visibility}):")
        print("\n".join(lines))
        print(f"  commit message: {commit_message}")
        return
    huggingface_hub.create_repo(repo_id, private=True if private else None, exist_ok=True, repo_type="model")
    commit = huggingface_hub.upload_folder(repo_id=repo_id, folder_path=folder, commit_message=commit_message)
    print(f"uploaded {summary} to {getattr(commit, 'commit_url', repo_id)}")
