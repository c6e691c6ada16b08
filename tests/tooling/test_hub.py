"""Model cards and publishing: one card renderer for every family, and ``hf-kernattn push``
through a stand-in for the Hub client (nothing reaches the network)."""

from __future__ import annotations

import hashlib
from pathlib import Path
from types import SimpleNamespace

import huggingface_hub
import pytest
import requests
from huggingface_hub import ModelCard
from huggingface_hub.errors import LocalTokenNotFoundError

import hf_kernattn
from hf_kernattn import LinearGPTForCausalLM, NPRFBertForMaskedLM, RelativePerformerViTForImageClassification
from hf_kernattn.cards import render_model_card, save_model_card
from hf_kernattn.cli import main
from hf_kernattn.push import PushError, files_to_push, push_folder, stale_modeling_code

from tests.conftest import tiny_linear_gpt_config, tiny_nprf_bert_config, tiny_relative_performer_vit_config
from tests.remote import code_bundle

RESULTS = [
    {"task": "text-generation", "dataset": "wikitext", "split": "validation", "metric": "perplexity", "value": 23.5},
    {"task": "text-generation", "dataset": "wikitext", "split": "test", "metric": "loss", "value": 3.1},
]


@pytest.mark.parametrize("model", [LinearGPTForCausalLM(tiny_linear_gpt_config()), NPRFBertForMaskedLM(tiny_nprf_bert_config()),
                                   RelativePerformerViTForImageClassification(tiny_relative_performer_vit_config())],
                         ids=["linear_gpt", "nprf_bert", "relative_performer_vit"])
def test_a_rendered_card_parses_back_with_exactly_the_results_passed_in(model, tmp_path):
    path = save_model_card(model, tmp_path, results=RESULTS, datasets=["wikitext"], base_model="gpt2",
                           training={"optimizer steps": 7}, repo_id="me/tiny")
    card = ModelCard.load(path)
    got = [(r.task_type, r.dataset_type, r.dataset_split, r.metric_type, r.metric_value) for r in card.data.eval_results]
    assert got == [(r["task"], r["dataset"], r["split"], r["metric"], r["value"]) for r in RESULTS]
    assert card.data.library_name == "transformers" and card.data.base_model == "gpt2"
    assert card.data.datasets == ["wikitext"] and model.config.model_type in card.data.tags
    assert "trust_remote_code=True" in card.text and "me/tiny" in card.text
    assert f"`{model.config.feature_map}`" in card.text  # the attention settings
    assert "Limitations" in card.text or "limitations" in card.text


def test_card_arguments_are_checked():
    with pytest.raises(ValueError, match="lacks \\['value'\\]"):
        render_model_card(tiny_linear_gpt_config(), results=[{"task": "t", "dataset": "d", "metric": "m"}])
    with pytest.raises(ValueError, match="no model card template for model_type 'bert'"):
        render_model_card(SimpleNamespace(model_type="bert"))


class FakeHub:
    """Records what would be sent to the Hub; ``fail`` is raised by the first call."""

    def __init__(self, fail: Exception | None = None):
        self.calls, self.fail = [], fail

    def _call(self, name, *args, **kwargs):
        self.calls.append((name, args, kwargs))
        if self.fail is not None:
            raise self.fail

    def create_repo(self, repo_id, **kwargs):
        self._call("create_repo", repo_id, **kwargs)

    def create_branch(self, repo_id, **kwargs):
        self._call("create_branch", repo_id, **kwargs)

    def upload_folder(self, **kwargs):
        self._call("upload_folder", **kwargs)
        return SimpleNamespace(commit_url=f"https://huggingface.co/{kwargs['repo_id']}/commit/0123")


def _saved_linear_gpt(tmp_path: Path) -> tuple[Path, list[str]]:
    """A Hub-ready Linear GPT folder plus things that must stay local; returns the folder and
    the file list a push must commit (derived independently of hf_kernattn.push)."""
    from transformers import PreTrainedTokenizerFast
    from tokenizers import Tokenizer, models

    folder = tmp_path / "ckpt"
    model = LinearGPTForCausalLM(tiny_linear_gpt_config())
    model.save_pretrained(folder)
    tok = PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.WordLevel({"a": 0, "<unk>": 1}, unk_token="<unk>")),
                                  unk_token="<unk>")
    tok_files = [Path(f).name for f in tok.save_pretrained(folder)]
    save_model_card(model, folder, results=RESULTS)
    (folder / "eval_results.json").write_text("{}")
    (folder / "pytorch_model.bin").write_bytes(b"not pushed")
    (folder / "step_3").mkdir()
    (folder / "step_3" / "model.safetensors").write_bytes(b"")
    code = code_bundle(["configuration_linear_gpt.py", "modeling_linear_gpt.py"])
    expected = ["README.md", "config.json", "generation_config.json", "model.safetensors", *code, *tok_files]
    return folder, sorted(set(expected))


