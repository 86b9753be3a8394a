"""Fault injection for the tools that write into checkpoint folders (the DISK seam of
tools/chatglm_tools/folder_transaction.py), the folders they are tried on, and an exact picture of a folder to compare
before and after.

Imported by tests/test_tools.py and tests/test_fast_tokenizer.py, and run as a script in a child process:

    python tests/tool_faults.py kill STEP -- TOOL_ARGS...    # run the installer, SIGKILL itself at step STEP
    python tests/tool_faults.py tmpfs MOUNTPOINT FREE_BYTES  # inside a private tmpfs: fill it, install, report JSON

Only the standard library and tools/ are imported, so a child starts in a fraction of a second.
"""
import errno
import hashlib
import json
import os
import signal
import stat
import struct
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tools"))
import install_into_checkpoint  # noqa: E402
from chatglm_tools import folder_transaction  # noqa: E402
from chatglm_tools.folder_transaction import TRANSACTION, Disk  # noqa: E402


# ---------------------------------------------------------------------------------------------------------------------
# What a folder holds, exactly
# ---------------------------------------------------------------------------------------------------------------------

def folder_state(root: Path, times: bool = True, skip=(TRANSACTION,)) -> dict:
    """relative path -> ("dir",) | ("link", target) | ("file", sha256, mode[, mtime_ns]), without following links."""
    state = {}
    for directory, subdirs, files in os.walk(root):
        subdirs[:] = sorted(d for d in subdirs if d not in skip)
        for name in subdirs + sorted(files):
            path = Path(directory) / name
            relative = str(path.relative_to(root))
            info = os.lstat(path)
            if stat.S_ISLNK(info.st_mode):
                state[relative] = ("link", os.readlink(path))
            elif stat.S_ISDIR(info.st_mode):
                state[relative] = ("dir",)
            else:
                digest = hashlib.sha256(path.read_bytes()).hexdigest()
                state[relative] = ("file", digest, stat.S_IMODE(info.st_mode)) + ((info.st_mtime_ns,) if times else ())
    return state


def dangling_links(root: Path) -> list:
    return [str(path) for path in Path(root).rglob("*") if path.is_symlink() and not path.exists()]


# ---------------------------------------------------------------------------------------------------------------------
# Folders to install into
# ---------------------------------------------------------------------------------------------------------------------

ORIGINAL_CODE = {name: f"# the checkpoint's own {name}\n" * 40 for name in
                 ("configuration_chatglm.py", "modeling_chatglm.py", "tokenization_chatglm.py", "quantization.py")}


def tiny_safetensors(keys) -> bytes:
    """A valid .safetensors file holding one float32 per key (enough for the installer's family check)."""
    header = {key: {"dtype": "F32", "shape": [1], "data_offsets": [4 * i, 4 * i + 4]} for i, key in enumerate(keys)}
    encoded = json.dumps(header).encode()
    return struct.pack("<Q", len(encoded)) + encoded + b"\0" * (4 * len(header))


def checkpoint_files(config_path: Path) -> dict:
    """name -> bytes of a small GLM-4 checkpoint as downloaded: config, weights, the original code files."""
    files = {"config.json": config_path.read_bytes(),
             "model.safetensors": tiny_safetensors([install_into_checkpoint.FAMILY_KEY, "transformer.output_layer"])}
    files.update({name: text.encode() for name, text in ORIGINAL_CODE.items()})
    return files


def write_checkpoint(folder: Path, files: dict) -> Path:
    folder.mkdir(parents=True)
    for name, data in files.items():
        (folder / name).write_bytes(data)
    return folder


def hub_cache(root: Path, files: dict, repo_id="THUDM/glm-4-9b-chat") -> dict:
    """A Hugging Face cache as huggingface_hub lays it out: blobs named by their sha256, two snapshots whose files
    are relative links to them. Revision "b" shares every blob of "a" except tokenization_chatglm.py's."""
    cache = root / ("models--" + repo_id.replace("/", "--"))
    blobs = cache / "blobs"
    blobs.mkdir(parents=True)
    revisions = {"a" * 40: files, "b" * 40: {**files, "tokenization_chatglm.py": b"# revision b's own tokenizer\n"}}
    for revision, contents in revisions.items():
        snapshot = cache / "snapshots" / revision
        snapshot.mkdir(parents=True)
        for name, data in contents.items():
            blob = blobs / hashlib.sha256(data).hexdigest()
            if not blob.exists():
                blob.write_bytes(data)
                blob.chmod(0o444)
            os.symlink(f"../../blobs/{blob.name}", snapshot / name)
    (cache / "refs").mkdir()
    (cache / "refs" / "main").write_text("a" * 40)
    return {"cache": cache, "a": cache / "snapshots" / ("a" * 40), "b": cache / "snapshots" / ("b" * 40)}


