"""User tools, the demo and the model benchmark, run as a user runs them; the installer also with faults injected
(tests/tool_faults.py).

Every installer test compares the folder's exact state (each entry's kind, bytes, mode, modification time, link
target) with the state before, or with the result of a run without faults.
"""
import itertools
import json
import os
import re
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import CODE_FILES, REPO, TRANSFORMERS, load_causal_lm, shared_path
from packaging.version import Version

import install_into_checkpoint as installer
from chatglm_tools import repository_module
from chatglm_tools.folder_transaction import JOURNAL, MANIFEST, ORIGINALS, TRANSACTION, fork_version
from tool_faults import (
    ORIGINAL_CODE, FaultyDisk, byte_budgets, checkpoint_files, dangling_links, folder_state, hub_cache, run_tool,
    tiny_safetensors, write_checkpoint,
)

INSTALL = [sys.executable, str(REPO / "tools" / "install_into_checkpoint.py")]
FAULTS = [sys.executable, str(REPO / "tests" / "tool_faults.py")]
ORIGINAL_NAMES = [name for name in CODE_FILES if name in ORIGINAL_CODE]  # the code files a checkpoint ships


def install_cli(*args):
    return subprocess.run(INSTALL + [str(arg) for arg in args], capture_output=True, text=True, timeout=300)


def tool(args, disk=None):
    return run_tool(installer.main, args, disk)


def folder_state_of(state):
    """A state without modification times (as folder_state(..., times=False) returns it)."""
    return {name: entry[:3] if entry[0] == "file" else entry for name, entry in state.items()}


def no_traceback(*outputs):
    return all("Traceback" not in output for output in outputs)


@pytest.fixture(scope="module")
def checkpoint_bytes():
    return checkpoint_files(shared_path("golden", "glm4-chat-tiny", "checkpoint", "config.json"))


@pytest.fixture
def new_checkpoint(tmp_path, checkpoint_bytes):
    """new_checkpoint() -> a fresh folder of a small GLM-4 checkpoint with its original code files."""
    counter = itertools.count()
    return lambda: write_checkpoint(tmp_path / f"checkpoint{next(counter)}", checkpoint_bytes)


def assert_installed(folder, originals: dict):
    """The fork's code files are in the folder as real files, and each replaced original is kept, byte for byte."""
    for name in CODE_FILES:
        assert not (folder / name).is_symlink() and (folder / name).read_bytes() == (REPO / name).read_bytes(), name
    kept = folder / ORIGINALS
    assert {path.name: path.read_bytes() for path in kept.iterdir()} == originals
    assert not any(path.is_symlink() for path in kept.iterdir())
    manifest = json.loads((folder / MANIFEST).read_text())
    assert sorted(manifest["files"]) == sorted(CODE_FILES)


# ---------------------------------------------------------------------------------------------------------------------
# Install, update, revert, as a user runs them
# ---------------------------------------------------------------------------------------------------------------------

def test_install_keeps_the_originals_loads_the_golden_checkpoint_and_reverts_byte_for_byte(tmp_path):
    folder = tmp_path / "downloaded_glm4"
    shutil.copytree(shared_path("golden", "glm4-chat-tiny", "checkpoint"), folder)
    for path in folder.iterdir():
        path.chmod(0o644)
    for name in ORIGINAL_NAMES:
        (folder / name).write_text(ORIGINAL_CODE[name])
    start = folder_state(folder)

    result = install_cli(folder)
    assert result.returncode == 0, result.stderr
    assert f"--revert {folder}" in result.stdout and fork_version() in result.stdout
    assert_installed(folder, {name: ORIGINAL_CODE[name].encode() for name in ORIGINAL_NAMES})
    from safetensors.torch import load_file

    expected = load_file(str(shared_path("golden", "glm4-chat-tiny", "expected.safetensors")))
    model = load_causal_lm(folder, attn_implementation="eager")
    with torch.no_grad():
        logits = model(input_ids=expected["seq_0_input_ids"][None]).logits[0]
    torch.testing.assert_close(logits, expected["seq_0_logits"], atol=1e-4, rtol=1e-4)

    result = install_cli("--revert", folder)
    assert result.returncode == 0, result.stderr
    assert folder_state(folder) == start


def test_install_into_a_glm4v_checkpoint_replaces_its_visual_py(tmp_path):
    """glm-4v-9b ships a visual.py of its own: it is kept like the other original files, and ours loads."""
    folder = tmp_path / "downloaded_glm4v"
    shutil.copytree(shared_path("golden", "glm4v-tiny-text", "checkpoint"), folder)
    for path in folder.iterdir():
        path.chmod(0o644)
    originals = {name: f"# the original {name}\n".encode() for name in (*ORIGINAL_NAMES, "visual.py")}
    for name, code in originals.items():
        (folder / name).write_bytes(code)
    result = install_cli(folder)
    assert result.returncode == 0, result.stderr
    assert_installed(folder, originals)
    from safetensors.torch import load_file

    expected = load_file(str(shared_path("golden", "glm4v-tiny-text", "expected.safetensors")))
    model = load_causal_lm(folder, attn_implementation="eager")
    with torch.no_grad():
        logits = model(input_ids=expected["input_ids"][None]).logits[0]
    torch.testing.assert_close(logits, expected["logits"], atol=1e-4, rtol=1e-4)


