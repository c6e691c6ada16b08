"""The documentation runs and points at what exists.

Every ```python block of README.md and docs/*.md runs: the blocks of one page, in order, as one
script in a fresh process (a page's later blocks use what its earlier ones built), in a folder
holding small local stand-ins for the paths and Hub ids the pages name (``path/to/bert``,
``path/or/id``, ``your-name/tiny-gpt`` ...: a relative path that is a directory is what
``from_pretrained`` loads, so the blocks run as written). A few sizes are made smaller
(``TOY``), and a block preceded by a ``<!-- no-test: reason -->`` line is skipped (``SKIPPED``
lists them all, so a new skip is a visible change).

Every relative link of README.md, CHANGELOG.md and docs/*.md (and its ``#anchor``) exists, and so
does every repository path written in code spans (``hf_kernattn/...``, ``examples/...``,
``tests/...``, ``docs/...``, ``scripts/...``) and every Python file named there.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
LINKED = [*PAGES, ROOT / "CHANGELOG.md"]

# The blocks that do not run here, by page and the reason given beside them.
SKIPPED = {"docs/architecture.md": 1}

# Smaller sizes for blocks written at a realistic size (exact text -> replacement).
TOY = {
    "hf_kernattn.NPRFBertConfig(num_labels=2)":
        "hf_kernattn.NPRFBertConfig(num_labels=2, hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=64)",
    "torch.randint(0, 256, (1, 4000))": "torch.randint(0, 256, (1, 300))",
    "torch.randint(0, 256, (1, 2000))": "torch.randint(0, 256, (1, 300))",
    'train_files=["train.txt"], steps=200)': 'train_files=["train.txt"], steps=2, batch_size=2, block_size=8)',
}

NO_TEST = re.compile(r"<!--\s*no-test:\s*(.+?)\s*-->")

# The pages show transformers' current name of the decoding state (``cache=``, ``out.cache``, from
# 5.24) and say in a line that earlier releases take ``past_key_values``: under those, the blocks
# run with that name, as the line says.
OLD_CACHE_NAME = {r"(?<![\w.])cache=": "past_key_values=", r"\bout\.cache\b": "out.past_key_values"}


def _for_installed_transformers(code: str) -> str:
    from hf_kernattn.modeling.cache import CACHE_FIELD

    if CACHE_FIELD == "cache":
        return code
    for old, new in OLD_CACHE_NAME.items():
        code = re.sub(old, new, code)
    return code


def python_blocks(page: Path) -> tuple[list[str], int]:
    """The page's ```python blocks in order, and how many were marked no-test."""
    lines = page.read_text(encoding="utf-8").splitlines()
    blocks, skipped, i = [], 0, 0
    while i < len(lines):
        if lines[i].strip() == "```python":
            j = i + 1
            while lines[j].strip() != "```":
                j += 1
            prev = next((lines[p] for p in range(i - 1, -1, -1) if lines[p].strip()), "")
            if NO_TEST.search(prev):
                skipped += 1
            else:
                blocks.append("\n".join(lines[i + 1:j]))
            i = j
        i += 1
    return blocks, skipped


def _stand_ins(folder: Path) -> None:
    """Small local checkpoints at the relative paths the pages name."""
    import torch
    from transformers import BertConfig, BertForMaskedLM, BertTokenizer, GPT2Config, GPT2LMHeadModel

    from hf_kernattn import LinearGPTForCausalLM
    from tests.conftest import tiny_linear_gpt_config

    torch.manual_seed(0)
    words = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", "first", "sentence", "a", "second", ",", "longer", "one"]
    bert = folder / "path" / "to" / "bert"
    bert.mkdir(parents=True)
    (bert / "vocab.txt").write_text("\n".join(words) + "\n")
    BertForMaskedLM(BertConfig(vocab_size=len(words), hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                               intermediate_size=64, max_position_embeddings=64)).save_pretrained(bert)
    GPT2LMHeadModel(GPT2Config(vocab_size=50, n_embd=32, n_layer=1, n_head=2, n_positions=64)).save_pretrained(
        folder / "path" / "or" / "id")
    gpt2 = folder / "path" / "to" / "gpt2"  # with a word-level tokenizer, and a text to train on
    GPT2LMHeadModel(GPT2Config(vocab_size=len(words), n_embd=32, n_layer=1, n_head=2, n_positions=64)).save_pretrained(gpt2)
    BertTokenizer(str(bert / "vocab.txt"), eos_token="[SEP]").save_pretrained(gpt2)
    (folder / "train.txt").write_text(" ".join(words[5:] * 20))
    tok = BertTokenizer(str(bert / "vocab.txt"))
    for name in ("path/or/hub-id", "your-name/tiny-gpt", "path/to/old-checkpoint"):
        LinearGPTForCausalLM(tiny_linear_gpt_config()).save_pretrained(folder / name)
        tok.save_pretrained(folder / name)


