"""Journaled, reversible changes to a checkpoint folder: what install_into_checkpoint.py and
convert_tokenizer_to_fast.py write with.

What the fork's tools leave in a folder they change:

* `chatglm_fork_manifest.json`: each file a tool wrote (sha256, size, tool, fork version) and what was there before
  (nothing, a file, or a symlink with its target), so that a later run knows what is installed and how to undo it;
* `chatglm_fork_originals/`: real copies of the files that were replaced. In a Hugging Face cache snapshot the
  originals are relative links into `../../blobs/`: the copies are read through the links, and no blob is ever
  opened for writing (a revision sharing the blobs is untouched).

Each run is one transaction. Everything new is written and flushed into `.chatglm_fork_transaction/` inside the
folder, then a journal is written, then the new entries are switched in by renames (each replaced entry is moved
into the transaction folder, not deleted), then the journal is marked committed and the transaction folder removed.
An error before the commit (disk full, permission, an exception, Ctrl-C) moves every entry back: the folder is left
exactly as it was, down to the inodes. After a `kill -9`, the next run finds the transaction folder: without a
journal nothing had changed yet, with one the renames are undone, once committed only the clean-up is left.
"""
import errno
import functools
import hashlib
import json
import os
import re
import shutil
import stat
import subprocess
import sys
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Dict, Iterable, List, Optional, Tuple

from . import REPO

MANIFEST = "chatglm_fork_manifest.json"
ORIGINALS = "chatglm_fork_originals"
TRANSACTION = ".chatglm_fork_transaction"
JOURNAL, COMMITTED = "journal.json", "committed.json"
MANIFEST_FORMAT = 1
RECORD_KEYS = {"sha256", "tool", "version", "original"}
ORIGINAL_KINDS = ("absent", "file", "link")
CHUNK = 1 << 20


class Refused(Exception):
    """The folder is not one to change (wrong kind of folder, changed by hand since, ...): exit code 2."""


class Failed(Exception):
    """The change could not be made and the folder is as it was: exit code 1."""


# ---------------------------------------------------------------------------------------------------------------------
# The file system, one call per step: the fault-injection tests replace DISK (disk full after N bytes, a permission
# error at step k, SIGKILL in the middle of a write).
# ---------------------------------------------------------------------------------------------------------------------

class Disk:
    def read(self, path: Path) -> bytes:
        with open(path, "rb") as handle:
            return handle.read()

    def create(self, path: Path) -> int:
        return os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_BINARY", 0), 0o600)

    def write(self, fd: int, data: bytes) -> int:
        return os.write(fd, data)

    def fsync(self, fd: int) -> None:
        os.fsync(fd)

    def chmod(self, path: Path, mode: int) -> None:
        os.chmod(path, mode)

    def set_mtime(self, path: Path, mtime_ns: int) -> None:
        os.utime(path, ns=(mtime_ns, mtime_ns))

    def mkdir(self, path: Path) -> None:
        os.mkdir(path)

    def symlink(self, target: str, path: Path) -> None:
        os.symlink(target, path)

    def rename(self, source: Path, destination: Path) -> None:
        os.replace(source, destination)

    def rmtree(self, path: Path) -> None:
        shutil.rmtree(path)

    def sync_dir(self, path: Path) -> None:
        """Make the renames inside `path` durable (POSIX only: Windows cannot open a folder)."""
        if os.name == "nt":
            return
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


DISK = Disk()


def sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


# ---------------------------------------------------------------------------------------------------------------------
# Entries: what a name in the folder is, or should become.
# ---------------------------------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Entry:
    kind: str  # "file", "link", "dir" or "absent"
    data: bytes = b""  # file
    mode: int = 0o644  # file
    mtime_ns: Optional[int] = None  # file: kept when the entry is a copy of an original
    target: str = ""  # link, as written in the link (relative links stay relative)
    children: Tuple[Tuple[str, "Entry"], ...] = ()  # dir

    @property
    def exists(self) -> bool:
        return self.kind != "absent"


ABSENT = Entry("absent")