def test_install_into_an_int4_checkpoint_completes_its_auto_map_and_reverts_byte_for_byte(tmp_path):
    """chatglm2-6b-int4's config.json maps AutoModel only: after the install AutoModelForCausalLM loads it with the
    original's logits; a second install changes nothing; --revert gives the folder back as downloaded."""
    folder = tmp_path / "downloaded_int4"
    shutil.copytree(shared_path("golden", "chatglm2-int4-tiny", "checkpoint"), folder)
    for path in folder.iterdir():
        path.chmod(0o644)
    original_config = json.loads((folder / "config.json").read_text())
    start = folder_state(folder)
    result = install_cli(folder)
    assert result.returncode == 0, result.stderr
    config = json.loads((folder / "config.json").read_text())
    ours = json.loads((REPO / "config.json").read_text())["auto_map"]
    assert config["auto_map"] == {**original_config["auto_map"], **{k: v for k, v in ours.items()
                                                                     if k not in original_config["auto_map"]}}
    assert {k: v for k, v in config.items() if k != "auto_map"} == {k: v for k, v in original_config.items()
                                                                   if k != "auto_map"}
    from safetensors.torch import load_file

    expected = load_file(str(shared_path("golden", "chatglm2-int4-tiny", "expected.safetensors")))
    model = load_causal_lm(folder)
    with torch.no_grad():
        logits = model(input_ids=expected["input_ids_0"][None]).logits[0]
    torch.testing.assert_close(logits, expected["logits_0"], atol=1e-4, rtol=1e-4)
    installed = folder_state_of(folder_state(folder, times=False))
    again = install_cli(folder)
    assert again.returncode == 0 and "nothing changed" in again.stdout, again.stdout + again.stderr
    assert folder_state_of(folder_state(folder, times=False)) == installed
    result = install_cli("--revert", folder)
    assert result.returncode == 0, result.stderr
    assert folder_state(folder) == start


def test_hub_cache_snapshot_survives_install_install_revert_and_shares_nothing(tmp_path, checkpoint_bytes):
    """huggingface_hub's layout: snapshot files are relative links into ../../blobs/, shared between revisions."""
    layout = hub_cache(tmp_path, checkpoint_bytes)
    cache, snapshot = layout["cache"], layout["a"]
    start, blobs, other_revision = folder_state(cache), folder_state(cache / "blobs"), folder_state(layout["b"])

    result = install_cli(snapshot)
    assert result.returncode == 0, result.stderr
    assert_installed(snapshot, {name: checkpoint_bytes[name] for name in ORIGINAL_NAMES})
    assert folder_state(cache / "blobs") == blobs and folder_state(layout["b"]) == other_revision
    assert not dangling_links(cache)
    for name in set(checkpoint_bytes) - set(CODE_FILES):  # config, weights, quantization.py: the same links
        assert os.readlink(snapshot / name) == start[f"snapshots/{snapshot.name}/{name}"][1]
    installed = folder_state(cache)

    again = install_cli(snapshot)
    assert again.returncode == 0, again.stderr
    assert "already installed" in again.stdout and fork_version() in again.stdout
    assert folder_state(cache) == installed

    status = install_cli("--status", snapshot)
    assert status.returncode == 0 and "as written" in status.stdout and "a link to ../../blobs/" in status.stdout

    reverted = install_cli("--revert", snapshot)
    assert reverted.returncode == 0, reverted.stderr
    assert folder_state(cache) == start


def test_a_companion_file_added_to_the_code_files_later_is_installed_and_reverted(new_checkpoint, tmp_path):
    """An update whose CODE_FILES gained a file (the checkpoint ships its own: its original is kept) and lost one
    (added by the earlier install: removed again)."""
    folder = new_checkpoint()
    (folder / "future_companion.py").write_text("# the checkpoint's own future_companion.py\n")
    start = folder_state(folder)
    earlier = tmp_path / "earlier_checkout"
    earlier.mkdir()
    for name in CODE_FILES:
        shutil.copy(REPO / name, earlier / name)
    (earlier / "dropped_companion.py").write_text("# a companion this checkout no longer has\n")
    code, out, err = run_tool(lambda args: installer.install(folder, source=earlier,
                                                             names=CODE_FILES + ("dropped_companion.py",)), [])
    assert code == 0 and (folder / "dropped_companion.py").exists()

    later = tmp_path / "later_checkout"
    shutil.copytree(earlier, later)
    (later / "dropped_companion.py").unlink()
    (later / "future_companion.py").write_text("# the fork's new companion\n")
    code, out, err = run_tool(
        lambda args: installer.install(folder, source=later, names=CODE_FILES + ("future_companion.py",)), [])
    assert code == 0, err
    assert "dropped_companion.py: removed" in out and "future_companion.py: replaced" in out
    assert not (folder / "dropped_companion.py").exists()
    assert (folder / "future_companion.py").read_text() == "# the fork's new companion\n"
    assert (folder / ORIGINALS / "future_companion.py").read_text() == "# the checkpoint's own future_companion.py\n"

    code, out, err = tool(["--revert", folder])
    assert code == 0, err
    assert folder_state(folder) == start