def _digest(folder: Path) -> dict:
    return {str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(folder.rglob("*")) if p.is_file()}


def test_push_commits_exactly_the_checkpoint_files(tmp_path):
    folder, expected = _saved_linear_gpt(tmp_path)
    hub = FakeHub()
    url = push_folder(folder, "me/tiny-gpt", private=True, revision="v1", commit_message="first", api=hub)
    assert url == "https://huggingface.co/me/tiny-gpt/commit/0123"
    (create, *_), (branch, *_), (upload, _, kwargs) = hub.calls
    assert (create, branch, upload) == ("create_repo", "create_branch", "upload_folder")
    assert hub.calls[0][2] == {"repo_type": "model", "private": True, "exist_ok": True}
    assert hub.calls[1][2]["branch"] == "v1"
    assert kwargs["revision"] == "v1" and kwargs["commit_message"] == "first" and kwargs["repo_id"] == "me/tiny-gpt"
    assert sorted(kwargs["allow_patterns"]) == expected
    assert files_to_push(folder) == expected


def test_push_warns_when_the_checkpoint_ships_other_modeling_code_than_the_installed(tmp_path, caplog):
    folder, expected = _saved_linear_gpt(tmp_path)
    assert stale_modeling_code(folder) == []  # save_pretrained ships the installed code as it is
    with caplog.at_level("WARNING"):
        push_folder(folder, "me/tiny-gpt", api=FakeHub())
    assert "modeling code" not in caplog.text
    caplog.clear()
    # the code an earlier version shipped: a file since removed, a file since changed
    old = Path(__file__).parents[1] / "fixtures" / "checkpoints" / "linear_gpt"
    for name in ("kernels_toeplitz.py", "modeling_linear_gpt.py"):
        (folder / name).write_bytes((old / name).read_bytes())
    assert stale_modeling_code(folder) == ["kernels_toeplitz.py", "modeling_linear_gpt.py"]
    assert set(stale_modeling_code(old)) >= {"kernels_toeplitz.py", "modeling_linear_gpt.py"}
    hub = FakeHub()
    with caplog.at_level("WARNING"):
        push_folder(folder, "me/tiny-gpt", api=hub)
    assert "kernels_toeplitz.py, modeling_linear_gpt.py" in caplog.text and "save_pretrained it again" in caplog.text
    assert [c[0] for c in hub.calls] == ["create_repo", "upload_folder"]  # still pushed: the user may mean it


def _http_library():
    """The HTTP library huggingface_hub is built on (httpx, or its successor): the one whose
    errors reach us when the network fails."""
    import importlib

    from huggingface_hub.errors import HfHubHTTPError

    return importlib.import_module(next(b.__module__.split(".")[0] for b in HfHubHTTPError.__mro__
                                        if b.__name__ == "HTTPError" and not b.__module__.startswith("huggingface_hub")))


def _hub_http_error(status: int):
    from huggingface_hub.errors import HfHubHTTPError

    http = _http_library()
    response = http.Response(status, request=http.Request("POST", "https://huggingface.co/api/repos/create"))
    return HfHubHTTPError(f"{status} Client Error: for url https://huggingface.co/api/repos/create\nmore lines\n",
                          response=response)


def _network_failures():
    """What the Hub client raises offline or with a refused token, with the line the user must get."""
    from huggingface_hub.errors import OfflineModeIsEnabled

    http = _http_library()
    request = http.Request("POST", "https://huggingface.co/api/repos/create")
    return [
        (requests.exceptions.ConnectionError("no route"), "could not reach the Hugging Face Hub"),
        (http.ConnectError("[Errno -2] Name or service not known", request=request), "could not reach the Hugging Face Hub"),
        (http.ConnectTimeout("timed out", request=request), "could not reach the Hugging Face Hub"),
        (http.ReadTimeout("timed out", request=request), "could not reach the Hugging Face Hub"),
        (TimeoutError("timed out"), "could not reach the Hugging Face Hub"),
        (OfflineModeIsEnabled("offline"), "HF_HUB_OFFLINE is set"),
        (_hub_http_error(401), "the token was refused"),
        (_hub_http_error(500), "the Hub answered with an error (HTTP 500"),
        (LocalTokenNotFoundError("no token"), "no Hugging Face token: log in with `hf auth login`"),
    ]