@dataclass
class Found:
    """A name as it is in the folder now; `data` is None for a link that leads nowhere."""

    kind: str  # "file", "link", "dir" or "absent"
    data: Optional[bytes] = None
    mode: int = 0o644
    mtime_ns: Optional[int] = None
    target: str = ""


def look(path: Path) -> Found:
    try:
        info = os.lstat(path)
    except FileNotFoundError:
        return Found("absent")
    if stat.S_ISLNK(info.st_mode):
        target = os.readlink(path)
        try:
            through = os.stat(path)
            data = DISK.read(path) if stat.S_ISREG(through.st_mode) else None
        except FileNotFoundError:
            return Found("link", target=target)
        return Found("link", data, stat.S_IMODE(through.st_mode), through.st_mtime_ns, target)
    if stat.S_ISDIR(info.st_mode):
        return Found("dir")
    if not stat.S_ISREG(info.st_mode):
        return Found("other")
    return Found("file", DISK.read(path), stat.S_IMODE(info.st_mode), info.st_mtime_ns)


# ---------------------------------------------------------------------------------------------------------------------
# The transaction
# ---------------------------------------------------------------------------------------------------------------------

@contextmanager
def folder_lock(folder: Path):
    """One run at a time per folder: an advisory lock on the folder itself (nothing is written for it)."""
    try:
        import fcntl
    except ImportError:  # Windows: no advisory locks on folders
        yield
        return
    fd = os.open(folder, os.O_RDONLY)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise Failed(f"another run of the fork's tools is changing {folder} right now; wait for it to finish "
                         "and run again") from None
        yield
    finally:
        os.close(fd)


def _write_file(path: Path, entry: Entry) -> None:
    fd = DISK.create(path)
    try:
        view = memoryview(entry.data)
        while view:
            written = DISK.write(fd, view[:CHUNK])
            view = view[written:]
        DISK.fsync(fd)
    finally:
        os.close(fd)
    DISK.chmod(path, entry.mode)
    if entry.mtime_ns is not None:
        DISK.set_mtime(path, entry.mtime_ns)


def _stage(path: Path, entry: Entry) -> None:
    if entry.kind == "file":
        _write_file(path, entry)
    elif entry.kind == "link":
        DISK.symlink(entry.target, path)
    elif entry.kind == "dir":
        DISK.mkdir(path)
        for name, child in entry.children:
            _stage(path / name, child)
        DISK.sync_dir(path)


def _write_json(path: Path, value) -> None:
    """Complete or absent: written beside, flushed, renamed."""
    partial = path.with_name(path.name + ".partial")
    _write_file(partial, Entry("file", json.dumps(value, indent=2).encode(), mode=0o644))
    DISK.rename(partial, path)
    DISK.sync_dir(path.parent)


def _sync_parents(folder: Path, names: Iterable[str]) -> None:
    for parent in sorted({(folder / name).parent for name in names}):
        DISK.sync_dir(parent)


def apply_changes(folder: Path, operation: str, changes: List[Tuple[str, Entry]]) -> Optional[str]:
    """Switch every (name, entry) in at once; on any error before the commit, the folder is left as it was.

    Returns a warning when the clean-up after the commit failed (the next run finishes it), else None.
    """
    transaction = folder / TRANSACTION
    DISK.mkdir(transaction)  # also what `recover` looks for after a kill
    try:
        DISK.mkdir(transaction / "new")
        DISK.mkdir(transaction / "old")
        for index, (name, entry) in enumerate(changes):
            _stage(transaction / "new" / str(index), entry)
        DISK.sync_dir(transaction / "new")
        journal = {"operation": operation, "changes": [[name, entry.exists] for name, entry in changes]}
        _write_json(transaction / JOURNAL, journal)
        for index, (name, entry) in enumerate(changes):
            if os.path.lexists(folder / name):
                DISK.rename(folder / name, transaction / "old" / str(index))
            if entry.exists:
                DISK.rename(transaction / "new" / str(index), folder / name)
        _sync_parents(folder, [name for name, _ in changes])
        DISK.sync_dir(transaction / "old")
        DISK.rename(transaction / JOURNAL, transaction / COMMITTED)  # the commit point
    except BaseException as error:
        try:
            _undo(folder)
        except Exception as undo_error:
            raise Failed(f"{operation} failed ({_describe(error)}) and undoing it failed too "
                         f"({_describe(undo_error)}): the next run of the fork's tools on this folder finishes "
                         f"undoing it from {transaction}/") from None
        raise
    try:
        DISK.rmtree(transaction)
    except OSError as error:
        return f"could not remove {transaction} ({_describe(error)}); the next run of the tool removes it"
    try:
        DISK.sync_dir(folder)
    except OSError as error:
        return f"the change is made, but flushing {folder} to disk failed ({_describe(error)})"
    return None


