"""Checkpoint files: safetensors read one tensor at a time, `.pt` files read without running code, and
safetensors shards written tensor by tensor.

Readers (`SafetensorsStore`, `StateDictStore`) index a checkpoint's tensors (`TensorInfo`: shape and dtype) and
load one on request, so a caller that converts rule by rule needs memory for one rule's tensors, not the model.
`write_shards` takes groups of tensors whose names, shapes and dtypes are known in advance and a function that
produces each group's values; it splits them into shards of a size limit and writes each value as it comes.
Every output file that a command replaces in place is written by `replaced_atomically` (`write_atomically` for
text): under a fresh temporary name beside it (made exclusively: never through a planted link), then renamed.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import math
import os
import pickle
import struct
import tempfile
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path, PurePath
from typing import Any, Protocol, TypeVar

import torch
from safetensors import safe_open
from tqdm.auto import tqdm

from nv_esm.vocabulary import CONVERT_DTYPE_NAMES

DTYPES = {name: getattr(torch, name) for name in CONVERT_DTYPE_NAMES}  # the dtypes a conversion writes
SAFETENSORS_DTYPES = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
}
WEIGHTS_NAME = "model.safetensors"
WEIGHTS_INDEX_NAME = "model.safetensors.index.json"
# What `replaced_atomically` adds to a file's name while it writes it (a regular expression, for the patterns of the
# names a command may find in its folder): `.` + mkstemp's random characters + `.tmp`, or `.tmp` (older versions).
TEMPORARY_SUFFIX = r"(\.[a-z0-9_]+)?\.tmp"
# The process's umask at import, read by setting it (which threads writing files must not race with); `umask()`
# reads the current one without setting it where the system tells it.
_UMASK = os.umask(0o022)
os.umask(_UMASK)


def umask() -> int:
    """The process's umask now (Linux's /proc/self/status tells it without setting it, so a thread writing files
    meanwhile is not affected), else the one at import: what written files and folders take their permissions
    from, as the user's own files do."""
    with contextlib.suppress(OSError, ValueError):
        for line in Path("/proc/self/status").read_text(encoding="ascii").splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    return _UMASK


# --------------------------------------------------------------------------------------------------------------
# Reading
# --------------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class TensorInfo:
    """Shape and dtype of a stored tensor."""

    shape: tuple[int, ...]
    dtype: torch.dtype

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize


class SafetensorsStore:
    """The tensors of safetensors files, read one at a time.

    Each read opens (memory-maps) the file for that tensor only, so pages of tensors already converted do not stay
    resident: the process never holds more than the tensors of the rule being converted.
    """

    def __init__(self, files: list[Path]) -> None:
        self.info: dict[str, TensorInfo] = {}
        self._files: dict[str, Path] = {}
        for path in files:
            with safe_open(str(path), framework="pt") as file:
                for key in file.keys():
                    self.info[key] = TensorInfo(tuple(file.get_slice(key).get_shape()), _torch_dtype(file, key, path))
                    self._files[key] = path

    def load(self, key: str) -> torch.Tensor:
        """The tensor stored under `key`."""
        with safe_open(str(self._files[key]), framework="pt") as file:
            return file.get_tensor(key)


def _torch_dtype(file: Any, key: str, path: Path) -> torch.dtype:
    name = file.get_slice(key).get_dtype()
    if name not in SAFETENSORS_DTYPES:
        raise ValueError(f"{path.name}: tensor {key} has dtype {name}, which ESM-2 checkpoints do not use.")
    return SAFETENSORS_DTYPES[name]


class StateDictStore:
    """The tensors of a state dict loaded from a `.pt` file (memory-mapped when the file allows)."""

    def __init__(self, state: dict[str, Any]) -> None:
        self._state = {key: value for key, value in state.items() if isinstance(value, torch.Tensor)}
        self.info = {key: TensorInfo(tuple(value.shape), value.dtype) for key, value in self._state.items()}

    def load(self, key: str) -> torch.Tensor:
        """The tensor stored under `key`."""
        return self._state[key]


def read_json(path: Path) -> dict:
    """The JSON object in `path`; ValueError naming the file when it holds something else."""
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except ValueError as error:  # JSONDecodeError, UnicodeDecodeError
        raise ValueError(f"{path} is not valid JSON: {error}") from error
    if not isinstance(data, dict):
        raise ValueError(f"{path} holds a JSON {type(data).__name__}, not an object.")
    return data


def update_digest(digest: Any, path: Path) -> None:
    """Feed every byte of file `path` to `digest` (a `hashlib` object), 16 MiB at a time."""
    with open(path, "rb") as file:
        while chunk := file.read(1 << 24):
            digest.update(chunk)


