"""The reference data folder in the repository (testdata/): it holds exactly what its manifest lists, the tests read
it unless CHATGLM_SHARED_DIR says otherwise, and scripts/refresh_testdata.py refreshes it from a newer shared folder
as a transaction (a fault at any step leaves the folder as it was; nothing is written outside it).
"""
import importlib.util
import os
import subprocess
import sys

import pytest
from conftest import REPO

from chatglm_tools import DATA, testdata
from chatglm_tools.folder_transaction import JOURNAL, TRANSACTION
from tool_faults import FaultyDisk, byte_budgets, folder_state, run_tool

SCRIPT = REPO / "scripts" / "refresh_testdata.py"
_spec = importlib.util.spec_from_file_location("refresh_testdata", SCRIPT)
refresh_testdata = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(refresh_testdata)


def refresh(*args, disk=None):
    return run_tool(refresh_testdata.main, args, disk)


# ---------------------------------------------------------------------------------------------------------------------
# The repository's folder
# ---------------------------------------------------------------------------------------------------------------------

def test_the_repository_folder_holds_exactly_the_files_of_its_manifest():
    """Every listed file present with its size and sha256, none unlisted; each from the shared folder's same path."""
    listed = testdata.read_manifest(DATA)
    assert testdata.problems(DATA) == []
    assert {path.split("/")[0] for path in listed} >= {"configs", "golden", "surface", "tokenizers", "tokvec"}
    assert all(record.source == f"shared/{path}" for path, record in listed.items())
    assert sum(record.size for record in listed.values()) < 40 * 2**20  # plain git files: the clone stays small


@pytest.mark.parametrize("override", [None, "", "elsewhere"])
def test_the_tests_read_the_repository_folder_unless_chatglm_shared_dir_points_elsewhere(tmp_path, override):
    """A clone with nothing beside it: the data comes from testdata/; CHATGLM_SHARED_DIR is an override, and a file
    missing there says which folder was read and how to get back to the repository's."""
    env = {name: value for name, value in os.environ.items() if name != "CHATGLM_SHARED_DIR"}
    if override is not None:
        env["CHATGLM_SHARED_DIR"] = str(tmp_path) if override else ""
    probe = ("import chatglm_tools as t\nprint(t.SHARED)\nprint(t.shared_path('tokvec', 'glm4.jsonl').stat().st_size)"
             "\ntry:\n    t.shared_path('tokvec', 'no-such.jsonl')\nexcept FileNotFoundError as e:\n    print(e)")
    result = subprocess.run([sys.executable, "-c", probe], cwd=tmp_path, env=dict(env, PYTHONPATH=str(REPO / "tools")),
                            capture_output=True, text=True, timeout=60)
    if override:  # an empty folder: even glm4.jsonl is missing, and the error names the variable
        assert result.returncode != 0 and f"CHATGLM_SHARED_DIR={tmp_path} does not hold it" in result.stderr
        assert "Unset CHATGLM_SHARED_DIR" in result.stderr
        return
    assert result.returncode == 0, result.stderr
    folder, size, error = result.stdout.splitlines()
    assert folder == str(DATA.resolve()) and int(size) == testdata.read_manifest(DATA)["tokvec/glm4.jsonl"].size
    assert f"missing from the repository's reference data folder {DATA}" in error
    assert "scripts/refresh_testdata.py" in error


# ---------------------------------------------------------------------------------------------------------------------
# The refresh, on a small folder and source of its own
# ---------------------------------------------------------------------------------------------------------------------

SOURCE = {"README.md": b"the shared folder's own README\n", "hooks/before-stop": b"#!/bin/sh\n", ".hidden": b"x",
          "golden/case/cases.json": b'{"a": 1}\n', "golden/case/checkpoint/model.safetensors": b"\0" * 300,
          "golden/FORMAT.md": b"format\n", "tokvec/glm4.jsonl": b'{"id": 1}\n', "old/only.txt": b"going\n"}
# A newer shared folder: one file changed, one removed, a folder gone, a file in a new folder and one beside others.
NEWER = {**{k: v for k, v in SOURCE.items() if k not in ("old/only.txt", "golden/FORMAT.md")},
         "golden/case/cases.json": b'{"a": 2, "b": 3}\n', "golden/new-case/checkpoint/config.json": b"{}\n",
         "tokvec/glm4_variants.jsonl": b'{"id": 2}\n'}
DATA_OF_NEWER = sorted(k for k in NEWER if not k.startswith((".", "README", "hooks/")))


def write_tree(root, files):
    for name, data in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_bytes(data)
    return root


def make_place(root):
    """A repository's data folder refreshed once from `shared/`, and `newer/`, a newer shared folder beside it."""
    folder = write_tree(root / "repo" / "testdata", {"README.md": b"# this folder's own README\n"})
    code, out, err = refresh(write_tree(root / "shared", SOURCE), "--folder", folder, disk=FaultyDisk())  # no fsync
    assert code == 0, err
    return folder, write_tree(root / "newer", NEWER)


@pytest.fixture
def place(tmp_path):
    return make_place(tmp_path)


def test_a_refresh_copies_the_data_of_a_source_and_writes_its_manifest(tmp_path):
    folder = write_tree(tmp_path / "repo" / "testdata", {"README.md": b"# own\n"})
    code, out, err = refresh(write_tree(tmp_path / "shared", SOURCE), "--folder", folder)
    assert code == 0, err
    assert "  added    golden/case/checkpoint/model.safetensors  (300 bytes)" in out.splitlines()
    data = sorted(k for k in SOURCE if not k.startswith((".", "README", "hooks/")))
    assert sorted(testdata.read_manifest(folder)) == data and testdata.problems(folder) == []
    assert testdata.read_manifest(folder)["golden/FORMAT.md"].source == "shared/golden/FORMAT.md"
    assert sorted(testdata.data_files(folder)) == data and (folder / "README.md").read_bytes() == b"# own\n"
    assert all((folder / name).read_bytes() == SOURCE[name] for name in data)


