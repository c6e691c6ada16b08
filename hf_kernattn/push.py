"""Publish a saved checkpoint to the Hugging Face Hub (``hf-kernattn push CHECKPOINT REPO_ID``).

:func:`push_folder` uploads the files a user needs to load the model, and only those
(:func:`files_to_push`): ``README.md`` (the model card), ``config.json``, the safetensors
weights, the modeling code that ``save_pretrained`` copied beside them (for
``trust_remote_code=True``), the preprocessing files (tokenizer or image processor) and
``generation_config.json`` where the family generates. Training checkpoints (``step_N``),
results files and anything pickled (``*.bin``, ``*.pt``) stay local. It goes through
``huggingface_hub``'s ``create_repo`` / ``create_branch`` / ``upload_folder`` in one commit.

Without a connection or a token (connection errors of ``requests`` or ``httpx``, timeouts,
``OfflineModeIsEnabled``, HTTP errors of the Hub) the push fails with one :class:`PushError` line
saying what to do; nothing local is changed.
"""

from __future__ import annotations

import argparse
import fnmatch
import sys
from pathlib import Path
from typing import NoReturn, Optional

from transformers.utils import logging

logger = logging.get_logger(__name__)

# What a checkpoint folder holds that a user needs (top-level files only).
PUSH_PATTERNS = (
    "README.md", "config.json", "generation_config.json", "model.safetensors", "model-*-of-*.safetensors",
    "model.safetensors.index.json", "*.py",
    "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.txt", "vocab.json", "merges.txt",
    "added_tokens.json", "spiece.model", "sentencepiece.bpe.model", "preprocessor_config.json",
    "processor_config.json", "chat_template.jinja",
)
PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".pkl", ".pickle", ".ckpt")


class PushError(OSError):
    """The push could not be done; the message says why and what to do (nothing local changed)."""


def network_errors() -> tuple[type[BaseException], ...]:
    """What the Hub client raises when the network fails: ``OSError`` (``ConnectionError``,
    ``TimeoutError``, requests' errors, ``huggingface_hub``'s ``OfflineModeIsEnabled`` and
    ``HfHubHTTPError``) and the HTTP library's own errors, which are no ``OSError`` (``httpx``'s
    ``ConnectError``, ``ReadTimeout``...): the library base ``HfHubHTTPError`` is built on, and
    ``httpx``'s where installed."""
    import importlib

    from huggingface_hub.errors import HfHubHTTPError

    found: list[type[BaseException]] = [OSError]
    found += [base for base in HfHubHTTPError.__mro__[1:]
              if not base.__module__.startswith(("huggingface_hub", "builtins")) and not issubclass(base, OSError)]
    for module in ("httpx", "httpx2"):
        try:
            found.append(importlib.import_module(module).HTTPError)
        except (ImportError, AttributeError):
            pass
    return tuple(dict.fromkeys(found))


def _first_line(err: BaseException) -> str:
    """The first line of an error's message (the Hub client's messages run over several)."""
    text = str(err).strip()
    return (text.splitlines()[0] if text else err.__class__.__name__)[:300]


def files_to_push(folder: str | Path) -> list[str]:
    """The top-level files of ``folder`` that :func:`push_folder` uploads, sorted. ``ValueError``
    when it is not a checkpoint folder (no ``config.json`` or no safetensors weights)."""
    folder = Path(folder)
    if not folder.is_dir():
        raise ValueError(f"{folder} is not a folder: give the folder save_pretrained wrote")
    names = sorted(p.name for p in folder.iterdir() if p.is_file())
    if "config.json" not in names:
        raise ValueError(f"{folder} has no config.json: give the folder save_pretrained wrote")
    if not any(n.endswith(".safetensors") for n in names):
        pickled = [n for n in names if n.endswith(PICKLE_SUFFIXES)]
        raise ValueError(f"{folder} has no safetensors weights" + (
            f" (only pickled ones: {pickled}; re-save with save_pretrained(..., safe_serialization=True))" if pickled else ""))
    chosen = [n for n in names if any(fnmatch.fnmatchcase(n, p) for p in PUSH_PATTERNS)]
    left = [n for n in names if n not in chosen and n.endswith(PICKLE_SUFFIXES)]
    if left:
        logger.warning(f"not pushed (pickle files are never published): {', '.join(left)}")
    return chosen


def stale_modeling_code(folder: str | Path) -> list[str]:
    """The modeling files in ``folder`` (the code ``save_pretrained`` shipped for
    ``trust_remote_code=True``) that are not the installed hf-kernattn's: files whose text differs
    from the installed one and files the installed package no longer has. Empty when the folder
    ships no modeling code or ships exactly the installed code."""
    from . import modeling

    installed = Path(modeling.__file__).parent
    names = sorted(p.name for p in Path(folder).glob("*.py") if p.is_file())
    return [n for n in names if not (installed / n).is_file()
            or (installed / n).read_bytes() != (Path(folder) / n).read_bytes()]