@pytest.mark.parametrize("failure,message", _network_failures(), ids=lambda x: type(x).__name__ if isinstance(x, Exception) else "")
def test_push_offline_or_without_token_fails_with_one_line_and_keeps_the_folder(tmp_path, monkeypatch, capsys,
                                                                                failure, message):
    folder, _ = _saved_linear_gpt(tmp_path)
    before = _digest(folder)
    with pytest.raises(PushError) as caught:
        push_folder(folder, "me/tiny-gpt", api=FakeHub(failure))
    assert message in str(caught.value) and "\n" not in str(caught.value)
    monkeypatch.setattr(huggingface_hub, "HfApi", lambda token=None: FakeHub(failure))
    capsys.readouterr()
    assert main(["push", str(folder), "me/tiny-gpt"]) == 1
    err = capsys.readouterr().err
    errors = [line for line in err.splitlines() if line.startswith("hf-kernattn: error:")]
    assert len(errors) == 1 and message in errors[0] and "unchanged" in errors[0] and "Traceback" not in err
    assert _digest(folder) == before


def test_push_refuses_what_is_not_a_checkpoint(tmp_path):
    with pytest.raises(ValueError, match="is not a folder"):
        push_folder(tmp_path / "missing", "me/x", api=FakeHub())
    (tmp_path / "config.json").write_text("{}")
    (tmp_path / "pytorch_model.bin").write_bytes(b"")
    with pytest.raises(ValueError, match="no safetensors weights \\(only pickled ones: \\['pytorch_model.bin'\\]"):
        push_folder(tmp_path, "me/x", api=FakeHub())
    with pytest.raises(ValueError, match="repo_id must be"):
        push_folder(tmp_path, "a/b/c", api=FakeHub())


def test_convert_writes_a_card_naming_the_base_model(tmp_path):
    from transformers import BertConfig, BertForMaskedLM

    from hf_kernattn.convert import convert_to_nprf_bert

    src = tmp_path / "bert"
    BertForMaskedLM(BertConfig(vocab_size=30, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                               intermediate_size=32, max_position_embeddings=16)).save_pretrained(src)
    convert_to_nprf_bert(src, tmp_path / "nprf")
    card = ModelCard.load(tmp_path / "nprf" / "README.md")
    assert card.data.base_model == str(src) and "Converted from" in card.text and "tensors copied" in card.text


def test_edited_checkpoint_code_runs_only_with_trust_remote_code(tmp_path):
    """transformers' rule, which our checkpoints follow: the code in a checkpoint runs only with
    trust_remote_code=True. Where hf_kernattn is installed its own classes load the weights and
    the checkpoint's code is not run at all."""
    import shutil

    import transformers

    from tests.remote import run_without_package

    folder = tmp_path / "edited"
    shutil.copytree(Path(__file__).parents[1] / "fixtures" / "checkpoints" / "linear_gpt", folder)
    code = folder / "modeling_linear_gpt.py"
    code.write_text(code.read_text() + "\nprint('EDITED CODE RAN')\n")
    out = run_without_package(f"""
import transformers
try:
    transformers.AutoModelForCausalLM.from_pretrained({str(folder)!r})
except ValueError as err:
    print("REFUSED", "trust_remote_code" in str(err))
transformers.AutoModelForCausalLM.from_pretrained({str(folder)!r}, trust_remote_code=True)
""", cwd=str(tmp_path))
    assert out.count("REFUSED True") == 1 and out.index("REFUSED True") < out.index("EDITED CODE RAN")
    model = transformers.AutoModelForCausalLM.from_pretrained(folder)  # the package's classes
    assert type(model).__module__ == "hf_kernattn.modeling.modeling_linear_gpt"


def _card_snippets(folder: Path, model, **card) -> list[str]:
    """The Python code blocks and inline ``...from_pretrained(...)`` calls of the card saved in
    ``folder`` for ``model``, with ``repo_id`` the folder itself."""
    import re

    text = save_model_card(model, folder, repo_id=str(folder), **card).read_text()
    blocks = re.findall(r"```python\n(.*?)```", text, flags=re.S)
    inline = re.findall(r"`(Auto\w+\.from_pretrained\([^`]*\))`", text)
    return blocks + [f"import transformers\ntransformers.{call}" for call in inline]


