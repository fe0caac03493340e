"""Step directories on disk: written beside the old one, committed by rename, checksummed.

``alpa.serialization`` decides *what* a checkpoint holds; this module decides how a step
directory ``<ckpt_dir>/checkpoint_<s>`` comes to exist, so that no crash loses a step.

**Commit.** A save never writes into ``checkpoint_<s>``. It writes into a directory of
its own beside it, ``checkpoint_<s>.alpa-tmp-<id>`` (orbax's own files, or the parts of a
Ray checkpoint), then seals it (:func:`seal`: the checksums, written last, mark it
complete), then commits it by renames:

1. ``checkpoint_<s>`` -> ``checkpoint_<s>.alpa-old``   (only when re-saving ``s``)
2. ``checkpoint_<s>.alpa-tmp-<id>`` -> ``checkpoint_<s>``   (the commit point)
3. delete ``checkpoint_<s>.alpa-old``

A process killed at any point leaves one of these states, each with a complete step:

* before 1: the old ``checkpoint_<s>`` (if any) as it was, and an unfinished
  ``.alpa-tmp-<id>`` that is never listed;
* between 1 and 2: no ``checkpoint_<s>`` but a complete ``checkpoint_<s>.alpa-old``,
  which readers take as step ``s`` (:func:`step_dirs`), and the next save of ``s`` renames
  back (:func:`recover`);
* after 2: the new ``checkpoint_<s>``, and perhaps part of ``.alpa-old``, ignored and
  deleted by the next save of ``s``.

Deleting a step (``keep=``) renames it to ``checkpoint_<s>.alpa-deleting`` first, so a
step being deleted is never listed half-deleted.

**Checksums.** :func:`seal` reads back every file of the new directory and records its
size and CRC-32 in ``alpa_checksums.json``, per part (``mesh_<id>`` and ``driver`` for a
Ray checkpoint, ``state`` for the one orbax checkpoint of the local runtime). CRC-32
(zlib) finds damaged bytes (disk, copy, truncation); it is not a defence against
tampering. :func:`verify` recomputes them; a mismatch is a :class:`DamagedCheckpointError`
naming the step, the part and the file. On the machine this was measured on, CRC-32 runs
at ~2.8 GB/s, sha256 at ~1.2 GB/s (``benchmark/alpa/checkpoint_checksums.py``).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import uuid
import zlib
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor

from alpa.saved_format import read_format

#: The checksums of a step directory, written last by :func:`seal`.
CHECKSUMS_FILE = "alpa_checksums.json"
#: The layout version of that file (``alpa.saved_format``).
CHECKSUMS_FORMAT = 1
#: Part of a file that lies in no part's directory (the local runtime's one checkpoint).
WHOLE_STATE = "state"

_STEP_DIR = re.compile(r"checkpoint_(\d+)")
_OLD_DIR = re.compile(r"checkpoint_(\d+)\.alpa-old")
_CHUNK = 16 << 20


class DamagedCheckpointError(ValueError):
    """A step's files are not those its save wrote (a checksum, a size or a metadata
    file differs, or a file is missing)."""


# ---------------------------------------------------------------------------------------
# Where steps are
# ---------------------------------------------------------------------------------------


def step_dirs(directory: str) -> dict[int, str]:
    """The committed steps under ``directory``: step -> its directory. A step whose
    re-save was killed between the two renames of the commit is its ``.alpa-old``
    directory (module docstring)."""
    if not os.path.isdir(directory):
        return {}
    found, old = {}, {}
    for name in os.listdir(directory):
        path = os.path.join(directory, name)
        if not os.path.isdir(path):
            continue
        if match := _STEP_DIR.fullmatch(name):
            found[int(match.group(1))] = path
        elif match := _OLD_DIR.fullmatch(name):
            old[int(match.group(1))] = path
    return {**old, **found}


def staging_dir(directory: str, step: int) -> str:
    """A fresh directory name beside ``checkpoint_<step>`` for a save to write into."""
    return os.path.join(directory, f"checkpoint_{step}.alpa-tmp-{uuid.uuid4().hex[:12]}")


def unfinished(directory: str, step: int | None) -> list[str]:
    """Names of what unfinished saves of ``step`` (any step when ``None``) left."""
    prefix = "checkpoint_" if step is None else f"checkpoint_{step}."
    return sorted(
        name
        for name in os.listdir(directory)
        if name.startswith(prefix)
        and _STEP_DIR.fullmatch(name) is None
        and _OLD_DIR.fullmatch(name) is None
    )


# ---------------------------------------------------------------------------------------
# Commit, recovery, deletion
# ---------------------------------------------------------------------------------------


def recover(directory: str, step: int) -> None:
    """Bring ``checkpoint_<step>`` back to a committed state before a new save of it:
    undo a commit killed between its renames, and delete what killed saves of ``step``
    and killed deletions of any step left."""
    final = os.path.join(directory, f"checkpoint_{step}")
    old = final + ".alpa-old"
    if os.path.isdir(old):
        if os.path.isdir(final):
            shutil.rmtree(old)  # killed after the commit, while deleting the old copy
        else:
            os.rename(old, final)  # killed between the renames: the old copy is the step
    for name in unfinished(directory, None):
        path = os.path.join(directory, name)
        ours = name.startswith(f"checkpoint_{step}.") or name.endswith(".alpa-deleting")
        if ours and os.path.isdir(path):
            shutil.rmtree(path, ignore_errors=True)


def commit(staging: str, directory: str, step: int) -> str:
    """Make the sealed ``staging`` the step ``checkpoint_<step>`` (module docstring);
    returns its path."""
    final = os.path.join(directory, f"checkpoint_{step}")
    old = final + ".alpa-old"
    if os.path.isdir(final):
        os.rename(final, old)
        _sync_dir(directory)
    os.rename(staging, final)
    _sync_dir(directory)
    if os.path.isdir(old):
        shutil.rmtree(old)
    return final


def delete_steps(directory: str, steps: Sequence[int]) -> None:
    """Delete committed steps, each unlisted by a rename before its files go."""
    for step, path in step_dirs(directory).items():
        if step in steps:
            doomed = os.path.join(directory, f"checkpoint_{step}.alpa-deleting")
            if os.path.isdir(doomed):  # left by a deletion that was killed
                shutil.rmtree(doomed)
            os.rename(path, doomed)
            _sync_dir(directory)
            shutil.rmtree(doomed)


def _sync_dir(directory: str) -> None:
    """Persist renames in ``directory`` (a crash of the machine, not only the process)."""
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:  # pragma: no cover - e.g. a file system without directory handles
        return
    try:
        os.fsync(fd)
    except OSError:  # pragma: no cover
        pass
    finally:
        os.close(fd)


# ---------------------------------------------------------------------------------------
# Checksums
# ---------------------------------------------------------------------------------------


def seal(staging: str, parts: Sequence[str] = ()) -> None:
    """Write the checksums of every file under ``staging``, grouped by part (a file in
    the directory ``p`` of ``parts`` belongs to part ``p``, any other to
    :data:`WHOLE_STATE`), as the last file of the save."""
    files = sorted(_files(staging))
    sums = _checksums(staging, files)
    by_part: dict[str, dict[str, list]] = {}
    for rel, (size, crc) in zip(files, sums, strict=True):
        by_part.setdefault(_part_of(rel, parts), {})[rel] = [size, crc]
    record = {"format": CHECKSUMS_FORMAT, "algorithm": "crc32", "parts": by_part}
    tmp = os.path.join(staging, CHECKSUMS_FILE + ".tmp")
    with open(tmp, "w") as f:
        json.dump(record, f)
        f.flush()
        os.fsync(f.fileno())
    os.rename(tmp, os.path.join(staging, CHECKSUMS_FILE))


def has_checksums(path: str) -> bool:
    return os.path.exists(os.path.join(path, CHECKSUMS_FILE))


def verify(path: str, step: int, *, contents: bool = True) -> None:
    """Check the files of the step directory ``path`` against its checksums: with
    ``contents``, every byte (CRC-32); without, only that each file is there with its
    size. Raises :class:`DamagedCheckpointError` naming the step, the part and the file."""
    expected = _read_checksums(path, step)
    listed = {
        rel: (part, size, crc)
        for part, files in expected.items()
        for rel, (size, crc) in files.items()
    }
    for rel in sorted(listed):
        part, size, _ = listed[rel]
        full = os.path.join(path, rel)
        if not os.path.isfile(full):
            raise _damaged(path, step, part, rel, "is missing")
        actual = os.path.getsize(full)
        if actual != size:
            raise _damaged(path, step, part, rel, f"has {actual} bytes, the save wrote {size}")
    if not contents:
        return
    files = sorted(listed)
    for rel, (_, crc) in zip(files, _checksums(path, files), strict=True):
        part, _, want = listed[rel]
        if crc != want:
            raise _damaged(
                path, step, part, rel, f"has CRC-32 {crc:08x}, the save wrote {want:08x}"
            )


def damaged_metadata(path: str, step: int, part: str, rel: str, error: BaseException):
    """The error for a step whose metadata orbax cannot read (with no checksum to blame)."""
    return _damaged(path, step, part, rel, f"cannot be read ({type(error).__name__}: {error})")


def missing_checksums(path: str, step: int) -> DamagedCheckpointError:
    """The error for a step without its checksum file: every step alpa saves has one,
    written last, so it was deleted (or the step was written by something else), and
    the step's files cannot be checked."""
    return DamagedCheckpointError(
        f"checkpoint of step {step} ({path}) has no checksum file {CHECKSUMS_FILE!r}: every "
        "step alpa saves ends with one, so it was deleted or the step was not written by "
        "alpa.save_checkpoint, and a damaged file would restore as different values. Pass "
        "verify=False to restore it without checking, or restore another step "
        "(alpa.serialization.checkpoint_steps lists them)."
    )


