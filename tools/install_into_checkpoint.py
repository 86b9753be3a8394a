"""Install this repository's code into a ChatGLM2/3 or GLM-4 checkpoint folder you already downloaded, and undo it.

    python tools/install_into_checkpoint.py /path/to/glm-4-9b-chat             # install, or update to this checkout
    python tools/install_into_checkpoint.py /path/to/glm-4-9b-chat --status    # what is installed there
    python tools/install_into_checkpoint.py /path/to/glm-4-9b-chat --revert    # the folder as it was, byte for byte

Installing copies the code files (CODE_FILES) into the folder in one transaction, and adds to config.json the
`auto_map` entries it lacks (chatglm2-6b-int4 ships AutoModel only): it all happens or nothing does,
also when the disk fills up or the run is killed (the next run finishes or undoes it). The files it replaces are
kept as real copies in `chatglm_fork_originals/`, and `chatglm_fork_manifest.json` records what was installed
(versions, sha256) and what was there before, so `--revert` puts back exactly that. In a Hugging Face cache snapshot
(files are links into ../../blobs/) only the snapshot's links are replaced: no blob is written, so other revisions
that share them are untouched. Running it again keeps the true originals and changes only what differs.

Exit codes: 0 done (or nothing to do), 1 failed with the folder unchanged, 2 refused (not a ChatGLM2/3 or GLM-4
checkpoint, this repository itself, files changed by hand since the install without --force).
"""
import argparse
import ast
import json
import os
import struct
import sys
from pathlib import Path
from typing import Optional

from chatglm_tools import CODE_FILES
from chatglm_tools.folder_transaction import (
    MANIFEST, ORIGINALS, REPO, TRANSACTION, Refused, check_target_folder, command, exit_code, finish_interrupted_run,
    folder_lock, fork_version, look, plan_update, read_manifest, report, run_plan, sha256,
)

TOOL = "install_into_checkpoint.py"
# A key every ChatGLM2/3 and GLM-4 checkpoint has, and what other families have instead.
FAMILY_KEY = "transformer.encoder.layers.0.self_attention.query_key_value.weight"
FIRST_GENERATION_KEY = "transformer.layers.0.attention.query_key_value.weight"
LEGACY_BACKUPS = "original_code_backup_*"  # what this tool wrote before it kept a manifest


# ---------------------------------------------------------------------------------------------------------------------
# Is this a folder to install into?
# ---------------------------------------------------------------------------------------------------------------------

def first_generation_fields() -> tuple:
    """configuration_chatglm.FIRST_GENERATION_FIELDS, read without importing transformers (seconds of start-up)."""
    tree = ast.parse((REPO / "configuration_chatglm.py").read_text(encoding="utf-8"))
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "FIRST_GENERATION_FIELDS"
                                                for t in node.targets):
            return tuple(ast.literal_eval(node.value))
    raise RuntimeError("configuration_chatglm.py no longer defines FIRST_GENERATION_FIELDS")


def read_json(path: Path, what: str) -> dict:
    try:
        value = json.loads(path.read_bytes())
    except (ValueError, UnicodeDecodeError) as error:
        raise Refused(f"{path} is not valid JSON ({error}): {what}") from None
    if not isinstance(value, dict):
        raise Refused(f"{path} holds a JSON {type(value).__name__}, not an object: {what}")
    return value


def safetensors_keys(path: Path) -> set:
    """The tensor names of a .safetensors file, from its header (8-byte length, then JSON)."""
    with open(path, "rb") as handle:
        head = handle.read(8)
        size = struct.unpack("<Q", head)[0] if len(head) == 8 else -1
        header = handle.read(size) if 0 < size <= 100_000_000 else b""
    try:
        return set(json.loads(header)) - {"__metadata__"}
    except (ValueError, UnicodeDecodeError):
        raise Refused(f"{path} is not a safetensors file (its header cannot be read): the download may be "
                      "incomplete; download it again") from None


def weight_keys(folder: Path) -> set:
    index = next(iter(sorted(folder.glob("*.index.json"))), None)
    if index is not None:
        weight_map = read_json(index, "the weights index may be damaged; download it again").get("weight_map")
        if not isinstance(weight_map, dict):
            raise Refused(f"{index} has no 'weight_map' table: the weights index may be damaged; download it again")
        return set(weight_map)
    if (folder / "model.safetensors").is_file():
        return safetensors_keys(folder / "model.safetensors")
    return set()  # .bin-only or weights elsewhere: judged by config.json alone