def test_the_cards_loading_code_never_prompts(tmp_path):
    """Every family's card: its loading code, run as shown on a checkpoint folder this project
    saved, in a process without hf_kernattn, without stdin or a terminal, finishes without
    transformers' "run custom code?" prompt (which blocks notebooks and batch jobs)."""
    import os
    import subprocess
    import sys
    import textwrap

    from PIL import Image
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import BertTokenizerFast, PreTrainedTokenizerFast, ViTImageProcessorPil

    from tests.conftest import V_BERT, V_GPT
    from tests.remote import _BLOCKER

    snippets = []
    gpt = tmp_path / "gpt"
    gpt_model = LinearGPTForCausalLM(tiny_linear_gpt_config(max_position_embeddings=256))  # the card generates 100
    gpt_model.save_pretrained(gpt)
    words = Tokenizer(models.WordLevel({"<unk>": 0, **{f"w{i}": i for i in range(1, V_GPT)}}, unk_token="<unk>"))
    words.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    PreTrainedTokenizerFast(tokenizer_object=words, unk_token="<unk>").save_pretrained(gpt)
    snippets += _card_snippets(gpt, gpt_model)
    bert = tmp_path / "bert"
    bert_model = NPRFBertForMaskedLM(tiny_nprf_bert_config())
    bert_model.save_pretrained(bert)
    (tmp_path / "vocab.txt").write_text("\n".join(["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"] +
                                                  [f"w{i}" for i in range(5, V_BERT)]))
    BertTokenizerFast(str(tmp_path / "vocab.txt")).save_pretrained(bert)  # (5.x: a vocab_file= keyword is ignored)
    snippets += _card_snippets(bert, bert_model)
    vit = tmp_path / "vit"
    vit_model = RelativePerformerViTForImageClassification(tiny_relative_performer_vit_config(num_channels=3))
    vit_model.save_pretrained(vit)
    ViTImageProcessorPil(size={"height": 16, "width": 16}).save_pretrained(vit)
    Image.new("RGB", (20, 20), (40, 90, 200)).save(tmp_path / "image.png")
    snippets += _card_snippets(vit, vit_model)
    assert sum("AutoTokenizer.from_pretrained" in s for s in snippets) == 2, snippets
    assert sum("AutoImageProcessor.from_pretrained" in s for s in snippets) == 1, snippets

    script = _BLOCKER + "".join(
        f"\nexec({textwrap.dedent(s)!r}, {{}})\nprint('snippet {i} done', flush=True)\n" for i, s in enumerate(snippets))
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env.update(HF_HUB_OFFLINE="1", HF_MODULES_CACHE=str(tmp_path / "modules"), OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, "-c", script], cwd=tmp_path, env=env, stdin=subprocess.DEVNULL,
                          capture_output=True, text=True, timeout=300, start_new_session=True)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    assert "custom code" not in out and "[y/N]" not in out, out[-4000:]
    assert all(f"snippet {i} done" in proc.stdout for i in range(len(snippets))), out[-4000:]


PUSH_DRIVER = r'''
import runpy, sys
import huggingface_hub
from huggingface_hub.errors import HfHubHTTPError
import importlib
http = importlib.import_module(next(b.__module__.split(".")[0] for b in HfHubHTTPError.__mro__
                                    if b.__name__ == "HTTPError" and not b.__module__.startswith("huggingface_hub")))


class Offline:
    """The Hub client on a machine without a network: every call fails to connect."""

    def __init__(self, *args, **kwargs):
        pass

    def __getattr__(self, name):
        def call(*args, **kwargs):
            raise http.ConnectError("[Errno -2] Name or service not known",
                                    request=http.Request("POST", "https://huggingface.co/api/repos/create"))
        return call


huggingface_hub.HfApi = Offline
sys.argv = sys.argv[1:]
runpy.run_path(sys.argv[0], run_name="__main__")
'''


@pytest.mark.parametrize("script", ["run_clm", "run_glue"])
def test_push_to_hub_without_a_network_ends_the_run_with_one_line(script, tmp_path):
    """An example script run with --push_to_hub where the Hub cannot be reached: everything is
    saved, then one 'error: not pushed' line, exit status 1, no traceback."""
    import subprocess
    import sys

    from tests.tooling.test_examples_resume import ROOT, _env, script_args

    args, _ = script_args(script, tmp_path)
    out = tmp_path / "out"
    args = [str(ROOT / "examples" / f"{script}.py"), *args, "--output_dir", str(out), "--push_to_hub",
            "--hub_model_id", "me/tiny"]
    env = _env()
    env.pop("HF_HUB_OFFLINE", None)  # the failure under test is the connection, not offline mode
    proc = subprocess.run([sys.executable, "-c", PUSH_DRIVER, *args], cwd=tmp_path, env=env, capture_output=True,
                          text=True, timeout=600, stdin=subprocess.DEVNULL)
    errors = [line for line in proc.stderr.splitlines() if "error: not pushed" in line]
    assert proc.returncode == 1, proc.stderr[-3000:]
    assert len(errors) == 1 and "could not reach the Hugging Face Hub" in errors[0], proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    saved = out / "final" if (out / "final").is_dir() else out
    assert (saved / "config.json").is_file() and (saved / "model.safetensors").stat().st_size > 0
    assert (saved / "README.md").is_file()