def find_damage(
    path: str, step: int, part: str, directory: str, read_values: bool = True
) -> DamagedCheckpointError | None:
    """The error naming the file of step ``path`` that is damaged (after a read failed,
    or before one that skips the checksums), found by its checksum where the step has
    them (every byte read again), else by reading the orbax checkpoint at ``directory``
    (the step, or one of its parts) file by file: its JSON files parsed, its OCDBT
    database's manifest and tree read, with ``read_values`` every value too (tensorstore
    names the file whose checksum or decoding fails). ``None`` when no file is at fault."""
    if has_checksums(path) and read_values:
        try:
            verify(path, step, contents=True)
        except DamagedCheckpointError as e:
            return e
    found = locate_damage(directory, read_values)
    if found is not None and has_checksums(path):
        try:  # the checksum's word, where it has one, for the file found
            verify(path, step, contents=True)
        except DamagedCheckpointError as e:
            return e
    if found is None:
        return None
    rel, what = found
    rel = os.path.relpath(os.path.join(directory, rel), path)
    return _damaged(path, step, part, rel, what)


#: The JSON files of an orbax checkpoint that its reader parses.
_JSON_FILES = ("_METADATA", "_sharding")


def locate_damage(directory: str, read_values: bool = True) -> tuple[str, str] | None:
    """``(file relative to directory, what is wrong)`` for the first file of the orbax
    checkpoint at ``directory`` that cannot be read, without checksums (its JSON files,
    its OCDBT manifest and tree, with ``read_values`` its data); ``None`` if every one
    reads."""
    for name in _JSON_FILES:
        full = os.path.join(directory, name)
        if not os.path.isfile(full):
            continue
        try:
            with open(full, encoding="utf-8") as f:
                json.load(f)
        except (OSError, ValueError) as e:  # UnicodeDecodeError is a ValueError
            return name, f"cannot be read ({type(e).__name__}: {e})"
    try:
        import tensorstore as ts

        store = ts.KvStore.open({"driver": "ocdbt", "base": f"file://{directory}/"}).result()
        keys = store.list().result()
        for key in keys if read_values else ():
            store.read(key).result()
    except Exception as e:  # tensorstore raises ValueError subclasses with the file's path
        named = re.search(r'local file "([^"]+)"', str(e))
        if named:
            return os.path.relpath(named.group(1), directory), f"cannot be read ({e})"
    return None