def test_a_refresh_says_what_changed_with_sizes_and_changes_only_its_folder(place, tmp_path):
    folder, newer = place
    expected = ["  added    golden/new-case/checkpoint/config.json  (3 bytes)",
                "  added    tokvec/glm4_variants.jsonl  (10 bytes)",
                "  changed  golden/case/cases.json  (9 bytes -> 17 bytes)",
                "  removed  golden/FORMAT.md  (7 bytes)",
                "  removed  old/only.txt  (6 bytes)",
                "  MANIFEST.tsv rewritten",
                "testdata: 2 added, 1 changed, 2 removed; it holds 5 files, 340 bytes"]
    before = folder_state(tmp_path)
    code, out, err = refresh(newer, "--folder", folder, "--dry-run")
    assert code == 0 and out.splitlines() == expected[:-1] + [expected[-1] + " (dry run: nothing written)"], err
    assert folder_state(tmp_path) == before
    code, out, err = refresh(newer, "--folder", folder)
    assert code == 0 and out.splitlines() == expected, err
    after = folder_state(tmp_path)
    outside = {name: entry for name, entry in after.items() if not name.startswith("repo/testdata/")}
    assert outside == {name: entry for name, entry in before.items() if not name.startswith("repo/testdata/")}
    assert sorted(testdata.data_files(folder)) == DATA_OF_NEWER and testdata.problems(folder) == []
    assert all((folder / name).read_bytes() == NEWER[name] for name in DATA_OF_NEWER)
    assert not (folder / "old").exists() and not (folder / TRANSACTION).exists()
    code, out, err = refresh(newer, "--folder", folder)  # nothing left to do: nothing is written
    assert code == 0 and out == f"testdata: up to date with {newer} (5 files, 340 bytes)\n" and err == ""
    assert folder_state(tmp_path) == after


def test_check_names_each_file_that_differs_from_the_manifest(place):
    folder, _ = place
    assert refresh("--check", "--folder", folder)[0] == 0
    (folder / "tokvec" / "glm4.jsonl").write_bytes(b'{"id": 9}\n')  # same size, other bytes
    (folder / "golden" / "FORMAT.md").unlink()
    (folder / "golden" / "notes.txt").write_text("by hand\n")
    code, out, err = refresh("--check", "--folder", folder)
    assert code == 1 and out.splitlines()[-1] == "testdata: 3 problems", out
    assert "  golden/FORMAT.md: missing" in out.splitlines() and "  golden/notes.txt: not in MANIFEST.tsv" in out
    assert "tokvec/glm4.jsonl: 10 bytes, sha256" in out and "the manifest says 10 bytes" in out


@pytest.mark.parametrize("case", ["source is the folder", "source inside the folder", "empty source", "no folder"])
def test_refusals_exit_2_and_change_nothing(place, tmp_path, case):
    folder, newer = place
    empty = tmp_path / "empty"
    empty.mkdir()
    args = {"source is the folder": [folder, "--folder", folder],
            "source inside the folder": [folder / "golden", "--folder", folder],
            "empty source": [empty, "--folder", folder],
            "no folder": [newer, "--folder", tmp_path / "no-such-folder"]}[case]
    before = folder_state(tmp_path)
    code, out, err = refresh(*args)
    assert code == 2 and err.startswith("refused: ") and "Traceback" not in err, err
    assert folder_state(tmp_path) == before


def clean_steps(tmp_path_factory):
    folder, newer = make_place(tmp_path_factory.mktemp("clean"))
    disk = FaultyDisk()
    code, out, err = refresh(newer, "--folder", folder, disk=disk)
    assert code == 0, err
    commit = next(i for i, (method, argument) in enumerate(disk.steps)
                  if method == "rename" and argument.endswith(os.sep + JOURNAL))
    return disk.steps, commit, folder_state(folder, times=False)


def test_a_fault_at_any_step_of_a_refresh_leaves_the_folder_as_it_was(tmp_path_factory):
    """A permission error at each step (reads, staging, journal, renames, clean-up), and a full disk halfway through
    each write: before the commit the folder is left as it was; after it only the clean-up failed (a warning), and the
    next run finishes it."""
    steps, commit, result = clean_steps(tmp_path_factory)
    assert len(steps) > 30
    faults = [FaultyDisk(fail_at=step) for step in range(len(steps))] + \
        [FaultyDisk(space=budget) for budget in byte_budgets(steps)]
    for disk in faults:
        root = tmp_path_factory.mktemp("fault")
        folder, newer = make_place(root)
        before = folder_state(root)
        code, out, err = refresh(newer, "--folder", folder, disk=disk)
        where = (disk.fail_at, disk.space, out, err)
        if disk.fail_at is not None and disk.fail_at > commit:
            assert code == 0 and "warning:" in out, where
            assert refresh("--check", "--folder", folder)[0] == 0  # the leftover is not data
            assert refresh(newer, "--folder", folder)[0] == 0 and not (folder / TRANSACTION).exists()
            assert folder_state(folder, times=False) == result, where
            continue
        reason = "Permission denied" if disk.fail_at is not None else "the disk is full"
        assert code == 1 and reason in err and "Traceback" not in out + err, where
        assert folder_state(root) == before, where
