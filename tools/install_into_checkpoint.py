"""Install this repository's code into a ChatGLM2/3 or GLM-4 checkpoint folder you already downloaded.

    python tools/install_into_checkpoint.py /path/to/glm-4-9b-chat [--dry-run]

The folder's own .py files are moved into `original_code_backup_<UTC time>/` inside it first (in a Hugging Face
cache snapshot they are symlinks: the links move, the cached blobs are never written to), then this repository's
files are copied in. A folder that is not a ChatGLM2/3 or GLM-4 checkpoint is refused before anything changes.
"""
import argparse
import json
import shutil
import sys
from datetime import datetime, timezone
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
# The files a user copies over a downloaded checkpoint (the demo and the tests read this list too).
CODE_FILES = ("configuration_chatglm.py", "modeling_chatglm.py", "tokenization_chatglm.py", "parallel_chatglm.py",
              "visual.py")
# A key every ChatGLM2/3 and GLM-4 checkpoint has, and what other families have instead.
FAMILY_KEY = "transformer.encoder.layers.0.self_attention.query_key_value.weight"
FIRST_GENERATION_KEY = "transformer.layers.0.attention.query_key_value.weight"


class NotAChatGLMCheckpoint(ValueError):
    pass


def weight_keys(folder: Path) -> set:
    index = next(iter(sorted(folder.glob("*.index.json"))), None)
    if index is not None:
        return set(json.loads(index.read_text())["weight_map"])
    single = folder / "model.safetensors"
    if single.exists():
        from safetensors import safe_open

        with safe_open(str(single), "pt") as f:
            return set(f.keys())
    return set()  # .bin-only or weights elsewhere: judged by config.json alone


def check_checkpoint(folder: Path) -> dict:
    """The checkpoint's config, or NotAChatGLMCheckpoint saying what the folder is and what to do."""
    if not (folder / "config.json").is_file():
        raise NotAChatGLMCheckpoint(f"{folder} has no config.json: give the folder that holds the checkpoint.")
    config = json.loads((folder / "config.json").read_text())
    model_type = config.get("model_type")
    if model_type != "chatglm":
        hint = " It is supported by transformers itself: load it without trust_remote_code." \
            if model_type in ("glm", "glm4") else ""
        raise NotAChatGLMCheckpoint(f"{folder} is a {model_type!r} checkpoint, not ChatGLM2/3 or GLM-4.{hint}")
    sys.path.insert(0, str(REPO))
    from configuration_chatglm import reject_other_families

    try:
        reject_other_families(config)
    except ValueError as error:
        raise NotAChatGLMCheckpoint(str(error)) from None
    keys = weight_keys(folder)
    if keys and FAMILY_KEY not in keys:
        what = "a first-generation ChatGLM-6B" if FIRST_GENERATION_KEY in keys else "an unknown"
        raise NotAChatGLMCheckpoint(f"{folder} holds {what} checkpoint: its weights lack {FAMILY_KEY}.")
    return config


def install(folder: Path, dry_run: bool = False) -> Path | None:
    check_checkpoint(folder)
    originals = sorted(p for p in folder.iterdir() if p.suffix == ".py")
    backup = None
    if originals:
        stamp = datetime.now(timezone.utc).strftime("%Y%m%dT%H%M%S%fZ")
        backup = folder / f"original_code_backup_{stamp}"
        print(f"backing up {', '.join(p.name for p in originals)} into {backup.name}/")
        if not dry_run:
            backup.mkdir()
            for path in originals:
                path.rename(backup / path.name)  # moves a symlink itself, never writes through it
    for name in CODE_FILES:
        if (REPO / name).exists():
            print(f"installing {name}")
            if not dry_run:
                shutil.copy(REPO / name, folder / name)
    return backup


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("checkpoint", type=Path)
    parser.add_argument("--dry-run", action="store_true", help="say what would change, change nothing")
    args = parser.parse_args(argv)
    try:
        install(args.checkpoint, args.dry_run)
    except NotAChatGLMCheckpoint as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    print("done" if not args.dry_run else "dry run: nothing changed")
    return 0


if __name__ == "__main__":
    sys.exit(main())