@pytest.fixture(scope="module")
def stand_ins(tmp_path_factory):
    folder = tmp_path_factory.mktemp("stand_ins")
    _stand_ins(folder)
    return folder


def _page_id(page: Path) -> str:
    return str(page.relative_to(ROOT))


@pytest.mark.parametrize("page", PAGES, ids=_page_id)
def test_every_python_block_runs(page, stand_ins, tmp_path):
    blocks, skipped = python_blocks(page)
    assert skipped == SKIPPED.get(_page_id(page), 0), "a block marked no-test was added or removed: update SKIPPED"
    if not blocks:
        pytest.skip("no python block")
    code = "\n\n".join(blocks)
    for old, new in TOY.items():
        code = code.replace(old, new)
    code = _for_installed_transformers(code)
    for entry in stand_ins.iterdir():
        (tmp_path / entry.name).symlink_to(entry, target_is_directory=True)
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1",
           "TRANSFORMERS_OFFLINE": "1", "HF_MODULES_CACHE": str(tmp_path / "modules")}
    proc = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=300, stdin=subprocess.DEVNULL)
    assert proc.returncode == 0, f"{_page_id(page)}:\n{proc.stderr[-4000:]}"


# --------------------------------------------------------------------------------------------
# links and paths


def _anchors(page: Path) -> set[str]:
    """GitHub's heading anchors: lower case, punctuation dropped, spaces to hyphens."""
    out = set()
    for line in _without_code_blocks(page.read_text(encoding="utf-8")).splitlines():
        m = re.match(r"#+\s+(.*)", line)
        if m:
            out.add(re.sub(r"[^\w\- ]", "", m.group(1).strip().lower()).replace(" ", "-"))
    return out


def _without_code_blocks(text: str) -> str:
    return re.sub(r"```.*?```", "", text, flags=re.S)


def test_every_relative_link_exists():
    missing = []
    for page in LINKED:
        for target in re.findall(r"\]\(([^)\s]+)\)", _without_code_blocks(page.read_text(encoding="utf-8"))):
            if re.match(r"[a-z]+:", target):
                continue
            path, _, anchor = target.partition("#")
            dest = (page.parent / path).resolve() if path else page
            if not dest.exists():
                missing.append(f"{_page_id(page)}: {target}")
            elif anchor and dest.suffix == ".md" and anchor not in _anchors(dest):
                missing.append(f"{_page_id(page)}: {target} (no such heading)")
    assert not missing, missing


REPO_DIRS = ("hf_kernattn/", "examples/", "tests/", "docs/", "scripts/", ".ci/")


def mentioned_files(page: Path) -> set[str]:
    """Repository paths and Python file names written in the page (in code spans and blocks)."""
    text = page.read_text(encoding="utf-8")
    spans = re.findall(r"`([^`\n]+)`", text) + re.findall(r"```.*?```", text, flags=re.S)
    found = set()
    for span in spans:
        for token in re.findall(r"[\w.*/-]+", span):
            token = token.rstrip(".,")
            if token.startswith(REPO_DIRS) or re.fullmatch(r"[\w*]+\.py", token):
                found.add(token)
    return found


def test_every_mentioned_file_exists():
    missing = []
    for page in LINKED:
        for name in sorted(mentioned_files(page)):
            if "/" in name:
                ok = any(ROOT.glob(name.rstrip("/"))) if "*" in name else (ROOT / name).exists()
            else:  # a bare file name: somewhere in the repository
                ok = any(p for p in ROOT.rglob(name) if ".venv" not in p.parts and ".git" not in p.parts)
            if not ok:
                missing.append(f"{_page_id(page)}: {name}")
    assert not missing, missing


def test_every_research_script_is_listed_where_the_scripts_are_listed():
    """README.md, docs/architecture.md and docs/training.md each list the example scripts: every
    script of examples/research/ is named in each."""
    scripts = sorted(p.name for p in (ROOT / "examples" / "research").glob("*.py") if not p.name.startswith("_"))
    assert len(scripts) >= 5
    missing = {page: [s for s in scripts if s not in (ROOT / page).read_text(encoding="utf-8")]
               for page in ("README.md", "docs/architecture.md", "docs/training.md")}
    assert not any(missing.values()), missing


# --------------------------------------------------------------------------------------------
# the decoding state's name


OLD_NAME_SHOWN = re.compile(r"past_key_values=|\.past_key_values\b")


def test_the_pages_and_model_cards_teach_the_current_name_of_the_decoding_state():
    """transformers 5.24 renamed the decoding state (``cache=``, ``out.cache``; the old names warn
    there): the README, the docs pages and the model card templates show the current name, and the
    old one only in a line saying it is what transformers before 5.24 takes."""
    cards = sorted((ROOT / "hf_kernattn" / "model_cards").glob("*.md"))
    shown = []
    for page in [*PAGES, *cards]:
        for number, line in enumerate(page.read_text(encoding="utf-8").splitlines(), 1):
            if OLD_NAME_SHOWN.search(line) and "before 5.24" not in line:
                shown.append(f"{page.relative_to(ROOT)}:{number}: {line.strip()}")
    assert not shown, shown
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    card = (ROOT / "hf_kernattn" / "model_cards" / "linear_gpt.md").read_text(encoding="utf-8")
    for text in (readme, card):
        assert "cache=" in text and "out.cache" in text and "before 5.24" in text