def _undo(folder: Path) -> None:
    """Put back every entry an unfinished transaction moved, from its journal (idempotent, survives a new kill)."""
    transaction = folder / TRANSACTION
    if not os.path.lexists(transaction):
        return
    journal_path = transaction / JOURNAL
    if journal_path.exists():
        changes = json.loads(DISK.read(journal_path))["changes"]
        for index in reversed(range(len(changes))):
            name, has_new = changes[index]
            new, old = transaction / "new" / str(index), transaction / "old" / str(index)
            if has_new and not os.path.lexists(new) and os.path.lexists(folder / name):
                DISK.rename(folder / name, new)
            if os.path.lexists(old):
                DISK.rename(old, folder / name)
        _sync_parents(folder, [name for name, _ in changes])
    DISK.rmtree(transaction)


def recover(folder: Path) -> Optional[str]:
    """Finish or undo a run that was killed, from what its transaction folder holds; says what it did."""
    transaction = folder / TRANSACTION
    if not os.path.lexists(transaction):
        return None
    if (transaction / COMMITTED).exists():
        operation = json.loads(DISK.read(transaction / COMMITTED))["operation"]
        DISK.rmtree(transaction)
        return f"an interrupted {operation} had completed: removed its leftover {TRANSACTION}/"
    if (transaction / JOURNAL).exists():
        operation = json.loads(DISK.read(transaction / JOURNAL))["operation"]
        _undo(folder)
        return f"undid an interrupted {operation} from its journal: the folder is as it was before it"
    DISK.rmtree(transaction)
    return f"removed the staged files of an interrupted run ({TRANSACTION}/), which had changed nothing"


def finish_interrupted_run(folder: Path) -> None:
    """Run at the start of every command of the fork's tools (not a dry run): says what it found and did."""
    try:
        note = recover(folder)
    except OSError as error:
        raise Failed(f"an interrupted run left {folder / TRANSACTION}, and finishing it failed "
                     f"({_describe(error)}); fix that and run again") from None
    if note:
        print(f"note: {note}")


