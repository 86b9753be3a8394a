"""The repository's reference data folder, testdata/ (its README.md says what it holds): the manifest that records
each file's size, sha256 and source, the check of the folder against it, and the folder's refresh from a newer copy
of the project's shared reference data (scripts/refresh_testdata.py).

A refresh is one transaction of folder_transaction: everything is staged inside the folder and switched in by
renames, so that it writes nothing outside the folder and an error leaves the folder as it was.
"""
import hashlib
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, List, Tuple

from . import folder_transaction
from .folder_transaction import ABSENT, TRANSACTION, Entry, Refused

MANIFEST = "MANIFEST.tsv"
README = "README.md"
OWN_FILES = (README, MANIFEST)  # the folder's own files: not copied from a source, not listed in the manifest
# Not copied from a source folder: its README.md (the folder has its own) and hooks/ (the project's checklist before
# a change is submitted, not data), nor hidden names (.git, editor files).
NOT_DATA = ("README.md", "hooks")
COLUMNS = ("path", "size", "sha256", "source")
HEADER = "# " + "\t".join(COLUMNS) + "    (source: the file's path under the folder it was refreshed from)\n"


@dataclass(frozen=True)
class Record:
    size: int
    sha256: str
    source: str


def record(data: bytes, source: str) -> Record:
    return Record(len(data), hashlib.sha256(data).hexdigest(), source)


def manifest_text(records: Dict[str, Record]) -> str:
    return HEADER + "".join(f"{path}\t{r.size}\t{r.sha256}\t{r.source}\n" for path, r in sorted(records.items()))


def read_manifest(folder: Path) -> Dict[str, Record]:
    records = {}
    for number, line in enumerate((folder / MANIFEST).read_text(encoding="utf-8").splitlines(), 1):
        if line.startswith("#") or not line.strip():
            continue
        fields = line.split("\t")
        if len(fields) != len(COLUMNS) or not fields[1].isdigit():
            raise ValueError(f"{folder / MANIFEST}, line {number}: expected {len(COLUMNS)} tab-separated fields "
                             f"({', '.join(COLUMNS)}), got {line!r}")
        records[fields[0]] = Record(int(fields[1]), fields[2], fields[3])
    return records


def data_files(root: Path, source: bool = False) -> Dict[str, Path]:
    """relative path (with /) -> path of every data file under `root`, links read through. In a source folder its
    NOT_DATA and hidden names are left out; in the data folder its own files and an interrupted transaction."""
    found = {}
    for directory, subdirs, files in os.walk(root):
        top = Path(directory) == root

        def is_data(name: str) -> bool:
            if source:
                return not name.startswith(".") and not (top and name in NOT_DATA)
            return not (top and name in OWN_FILES + (TRANSACTION,))

        subdirs[:] = sorted(filter(is_data, subdirs))
        for name in sorted(filter(is_data, files)):
            path = Path(directory) / name
            found[path.relative_to(root).as_posix()] = path
    return found


def problems(folder: Path) -> List[str]:
    """Where `folder` and its manifest disagree: a listed file missing or with other bytes, a file not listed."""
    listed, present = read_manifest(folder), data_files(folder)
    found = [f"{path}: missing" for path in sorted(listed.keys() - present.keys())]
    for path in sorted(listed.keys() & present.keys()):
        have = record(present[path].read_bytes(), listed[path].source)
        if have != listed[path]:
            found.append(f"{path}: {have.size} bytes, sha256 {have.sha256}; the manifest says {listed[path].size} "
                         f"bytes, sha256 {listed[path].sha256}")
    found += [f"{path}: not in {MANIFEST}" for path in sorted(present.keys() - listed.keys())]
    return found


# ---------------------------------------------------------------------------------------------------------------------
# The refresh
# ---------------------------------------------------------------------------------------------------------------------

@dataclass
class Refresh:
    """What a refresh changes: the transaction's entries, one line per file for the user, and a summary."""

    changes: List[Tuple[str, Entry]] = field(default_factory=list)
    lines: List[str] = field(default_factory=list)
    summary: str = ""


def _tree(files: Dict[str, bytes]) -> Entry:
    """A new folder holding `files` (relative path -> bytes), as one entry."""
    children: Dict[str, dict] = {}
    for path, data in files.items():
        head, _, rest = path.partition("/")
        children.setdefault(head, {})[rest] = data
    entries = [(name, Entry("file", inner[""]) if "" in inner else _tree(inner)) for name, inner in children.items()]
    return Entry("dir", children=tuple(sorted(entries)))


