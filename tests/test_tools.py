"""User tools, the demo and the model benchmark, run as a user runs them."""
import json
import os
import shutil
import subprocess
import sys

import pytest
import torch
from conftest import REPO, TRANSFORMERS, load_causal_lm, shared_path
from packaging.version import Version

INSTALL = [sys.executable, str(REPO / "tools" / "install_into_checkpoint.py")]


def downloaded_checkpoint(tmp_path, name="glm4-chat-tiny", folder_name="downloaded_glm4"):
    """A golden checkpoint as a user has it: the original's .py files beside the weights."""
    folder = tmp_path / folder_name
    shutil.copytree(shared_path("golden", name, "checkpoint"), folder)
    for path in folder.iterdir():
        path.chmod(0o644)
    for code in ("modeling_chatglm.py", "configuration_chatglm.py", "tokenization_chatglm.py"):
        (folder / code).write_text(f"# the original {code}\n")
    return folder


def test_install_backs_up_the_original_code_and_the_checkpoint_then_loads(tmp_path):
    folder = downloaded_checkpoint(tmp_path)
    subprocess.run(INSTALL + [str(folder)], check=True, capture_output=True)
    [backup] = folder.glob("original_code_backup_*")
    assert sorted(p.name for p in backup.iterdir()) == [
        "configuration_chatglm.py", "modeling_chatglm.py", "tokenization_chatglm.py"]
    assert (backup / "modeling_chatglm.py").read_text() == "# the original modeling_chatglm.py\n"
    assert (folder / "modeling_chatglm.py").read_text() == (REPO / "modeling_chatglm.py").read_text()
    from safetensors.torch import load_file

    expected = load_file(str(shared_path("golden", "glm4-chat-tiny", "expected.safetensors")))
    model = load_causal_lm(folder, attn_implementation="eager")
    with torch.no_grad():
        logits = model(input_ids=expected["seq_0_input_ids"][None]).logits[0]
    torch.testing.assert_close(logits, expected["seq_0_logits"], atol=1e-4, rtol=1e-4)


def test_install_never_writes_through_hub_cache_symlinks(tmp_path):
    folder = downloaded_checkpoint(tmp_path)
    blob = tmp_path / "blob_modeling"
    blob.write_text("# cached blob\n")
    (folder / "modeling_chatglm.py").unlink()
    os.symlink(blob, folder / "modeling_chatglm.py")
    subprocess.run(INSTALL + [str(folder)], check=True, capture_output=True)
    assert blob.read_text() == "# cached blob\n"
    [backup] = folder.glob("original_code_backup_*")
    assert (backup / "modeling_chatglm.py").is_symlink()


def test_install_refuses_other_families_and_changes_nothing(tmp_path):
    folder = downloaded_checkpoint(tmp_path, folder_name="v1")
    config = json.loads((folder / "config.json").read_text())
    config.update(position_encoding_2d=True, inner_hidden_size=16384)
    (folder / "config.json").write_text(json.dumps(config))
    before = sorted(p.name for p in folder.iterdir())
    result = subprocess.run(INSTALL + [str(folder)], capture_output=True, text=True)
    assert result.returncode == 2 and "first-generation ChatGLM-6B" in result.stderr
    assert sorted(p.name for p in folder.iterdir()) == before
    native = downloaded_checkpoint(tmp_path, folder_name="native_glm")
    config.update(model_type="glm")
    (native / "config.json").write_text(json.dumps(config))
    result = subprocess.run(INSTALL + [str(native)], capture_output=True, text=True)
    assert result.returncode == 2 and "without trust_remote_code" in result.stderr


def test_demo_runs_offline_through_auto_classes(tmp_path):
    env = dict(os.environ, HF_HUB_OFFLINE="1", HF_MODULES_CACHE=str(tmp_path / "modules"))
    result = subprocess.run([sys.executable, str(REPO / "examples" / "demo.py"), "--max-new-tokens", "5"],
                            capture_output=True, text=True, env=env, timeout=600)
    assert result.returncode == 0, result.stderr[-2000:]
    assert "loaded ChatGLMForConditionalGeneration" in result.stdout and "demo: ok" in result.stdout
    lines = result.stdout.splitlines()
    generated = next(line for line in lines if line.startswith("generated ids:"))
    assert len(json.loads(generated.split(":", 1)[1])) == 5
    # The shared data holds GLM-4's tokenizer.model: chat template -> ids -> generate -> decode, end to end.
    prompt = json.loads(next(line for line in lines if line.startswith("prompt ids:")).split(":", 1)[1])
    assert prompt[:3] == [151331, 151333, 151336] and prompt[-1] == 151337  # [gMASK]<sop><|user|> ... <|assistant|>
    assert any(line.startswith("generated text:") for line in lines)


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


@pytest.mark.matrix_ends
def test_model_benchmark_runs_from_a_clone(tmp_path):
    """The benchmark's whole path on a tiny model (no timing is asserted): its KV bytes equal the theory, and where
    transformers has GlmForCausalLM, the native model generates the fork's tokens and has its KV bytes too."""
    numbers = tmp_path / "numbers.json"
    result = subprocess.run(
        [sys.executable, str(REPO / "benchmarks" / "model_benchmark.py"), "--quick", "--sections", "kv,generate",
         "--json", str(numbers)], capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout + result.stderr[-2000:]
    rows = json.loads(numbers.read_text())["rows"]
    kv = [row for row in rows if row["section"] == "KV memory"]
    assert len(kv) == 4 and all(abs(share - 1) <= 0.01 for row in kv for share in row["held_over_theory"].values())
    if TRANSFORMERS >= Version("4.46"):
        generated = [row for row in rows if row["section"] == "generate"]
        assert [row["note"] for row in generated] == ["same tokens", "same tokens"]
        assert all("ratio" in row for row in rows)