def push_folder(
    folder: str | Path,
    repo_id: str,
    *,
    private: bool = False,
    revision: Optional[str] = None,
    commit_message: Optional[str] = None,
    token: Optional[str] = None,
    api=None,
) -> str:
    """Upload the checkpoint in ``folder`` to the model repository ``repo_id`` (created if needed,
    ``private`` when asked; on the branch ``revision`` when given, created from main if needed)
    in one commit. Returns the commit URL. ``api``: an ``huggingface_hub.HfApi`` (default: a new
    one with ``token``). Raises :class:`PushError` with what to do when the Hub cannot be
    reached or the token is missing or refused."""
    from huggingface_hub import HfApi
    from huggingface_hub.errors import HfHubHTTPError, LocalTokenNotFoundError, OfflineModeIsEnabled

    if not isinstance(repo_id, str) or repo_id.count("/") > 1 or not repo_id.strip("/"):
        raise ValueError(f"repo_id must be 'name' or 'user-or-org/name', got {repo_id!r}")
    files = files_to_push(folder)
    stale = stale_modeling_code(folder)
    if stale:
        logger.warning(
            f"{folder} ships modeling code that is not the installed hf-kernattn's ({', '.join(stale)}): whoever loads "
            "it with trust_remote_code=True runs that code. To ship the installed code, load the checkpoint with "
            "hf_kernattn (from_pretrained without trust_remote_code), save_pretrained it again, then push")
    api = api or HfApi(token=token)
    message = commit_message or f"Upload {Path(folder).name} with hf-kernattn"
    again = f"push again with `hf-kernattn push {folder} {repo_id}`; {folder} is unchanged"
    try:
        api.create_repo(repo_id, repo_type="model", private=private, exist_ok=True)
        if revision:
            api.create_branch(repo_id, branch=revision, repo_type="model", exist_ok=True)
        info = api.upload_folder(folder_path=str(folder), repo_id=repo_id, repo_type="model", revision=revision,
                                 commit_message=message, allow_patterns=files)
    except LocalTokenNotFoundError as err:
        raise PushError(f"no Hugging Face token: log in with `hf auth login` (or set HF_TOKEN, or pass --token) "
                        f"and push again; {folder} is unchanged ({err.__class__.__name__})") from None
    except OfflineModeIsEnabled:
        raise PushError(f"HF_HUB_OFFLINE is set, so the Hub is not contacted: unset it and {again}") from None
    except HfHubHTTPError as err:
        status = getattr(getattr(err, "response", None), "status_code", None)
        if status in (401, 403):
            hint = "the token was refused or may not write to this repository: check it with `hf auth whoami`"
        elif status is None:
            hint = "no answer from the Hub: check the connection"
        else:
            hint = "the Hub answered with an error"
        raise PushError(f"could not push to {repo_id}: {hint} (HTTP {status}: {_first_line(err)}); {again}") from None
    except network_errors() as err:
        raise PushError(f"could not reach the Hugging Face Hub to push to {repo_id} ({err.__class__.__name__}: "
                        f"{_first_line(err)}): check the connection (or HF_HUB_OFFLINE) and {again}") from None
    url = getattr(info, "commit_url", None) or str(info)
    logger.info(f"pushed {', '.join(files)} of {folder} to {repo_id}" + (f" ({revision})" if revision else ""))
    return url


def exit_not_pushed(err: BaseException, prog: Optional[str] = None) -> NoReturn:
    """End a script whose ``--push_to_hub`` failed (after everything was saved): one
    ``PROG: error: not pushed: ...`` line on stderr, exit status 1, no traceback."""
    prog = prog or Path(sys.argv[0]).name or "hf-kernattn"
    print(f"{prog}: error: not pushed: {' '.join(str(err).split())}", file=sys.stderr, flush=True)
    raise SystemExit(1)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("checkpoint", help="a folder written by save_pretrained (or by an example script)")
    parser.add_argument("repo_id", help="the model repository: 'name' or 'user-or-org/name'")
    parser.add_argument("--private", action="store_true", help="create the repository private")
    parser.add_argument("--revision", default=None, help="push to this branch (created from main if needed)")
    parser.add_argument("--commit-message", default=None,
                        help="the commit message (default: 'Upload CHECKPOINT with hf-kernattn')")
    parser.add_argument("--token", default=None, help="a Hugging Face token (default: the one `hf auth login` saved)")


def run(args: argparse.Namespace) -> int:
    """``hf-kernattn push``: the files pushed are reported through the logger, the commit URL printed."""
    print(push_folder(args.checkpoint, args.repo_id, private=args.private, revision=args.revision,
                      commit_message=args.commit_message, token=args.token))
    return 0