def _parents(path: str) -> List[str]:
    """The folders above `path`, from the top: "a/b/c" -> ["a", "a/b"]."""
    parts = path.split("/")
    return ["/".join(parts[:depth]) for depth in range(1, len(parts))]


def _topmost(path: str, keep) -> str:
    """The first folder above `path`, from the top, for which keep(folder) is false; `path` itself when there is
    none."""
    return next((parent for parent in _parents(path) if not keep(parent)), path)


def _size(n: int) -> str:
    return f"{n:,} bytes"


def check_folders(folder: Path, source: Path) -> None:
    for what, path in (("folder to refresh", folder), ("source folder", source)):
        if not path.is_dir():
            raise Refused(f"the {what} {path} is not a folder")
    if folder == source or folder in source.parents or source in folder.parents:
        raise Refused(f"{source} and {folder} overlap: give the shared reference data folder as SOURCE_DIR")


def _additions(folder: Path, source: Path, added: Dict[str, bytes]) -> List[Tuple[str, Entry]]:
    """The new files as entries: one in a folder that does not exist yet comes with that folder (one entry per new
    top folder)."""
    entries, new_folders = [], {}
    for path, data in sorted(added.items()):
        if any((folder / parent).exists() and not (folder / parent).is_dir() for parent in _parents(path)):
            raise Refused(f"{path} is in a folder in {source}, but a file of that name is in {folder}: remove it "
                          "and run again")
        top = _topmost(path, lambda name: (folder / name).is_dir())
        if top == path:
            entries.append((path, Entry("file", data)))
        else:
            new_folders.setdefault(top, {})[path[len(top) + 1:]] = data
    return entries + [(top, _tree(files)) for top, files in new_folders.items()]


def plan_refresh(folder: Path, source: Path) -> Refresh:
    folder, source = folder.resolve(), source.resolve()
    check_folders(folder, source)
    read = folder_transaction.DISK.read
    wanted = {path: read(file) for path, file in data_files(source, source=True).items()}
    if not wanted:
        raise Refused(f"{source} holds no data files: give the shared reference data folder as SOURCE_DIR")
    current = {path: read(file) for path, file in data_files(folder).items()}
    plan = Refresh()
    added = {path: data for path, data in wanted.items() if path not in current}
    removed = sorted(current.keys() - wanted.keys())
    changed = sorted(path for path in wanted.keys() & current.keys() if wanted[path] != current[path])
    plan.changes += [(path, Entry("file", wanted[path])) for path in changed]
    plan.changes += _additions(folder, source, added)
    # A folder left without data goes as a whole (with what else it held).
    gone = {_topmost(path, lambda name: any(p.startswith(name + "/") for p in wanted)) for path in removed}
    plan.changes += [(name, ABSENT) for name in sorted(gone)]
    plan.lines += [f"added    {path}  ({_size(len(data))})" for path, data in sorted(added.items())]
    plan.lines += [f"changed  {path}  ({_size(len(current[path]))} -> {_size(len(wanted[path]))})" for path in changed]
    plan.lines += [f"removed  {path}  ({_size(len(current[path]))})" for path in removed]
    records = {path: record(data, f"{source.name}/{path}") for path, data in wanted.items()}
    manifest = manifest_text(records).encode()
    if not (folder / MANIFEST).is_file() or read(folder / MANIFEST) != manifest:
        plan.changes.append((MANIFEST, Entry("file", manifest)))
        plan.lines.append(f"{MANIFEST} rewritten")
    total = sum(r.size for r in records.values())
    counts = f"{len(added)} added, {len(changed)} changed, {len(removed)} removed"
    plan.summary = (f"{folder.name}: {counts}; it holds {len(records)} files, {_size(total)}" if plan.changes else
                    f"{folder.name}: up to date with {source} ({len(records)} files, {_size(total)})")
    return plan


def refresh(folder: Path, source: Path, dry_run: bool = False) -> Refresh:
    """Make `folder` hold exactly the data files of `source` (and its own README.md), with a new manifest."""
    folder = folder.resolve()
    if not folder.is_dir():
        raise Refused(f"the folder to refresh {folder} is not a folder")
    if dry_run:
        return plan_refresh(folder, source)
    with folder_transaction.folder_lock(folder):
        folder_transaction.finish_interrupted_run(folder)
        plan = plan_refresh(folder, source)
        if plan.changes:
            warning = folder_transaction.run_plan(folder, "refresh", folder_transaction.Plan(plan.changes))
            if warning:
                plan.lines.append(f"warning: {warning}")
    return plan