# ---------------------------------------------------------------------------------------------------------------------
# Faults
# ---------------------------------------------------------------------------------------------------------------------

class FaultyDisk(Disk):
    """The real file system, with one fault: at step `fail_at` raise `error` (default: permission denied on the
    step's path), or once `space` bytes are written raise ENOSPC (after writing what fits), or at step `kill_at`
    SIGKILL the process (halfway through the bytes when the step is a write). `steps` records (method, argument)
    of every step, faulty or not."""

    def __init__(self, fail_at=None, error=None, space=None, kill_at=None):
        self.fail_at, self.error, self.space, self.kill_at = fail_at, error, space, kill_at
        self.steps, self.written = [], 0

    def _step(self, method, argument):
        index = len(self.steps)
        self.steps.append((method, str(argument)))
        if index == self.kill_at and method != "write":
            os.kill(os.getpid(), signal.SIGKILL)
        if index == self.fail_at:
            raise self.error or PermissionError(errno.EACCES, os.strerror(errno.EACCES), str(argument))
        return index

    def write(self, fd, data):
        index = self._step("write", len(data))
        if index == self.kill_at:
            os.write(fd, data[:len(data) // 2])
            os.kill(os.getpid(), signal.SIGKILL)
        if self.space is not None and self.written + len(data) > self.space:
            fits = max(self.space - self.written, 0)
            self.written += os.write(fd, data[:fits]) if fits else 0
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        written = super().write(fd, data)
        self.written += written
        return written


def _wrap(name):
    def method(self, *args, **kwargs):
        self._step(name, args[0] if args else "")
        return getattr(Disk, name)(self, *args, **kwargs)

    method.__name__ = name
    return method


def _count_only(name):
    def method(self, *args, **kwargs):
        self._step(name, args[0] if args else "")

    method.__name__ = name
    return method


for _name in ("read", "create", "chmod", "set_mtime", "mkdir", "symlink", "rename", "rmtree"):
    setattr(FaultyDisk, _name, _wrap(_name))
# Flushing to the platters only matters on power loss, which no test simulates: counted as steps, not done (a sweep
# over every step would otherwise spend its time in fsync).
for _name in ("fsync", "sync_dir"):
    setattr(FaultyDisk, _name, _count_only(_name))


def run_tool(main, args, disk=None):
    """main(args) in this process, with `disk` as the file system: (exit code, stdout, stderr)."""
    import contextlib
    import io

    saved = folder_transaction.DISK
    folder_transaction.DISK = disk or Disk()
    out, err = io.StringIO(), io.StringIO()
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            code = main([str(arg) for arg in args])
    finally:
        folder_transaction.DISK = saved
    return code, out.getvalue(), err.getvalue()


def byte_budgets(steps) -> list:
    """Byte counts at which to run out of space: none at all, and halfway through each write of a clean run."""
    budgets, total = {0}, 0
    for method, argument in steps:
        if method == "write":
            budgets.add(total + int(argument) // 2)
            total += int(argument)
    return sorted(budgets)


# ---------------------------------------------------------------------------------------------------------------------
# Child-process entry points
# ---------------------------------------------------------------------------------------------------------------------

def _kill(step: int, tool_args: list) -> int:
    folder_transaction.DISK = FaultyDisk(kill_at=step)
    return install_into_checkpoint.main(tool_args)


def _tmpfs(mountpoint: Path, free_bytes: int, config_path: Path) -> int:
    """Fill a tmpfs but `free_bytes`, try an install, print what happened as JSON."""
    folder = write_checkpoint(mountpoint / "checkpoint", checkpoint_files(config_path))
    filler = mountpoint / "filler"
    fd = os.open(filler, os.O_WRONLY | os.O_CREAT)
    try:
        while os.write(fd, b"\0" * 4096):
            pass
    except OSError as error:
        assert error.errno == errno.ENOSPC, error
    finally:
        os.close(fd)
    os.truncate(filler, max(filler.stat().st_size - free_bytes, 0))
    before = folder_state(folder)
    code, out, err = run_tool(install_into_checkpoint.main, [folder])
    print(json.dumps({"code": code, "stdout": out, "stderr": err, "before": before, "after": folder_state(folder),
                      "leftover": os.path.lexists(folder / TRANSACTION)}))
    return 0


if __name__ == "__main__":
    if sys.argv[1] == "kill":
        sys.exit(_kill(int(sys.argv[2]), sys.argv[4:]))
    if sys.argv[1] == "tmpfs":
        sys.exit(_tmpfs(Path(sys.argv[2]), int(sys.argv[3]), Path(sys.argv[4])))
    raise SystemExit(f"unknown mode {sys.argv[1]!r}")
