"""Publish a saved checkpoint to the Hugging Face Hub (``hf-kernattn push CHECKPOINT REPO_ID``).

:func:`push_folder` uploads the files a user needs to load the model, and only those
(:func:`files_to_push`): ``README.md`` (the model card), ``config.json``, the safetensors
weights, the modeling code that ``save_pretrained`` copied beside them (for
``trust_remote_code=True``), the preprocessing files (tokenizer or image processor) and
``generation_config.json`` where the family generates. Training checkpoints (``step_N``),
results files and anything pickled (``*.bin``, ``*.pt``) stay local. It goes through
``huggingface_hub``'s ``create_repo`` / ``create_branch`` / ``upload_folder`` in one commit.

Without a connection or a token the push fails with one :class:`PushError` line saying what to
do; nothing local is changed.
"""

from __future__ import annotations

import argparse
import fnmatch
from pathlib import Path
from typing import Optional

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
    from huggingface_hub.errors import HfHubHTTPError, LocalTokenNotFoundError

    if not isinstance(repo_id, str) or repo_id.count("/") > 1 or not repo_id.strip("/"):
        raise ValueError(f"repo_id must be 'name' or 'user-or-org/name', got {repo_id!r}")
    files = files_to_push(folder)
    api = api or HfApi(token=token)
    message = commit_message or f"Upload {Path(folder).name} with hf-kernattn"
    try:
        api.create_repo(repo_id, repo_type="model", private=private, exist_ok=True)
        if revision:
            api.create_branch(repo_id, branch=revision, repo_type="model", exist_ok=True)
        info = api.upload_folder(folder_path=str(folder), repo_id=repo_id, repo_type="model", revision=revision,
                                 commit_message=message, allow_patterns=files)
    except LocalTokenNotFoundError as err:
        raise PushError(f"no Hugging Face token: log in with `hf auth login` (or set HF_TOKEN, or pass --token) "
                        f"and push again; {folder} is unchanged ({err.__class__.__name__})") from None
    except HfHubHTTPError as err:
        status = getattr(getattr(err, "response", None), "status_code", None)
        hint = ("the token was refused or may not write to this repository: check it with `hf auth whoami`"
                if status in (401, 403) else "the Hub answered with an error")
        raise PushError(f"could not push to {repo_id}: {hint} (HTTP {status}); {folder} is unchanged") from None
    except (OSError, ConnectionError) as err:  # offline: requests' connection errors are OSErrors
        raise PushError(f"could not reach the Hugging Face Hub to push to {repo_id} ({err.__class__.__name__}): "
                        f"check the connection (or HF_HUB_OFFLINE) and push again with `hf-kernattn push {folder} "
                        f"{repo_id}`; {folder} is unchanged") from None
    url = getattr(info, "commit_url", None) or str(info)
    logger.info(f"pushed {', '.join(files)} of {folder} to {repo_id}" + (f" ({revision})" if revision else ""))
    return url


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("checkpoint", help="a folder written by save_pretrained (or by an example script)")
    parser.add_argument("repo_id", help="the model repository: 'name' or 'user-or-org/name'")
    parser.add_argument("--private", action="store_true", help="create the repository private")
    parser.add_argument("--revision", default=None, help="push to this branch (created from main if needed)")
    parser.add_argument("--commit-message", default=None)
    parser.add_argument("--token", default=None, help="a Hugging Face token (default: the one `hf auth login` saved)")


def run(args: argparse.Namespace) -> int:
    """``hf-kernattn push``: the files pushed are reported through the logger, the commit URL printed."""
    print(push_folder(args.checkpoint, args.repo_id, private=args.private, revision=args.revision,
                      commit_message=args.commit_message, token=args.token))
    return 0
