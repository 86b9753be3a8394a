"""Only the six dependencies are needed to load and run the text models and their tokenizers.

transformers' remote-code loader refuses a file whose imports name a package that is not installed
(`dynamic_module_utils.check_imports`): a Pillow import anywhere in tokenization_chatglm.py stopped every text
tokenizer from loading on an environment without Pillow. Optional features import their package on use.
"""

import subprocess
import sys

import pytest
from transformers.dynamic_module_utils import get_imports

from conftest import CODE_FILES, REAL_VOCABULARY, REPO, save_checkpoint
from tokenizer_fixtures import make_tokenizer_folder

DEPENDENCIES = {"torch", "transformers", "accelerate", "safetensors", "sentencepiece", "tiktoken"}
OPTIONAL = ("PIL", "peft", "torchao", "optimum", "trl", "torchvision", "bitsandbytes")


@pytest.mark.parametrize("name", CODE_FILES)
def test_remote_code_import_check_asks_only_for_the_dependencies(name):
    """The packages transformers' import check requires before it loads the file (stdlib aside)."""
    required = set(get_imports(str(REPO / name))) - set(sys.stdlib_module_names)
    assert required <= DEPENDENCIES, f"{name} requires {sorted(required - DEPENDENCIES)} at load time"


# A child interpreter in which the optional packages behave as not installed, whether they are or not: a None entry in
# sys.modules makes `import` fail and importlib.util.find_spec (transformers' availability checks) return None.
BLOCK_OPTIONAL = f"""
import sys
sys.modules.update(dict.fromkeys({OPTIONAL!r}))
"""


def run_without_optional_packages(script: str):
    result = subprocess.run([sys.executable, "-c", BLOCK_OPTIONAL + script], capture_output=True, text=True,
                            timeout=600)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return result.stdout


def test_tokenizers_and_models_load_and_run_without_optional_packages(tmp_path, tiny_model):
    folders = {}
    for family in ("glm4", "chatglm3"):
        folder = make_tokenizer_folder(tmp_path / family, family)
        save_checkpoint(tiny_model(family, padded_vocab_size=REAL_VOCABULARY[family]), folder)
        folders[family] = str(folder)
    out = run_without_optional_packages(f"""
import torch, transformers
for family, folder in {folders!r}.items():
    tok = transformers.AutoTokenizer.from_pretrained(folder, trust_remote_code=True)
    ids = tok.apply_chat_template([{{"role": "user", "content": "Hello, world"}}], add_generation_prompt=True,
                                  return_tensors="pt", return_dict=True)
    model = transformers.AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True)
    out = model.generate(**ids, max_new_tokens=3, do_sample=False)
    assert out.shape[-1] == ids["input_ids"].shape[-1] + 3, out.shape
    print(family, "ok", isinstance(tok.decode(out[0, -3:]), str))
assert all(sys.modules[name] is None for name in {OPTIONAL!r})
""")
    assert out.split() == ["glm4", "ok", "True", "chatglm3", "ok", "True"]


def test_a_glm4v_image_without_pillow_names_the_package(tmp_path):
    folder = make_tokenizer_folder(tmp_path / "glm4v", "glm4", config_changes={"image_size": 8})
    run_without_optional_packages(f"""
import transformers
tok = transformers.AutoTokenizer.from_pretrained({str(folder)!r}, trust_remote_code=True)
try:
    tok.apply_chat_template([{{"role": "user", "image": object(), "content": "What is this?"}}],
                            add_generation_prompt=True, return_dict=True)
except ImportError as error:
    assert "pip install pillow" in str(error), error
else:
    raise AssertionError("an image without Pillow was accepted")
""")
