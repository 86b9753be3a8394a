"""Libraries shared by the user commands in tools/, the tests and the benchmarks; none of them is a command.

    folder_transaction   journaled, reversible changes to a checkpoint folder (install, convert, export)
    device_check         runs that must agree across device placements (tests, tools/gpu_check.py)
    native_glm           conversion to transformers' own GlmForCausalLM, the independent reference
    kv_cache             what a transformers KV cache holds, on every supported release
    testdata             the repository's reference data folder (testdata/): its manifest, and its refresh

Import them as `from chatglm_tools import folder_transaction`. The one path setup is `tools/` on sys.path: Python
puts it there for every command in tools/ (a script's own folder comes first), pytest.ini's `pythonpath` for the
tests, and each script in benchmarks/, examples/ and scripts/ inserts it once at its top.
"""
import importlib
import os
import shutil
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
# The reference data (golden outputs of the original code, real tokenizer files and configs, ...) is in the repository:
# testdata/ (its README.md). CHATGLM_SHARED_DIR, when set, points the tests and tools at another copy instead.
DATA = REPO / "testdata"
SHARED = Path(os.environ.get("CHATGLM_SHARED_DIR") or DATA).resolve()

# The files a user copies over a downloaded checkpoint (the installer, the demo, the tests and the benchmarks read this
# list). A companion file added here later is installed by the installer's next run, its original kept like the others.
CODE_FILES = ("configuration_chatglm.py", "modeling_chatglm.py", "tokenization_chatglm.py", "parallel_chatglm.py",
              "visual.py", "quantization_chatglm.py", "ptuning_chatglm.py", "checks_chatglm.py")


def shared_path(*parts) -> Path:
    """A file of the reference data; its absence is an error (never a skip) that names the folder and what to do."""
    path = SHARED.joinpath(*parts)
    if path.exists():
        return path
    if SHARED != DATA.resolve():
        raise FileNotFoundError(f"{path} is missing: CHATGLM_SHARED_DIR={os.environ['CHATGLM_SHARED_DIR']} does not "
                                f"hold it. Unset CHATGLM_SHARED_DIR to use the repository's {DATA}, or point it to "
                                "a complete copy of the reference data.")
    raise FileNotFoundError(f"{path} is missing from the repository's reference data folder {DATA}: restore it "
                            "(git checkout -- testdata) or refresh the folder (python scripts/refresh_testdata.py "
                            "SOURCE_DIR; see testdata/README.md).")


def copy_code_into(folder: Path) -> Path:
    """The repository's code files dropped into a checkpoint folder, as a user does with a downloaded checkpoint."""
    for name in CODE_FILES:
        if (REPO / name).exists():
            shutil.copy(REPO / name, folder / name)
    return folder


def held_bytes(module) -> int:
    """The bytes `module` holds: the distinct storages of its parameters, buffers and pre-quantized layers' packed
    copies (plain attributes, which neither lists; their bytes are the weight's own where they replaced the codes)."""
    tensors = [*module.parameters(), *module.buffers()]
    tensors += [t for m in module.modules() if getattr(m, "packed", None) is not None
                for t in m.packed if hasattr(t, "untyped_storage")]  # its tensors (this file imports no torch)
    return sum({t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors}.values())


def repository_module(name: str):
    """A top-level file of this repository imported as a plain module (the tools read tokenization_chatglm.py so)."""
    if str(REPO) not in sys.path:
        sys.path.insert(0, str(REPO))
    return importlib.import_module(name)