HASHED_CHUNK_BYTES = 1 << 26  # 64 MiB: the pieces `chunk_digests` hashes side by side


def chunk_digests(path: Path) -> bytes:
    """The SHA-256 digests of file `path`'s consecutive `HASHED_CHUNK_BYTES` pieces, concatenated (32 bytes a piece):
    every byte counts, and the pieces are hashed on one thread a core (at most 16) at once (hashlib and file reads
    let go of the GIL), so a 2.6 GB checkpoint takes a fraction of a second, not seconds."""
    from concurrent.futures import ThreadPoolExecutor

    size = path.stat().st_size
    descriptor = os.open(path, os.O_RDONLY)
    try:

        def piece(offset: int) -> bytes:
            return hashlib.sha256(os.pread(descriptor, HASHED_CHUNK_BYTES, offset)).digest()

        with ThreadPoolExecutor(max_workers=min(16, os.cpu_count() or 1)) as pool:
            return b"".join(pool.map(piece, range(0, size, HASHED_CHUNK_BYTES)))
    finally:
        os.close(descriptor)


def file_sha256(path: Path) -> str:
    """The SHA-256 of file `path`, in hex."""
    digest = hashlib.sha256()
    update_digest(digest, path)
    return digest.hexdigest()


def weight_files(folder: Path) -> list[Path]:
    """The safetensors files of a checkpoint folder (single file or sharded with an index)."""
    index = folder / WEIGHTS_INDEX_NAME
    if index.exists():
        weight_map = read_json(index).get("weight_map")
        if (
            not isinstance(weight_map, dict)
            or not weight_map
            or not all(isinstance(v, str) for v in weight_map.values())
        ):
            raise ValueError(f"{index} has no 'weight_map' (tensor name -> file name); the index is broken.")
        shards = sorted(set(weight_map.values()))
        for shard in shards:
            if not shard.endswith(".safetensors") or PurePath(shard).is_absolute() or ".." in PurePath(shard).parts:
                raise ValueError(f"{index} names the file {shard!r}, not a .safetensors file inside {folder}; refused.")
            if not (folder / shard).is_file():
                raise ValueError(f"{index} names {shard}, which is not in {folder}.")
        return [folder / shard for shard in shards]
    single = folder / WEIGHTS_NAME
    if not single.exists():
        raise ValueError(
            f"{folder} holds no {WEIGHTS_NAME} or {WEIGHTS_INDEX_NAME}. Only safetensors weights are read "
            "(pickled pytorch_model.bin files are not); original fair-esm checkpoints are passed as the .pt file."
        )
    return [single]


def checked_weight_files(folder: Path) -> list[Path]:
    """`weight_files(folder)`, each checked to be a readable safetensors file (its header, and a size that covers
    every tensor): ValueError naming a file cut off or overwritten, which transformers and safetensors would report
    with a traceback."""
    from safetensors import SafetensorError

    files = weight_files(folder)
    for path in files:
        try:
            with safe_open(str(path), framework="pt"):
                pass
        except SafetensorError as error:
            raise ValueError(
                f"{path} is not a readable safetensors file ({error}); the checkpoint is damaged: convert or "
                "download it again."
            ) from None
    return files


def load_torch_file(path: Path) -> dict:
    """`torch.load` with `weights_only=True` (tensors and plain containers; fair-esm's `argparse.Namespace` cfg is
    allowed, nothing else runs), memory-mapped when the file is in the zip format."""
    try:
        with torch.serialization.safe_globals([argparse.Namespace]):
            try:
                return torch.load(path, map_location="cpu", weights_only=True, mmap=True)
            except RuntimeError as error:
                if "mmap" not in str(error):
                    raise
                return torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as error:
        detail = str(error).strip().splitlines()[-3:]
        raise ValueError(
            f"{path} holds objects other than tensors, so it is not read (only weights_only loading is done): "
            + " ".join(line.strip() for line in detail)
        ) from error