def test_the_readme_linear_gpt_quickstart_prints_no_deprecation(tmp_path):
    """The README's Linear GPT quickstart, run as shown (smaller prompt) under the installed
    transformers, continues from the returned state and prints no deprecation warning (the old
    name of the state printed two under 5.24)."""
    blocks = re.findall(r"```python\n(.*?)```", (ROOT / "README.md").read_text(encoding="utf-8"), flags=re.S)
    (code,) = [b for b in blocks if "LinearGPTForCausalLM(config)" in b and "generate(" in b]
    for old, new in TOY.items():
        code = code.replace(old, new)
    code = _for_installed_transformers(code)
    code += "\nassert more.shape[1] == out.sequences.shape[1] + 20\nprint('CONTINUED')\n"
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1",
           "HF_MODULES_CACHE": str(tmp_path / "modules"), "PYTHONWARNINGS": "always"}
    proc = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=300, stdin=subprocess.DEVNULL)
    assert proc.returncode == 0 and "CONTINUED" in proc.stdout, proc.stderr[-3000:]
    noise = [line for line in proc.stderr.splitlines()  # (other packages' unrelated notices left aside)
             if re.search(r"deprecat|FutureWarning", line, flags=re.I) and re.search(r"past_key_values|cache", line)]
    assert not noise, noise


# --------------------------------------------------------------------------------------------
# auto's crossovers: one source of truth, the shipped calibration table


def _crossovers() -> dict[str, str]:
    """The sentence for each call the docs describe, from the shipped table."""
    from hf_kernattn.bench.calibrate import DOC_CALLS, describe_crossovers
    from hf_kernattn import load_auto_table

    load_auto_table(None)  # the shipped table, whatever a test or HF_KERNATTN_AUTO_TABLE loaded
    return {name: describe_crossovers(call) for name, call in DOC_CALLS.items()}


def _flat(page: str) -> str:
    """The page's text with its line breaks (and a table row's cells) as single spaces."""
    return re.sub(r"\s+", " ", (ROOT / page).read_text(encoding="utf-8"))


def test_the_crossovers_the_pages_state_are_the_shipped_tables():
    """Every sentence on `auto`'s crossovers in README.md, docs/nprf_bert.md and docs/linear_gpt.md
    is the one ``hf-kernattn bench calibrate --describe`` generates from the shipped table (a
    changed table fails here, naming the sentence to write), and no page states another number
    for NPRF-BERT's K = 512."""
    said = _crossovers()
    wanted = {
        "README.md": [f"K = 512 and BERT-base's 12 heads runs {said['nprf_bert']}"],
        "docs/nprf_bert.md": [f"K = 512 and 12 heads, **{said['nprf_bert']}**",
                              f"(at one head: {said['nprf_bert_one_head']};",
                              f"(at K = 512 and 12 heads: {said['nprf_bert']};"],
        "docs/linear_gpt.md": [f"training included: {said['linear_gpt_rpe_state']}; with `use_cache=False`: "
                               f"{said['linear_gpt_rpe']};"],
    }
    missing = [f"{page}: {sentence}" for page, sentences in wanted.items() for sentence in sentences
               if sentence not in _flat(page)]
    assert not missing, "write these sentences (from the shipped table):\n" + "\n".join(missing)
    # any "up to N tokens" stated for NPRF-BERT's K = 512 is one of the table's crossovers for it
    allowed = {m for key in ("nprf_bert", "nprf_bert_one_head") for m in re.findall(r"up to ([\d,]+)", said[key])}
    stated = {}
    for page in ["README.md", *(f"docs/{p.name}" for p in sorted((ROOT / "docs").glob("*.md")))]:
        for m in re.finditer(r"NPRF-BERT[^.]{0,80}K = 512|K = 512 and (?:BERT-base's )?12 heads", _flat(page)):
            window = _flat(page)[m.end():m.end() + 200].split(";")[0]
            stated.update({f"{page}: {n}": n for n in re.findall(r"up to ([\d,]+) tokens", window)})
    assert stated and all(n in allowed for n in stated.values()), (stated, allowed)


def test_the_readme_shows_the_two_figures_that_tell_the_story():
    """Decoding latency and state against the context, attention time and memory against N."""
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    for figure in ("docs/figures/linear_gpt_generate.png", "docs/figures/attention_bench.png"):
        assert re.search(r"!\[[^\]]+\]\(" + re.escape(figure) + r"\)", readme), figure
        assert (ROOT / figure).is_file()