def test_files_changed_by_hand_are_not_overwritten_without_force(new_checkpoint):
    folder = new_checkpoint()
    start = folder_state(folder)
    assert tool([folder])[0] == 0
    installed = folder_state(folder, times=False)
    (folder / "modeling_chatglm.py").write_text("# my own edits\n")
    edited = folder_state(folder)
    for args in ([folder], ["--revert", folder]):
        code, out, err = tool(args)
        assert code == 2 and "--force" in err and "modeling_chatglm.py" in err and no_traceback(out, err)
        assert folder_state(folder) == edited
    code, out, err = tool(["--force", folder])
    assert code == 0 and "modeling_chatglm.py: updated" in out, err
    assert folder_state(folder, times=False) == installed
    (folder / "modeling_chatglm.py").write_text("# my own edits again\n")
    code, out, err = tool(["--revert", "--force", folder])
    assert code == 0, err
    assert folder_state(folder) == start


def test_status_says_what_is_installed(new_checkpoint):
    folder = new_checkpoint()
    code, out, _ = tool(["--status", folder])
    assert code == 0 and "not installed" in out
    tool([folder])
    code, out, _ = tool(["--status", folder])
    assert code == 0 and out.count("as written") == len(CODE_FILES) and fork_version() in out
    assert "before: nothing (added)" in out and f"before: a file (copy in {ORIGINALS}/)" in out


def refusal_cases(folder):
    """name -> (edit the checkpoint folder, what the message must say); the edit may return other arguments."""

    def write(name, text):
        return lambda: (folder / name).write_text(text)

    def edit_config(**changes):
        config = json.loads((folder / "config.json").read_text())
        return write("config.json", json.dumps({**config, **changes}))

    return {
        "missing path": (lambda: [folder / "nowhere"], "does not exist"),
        "a file": (lambda: [folder / "config.json"], "is a file"),
        "no config": (lambda: (folder / "config.json").unlink(), "has no config.json"),
        "config not JSON": (write("config.json", "{'model_type': chatglm"), "not valid JSON"),
        "config a list": (write("config.json", "[1, 2]"), "not an object"),
        "native GLM": (edit_config(model_type="glm"), "without trust_remote_code"),
        "llama": (edit_config(model_type="llama"), "not ChatGLM2/3 or GLM-4"),
        "first generation config": (edit_config(position_encoding_2d=True), "first-generation ChatGLM-6B"),
        "first generation weights": (lambda: (folder / "model.safetensors").write_bytes(
            tiny_safetensors([installer.FIRST_GENERATION_KEY])), "first-generation"),
        "damaged weights": (write("model.safetensors", "<html>404</html>"), "not a safetensors file"),
        "damaged index": (write("model.safetensors.index.json", '{"weight_map": '), "not valid JSON"),
        "index without map": (write("model.safetensors.index.json", '{"metadata": {}}'), "no 'weight_map'"),
        "damaged manifest": (write(MANIFEST, "{}"), "is damaged"),
        "originals without manifest": (lambda: (folder / ORIGINALS).mkdir(), f"{MANIFEST} is missing"),
        "earlier tool's backup": (lambda: (folder / "original_code_backup_20250101T000000Z").mkdir(),
                                  "earlier version of this tool"),
    }


@pytest.mark.parametrize("case", list(refusal_cases(REPO)))
def test_refusals_exit_2_with_a_message_and_change_nothing(new_checkpoint, case):
    folder = new_checkpoint()
    edit, message = refusal_cases(folder)[case]
    args = edit()
    args = args if isinstance(args, list) else [folder]
    before = folder_state(folder)
    code, out, err = tool(args)
    assert code == 2 and err.startswith("refused:") and message in err and no_traceback(out, err), (out, err)
    assert folder_state(folder) == before


def test_refuses_to_install_into_this_repository():
    before = {name: (REPO / name).read_bytes() for name in CODE_FILES if (REPO / name).exists()}
    result = install_cli(REPO)
    assert result.returncode == 2 and "checkout of this repository" in result.stderr
    assert no_traceback(result.stderr) and not (REPO / MANIFEST).exists() and not (REPO / ORIGINALS).exists()
    assert {name: (REPO / name).read_bytes() for name in before} == before