def read_fair_esm(path: Path) -> tuple[dict[str, Any], Any]:
    """The state dict and the model arguments (`cfg["model"]`, a Namespace or dict) of an original fair-esm ESM-2
    checkpoint (`{"model": state dict, "cfg": {"model": args}}`), with the contact regression of the
    `-contact-regression.pt` beside it when there is one; ValueError when either file is something else or the
    contact regression is nowhere."""
    data = load_torch_file(path)
    if not isinstance(data, dict) or not isinstance(data.get("model"), dict):
        raise ValueError(f"{path} is not a fair-esm checkpoint (expected a dict with a 'model' state dict).")
    if "cfg" not in data:
        arch = getattr(data.get("args"), "arch", None)
        raise ValueError(f"{path} is not an ESM-2 checkpoint (no 'cfg'; args.arch={arch!r}: ESM-1 and MSA models).")
    cfg = data["cfg"]
    model_args = cfg.get("model") if isinstance(cfg, dict) else getattr(cfg, "model", None)
    if model_args is None:
        raise ValueError(
            f"{path}: its 'cfg' has no 'model' (the model's arguments); is it a fair-esm ESM-2 checkpoint?"
        )
    state = dict(data["model"])
    regression = path.with_name(path.stem + "-contact-regression.pt")
    if regression.exists():
        regression_data = load_torch_file(regression)
        if not isinstance(regression_data, dict) or not isinstance(regression_data.get("model"), dict):
            raise ValueError(
                f"{regression} is not a contact-regression file (expected a dict with a 'model' state dict)."
            )
        state.update(regression_data["model"])
    from nv_esm.state_dict_mapping import CONTACT_HEAD_TENSORS, canonical_fair_esm_name  # here: it imports the config

    if not any(canonical_fair_esm_name(key) in CONTACT_HEAD_TENSORS for key in state):
        raise ValueError(
            f"{path} holds no contact-regression weights and {regression.name} is not beside it; put fair-esm's "
            f"{regression.name} (from the same release as the model) in {path.parent}."
        )
    return state, model_args


# --------------------------------------------------------------------------------------------------------------
# Sizes
# --------------------------------------------------------------------------------------------------------------


def format_bytes(size: float) -> str:
    """Bytes in decimal units, as the Hub shows them."""
    for unit in ("B", "kB", "MB", "GB", "TB"):
        if size < 1000 or unit == "TB":
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.2f} {unit}"
        size /= 1000
    raise AssertionError("unreachable")


# --------------------------------------------------------------------------------------------------------------
# Writing safetensors shards tensor by tensor
# --------------------------------------------------------------------------------------------------------------


class SafetensorsWriter:
    """Writes one safetensors file whose tensors (names, shapes, dtypes) are known before their values.

    The header goes first; then each tensor's bytes as it is produced, in the announced order. Only the tensor
    being written is in memory. Use as a context manager; leaving it early (an error) leaves an incomplete file,
    which the caller deletes with the rest of the staging folder.
    """

    def __init__(self, path: Path, entries: list[tuple[str, TensorInfo]], metadata: dict[str, str]) -> None:
        names = {dtype: name for name, dtype in SAFETENSORS_DTYPES.items()}
        header: dict[str, Any] = {"__metadata__": metadata}
        offset = 0
        for name, info in entries:
            header[name] = {
                "dtype": names[info.dtype],
                "shape": list(info.shape),
                "data_offsets": [offset, offset + info.nbytes],
            }
            offset += info.nbytes
        encoded = json.dumps(header, separators=(",", ":")).encode()
        encoded += b" " * (-len(encoded) % 8)
        self.path = path
        self._pending = deque(entries)
        self._file = open(path, "wb")
        self._file.write(struct.pack("<Q", len(encoded)) + encoded)

    def write(self, name: str, tensor: torch.Tensor) -> None:
        """Append the next tensor; it must be the one announced next, with its shape and dtype."""
        expected, info = self._pending.popleft()
        if name != expected or tuple(tensor.shape) != info.shape or tensor.dtype != info.dtype:
            raise RuntimeError(
                f"{self.path.name}: expected {expected} {list(info.shape)} {info.dtype}, got {name} "
                f"{list(tensor.shape)} {tensor.dtype}"
            )
        self._file.write(tensor.detach().contiguous().reshape(-1).view(torch.uint8).numpy().data)

    def __enter__(self) -> SafetensorsWriter:
        return self

    def __exit__(self, error_type: type | None, *_: object) -> None:
        self._file.close()
        if error_type is None and self._pending:
            raise RuntimeError(f"{self.path.name}: {len(self._pending)} announced tensors were not written")


class TensorGroup(Protocol):
    """Tensors that are produced together (e.g. by one conversion rule), announced before their values."""

    @property
    def outputs(self) -> tuple[tuple[str, TensorInfo], ...]:
        """Name and `TensorInfo` of each tensor, in the order they are produced."""
        ...

    @property
    def nbytes(self) -> int:
        """Bytes of all the group's tensors."""
        ...


Group = TypeVar("Group", bound=TensorGroup)


