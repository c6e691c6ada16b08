"""Set-up and packaging: which Python `scripts/run.sh` installs into, what `.ci/run` tests, the
declared dependency range, and user-facing text that speaks of the project only.

run.sh is exercised with `--dry-run` in a scratch copy of the repository (it prints every install
command and runs none), so these tests are fast and never touch a real environment."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _base_python() -> str:
    """An interpreter that is in no virtual or conda environment (what `python3` is on a fresh
    Debian/Ubuntu machine), or skip."""
    exe = getattr(sys, "_base_executable", None) or sys.executable
    code = "import os, sys; print(int(sys.prefix != sys.base_prefix or os.path.isdir(os.path.join(sys.prefix, 'conda-meta'))))"
    res = subprocess.run([exe, "-c", code], capture_output=True, text=True)
    if res.returncode != 0 or res.stdout.strip() != "0":
        pytest.skip("no Python outside a virtual/conda environment to stand in for a system Python")
    return exe


def _scratch_repo(tmp_path: Path) -> Path:
    repo = tmp_path / "repo"
    (repo / "scripts").mkdir(parents=True)
    (repo / ".ci").mkdir()
    shutil.copy2(ROOT / "scripts" / "run.sh", repo / "scripts" / "run.sh")
    shutil.copy2(ROOT / ".ci" / "run", repo / ".ci" / "run")
    shutil.copy2(ROOT / "pyproject.toml", repo / "pyproject.toml")
    return repo.resolve()


def _env(**extra: str) -> dict:
    env = {k: v for k, v in os.environ.items()
           if k not in ("VIRTUAL_ENV", "CONDA_PREFIX", "PYTHON", "PYTHONPATH") and not k.startswith("HF_KERNATTN_")}
    env.update(extra)
    return env


def _plan(cmd: list[str], env: dict) -> list[str]:
    """The commands a dry run would run ("+ ..." lines)."""
    res = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=120)
    assert res.returncode == 0, res.stderr
    return [line[2:] for line in res.stderr.splitlines() if line.startswith("+ ")]


def test_run_sh_without_an_environment_uses_a_project_venv_never_the_system_pip(tmp_path):
    base = _base_python()
    repo = _scratch_repo(tmp_path)
    plan = _plan(["bash", str(repo / "scripts" / "run.sh"), "--dry-run", "test"], _env(PYTHON=base))
    venv_py = f"{repo}/.venv/bin/python"
    assert plan[0].startswith(f"{base} -m venv ") and plan[0].endswith(f" {repo}/.venv")
    assert not any(line.startswith(f"{base} -m pip") for line in plan)  # nothing into the base Python
    assert f"{venv_py} -m pip install -q -e .[dev]" in plan
    assert plan[-1].startswith(f"{venv_py} -m pytest -n 2")
    # A base Python without torch: the venv is isolated and gets the pinned torch; with torch it
    # sees the system site-packages and installs no torch.
    base_has_torch = subprocess.run([base, "-c", "import torch"], capture_output=True).returncode == 0
    assert ("--system-site-packages" in plan[0]) == base_has_torch
    assert (f"{venv_py} -m pip install -q torch==2.13.0" in plan) == (not base_has_torch)


def test_run_sh_keeps_a_system_torch_through_system_site_packages(tmp_path):
    base = _base_python()
    repo = _scratch_repo(tmp_path)
    fake = tmp_path / "site"
    (fake / "torch").mkdir(parents=True)
    (fake / "torch" / "__init__.py").write_text("")
    plan = _plan(["bash", str(repo / "scripts" / "run.sh"), "--dry-run", "demo"], _env(PYTHON=base, PYTHONPATH=str(fake)))
    assert plan[0] == f"{base} -m venv --system-site-packages {repo}/.venv"
    assert not any("torch==" in line for line in plan)
    assert plan[-1] == f"{repo}/.venv/bin/python -m hf_kernattn.cli demo"


def test_run_sh_uses_an_active_environment_as_it_is(tmp_path):
    if sys.prefix == sys.base_prefix and not (Path(sys.prefix) / "conda-meta").is_dir():
        pytest.skip("the tests do not run inside a virtual/conda environment")
    repo = _scratch_repo(tmp_path)
    plan = _plan(["bash", str(repo / "scripts" / "run.sh"), "--dry-run", "test", "-k", "x"], _env(PYTHON=sys.executable))
    assert not any(" -m venv " in line for line in plan)
    assert not (repo / ".venv").exists()
    # this scratch copy is not the installed checkout: an editable install into the active env
    assert plan[-2] == f"{sys.executable} -m pip install -q -e .[dev]"
    assert plan[-1] == f"{sys.executable} -m pytest -n 2 -q -p no:cacheprovider -k x"


def _oldest_transformers() -> str:
    from packaging.requirements import Requirement

    try:
        import tomllib
    except ImportError:  # Python 3.10
        pytest.skip("tomllib needs Python 3.11")
    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    (req,) = [Requirement(d) for d in deps if Requirement(d).name == "transformers"]
    (low,) = [s.version for s in req.specifier if s.operator == ">="]
    return low


def test_ci_tests_the_readme_command_and_the_oldest_supported_transformers(tmp_path):
    base = _base_python()
    repo = _scratch_repo(tmp_path)
    oldest = _oldest_transformers()
    plan = _plan(["bash", str(repo / ".ci" / "run"), "--dry-run"], _env(PYTHON=base))
    pytest_runs = [line for line in plan if " -m pytest " in line]
    assert pytest_runs == [f"{repo}/.venv/bin/python -m pytest -n 2 -q -p no:cacheprovider",
                           f"{repo}/.venv-oldest/bin/python -m pytest -n 2 -q -p no:cacheprovider"]
    assert f"{repo}/.venv-oldest/bin/python -m pip install -q -e .[dev] transformers=={oldest}" in plan
    assert not any("transformers==" in line for line in plan if line.startswith(f"{repo}/.venv/"))
    # The README's test command is what CI runs first.
    assert "bash scripts/run.sh test" in (ROOT / "README.md").read_text()
    assert "bash scripts/run.sh test" in (ROOT / ".ci" / "run").read_text()


def test_declared_dependencies():
    oldest = _oldest_transformers()
    from packaging.version import Version

    # The decoding state is built on transformers' linear-attention cache layers, whose current
    # API (several states per layer, the sliding-window variant) dates from 5.18.
    assert Version(oldest) >= Version("5.18")
    import tomllib

    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    names = {re.split(r"[<>=!~ ;\[]", d)[0] for d in project["dependencies"]}
    assert {"scikit-learn", "scipy", "torch", "transformers"} <= names
    assert all(family in project["description"] for family in ("NPRF-BERT", "Linear GPT", "ViT"))  # the three families


_ISSUE_TEXT = re.compile(r"\bissues?\s*#?\d+|\bthe issue\b|\bissue's\b", re.IGNORECASE)


def test_user_facing_text_names_no_issue_numbers():
    files = [ROOT / "README.md", ROOT / "pyproject.toml", *sorted((ROOT / "docs").rglob("*.md")),
             *sorted((ROOT / "hf_kernattn" / "model_cards").glob("*.md")), *sorted((ROOT / "hf_kernattn").rglob("*.py")), ROOT / "hf_kernattn_cli.py",
             *sorted((ROOT / "examples").rglob("*.py"))]
    hits = [f"{f.relative_to(ROOT)}:{i}: {line.strip()}" for f in files
            for i, line in enumerate(f.read_text(encoding="utf-8").splitlines(), 1) if _ISSUE_TEXT.search(line)]
    assert hits == []
    assert "DESIGN.md" not in (ROOT / "README.md").read_text()
    assert (ROOT / "docs" / "architecture.md").is_file()


def test_cli_help_names_no_issue_numbers(capsys):
    from hf_kernattn import cli

    texts = []
    for argv in ([], ["bench"], *[["bench", b] for b in cli.BENCHMARKS], *[[c] for c in cli.COMMANDS]):
        with pytest.raises(SystemExit):
            cli.main([*argv, "--help"])
        texts.append(capsys.readouterr().out)
    assert all(t.startswith("usage: hf-kernattn") for t in texts)
    assert not any(_ISSUE_TEXT.search(t) for t in texts)


def test_the_readme_uses_no_deprecated_checkpointing_names():
    """The README and the docs pages show transformers' current checkpointing calls: every old name it could show
    warns (FutureWarning) in the installed transformers, so none appears in a code span."""
    import re
    import warnings
    from pathlib import Path

    import transformers

    from hf_kernattn import LinearGPTForCausalLM
    from tests.conftest import tiny_linear_gpt_config

    model = LinearGPTForCausalLM(tiny_linear_gpt_config())
    if not hasattr(model, "activation_checkpointing_enable"):
        pytest.skip("this transformers (before 5.23) has only the gradient_checkpointing names: none is deprecated")
    deprecated = []
    for old in ("gradient_checkpointing_enable", "gradient_checkpointing_disable"):
        if hasattr(model, old.replace("gradient", "activation")):  # renamed in this transformers
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                getattr(model, old)()
            assert any(issubclass(w.category, FutureWarning) for w in caught), old
            deprecated.append(old)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        transformers.TrainingArguments(output_dir="unused", gradient_checkpointing=True, report_to=[])
    if any(issubclass(w.category, FutureWarning) for w in caught):
        deprecated.append("gradient_checkpointing=True")
    root = Path(__file__).resolve().parents[2]
    pages = [(root / "README.md").read_text(), *(p.read_text() for p in sorted((root / "docs").glob("*.md")))]
    assert deprecated  # transformers 5.23 renamed them all
    assert any(old in page for old in deprecated for page in pages)  # the page that says they warn
    # an old name may appear only where the README or a docs page says that it warns, never as what to run
    shown = [m.group(0) for page in pages for old in deprecated for m in re.finditer(re.escape(old), page)
             if "FutureWarning" not in page[max(0, m.start() - 200):m.end() + 200]]
    assert not shown, shown


def test_the_readme_vit_quickstart_runs_without_warnings(tmp_path):
    """The README's relative-performer ViT quickstart, run as shown (a fresh process, whatever
    of torchvision is installed), prints no warning: no torchvision fallback, no deprecation."""
    import os
    import re
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    blocks = re.findall(r"```python\n(.*?)```", (root / "README.md").read_text(), flags=re.S)
    (code,) = [b for b in blocks if "RelativePerformerViTForImageClassification(config)" in b and "classify = " in b]
    code += "\nfrom PIL import Image\nprint('CLASSES', len(classify(Image.new('RGB', (40, 40)))))\n"
    env = {**os.environ, "PYTHONPATH": str(root), "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1",
           "HF_MODULES_CACHE": str(tmp_path / "modules"), "PYTHONWARNINGS": "always"}
    proc = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=300, stdin=subprocess.DEVNULL)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "CLASSES 5" in proc.stdout
    # (torchao, when installed, is imported by transformers with every model and registers enums that torch
    # calls deprecated: its own noise, not the quickstart's)
    noise = [line for line in proc.stderr.splitlines()
             if re.search(r"warn|torchvision|deprecat", line, flags=re.I) and "real_accelerator" not in line
             and not re.search(r"register_constant\(\) on Enum subclasses is deprecated", line)]
    assert not noise, noise


def test_the_test_modules_import_without_pillow():
    """Pillow is not a dependency of the package: a test module that imported it at module level
    would stop the whole run where it is missing. Without it, every module collects and the image
    pipeline checks skip, saying why."""
    code = (
        "import sys; sys.modules['PIL'] = None\n"  # import PIL raises ImportError
        "import pytest\n"
        "sys.exit(pytest.main(['-q', '-rs', '-p', 'no:cacheprovider', '-n', '0',\n"
        "    'tests/models/relative_performer_vit/test_model.py', '-k', 'pipeline or identically']))\n"
    )
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    run = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout + run.stderr
    assert "2 skipped" in run.stdout and "Pillow is not installed" in run.stdout, run.stdout