def check_checkpoint(folder: Path) -> dict:
    """The checkpoint's config, or Refused saying what the folder is and what to do."""
    if not (folder / "config.json").is_file():
        raise Refused(f"{folder} has no config.json: give the folder that holds the checkpoint")
    config = read_json(folder / "config.json", "the checkpoint's config.json may be damaged; download it again")
    model_type = config.get("model_type")
    if model_type != "chatglm":
        hint = " It is supported by transformers itself: load it without trust_remote_code." \
            if model_type in ("glm", "glm4") else ""
        what = f"is a {model_type!r} checkpoint" if model_type else "has a config.json without model_type"
        raise Refused(f"{folder} {what}, not ChatGLM2/3 or GLM-4.{hint}")
    found = [name for name in first_generation_fields() if name in config]
    keys = weight_keys(folder)
    if found or (keys and FAMILY_KEY not in keys):
        what = "a first-generation ChatGLM-6B" if found or FIRST_GENERATION_KEY in keys else "an unknown"
        because = f"its config has {', '.join(found)}" if found else f"its weights lack {FAMILY_KEY}"
        raise Refused(f"{folder} holds {what} checkpoint ({because}), which this code (ChatGLM2/3 and GLM-4) cannot "
                      "load. Keep that checkpoint's own code files.")
    return config


def legacy_backups(folder: Path) -> list:
    return sorted(path.name for path in folder.glob(LEGACY_BACKUPS) if path.is_dir())


def refuse_unrecorded_legacy_install(folder: Path) -> None:
    """An earlier version of this tool moved the originals into original_code_backup_<time>/ and kept no manifest:
    the code files in the folder may be the fork's, and taking them for the originals would lose the real ones."""
    found = legacy_backups(folder)
    if found and not os.path.lexists(folder / MANIFEST):
        raise Refused(
            f"{folder} has {', '.join(found)}, made by an earlier version of this tool: those hold the checkpoint's "
            "original code files, and the files now in the folder may be the fork's. Move the files of that folder "
            "back into the checkpoint folder (in a Hugging Face cache snapshot, where they may be dangling links, "
            "download the snapshot's .py files again instead), delete it, and run again.")


# ---------------------------------------------------------------------------------------------------------------------
# Install, revert, status
# ---------------------------------------------------------------------------------------------------------------------

def completed_auto_map(folder: Path, source: Path, rewritten: bool) -> Optional[bytes]:
    """config.json with the `auto_map` entries of this repository's config.json that the folder's lacks, or None when
    it lacks none (and no earlier install rewrote it). chatglm2-6b-int4 and codegeex2-6b-int4 ship AutoModel only, so
    AutoModelForCausalLM refuses them; the original config.json is kept and comes back with --revert."""
    config = read_json(folder / "config.json", "the checkpoint's config.json may be damaged; download it again")
    reference = source / "config.json" if (source / "config.json").is_file() else REPO / "config.json"
    ours = read_json(reference, "this repository's config.json")["auto_map"]
    auto_map = config.get("auto_map") if isinstance(config.get("auto_map"), dict) else {}
    missing = {name: value for name, value in ours.items() if name not in auto_map}
    if not missing:
        return (folder / "config.json").read_bytes() if rewritten else None
    config["auto_map"] = {**auto_map, **missing}
    return (json.dumps(config, indent=2, ensure_ascii=False) + "\n").encode("utf-8")


def installed_versions(manifest: dict, tool: str = TOOL) -> str:
    versions = sorted({record["version"] for record in manifest["files"].values() if record["tool"] == tool})
    return ", ".join(versions) or "none"


def carry_out(folder: Path, operation: str, plan, done: str, dry_run: bool) -> None:
    if dry_run:
        report(f"dry run, nothing changed; the {operation} would do", plan.lines)
    else:
        report(done, plan.lines, run_plan(folder, operation, plan))


