"""The tooling outside modeling/ is laid out by what each file holds, one copy of each piece of code."""

from __future__ import annotations

import importlib
from pathlib import Path

import hf_kernattn_cli as cli

ROOT = Path(__file__).resolve().parents[2]


def test_bench_modules_are_named_as_their_commands():
    for name, module in cli.BENCHMARKS.items():
        assert module == name
        assert importlib.import_module(f"hf_kernattn.bench.{module}").NAME == name


def test_the_push_command_lives_in_push():
    from hf_kernattn import push

    assert cli.COMMANDS["push"] == "push" and callable(push.push_folder)


def test_training_names_are_importable_from_the_package_and_defined_once():
    import hf_kernattn.training as training

    homes = {}
    for name in training.__all__:
        obj = getattr(training, name)
        home = getattr(obj, "__module__", None)
        if home is not None and callable(obj):
            assert home.startswith("hf_kernattn.training.") and home != "hf_kernattn.training", (name, home)
            homes[name] = home
    assert {h.rsplit(".", 1)[1] for h in homes.values()} == {"args", "checkpoints", "distributed", "loop", "optimizer",
                                                          "serialization", "threads"}


def test_conversion_keeps_its_public_api_with_one_module_per_source_family():
    import hf_kernattn.convert as convert

    for name in ("convert", "convert_to_nprf_bert", "convert_to_linear_gpt", "convert_to_relative_performer_vit",
                 "add_arguments", "run", "HEADS", "SUPPORTED_MODEL_TYPES", "CONVERTED_NUM_RANDOM_FEATURES"):
        assert hasattr(convert, name), name
    assert convert.convert_to_nprf_bert.__module__ == "hf_kernattn.convert.bert"
    assert convert.convert_to_relative_performer_vit.__module__ == "hf_kernattn.convert.vit"
    for family in ("common", "bert", "gpt2", "llama", "vit"):
        importlib.import_module(f"hf_kernattn.convert.{family}")


def test_research_experiments_sit_apart_from_the_task_scripts():
    research = {p.name for p in (ROOT / "examples" / "research").glob("*.py")}
    assert {"copy_task.py", "shift_robustness.py", "finetune_converted.py"} <= research
    tasks = {p.name for p in (ROOT / "examples").glob("*.py")}
    assert tasks == {"run_clm.py", "run_mlm.py", "run_glue.py", "run_image_classification.py"}
