"""Run code in a fresh Python process where ``hf_kernattn`` cannot be imported.

That is how a user without our package loads a checkpoint with ``trust_remote_code=True``.
"""

from __future__ import annotations

import ast
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

_BLOCKER = '''
import sys, importlib.abc
class _Block(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name == "hf_kernattn" or name.startswith("hf_kernattn."):
            raise ModuleNotFoundError("hf_kernattn is blocked in this process", name=name)
        return None
sys.meta_path.insert(0, _Block())
'''


def run_without_package(code: str, cwd: str, timeout: int = 300) -> str:
    """Run ``code`` in a subprocess that cannot import hf_kernattn; return its stdout.

    Raises ``AssertionError`` with stderr when the process fails.
    """
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH",)}
    env["HF_HUB_OFFLINE"] = "1"
    env["TRANSFORMERS_OFFLINE"] = "1"
    env["HF_MODULES_CACHE"] = os.path.join(cwd, "hf_modules_cache")
    script = _BLOCKER + "\nimport importlib\ntry:\n    importlib.import_module('hf_kernattn')\n    raise SystemExit('hf_kernattn importable')\nexcept ModuleNotFoundError:\n    pass\n" + textwrap.dedent(code)
    proc = subprocess.run(
        [sys.executable, "-c", script], cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout
    )
    assert proc.returncode == 0, f"subprocess failed:\n{proc.stderr[-4000:]}"
    return proc.stdout


def causal_lm_logits_without_package(folder: str, ids, cwd) -> list:
    """The logits (``use_cache=False``, as nested lists) of the causal LM saved in ``cwd/folder``
    for the token ids ``ids``, loaded through ``AutoModelForCausalLM`` with ``trust_remote_code``
    in a process that cannot import hf_kernattn."""
    code = f"""
import json, torch, transformers
m = transformers.AutoModelForCausalLM.from_pretrained({folder!r}, trust_remote_code=True).eval()
with torch.no_grad():
    print(json.dumps(m(torch.tensor({ids.tolist()}), use_cache=False).logits.tolist()))
"""
    return json.loads(run_without_package(code, cwd=str(cwd)).strip().splitlines()[-1])


MODELING = Path(__file__).resolve().parents[1] / "hf_kernattn" / "modeling"


def code_bundle(entry_files: list[str]) -> set[str]:
    """The modeling files reachable from ``entry_files`` through ``from .name import ...`` (read
    with ast, independently of transformers' own copying): what a checkpoint must ship."""
    seen, todo = set(), list(entry_files)
    while todo:
        name = todo.pop()
        if name not in seen:
            seen.add(name)
            todo += [n.module + ".py" for n in ast.walk(ast.parse((MODELING / name).read_text()))
                     if isinstance(n, ast.ImportFrom) and n.level == 1 and n.module]
    return seen