def _damaged(path: str, step: int, part: str, rel: str, what: str) -> DamagedCheckpointError:
    return DamagedCheckpointError(
        f"checkpoint of step {step} ({path}) is damaged: part {part!r}, file {rel!r} {what}. "
        "Restore another step (alpa.serialization.checkpoint_steps lists them) or save "
        "this one again."
    )


def _read_checksums(path: str, step: int) -> dict[str, dict[str, list]]:
    try:
        with open(os.path.join(path, CHECKSUMS_FILE)) as f:
            record = json.load(f)
    except (OSError, ValueError) as e:
        raise _damaged(path, step, "checksums", CHECKSUMS_FILE, f"cannot be read ({e})") from e
    if isinstance(record, dict):  # a newer alpa's checksums are refused, not called damaged
        source = f"the checksum file of step {step} ({os.path.join(path, CHECKSUMS_FILE)})"
        read_format(
            record, CHECKSUMS_FORMAT, "checksum record", source, "restore it with that version"
        )
    try:
        parts = record["parts"]
        if record.get("algorithm") != "crc32" or not isinstance(parts, dict):
            raise ValueError(f"unknown checksum record {record.get('algorithm')!r}")
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise _damaged(path, step, "checksums", CHECKSUMS_FILE, f"cannot be read ({e})") from e
    return parts


def _files(root: str) -> list[str]:
    found = []
    for here, _, names in os.walk(root):
        for name in names:
            rel = os.path.relpath(os.path.join(here, name), root)
            if rel != CHECKSUMS_FILE:
                found.append(rel)
    return found


def _part_of(rel: str, parts: Sequence[str]) -> str:
    head = rel.split(os.sep, 1)[0]
    return head if head in parts and head != rel else WHOLE_STATE


def _crc(path: str) -> tuple[int, int]:
    crc, size = 0, 0
    with open(path, "rb", buffering=0) as f:
        buffer = bytearray(_CHUNK)
        view = memoryview(buffer)
        while n := f.readinto(buffer):
            crc = zlib.crc32(view[:n], crc)
            size += n
    return size, crc


def _checksums(root: str, files: Sequence[str]) -> list[tuple[int, int]]:
    """``(size, crc32)`` of each file; zlib releases the GIL, so files hash in parallel."""
    paths = [os.path.join(root, rel) for rel in files]
    with ThreadPoolExecutor(max_workers=min(8, os.cpu_count() or 1)) as pool:
        return list(pool.map(_crc, paths))