def exit_code(command_line: Callable[[], int]) -> int:
    """Run a tool's command; what a user can cause ends in a message, not a traceback: 2 refused, 1 failed with the
    folder unchanged (or, for Ctrl-C, unchanged unless the change had completed)."""
    try:
        return command_line()
    except Refused as error:
        print(f"refused: {error}", file=sys.stderr)
        return 2
    except Failed as error:
        print(f"error: {error}", file=sys.stderr)
        return 1
    except OSError as error:  # reading the folder (permissions, a vanished file): nothing was changed yet
        print(f"error: {_describe(error)}; nothing was changed.", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("error: interrupted; a change that had not completed was undone (install_into_checkpoint.py --status "
              "says what the folder holds)", file=sys.stderr)
        return 1


def _describe(error: BaseException) -> str:
    if isinstance(error, OSError) and error.strerror:
        where = f" ({error.filename})" if error.filename else ""
        return f"{error.strerror}{where}"
    return str(error) or type(error).__name__


def command(script: str, *args) -> str:
    """How to run a tool again, e.g. to undo what it did: its path relative to the working folder when it is below."""
    path = Path(script).resolve()
    try:
        path = path.relative_to(Path.cwd())
    except ValueError:
        pass
    return " ".join(["python", str(path), *map(str, args)])


def report(headline: str, lines: Iterable[str], warning: Optional[str] = None) -> None:
    print(f"{headline}:")
    for line in lines:
        print(f"  {line}")
    if warning:
        print(f"warning: {warning}")


def check_target_folder(folder: Path) -> None:
    """Refused unless `folder` is an existing folder, and not a checkout of this repository (whose own code the
    installer would otherwise move aside)."""
    if not folder.exists():
        raise Refused(f"{folder} does not exist: give the folder of a downloaded checkpoint")
    if not folder.is_dir():
        raise Refused(f"{folder} is a file: give the folder of a downloaded checkpoint")
    if folder.resolve() == REPO or (folder / "tools" / "install_into_checkpoint.py").is_file():
        raise Refused(f"{folder} is a checkout of this repository, not a downloaded checkpoint: give the folder "
                      "that holds the checkpoint's config.json and weights")


# ---------------------------------------------------------------------------------------------------------------------
# The manifest and the originals: what the fork wrote, and what was there before
# ---------------------------------------------------------------------------------------------------------------------

@functools.lru_cache(maxsize=None)
def fork_version() -> str:
    """This checkout's release (the newest in CHANGELOG.md) and git commit when it is a git checkout."""
    version = "unknown"
    changelog = REPO / "CHANGELOG.md"
    if changelog.exists():
        found = re.search(r"^## \[(\d[^\]]*)\]", changelog.read_text(encoding="utf-8"), re.MULTILINE)
        version = found.group(1) if found else version
    try:
        commit = subprocess.run(["git", "-C", str(REPO), "rev-parse", "--short=12", "HEAD"], capture_output=True,
                                text=True, timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        commit = ""
    return f"{version} (commit {commit})" if commit else version


def read_manifest(folder: Path) -> dict:
    path = folder / MANIFEST
    if not os.path.lexists(path):
        if os.path.lexists(folder / ORIGINALS):
            raise Refused(f"{folder / ORIGINALS} exists but {MANIFEST} is missing, so nothing says what it holds. "
                          f"Put the manifest back, or restore the files of {ORIGINALS}/ by hand and delete it.")
        return {"format": MANIFEST_FORMAT, "files": {}}
    try:
        manifest = json.loads(DISK.read(path))
        if manifest.get("format") != MANIFEST_FORMAT or not isinstance(manifest.get("files"), dict):
            raise ValueError(f"expected format {MANIFEST_FORMAT} with a 'files' table")
        for name, record in manifest["files"].items():
            if not RECORD_KEYS <= set(record) or record["original"].get("kind") not in ORIGINAL_KINDS:
                raise ValueError(f"the record of {name} lacks {', '.join(sorted(RECORD_KEYS))} or original.kind")
    except (ValueError, AttributeError, TypeError) as error:
        raise Refused(f"{path} is damaged ({error}): it records what the fork's tools changed here. Restore it "
                      "from a copy, or delete it together with the files it lists to start over.") from None
    return manifest


def original_record(found: Found, name: str) -> dict:
    if found.kind == "absent":
        return {"kind": "absent"}
    if found.kind == "file":
        return {"kind": "file", "sha256": sha256(found.data), "mode": found.mode}
    if found.kind == "link":
        digest = sha256(found.data) if found.data is not None else None
        return {"kind": "link", "target": found.target, "sha256": digest}
    raise Refused(f"{name} is a {found.kind}, not a file: move it away and run again")


def _check_unchanged(path: Path, found: Found, record: dict, force: bool) -> None:
    if force or (found.kind == "file" and sha256(found.data) == record["sha256"]):
        return
    raise Refused(f"{path} was changed since the fork's tools wrote it (it is not the file the manifest records). "
                  "Keep a copy of it if you need it, then run again with --force to replace it.")


def _restored_entry(folder: Path, name: str, original: dict) -> Tuple[Entry, str]:
    """The original as it was: the same link when it still leads to the same bytes, else the saved copy."""
    if original["kind"] == "absent":
        return ABSENT, "removed (the fork added it)"
    if original["kind"] == "link":
        link = Entry("link", target=original["target"])
        if original["sha256"] is None:
            return link, f"restored as the link to {original['target']} (which led nowhere before too)"
        target = folder / original["target"]  # relative to the folder the link is in; pathlib keeps absolute ones
        if target.is_file() and sha256(DISK.read(target)) == original["sha256"]:
            return link, f"restored as the link to {original['target']}"
    copy = look(folder / ORIGINALS / name)
    if copy.kind != "file" or sha256(copy.data) != original["sha256"]:
        raise Refused(f"{folder / ORIGINALS / name} is missing or differs from the original the manifest records: "
                      "the original cannot be restored from it")
    note = " (the file its link led to is gone or changed: restored as a regular file)" \
        if original["kind"] == "link" else ""
    return Entry("file", copy.data, original.get("mode", copy.mode), copy.mtime_ns), "restored" + note


@dataclass
class Plan:
    """The changes to make, and one line per name for the user."""

    changes: List[Tuple[str, Entry]] = field(default_factory=list)
    lines: List[str] = field(default_factory=list)


def plan_update(folder: Path, writes: Dict[str, bytes], restores: Iterable[str], tool: str,
                force: bool = False) -> Plan:
    """The transaction that writes `writes` (name -> bytes) and puts back the originals of `restores`, keeping the
    manifest and the originals' copies in step."""
    manifest = read_manifest(folder)
    files = dict(manifest["files"])
    plan = Plan()
    new_copies, dropped_copies = {}, []
    version = fork_version()
    for name, data in writes.items():
        record, found = files.get(name), look(folder / name)
        if record is not None:
            _check_unchanged(folder / name, found, record, force)
            current = sha256(found.data) if found.kind == "file" else None
            if record["sha256"] == sha256(data) == current:
                plan.lines.append(f"{name}: unchanged")
                continue
            original, what = record["original"], "updated"
        else:
            original = original_record(found, name)
            if found.data is not None:
                new_copies[name] = Entry("file", found.data, found.mode, found.mtime_ns)
                what = f"replaced (the original is kept in {ORIGINALS}/)"
            else:
                what = "added" if found.kind == "absent" else f"replaced the link to {found.target} (led nowhere)"
        plan.changes.append((name, Entry("file", data, mode=0o644)))
        plan.lines.append(f"{name}: {what}")
        files[name] = {"sha256": sha256(data), "size": len(data), "tool": tool, "version": version,
                       "original": original}
    for name in restores:
        record = files.pop(name)
        _check_unchanged(folder / name, look(folder / name), record, force)
        entry, what = _restored_entry(folder, name, record["original"])
        plan.changes.append((name, entry))
        plan.lines.append(f"{name}: {what}")
        if os.path.lexists(folder / ORIGINALS / name):
            dropped_copies.append(name)
    if not plan.changes:
        return plan
    plan.changes += _originals_changes(folder, new_copies, dropped_copies, keep=bool(files))
    manifest_entry = ABSENT if not files else Entry(
        "file", json.dumps({**manifest, "files": files}, indent=2, ensure_ascii=False).encode() + b"\n")
    if manifest_entry.exists or os.path.lexists(folder / MANIFEST):
        plan.changes.append((MANIFEST, manifest_entry))
    return plan


def _originals_changes(folder: Path, added: Dict[str, Entry], dropped: List[str], keep: bool):
    exists = os.path.lexists(folder / ORIGINALS)
    if not keep:
        return [(ORIGINALS, ABSENT)] if exists else []
    if not exists:
        return [(ORIGINALS, Entry("dir", children=tuple(added.items())))] if added else []
    return ([(f"{ORIGINALS}/{name}", entry) for name, entry in added.items()]
            + [(f"{ORIGINALS}/{name}", ABSENT) for name in dropped])


def run_plan(folder: Path, operation: str, plan: Plan) -> Optional[str]:
    """Apply a plan, turning what a user can cause (disk full, permissions) into Failed with the folder unchanged."""
    try:
        return apply_changes(folder, operation, plan.changes)
    except OSError as error:
        reason = "the disk is full" if error.errno == errno.ENOSPC else _describe(error)
        raise Failed(f"{operation} failed: {reason}. Nothing was changed in {folder}.") from None