def test_another_run_on_the_same_folder_is_turned_away(new_checkpoint):
    fcntl = pytest.importorskip("fcntl", reason="advisory folder locks are POSIX-only")
    folder = new_checkpoint()
    before = folder_state(folder)
    fd = os.open(folder, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        code, out, err = tool([folder])
    finally:
        os.close(fd)
    assert code == 1 and "another run" in err and folder_state(folder) == before


# ---------------------------------------------------------------------------------------------------------------------
# Faults: a permission error at each step, a full disk after N bytes, an exception, SIGKILL, a real full tmpfs
# ---------------------------------------------------------------------------------------------------------------------

@pytest.fixture
def operation_folder(new_checkpoint, tmp_path):
    """operation_folder(name) -> (a folder ready for the operation, its arguments). "update" installs over an
    earlier install whose modeling file differs, which lacked parallel_chatglm.py and had a companion file since
    dropped."""
    earlier = tmp_path / "earlier_checkout"
    earlier.mkdir()
    for name in CODE_FILES:
        if name != "parallel_chatglm.py":
            shutil.copy(REPO / name, earlier / name)
    (earlier / "modeling_chatglm.py").write_text("# an earlier modeling file\n")
    (earlier / "dropped_companion.py").write_text("# dropped since\n")

    def prepare(operation):
        folder = new_checkpoint()
        if operation == "update":
            names = CODE_FILES + ("dropped_companion.py",)
            run_tool(lambda args: installer.install(folder, source=earlier, names=names), [], FaultyDisk())
        elif operation == "revert":
            run_tool(installer.main, [folder], FaultyDisk())
        return folder, ([folder, "--revert"] if operation == "revert" else [folder])

    return prepare


def clean_run(prepare, operation):
    """A run without faults: its steps, the index of its commit, and the folder it leaves."""
    folder, args = prepare(operation)
    disk = FaultyDisk()
    code, out, err = tool(args, disk)
    assert code == 0, err
    commit = next(index for index, (method, argument) in enumerate(disk.steps)
                  if method == "rename" and argument.endswith(os.sep + JOURNAL))
    return disk.steps, commit, folder_state(folder, times=False)


OPERATIONS = ("install", "update", "revert")


@pytest.mark.parametrize("operation", OPERATIONS)
def test_a_permission_error_at_any_step_leaves_the_folder_as_it_was(operation_folder, operation):
    steps, commit, result = clean_run(operation_folder, operation)
    assert len(steps) > 20  # reads, staging, journal, renames, clean-up
    for step in range(len(steps)):
        folder, args = operation_folder(operation)
        before = folder_state(folder)
        code, out, err = tool(args, FaultyDisk(fail_at=step))
        where = (step, steps[step], out, err)
        if step <= commit:
            assert code == 1 and "Permission denied" in err and no_traceback(out, err), where
            assert folder_state(folder) == before and not os.path.lexists(folder / TRANSACTION), where
        else:  # after the commit only the clean-up failed: done, and the next run removes the leftover
            assert code == 0 and "warning:" in out, where
            assert folder_state(folder, times=False) == result, where
            assert tool(["--status", folder])[0] == 0 and not os.path.lexists(folder / TRANSACTION)
            assert folder_state(folder, times=False) == result, where


@pytest.mark.parametrize("operation", OPERATIONS)
def test_a_full_disk_after_any_number_of_bytes_leaves_the_folder_as_it_was(operation_folder, operation):
    steps, _, _ = clean_run(operation_folder, operation)
    budgets = byte_budgets(steps)
    assert len(budgets) > 3
    for budget in budgets:
        folder, args = operation_folder(operation)
        before = folder_state(folder)
        code, out, err = tool(args, FaultyDisk(space=budget))
        assert code == 1 and "the disk is full" in err and no_traceback(out, err), (budget, err)
        assert folder_state(folder) == before and not os.path.lexists(folder / TRANSACTION), budget


def test_an_exception_or_ctrl_c_in_the_middle_of_the_renames_leaves_the_folder_as_it_was(operation_folder):
    """A bug surfaces as its traceback, Ctrl-C as a message; either way every entry is moved back first."""
    steps, commit, _ = clean_run(operation_folder, "install")
    folder, args = operation_folder("install")
    before = folder_state(folder)
    with pytest.raises(RuntimeError, match="a bug"):
        tool(args, FaultyDisk(fail_at=commit - 3, error=RuntimeError("a bug")))
    assert folder_state(folder) == before and not os.path.lexists(folder / TRANSACTION)
    code, out, err = tool(args, FaultyDisk(fail_at=commit - 3, error=KeyboardInterrupt()))
    assert code == 1 and "interrupted" in err and no_traceback(out, err)
    assert folder_state(folder) == before and not os.path.lexists(folder / TRANSACTION)


def killed_at(step, args):
    result = subprocess.run(FAULTS + ["kill", str(step), "--"] + [str(arg) for arg in args], capture_output=True,
                            text=True, timeout=120)
    assert result.returncode == -signal.SIGKILL, (step, result.stdout, result.stderr)


def kill_points(steps, commit):
    """A write halfway, an original moved aside but the new file not yet in, the commit, the clean-up."""
    biggest_write = max((index for index, (method, _) in enumerate(steps) if method == "write"),
                        key=lambda index: int(steps[index][1]))
    journal_written = next(index for index in range(commit, 0, -1) if steps[index][0] == "sync_dir"
                           and steps[index][1].endswith(TRANSACTION))
    return {"mid-copy": biggest_write, "between renames": journal_written + 2, "commit": commit,
            "clean-up": commit + 1}


@pytest.mark.parametrize("recovery", [["--status"], [], ["--revert"]], ids=["status", "install", "revert"])
def test_sigkill_then_the_next_run_finishes_or_undoes_the_install(operation_folder, recovery):
    steps, commit, result = clean_run(operation_folder, "install")
    for point, step in kill_points(steps, commit).items():
        folder, args = operation_folder("install")
        start = folder_state(folder)
        killed_at(step, args)
        for name, entry in folder_state(folder, times=False).items():
            assert entry in (folder_state_of(start).get(name), result.get(name)), (point, name)
        code, out, err = tool([folder, *recovery])
        assert code == 0 and "note:" in out and not os.path.lexists(folder / TRANSACTION), (point, out, err)
        if recovery == ["--status"]:
            assert (folder_state(folder) == start) if step <= commit else \
                (folder_state(folder, times=False) == result), point
        elif recovery == []:
            assert folder_state(folder, times=False) == result, point
        else:
            assert folder_state(folder) == start, point


@pytest.mark.matrix_ends
@pytest.mark.parametrize("operation", OPERATIONS)
def test_sigkill_at_every_step_then_status_recovers(operation_folder, operation):
    steps, commit, result = clean_run(operation_folder, operation)
    for step in range(len(steps)):
        folder, args = operation_folder(operation)
        start = folder_state(folder)
        killed_at(step, args)
        for name, entry in folder_state(folder, times=False).items():
            assert entry in (folder_state_of(start).get(name), result.get(name)), (step, steps[step], name)
        code, out, err = tool([folder, "--status"])
        assert code == 0 and not os.path.lexists(folder / TRANSACTION), (step, out, err)
        if step <= commit:
            assert folder_state(folder) == start, (step, steps[step])
        else:
            assert folder_state(folder, times=False) == result, (step, steps[step])


def test_a_real_full_tmpfs_leaves_the_folder_as_it_was(tmp_path):
    """The in-process ENOSPC test above covers every byte count; this one fills a real 1 MiB tmpfs, mounted in a
    private mount namespace (as root, or as a user where user namespaces are allowed)."""
    if shutil.which("unshare") is None:
        pytest.skip("no `unshare` here to mount a private tmpfs; the in-process ENOSPC test covers this guarantee")
    mountpoint = tmp_path / "tmpfs"
    mountpoint.mkdir()
    prefix = ["unshare", "--mount"] if os.geteuid() == 0 else ["unshare", "--map-root-user", "--mount"]
    mount = f"mount -t tmpfs -o size=1m tmpfs {mountpoint}"
    probe = subprocess.run(prefix + ["sh", "-c", mount], capture_output=True, text=True)
    if probe.returncode != 0:
        pytest.skip(f"cannot mount a private tmpfs here ({probe.stderr.strip()}); the in-process ENOSPC test covers "
                    "this guarantee")
    config = shared_path("golden", "glm4-chat-tiny", "checkpoint", "config.json")
    run = subprocess.run(prefix + ["sh", "-c", f'{mount} && exec "$@"', "sh"] + FAULTS
                         + ["tmpfs", str(mountpoint), str(100_000), str(config)],
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    report = json.loads(run.stdout)
    assert report["code"] == 1 and "the disk is full" in report["stderr"], report["stderr"]
    assert report["after"] == report["before"] and not report["leftover"]


# ---------------------------------------------------------------------------------------------------------------------
# The demo and the GPU check
# ---------------------------------------------------------------------------------------------------------------------

DEMO = [sys.executable, str(REPO / "examples" / "demo.py")]
# What a first run prints, line by line: the set-up, what was loaded, the prompt, the answer, "demo: ok".
DEMO_LINES = [
    r"building a random-weight checkpoint: glm-4-9b-chat's config\.json with 2 layers of 128",
    r"loaded ChatGLMForConditionalGeneration \(39\.1M parameters\) with transformers \S+, torch \S+",
    r"prompt: 'Write one sentence about the sea\.' -> ids (?P<prompt>\[[\d, ]+\])",
    r"answer: '.*' <- ids (?P<answer>\[[\d, ]+\]) \(random weights: no meaning\)",
    r"demo: ok",
]


def left_behind(tmp_path) -> list:
    """What the demo left in its temporary folder (torch's own compile cache, torchinductor_<user>, is torch's)."""
    return sorted(path.name for path in (tmp_path / "tmp").iterdir() if not path.name.startswith("torchinductor_"))


def demo_environment(tmp_path) -> dict:
    """The test environment as a user's shell has it (transformers' remote-code cache not set: the demo makes its
    own), with a temporary folder of its own, so that anything left behind shows."""
    (tmp_path / "tmp").mkdir()
    env = {name: value for name, value in os.environ.items() if name != "HF_MODULES_CACHE"}
    return dict(env, HF_HUB_OFFLINE="1", TMPDIR=str(tmp_path / "tmp"))


def test_demo_prints_only_what_a_new_user_needs_and_leaves_nothing_behind(tmp_path):
    """It printed torchao's "Failed to load ... _C_mxfp8 ... .so" lines and two torch warnings (transformers 5 imports
    torchao whenever it is installed, as in this environment), transformers' "Both `max_new_tokens` (=24) and
    `max_length`(=128000) seem to have been set" (4.x: the checkpoint's temperature/top_p with greedy search), and
    left a chatglm-demo-modules-* folder in the temporary folder."""
    result = subprocess.run(DEMO + ["--max-new-tokens", "5"], capture_output=True, text=True,
                            env=demo_environment(tmp_path), timeout=600)
    output = (result.stdout + result.stderr).splitlines()
    assert result.returncode == 0, result.stderr[-2000:]
    assert len(output) == len(DEMO_LINES), "\n".join(output)
    matches = [re.fullmatch(pattern, line) for pattern, line in zip(DEMO_LINES, output)]
    assert all(matches), "\n".join(output)
    for line in output[:-2]:  # the answer line is random words, held to its form above
        assert not re.search(r"fail|warn|error|traceback", line, re.IGNORECASE), line
    # testdata/ holds GLM-4's tokenizer.model: chat template -> ids -> generate -> decode, end to end.
    prompt, answer = json.loads(matches[2]["prompt"]), json.loads(matches[3]["answer"])
    assert prompt[:3] == [151331, 151333, 151336] and prompt[-1] == 151337  # [gMASK]<sop><|user|> ... <|assistant|>
    assert len(answer) == 5
    assert left_behind(tmp_path) == []


@pytest.mark.matrix_ends  # the demo's own clean-up; every release runs the demo itself (the test above)
def test_demo_leaves_nothing_behind_when_it_fails_or_is_stopped(tmp_path):
    env = demo_environment(tmp_path)
    failed = subprocess.run(DEMO + ["--model", str(tmp_path / "no-such-checkpoint")], capture_output=True, text=True,
                            env=env, timeout=600)
    assert failed.returncode != 0 and "no-such-checkpoint" in failed.stderr
    assert left_behind(tmp_path) == []
    with subprocess.Popen(DEMO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env) as stopped:
        assert stopped.stdout.readline().startswith("building a random-weight checkpoint")
        stopped.terminate()  # SIGTERM, as a service manager or `timeout` stops it
        stopped.communicate(timeout=120)
    assert stopped.returncode != 0
    assert left_behind(tmp_path) == []


@pytest.mark.matrix_ends  # the script's own path; the versions between run what it calls (loading, device maps)
def test_gpu_check_script_runs_on_a_cpu_only_machine(tmp_path):
    """CI has no GPU: run the script's whole path with two 'devices' that are the CPU, so it cannot rot."""
    rows = tmp_path / "rows.json"
    result = subprocess.run(
        [sys.executable, str(REPO / "tools" / "gpu_check.py"), "--splits", "cpu,cpu", "--dtypes", "float32",
         "--attn", "sdpa", "--json", str(rows)],
        capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout + result.stderr[-2000:]
    data = json.loads(rows.read_text())
    assert [r["family"] for r in data] == ["glm4", "chatglm3"] and all(r["ok"] for r in data)


def test_int4_check_script_runs_on_a_cpu_only_machine(tmp_path):
    """tools/int4_check.py (in scripts/gpu_checks.sh) on the CPU's kernel: a layer whose rows fill the kernel's tiles
    holds one copy, one that does not keeps its codes beside; both read their codes back."""
    rows = tmp_path / "rows.json"
    result = subprocess.run([sys.executable, str(REPO / "tools" / "int4_check.py"), "--device", "cpu", "--shapes",
                             "256x128", "80x128", "--json", str(rows)], capture_output=True, text=True, timeout=600)
    if repository_module("quantization_chatglm").int4_kernel(torch.device("cpu")) is None:
        assert result.returncode == 1 and "| False |" in result.stdout  # nothing packed: the rows say so
        pytest.skip(f"torch {torch.__version__} has no int4 kernel for the CPU")
    assert result.returncode == 0, result.stdout + result.stderr[-2000:]
    filled, partial = json.loads(rows.read_text())
    assert filled["layout"] != "none" and filled["held / codes"] < 1.2 and filled["ok"]
    assert partial["layout"] == "none" and partial["held / codes"] > 1.9 and partial["ok"]


GPU_CHECK_ON_CPU = [sys.executable, str(REPO / "tools" / "gpu_check.py"), "--splits", "cpu,cpu", "--attn", "sdpa"]


@pytest.mark.matrix_ends
def test_gpu_check_leaves_nothing_behind_when_it_ends_fails_or_is_stopped(tmp_path):
    """Every run left its copy of the model code in a chatglm-gpu-check-* folder of the temporary folder."""
    env = dict(demo_environment(tmp_path), PYTHONUNBUFFERED="1")
    ended = subprocess.run(GPU_CHECK_ON_CPU + ["--dtypes", "float32"], capture_output=True, text=True, env=env,
                           timeout=600)
    assert ended.returncode == 0 and left_behind(tmp_path) == [], ended.stderr[-2000:]
    failed = subprocess.run(GPU_CHECK_ON_CPU + ["--dtypes", "no_such_dtype"], capture_output=True, text=True,
                            env=env, timeout=600)
    assert failed.returncode != 0 and "no_such_dtype" in failed.stderr
    assert left_behind(tmp_path) == []
    with subprocess.Popen(GPU_CHECK_ON_CPU + ["--dtypes", "float32"], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                          text=True, env=env) as stopped:
        assert stopped.stdout.readline().startswith("family")  # the table's header: the code is copied by then
        assert [name[:18] for name in left_behind(tmp_path)] == ["chatglm-gpu-check-"]
        stopped.terminate()  # SIGTERM, as a service manager or `timeout` stops it
        stopped.communicate(timeout=120)
    assert stopped.returncode != 0
    assert left_behind(tmp_path) == []


@pytest.mark.newest_end
@pytest.mark.matrix_ends
def test_cpu_matvec_kernels_benchmark_runs():
    """benchmarks/cpu_matvec_kernels.py --quick: the machine line names the CPU's instruction sets; a table line per
    class, route and thread count, each timed (its product checked against the float one first) or saying why it was
    skipped (no timing is asserted); torch.mv, F.linear and the split rows exist in every supported torch."""
    result = subprocess.run([sys.executable, str(REPO / "benchmarks" / "cpu_matvec_kernels.py"), "--quick",
                             "--threads", "1"], capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    first = result.stdout.splitlines()[0]
    assert "avx2" in first or not Path("/proc/cpuinfo").exists(), first  # present, or named among the missing
    cells = [[cell.strip() for cell in line.strip(" |").split("|")] for line in result.stdout.splitlines()
             if line.startswith("| ") and "---" not in line]
    lines = {(cell[0], cell[1]): cell for cell in cells[1:]}  # the header left out
    split = "rows split over threads"
    routes = {
        "fp32": ["F.linear (eager)", "torch.mv", f"torch.mv, {split} (use_cpu_packed_weights)",
                 "compiled one-row product (inductor)"],
        "bf16": ["F.linear (eager)", "torch.mv (use_cpu_packed_weights, one row)", f"torch.mv, {split}",
                 "oneDNN blocked copy", "compiled one-row product (inductor, fp32 sums)"],
        "int8": ["_weight_int8pack_mm (int8 checkpoints, quantize(8))", f"_weight_int8pack_mm, {split}",
                 "int8 x int8 torch._int_mm (W8A8)", "compiled: codes x scale in the reduction (inductor)",
                 "compiled: four codes per int32 word (inductor)",
                 "compiled max-autotune, freezing (inductor's weight-only template)", "torchao int8 weight-only"],
        "int4": ["_weight_int4pack_mm, groups of 64 (quantize(4))", f"_weight_int4pack_mm, {split}",
                 "compiled: eight codes per int32 word unpacked in the reduction (inductor)",
                 "torchao int4 weight-only, CPU layout"]}
    assert list(lines) == [("copy", "")] + [(kind, route) for kind, names in routes.items() for route in names]
    timed = [("fp32", "F.linear (eager)"), ("fp32", "torch.mv"),
             ("fp32", "torch.mv, rows split over threads (use_cpu_packed_weights)"), ("bf16", "F.linear (eager)")]
    assert all(float(lines[key][3]) > 0 for key in timed), result.stdout[-3000:]
    # every torch-kernel route of the model's own paths computes the float product (the others may say "wrong")
    model_paths = [("bf16", "F.linear (eager)"), ("int8", "_weight_int8pack_mm (int8 checkpoints, quantize(8))"),
                   ("int4", "_weight_int4pack_mm, groups of 64 (quantize(4))")]
    assert not any("wrong" in lines[key][3] for key in model_paths), result.stdout[-3000:]


@pytest.mark.newest_end
@pytest.mark.matrix_ends
@pytest.mark.parametrize("models", ["checkpoints", "in-memory"])
def test_model_benchmark_times_the_weight_check_against_the_load(tmp_path, models):
    """The `weights` row: from_pretrained's NaN/inf check, and its share of the load (or the in-memory build) it
    follows in the same run (no timing is asserted)."""
    numbers = tmp_path / "numbers.json"
    result = subprocess.run(
        [sys.executable, str(REPO / "benchmarks" / "model_benchmark.py"), "--quick", "--sections", "weights",
         "--json", str(numbers)] + (["--in-memory"] if models == "in-memory" else []),
        capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout + result.stderr[-2000:]
    (row,) = [row for row in json.loads(numbers.read_text())["rows"] if row["section"] == "weights"]
    assert row["unit"] == "ms" and row["load_seconds"] > 0
    assert row["share_of_load"] == pytest.approx(row["fork"] / 1e3 / row["load_seconds"])
    assert ("building the models in memory" if models == "in-memory" else "from_pretrained") in row["note"]


@pytest.mark.newest_end
@pytest.mark.matrix_ends
def test_llamacpp_benchmark_runs_from_a_clone(tmp_path):
    """benchmarks/llamacpp_benchmark.py --quick: every class's decode line on our side, against llama.cpp's GGUF of
    the same weights where llama_cpp is importable in this environment (scripts/llamacpp_benchmark.sh's; not CI's),
    and each fast path's deviation from its exact twin (no timing is asserted). Its third section, the routes to the
    one-row products, is cpu_matvec_kernels.measure on the same shapes: test_cpu_matvec_kernels_benchmark_runs."""
    import importlib.util

    numbers = tmp_path / "numbers.json"
    result = subprocess.run([sys.executable, str(REPO / "benchmarks" / "llamacpp_benchmark.py"), "--quick",
                             "--sections", "speed,deviation", "--threads", "1", "--json", str(numbers)],
                            capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    run = json.loads(numbers.read_text())
    variants = [row["variant"] for row in run["speed"]]
    every = ["fp32", "fp32 packed", "bf16 eager", "bf16 packed", "bf16 compiled", "int8", "int8 + packed bf16 head", "int8 + int8 head",
             "int4", "int4 + packed bf16 head", "int4 + int8 head", "int4 + int4 head"]
    # the packed lines are skipped, and say so, where torch has no oneDNN linear (use_cpu_packed_weights refuses);
    # the compiled one where inductor cannot compile (no C++ compiler)
    assert variants == [name for name in every if f"{name}: skipped" not in result.stdout]
    assert len(variants) >= 7
    assert all(row["ours_ms"] > 0 and 0 < row["ours_bytes"] for row in run["speed"])
    # the products alone are timed on the modules' eager kernels: not for the compiled line
    assert all(("products_ms" in row) == (row["variant"] != "bf16 compiled") for row in run["speed"])
    assert all(row["products_ms"] > 0 for row in run["speed"] if "products_ms" in row)
    heads = {row["variant"]: row["ours_bytes"] for row in run["speed"]}
    assert heads["int4 + int4 head"] < heads["int4 + int8 head"] < heads["int4"]  # the head's bytes: 4 < 8 < 16 bits
    measured_llama = importlib.util.find_spec("llama_cpp") is not None and "llama.cpp not measured" not in run["header"]
    assert all(("llama_ms" in row) == measured_llama for row in run["speed"]), run["header"]
    deviation = {row["variant"]: row for row in run["deviation"]}
    assert list(deviation) == ["fp32 packed", "int8 kernel (bf16)", "int8 + int8 head", "int4 + int8 head",
                               "int4 + int4 head"]
    assert deviation["fp32 packed"]["max_rel"] < 1e-5  # fp32's rounding at most (the same kernel, rows shared out)
    assert deviation["int8 kernel (bf16)"]["max_rel"] < 0.05  # bf16's rounding, not another model
    assert all(0 <= row["top1_same"] <= row["steps"] == 8 for row in deviation.values())  # --quick: 8 steps
    # the CPU class it was measured on; no routes' table when its section is left out
    assert run["cpu_class"] in ("AVX-512/AMX", "AVX-512", "AVX2 only", "no AVX2")
    assert f"CPU class: {run['cpu_class']}" in result.stdout
    assert not run["kernels"] and "routes to the one-row products" not in result.stdout


@pytest.mark.newest_end
@pytest.mark.matrix_ends
@pytest.mark.parametrize("models", ["checkpoints", "in-memory"])
def test_model_benchmark_runs_from_a_clone(tmp_path, models):
    """The benchmark's whole path on a tiny model (no timing is asserted), from checkpoints on disk or built in
    memory: its KV bytes equal the theory, and where transformers has GlmForCausalLM, the native model generates the
    fork's tokens and has its KV bytes too; the bandwidth lines, eager and compiled with and without CUDA graphs
    (inductor needs a C++ compiler), the static cache's first generate() call and the step profile come out."""
    numbers = tmp_path / "numbers.json"
    result = subprocess.run(
        [sys.executable, str(REPO / "benchmarks" / "model_benchmark.py"), "--quick", "--sections",
         "kv,generate,profile,int4,bandwidth,compiled", "--limit-dtypes", "float32", "--json", str(numbers)]
        + (["--in-memory"] if models == "in-memory" else []),
        capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout + result.stderr[-2000:]
    rows = json.loads(numbers.read_text())["rows"]
    kv = [row for row in rows if row["section"] == "KV memory"]
    assert len(kv) == 4 and all(abs(share - 1) <= 0.01 for row in kv for share in row["held_over_theory"].values())
    bandwidth = [row["metric"] for row in rows if row["section"] == "memory bandwidth" and row["share_of_copy"] > 0]
    expected = ["decode bs=1 float32, context 16: (weights + KV) / step"]
    if shutil.which(os.environ.get("CXX", "g++")):
        expected += ["compiled decode bs=1 float32, static cache: (weights + KV) / step",
                     "compiled decode bs=1 float32, static cache, CUDA graphs: (weights + KV) / step"]
    assert bandwidth == expected, result.stdout[-2000:]
    generated = [row for row in rows if row["section"] == "generate"]
    assert [row["unit"] for row in generated] == ["ms/token", "s", "ms/token"]  # the static cache's first call apart
    per_layer = "operators per layer, bs=1 decode step (views and no-op casts left out)"
    hooked = "decode step bs=3, context 16, a no-op hook on every module: torch operators, fork hooked / fork"
    assert [row["metric"] for row in rows if row["section"] == "profile"] == [
        hooked, "decode step bs=3, context 16: torch operators", per_layer]
    hooked_row = next(row for row in rows if row["metric"] == hooked)
    assert hooked_row["fork"] == hooked_row["native"] > 0  # hooks only read: the same operators run (issue 48)
    assert 0 < next(row for row in rows if row["metric"] == per_layer)["fork"] <= 24  # issue 38's target (fp32)
    int4 = {row["metric"]: row for row in rows if row["section"] == "int4"}
    decode = [row for metric, row in int4.items() if metric.startswith("int4 decode bs=1")]
    assert {"today", "exact"} <= {row["metric"].split()[3] for row in decode}
    assert all(row["unit"] == "ms/step" and row["ratio"] > 0 for row in decode)
    assert "int4 decode bs=1 exact vs today's (dequantize every step), context 16" in int4
    if TRANSFORMERS >= Version("4.46"):
        assert [row["note"] for row in generated if row["unit"] == "ms/token"] == ["same tokens", "same tokens"]
        assert all("ratio" in row for row in rows)
