"""Refresh the repository's reference data folder (testdata/) from a newer copy of the project's shared reference data,
or check it against its manifest. Standard library only.

    python scripts/refresh_testdata.py ../shared --dry-run   # what would change: added / changed / removed, sizes
    python scripts/refresh_testdata.py ../shared             # copy what changed, rewrite testdata/MANIFEST.tsv
    python scripts/refresh_testdata.py --check               # every file present with its size and sha256

The folder ends up holding exactly the source's data files (not its README.md, hooks/ or hidden names) and its own
README.md. The refresh is one transaction inside the folder: an error (disk full, permissions, Ctrl-C) leaves it as
it was, and nothing is written outside it. Exit codes: 0 done, 1 failed (folder unchanged) or check failed,
2 refused (nothing done).
"""
import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools"))
from chatglm_tools import DATA  # noqa: E402
from chatglm_tools import folder_transaction, testdata  # noqa: E402


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("source", nargs="?", type=Path, metavar="SOURCE_DIR",
                        help="the folder to refresh from (the project's shared reference data, e.g. ../shared)")
    parser.add_argument("--dry-run", action="store_true", help="say what would change, write nothing")
    parser.add_argument("--check", action="store_true", help="check the folder against its manifest, change nothing")
    parser.add_argument("--folder", type=Path, default=DATA, help=f"the folder to refresh or check (default {DATA})")
    args = parser.parse_args(argv)
    if args.check == (args.source is not None):
        parser.error("give SOURCE_DIR to refresh from, or --check")
    if args.check:
        return check(args.folder)
    return folder_transaction.exit_code(lambda: refresh(args.folder, args.source, args.dry_run))


def refresh(folder: Path, source: Path, dry_run: bool) -> int:
    try:
        plan = testdata.refresh(folder, source, dry_run)
    except KeyboardInterrupt:
        raise folder_transaction.Failed(f"interrupted; the refresh had not completed and {folder} is as it was "
                                        "before it") from None
    for line in plan.lines:
        print(f"  {line}")
    print(plan.summary + (" (dry run: nothing written)" if dry_run and plan.changes else ""))
    return 0


def check(folder: Path) -> int:
    found = testdata.problems(folder)
    for line in found:
        print(f"  {line}")
    listed = testdata.read_manifest(folder)
    print(f"{folder.name}: {len(found)} problems" if found else
          f"{folder.name}: {len(listed)} files, each with the size and sha256 of {testdata.MANIFEST}")
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main())
