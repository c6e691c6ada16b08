"""Checkpoints written by earlier code keep loading, and loading is safe.

``tests/fixtures/checkpoints/<family>`` holds one tiny checkpoint per family as
``save_pretrained`` wrote it (``tests/fixtures/make_checkpoints.py``) with fixed inputs and the
outputs it gave then. Every run loads them with the package (today's code) and in a fresh process
where ``hf_kernattn`` cannot be imported (the code shipped in the checkpoint), and compares the
outputs: float32, the same arithmetic up to summation order (another machine's kernels), so the
float32 bound of reordered sums at the logits' magnitude (``tests.reference.reorder_atol``)
separates rounding from a changed result.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import safetensors.torch
import torch
import transformers

import hf_kernattn
from hf_kernattn.modeling.attention_config import CHECKPOINT_FORMAT, LIBRARY_VERSION

from tests.conftest import unpickling_forbidden
from tests.reference import reorder_atol
from tests.remote import MODELING, code_bundle, run_without_package

ROOT = Path(__file__).parents[1] / "fixtures" / "checkpoints"
FAMILIES = {"linear_gpt": "AutoModelForCausalLM", "nprf_bert": "AutoModelForMaskedLM",
            "relative_performer_vit": "AutoModelForImageClassification"}
ENTRY_FILES = {
    "linear_gpt": ["configuration_linear_gpt.py", "modeling_linear_gpt.py"],
    "nprf_bert": ["configuration_nprf_bert.py", "modeling_nprf_bert.py"],
    "relative_performer_vit": ["configuration_relative_performer_vit.py", "modeling_relative_performer_vit.py"],
}


def _expected(name: str) -> dict:
    return safetensors.torch.load_file(str(ROOT / name / "expected.safetensors"))


def _atol(name: str) -> float:
    """How far today's logits of fixture ``name`` may be from the stored ones: reordered float32
    sums (the longest: the MLP's width; four reductions chained per layer) at their magnitude."""
    config = json.loads((ROOT / name / "config.json").read_text())
    terms = max(config["hidden_size"], config["intermediate_size"], 64)  # 64: longer than any fixture input
    return reorder_atol(_expected(name)["logits"], terms=terms, layers=4 * config["num_hidden_layers"])


@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_fixture_checkpoint_loads_with_the_package_and_gives_the_stored_outputs(name):
    data = _expected(name)
    model = getattr(transformers, FAMILIES[name]).from_pretrained(ROOT / name).eval()
    assert type(model).__module__.startswith("hf_kernattn.")  # today's code, not the bundled one
    inputs = {k: v for k, v in data.items() if k != "logits"}
    with torch.no_grad():
        torch.testing.assert_close(model(**inputs).logits, data["logits"], rtol=0, atol=_atol(name))


def test_fixture_checkpoints_load_without_the_package(tmp_path):
    """Every fixture, loaded through its Auto class with trust_remote_code in one process where
    hf_kernattn cannot be imported, gives the stored outputs."""
    atol = {name: _atol(name) for name in FAMILIES}
    code = f"""
import json, safetensors.torch, torch, transformers
for name, auto in {FAMILIES!r}.items():
    folder = {str(ROOT)!r} + "/" + name
    data = safetensors.torch.load_file(folder + "/expected.safetensors")
    model = getattr(transformers, auto).from_pretrained(folder, trust_remote_code=True).eval()
    assert not type(model).__module__.startswith("hf_kernattn"), type(model).__module__
    with torch.no_grad():
        got = model(**{{k: v for k, v in data.items() if k != "logits"}}).logits
    torch.testing.assert_close(got, data["logits"], rtol=0, atol={atol!r}[name])
    print(name, "ok")
"""
    out = run_without_package(code, cwd=str(tmp_path))
    assert out.split() == [w for name in sorted(FAMILIES) for w in (name, "ok")]


@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_fixture_records_its_writer_and_holds_only_safe_files_and_our_code(name):
    folder = ROOT / name
    config = json.loads((folder / "config.json").read_text())
    assert config["hf_kernattn_version"] == LIBRARY_VERSION == hf_kernattn.__version__
    assert config["checkpoint_format"] == CHECKPOINT_FORMAT
    files = sorted(p.name for p in folder.iterdir())
    data_files = [f for f in files if not f.endswith(".py")]
    assert data_files == ["config.json", "expected.safetensors"] + (["generation_config.json"] if name == "linear_gpt" else []) \
        + ["model.safetensors"]
    # the code it was written with: our modeling files only (their names, today's or the re-export files the
    # fixtures' writer shipped and later releases removed), the family's entry files among them
    code = {f for f in files if f.endswith(".py")}
    ours = {p.name for p in MODELING.glob("*.py")} - {"__init__.py"}
    assert set(ENTRY_FILES[name]) <= code <= ours | {"backends.py", "kernels_toeplitz.py"}


@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_a_saved_checkpoint_bundles_exactly_the_modeling_files_its_family_imports(name, tmp_path):
    """The code bundle save_pretrained writes: the family's configuration and modeling files
    and the modeling files they import (read with ast), nothing else."""
    model = transformers.AutoModel.from_pretrained(ROOT / name)
    model.save_pretrained(tmp_path)
    assert {p.name for p in tmp_path.glob("*.py")} == code_bundle(ENTRY_FILES[name])


def test_a_checkpoint_of_a_newer_format_fails_naming_both_versions(tmp_path):
    folder = tmp_path / "newer"
    shutil.copytree(ROOT / "linear_gpt", folder)
    config = json.loads((folder / "config.json").read_text())
    config.update(checkpoint_format=CHECKPOINT_FORMAT + 1, hf_kernattn_version="9.0.0")
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=rf"written by hf-kernattn 9\.0\.0 .* this code is hf-kernattn {LIBRARY_VERSION}"):
        transformers.AutoModelForCausalLM.from_pretrained(folder)


def test_loading_never_unpickles_unless_asked(tmp_path, caplog):
    """Safetensors only: loading a checkpoint never calls the unpickler; a folder holding only
    pickled weights is refused unless use_safetensors=False is passed, which is warned about."""
    with unpickling_forbidden():
        for name, auto in FAMILIES.items():
            getattr(transformers, auto).from_pretrained(ROOT / name)
    folder = tmp_path / "pickled"
    shutil.copytree(ROOT / "linear_gpt", folder)
    state = safetensors.torch.load_file(str(folder / "model.safetensors"))
    (folder / "model.safetensors").unlink()
    torch.save(state, folder / "pytorch_model.bin")
    with pytest.raises(OSError, match="model.safetensors"):
        transformers.AutoModelForCausalLM.from_pretrained(folder)
    with caplog.at_level("WARNING"):
        model = transformers.AutoModelForCausalLM.from_pretrained(folder, use_safetensors=False)
    assert "use_safetensors=False" in caplog.text and "trust" in caplog.text
    assert torch.equal(model.transformer.wte.weight, state["transformer.wte.weight"])
