"""Fixtures shared by every test module.

The environment is fixed here, before anything imports transformers: remote code goes to a fresh modules cache
(a stale copy from an earlier run would otherwise be tested), and nothing may reach a hub.
"""
import os
import shutil
import tempfile
from pathlib import Path

_MODULES_CACHE = tempfile.mkdtemp(prefix="chatglm-hf-modules-")
os.environ["HF_MODULES_CACHE"] = _MODULES_CACHE
os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["TRANSFORMERS_OFFLINE"] = "1"
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import pytest  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
SHARED = Path(os.environ.get("CHATGLM_SHARED_DIR", REPO.parent / "shared")).resolve()
# The files a user copies over a downloaded checkpoint.
CODE_FILES = ("configuration_chatglm.py", "modeling_chatglm.py", "tokenization_chatglm.py")


def pytest_sessionfinish(session, exitstatus):
    shutil.rmtree(_MODULES_CACHE, ignore_errors=True)


def shared_path(*parts) -> Path:
    """A file of the shared data (golden outputs, real tokenizer files); its absence is an error, not a skip."""
    path = SHARED.joinpath(*parts)
    if not path.exists():
        raise FileNotFoundError(
            f"{path} is missing: the tests need the shared data folder; set CHATGLM_SHARED_DIR to it."
        )
    return path


def copy_code_into(folder: Path) -> Path:
    """Drop the repository's code files into a checkpoint folder, as a user does with a downloaded checkpoint."""
    for name in CODE_FILES:
        if (REPO / name).exists():
            shutil.copy(REPO / name, folder / name)
    return folder


@pytest.fixture(scope="session")
def shared_dir() -> Path:
    return shared_path()