def split_into_shards(groups: Sequence[Group], max_bytes: int) -> list[list[Group]]:
    """Consecutive groups gathered into shards of at most `max_bytes` (a larger group gets a shard of its own)."""
    shards: list[list[Group]] = []
    size = 0
    for group in groups:
        if not shards or size + group.nbytes > max_bytes:
            shards.append([])
            size = 0
        shards[-1].append(group)
        size += group.nbytes
    return shards


def check_shard_size(groups: Sequence[Group], max_bytes: int) -> None:
    """Refuse a shard size limit below the bytes of the largest group: a group is never split across files, so its
    shard would be larger than the limit asked for. ValueError naming the group's first tensor and the least
    limit that holds it."""
    largest = max(groups, key=lambda group: group.nbytes, default=None)
    if largest is None or largest.nbytes <= max_bytes:
        return
    name, size = largest.outputs[0][0], format_bytes(largest.nbytes)
    together = f" and the {len(largest.outputs) - 1} tensors made with it" if len(largest.outputs) > 1 else ""
    raise ValueError(
        f"--max-shard-size {format_bytes(max_bytes)} is smaller than {name}{together} ({size}), which a weights file "
        f"holds whole; pass at least {largest.nbytes} bytes."
    )


def shard_names(count: int) -> list[str]:
    """File names of `count` shards: `model.safetensors` alone, else `model-00001-of-0000N.safetensors`..."""
    if count == 1:
        return [WEIGHTS_NAME]
    return [f"model-{index:05d}-of-{count:05d}.safetensors" for index in range(1, count + 1)]


def write_shards(
    folder: Path,
    groups: Sequence[Group],
    produce: Callable[[Group], Iterable[torch.Tensor]],
    max_shard_bytes: int,
    description: str = "",
    progress: bool | None = None,
) -> int:
    """Write every group's tensors, as `produce(group)` makes them, into safetensors shards of at most
    `max_shard_bytes` in `folder`, with `model.safetensors.index.json` when there are several; returns the shard
    count. `progress`: show a progress bar labelled `description` (None: only on a terminal). A limit below the
    largest group is refused (`check_shard_size`) before anything is written."""
    check_shard_size(groups, max_shard_bytes)
    shards = split_into_shards(groups, max_shard_bytes)
    weight_map = {}
    total = sum(group.nbytes for group in groups)
    quiet = None if progress is None else not progress
    with tqdm(total=total, unit="B", unit_scale=True, desc=description, disable=quiet) as bar:
        for name, shard in zip(shard_names(len(shards)), shards):
            entries = [output for group in shard for output in group.outputs]
            with SafetensorsWriter(folder / name, entries, {"format": "pt"}) as writer:
                for group in shard:
                    bar.set_postfix_str(group.outputs[0][0], refresh=False)
                    for (out_name, _), tensor in zip(group.outputs, produce(group)):
                        writer.write(out_name, tensor)
                    bar.update(group.nbytes)
            weight_map.update({out_name: name for out_name, _ in entries})
    if len(shards) > 1:
        index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
        (folder / WEIGHTS_INDEX_NAME).write_text(json.dumps(index, indent=2) + "\n", encoding="utf-8")
    return len(shards)


# --------------------------------------------------------------------------------------------------------------
# Replacing a file atomically
# --------------------------------------------------------------------------------------------------------------


@contextlib.contextmanager
def replaced_atomically(path: Path) -> Iterator[Path]:
    """A new empty file beside `path` for the block to write, then synced, given the umask's permissions and renamed
    to `path`; deleted if the block fails. Its name (`path`'s, `.`, random characters, `.tmp`: see
    `TEMPORARY_SUFFIX`) is made exclusively (`tempfile.mkstemp`, O_EXCL): a file or link planted under any name
    beside `path` is never written through. `path` itself, a link included, is replaced, never written into."""
    handle, name = tempfile.mkstemp(prefix=f"{path.name}.", suffix=".tmp", dir=path.parent)
    os.close(handle)
    temporary = Path(name)
    try:
        yield temporary
        temporary.chmod(0o666 & ~umask())  # mkstemp makes it 0600; outputs are as readable as any file the user makes
        with open(temporary, "rb") as file:
            os.fsync(file.fileno())
        os.replace(temporary, path)
    except BaseException:
        temporary.unlink(missing_ok=True)
        raise


def write_atomically(path: Path, text: str) -> None:
    """`text` (UTF-8) under `path`, through `replaced_atomically`."""
    with replaced_atomically(path) as temporary:
        temporary.write_text(text, encoding="utf-8")