def install(folder: Path, source: Path = REPO, names=CODE_FILES, force: bool = False, dry_run: bool = False) -> int:
    check_checkpoint(folder)
    refuse_unrecorded_legacy_install(folder)
    manifest = read_manifest(folder)
    writes = {name: (source / name).read_bytes() for name in names if (source / name).is_file()}
    config = completed_auto_map(folder, source, rewritten=manifest["files"].get("config.json", {}).get("tool") == TOOL)
    if config is not None:
        writes["config.json"] = config
    # A companion file that this checkout no longer has: its original goes back.
    dropped = [name for name, record in manifest["files"].items() if record["tool"] == TOOL and name not in writes]
    plan = plan_update(folder, writes, dropped, TOOL, force)
    if not plan.changes:
        print(f"the fork ({installed_versions(manifest)}) is already installed in {folder}: its code files are "
              "this checkout's; nothing changed.")
        return 0
    carry_out(folder, "install", plan, f"installed the fork {fork_version()} into {folder}", dry_run)
    if not dry_run:
        print(f"undo with: {command(__file__, '--revert', folder)}")
    return 0


def revert(folder: Path, force: bool = False, dry_run: bool = False) -> int:
    manifest = read_manifest(folder)
    if not manifest["files"]:
        legacy = legacy_backups(folder)
        hint = (f" ({', '.join(legacy)} is from an earlier version of this tool: move its files back by hand)"
                if legacy else "")
        print(f"nothing to revert: the fork's tools have recorded no change in {folder}{hint}.")
        return 0
    plan = plan_update(folder, {}, list(manifest["files"]), TOOL, force)
    carry_out(folder, "revert", plan, f"reverted {folder} to the files it had before the fork's tools changed it",
              dry_run)
    return 0


def status(folder: Path, source: Path = REPO, names=CODE_FILES) -> int:
    files = read_manifest(folder)["files"]
    if not files:
        check_checkpoint(folder)
    if not any(record["tool"] == TOOL for record in files.values()):
        own = [name for name in names if (folder / name).exists()]
        print(f"{folder}: the fork's code is not installed; the checkpoint's own code files: "
              f"{', '.join(own) or 'none'}.")
        for name in legacy_backups(folder):
            print(f"  {name}/ is a backup made by an earlier version of this tool (no manifest)")
    else:
        stale = [name for name in names if (source / name).is_file()
                 and files.get(name, {}).get("sha256") != sha256((source / name).read_bytes())]
        if stale:
            print(f"this checkout ({fork_version()}) has other {', '.join(stale)}: run the install again to update.")
    if files:
        report(f"{folder}: files written by the fork's tools ({MANIFEST})",
               [describe_record(folder, name, record) for name, record in files.items()])
        print(f"undo everything with: {command(__file__, '--revert', folder)}")
    return 0


def describe_record(folder: Path, name: str, record: dict) -> str:
    found = look(folder / name)
    state = "as written" if found.kind == "file" and sha256(found.data) == record["sha256"] \
        else "CHANGED since it was written"
    original = record["original"]
    before = {"absent": "nothing (added)", "file": f"a file (copy in {ORIGINALS}/)",
              "link": f"a link to {original.get('target')} (copy in {ORIGINALS}/)"}[original["kind"]]
    return f"{name}: {record['version']}, by {record['tool']}, {state}; before: {before}"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("checkpoint", type=Path, help="the checkpoint folder")
    action = parser.add_mutually_exclusive_group()
    action.add_argument("--status", action="store_true", help="say what is installed, change nothing")
    action.add_argument("--revert", action="store_true", help="put back every file the fork's tools replaced")
    parser.add_argument("--dry-run", action="store_true", help="say what would change, change nothing")
    parser.add_argument("--force", action="store_true", help="also replace files changed by hand since the install")
    args = parser.parse_args(argv)
    folder = args.checkpoint

    def run() -> int:
        check_target_folder(folder)
        with folder_lock(folder):
            if not args.dry_run:
                finish_interrupted_run(folder)
            elif os.path.lexists(folder / TRANSACTION):
                print(f"note: {folder / TRANSACTION} is left from an interrupted run; a run without --dry-run "
                      "finishes or undoes it first")
            if args.status:
                return status(folder)
            if args.revert:
                return revert(folder, args.force, args.dry_run)
            return install(folder, force=args.force, dry_run=args.dry_run)

    return exit_code(run)


if __name__ == "__main__":
    sys.exit(main())
