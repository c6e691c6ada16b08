"""The Accelerate training loop of the example scripts, in the order a script calls it: the start
of a run (its ``Accelerator``, identity and resume point), a reproducible data order, the
learning-rate schedule, the loop with evaluation, checkpoints and exact resume, and the end of a
run (final evaluation, save, push).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Any, Callable, Optional

import torch
from torch import nn
from transformers.utils import logging

from .args import NOT_FINGERPRINTED
from .checkpoints import (
    fingerprint_settings,
    load_checkpoint,
    resolve_checkpoint,
    run_fingerprint,
    save_checkpoint,
)
from .distributed import make_accelerator

logger = logging.get_logger(__name__)


def run_main(main: Callable[[], Any]) -> None:
    """Run a script's ``main()``. What a user can fix ends it with one line (``script: error:
    ...``, no traceback) and exit status 1, as in the ``hf-kernattn`` command: a ``ValueError``
    (bad values, files or data, the library's convention; :class:`CheckpointError` among them) or
    an ``OSError`` (a file or model that cannot be found or read). Anything else keeps its traceback."""
    try:
        main()
    except (ValueError, OSError) as err:
        name = Path(sys.argv[0]).name or "script"
        print(f"{name}: error: {' '.join(str(err).split()) or type(err).__name__}", file=sys.stderr, flush=True)
        raise SystemExit(1) from None


# --------------------------------------------------------------------------------------------
# data order and the training loop


class EpochShuffleSampler(torch.utils.data.Sampler):
    """A random permutation per epoch, drawn from ``seed + epoch`` alone (no global RNG): the data
    order of any epoch can be reproduced when a run resumes.

    Give the ``DataLoader`` its own ``generator=torch.Generator()`` as well: otherwise every new
    iterator draws its base seed from the global RNG, which shifts the dropout randomness of a
    resumed run (it starts an iterator mid-epoch)."""

    def __init__(self, num_samples: int, seed: int):
        self.num_samples, self.seed, self.epoch = num_samples, seed, 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __len__(self) -> int:
        return self.num_samples

    def __iter__(self):
        g = torch.Generator().manual_seed(self.seed + self.epoch)
        return iter(torch.randperm(self.num_samples, generator=g).tolist())


def start_run(args: argparse.Namespace, script: str):
    """The start of an Accelerate example run: its ``Accelerator`` (:func:`make_accelerator`), the
    seed (``--seed``), the output folder (made by the main process), one line saying how it runs
    (processes, device, mixed precision, threads) and its identity and resume point
    (:func:`identify_run`). Returns ``(accelerator, output folder, settings, fingerprint, resume)``."""
    from accelerate.utils import set_seed

    accelerator = make_accelerator(args)
    set_seed(args.seed)
    out = Path(args.output_dir)
    if accelerator.is_main_process:
        out.mkdir(parents=True, exist_ok=True)
    accelerator.print(f"processes: {accelerator.num_processes}, device: {accelerator.device}, "
                      f"mixed precision: {accelerator.mixed_precision}, threads per process: {torch.get_num_threads()}")
    return (accelerator, out, *identify_run(accelerator, args, script, out))


def identify_run(accelerator, args: argparse.Namespace, script: str,
                 output_dir: str | os.PathLike) -> tuple[dict[str, Any], str, Optional[Path]]:
    """``(settings, fingerprint, resume)`` of an Accelerate example run: the settings that decide
    what it computes (its flags but :data:`NOT_FINGERPRINTED`, the script, the number of processes
    and the mixed precision), their :func:`run_fingerprint`, and the checkpoint in ``output_dir``
    that ``--resume_from_checkpoint`` names (:func:`resolve_checkpoint`; ``None``: start fresh)."""
    settings = fingerprint_settings(args, NOT_FINGERPRINTED) | {
        "script": script, "num_processes": accelerator.num_processes, "mixed_precision": accelerator.mixed_precision}
    fingerprint = run_fingerprint(settings)
    return settings, fingerprint, resolve_checkpoint(args.resume_from_checkpoint, output_dir, fingerprint,
                                                     settings=settings)


def make_scheduler(accelerator, args: argparse.Namespace, optimizer, max_train_steps: int, warmup: int):
    """The learning-rate schedule ``--lr_scheduler_type`` (``transformers.get_scheduler``) after
    ``warmup`` steps over ``max_train_steps`` optimizer steps, prepared by ``accelerator``.

    Accelerate steps a prepared scheduler once per process: both counts are scaled by the number
    of processes, as transformers' examples do. ``prepare_scheduler``, not ``prepare``: under
    DeepSpeed, ``prepare()`` returns a scheduler given without its model unwrapped, which then
    steps at every micro-batch."""
    from transformers import get_scheduler

    n = accelerator.num_processes
    return accelerator.prepare_scheduler(get_scheduler(
        args.lr_scheduler_type, optimizer, num_warmup_steps=warmup * n, num_training_steps=max_train_steps * n))


def start_tracking(accelerator, args: argparse.Namespace, project: str, settings: dict[str, Any]) -> None:
    """``--with_tracking``: start the trackers of ``project`` with the run's plain settings."""
    if args.with_tracking:
        accelerator.init_trackers(project, {k: v for k, v in settings.items() if isinstance(v, (int, float, str, bool))})


def train_loop(
    accelerator,
    args: argparse.Namespace,
    *,
    model: nn.Module,
    optimizer,
    scheduler,
    train_dl,
    sampler: EpochShuffleSampler,
    max_train_steps: int,
    evaluate: Callable[[], dict],
    eval_steps: int = 0,
    prepare_batch: Optional[Callable[[dict], dict]] = None,
    generators: Optional[dict[str, torch.Generator]] = None,
    fingerprint: str,
    settings: dict[str, Any],
    save_extra: Optional[Callable[[Path], None]] = None,
    resume: Optional[Path] = None,
    desc: str = "train",
    report: Optional[Callable[[str], None]] = None,
) -> dict:
    """Train to ``max_train_steps`` optimizer steps (resuming when asked); returns
    ``{"step", "history", "stopped"}``. ``history`` holds the evaluations (every ``eval_steps``
    steps, else at the end of each epoch) and per-step training losses, kept across resumes.
    ``stopped`` is true when ``--stop_after_steps`` ended the run early (a checkpoint was saved).
    ``resume`` is the checkpoint from :func:`resolve_checkpoint` (``None``: start fresh);
    ``report`` receives the progress lines (default: this module's logger, at info level); lines
    reported while the progress bar is shown are written above it, never onto it.
    ``--stop_after_steps N`` counts from the step this invocation starts (or resumes) at.
    ``--checkpoints_total_limit`` keeps that many checkpoints of the run."""
    from tqdm.auto import tqdm

    step, epoch, batch_in_epoch, history = 0, 0, 0, {"eval": [], "train": []}
    report = report or logger.info
    ckpt = resume
    if ckpt is None and args.resume_from_checkpoint == "latest":
        logger.warning(f"no checkpoint of this run in {args.output_dir}: starting fresh")
    if ckpt is not None:
        progress = load_checkpoint(accelerator, ckpt, model, optimizer, scheduler, generators)
        step, epoch, batch_in_epoch, history = (progress["step"], progress["epoch"], progress["batch_in_epoch"],
                                                progress["history"])
        report(f"resumed from {ckpt} at step {step} (epoch {epoch}, batch {batch_in_epoch})")
    stop_at = max_train_steps if args.stop_after_steps is None else min(max_train_steps, step + args.stop_after_steps)
    if args.stop_after_steps is not None and stop_at < max_train_steps:
        report(f"--stop_after_steps {args.stop_after_steps}: this invocation stops after step {stop_at} "
               f"(of {max_train_steps}), with a checkpoint")
    every = None if args.checkpointing_steps in (None, "epoch") else int(args.checkpointing_steps)
    total_limit = getattr(args, "checkpoints_total_limit", None)
    bar = tqdm(total=max_train_steps, initial=step, disable=not accelerator.is_local_main_process, desc=desc)

    def say(line: str) -> None:  # above the progress bar, not onto it
        with tqdm.external_write_mode():
            report(line)
    model.train()
    running, counted = 0.0, 0
    while step < stop_at:
        loader = accelerator.skip_first_batches(train_dl, batch_in_epoch) if batch_in_epoch else train_dl
        # Accelerate's loaders pass their own epoch counter to the sampler when iterated: set both.
        for obj in (sampler, train_dl, loader):
            if hasattr(obj, "set_epoch"):
                obj.set_epoch(epoch)
        for batch in loader:
            batch_in_epoch += 1
            if prepare_batch is not None:
                batch = prepare_batch(batch)
            with accelerator.accumulate(model):
                loss = model(**batch).loss
                accelerator.backward(loss)
                if accelerator.sync_gradients and args.max_grad_norm > 0:
                    accelerator.clip_grad_norm_(model.parameters(), args.max_grad_norm)
                optimizer.step()
                scheduler.step()
                optimizer.zero_grad()
            running += loss.detach().float().item()
            counted += 1
            if not accelerator.sync_gradients:
                continue
            step += 1
            epoch_done = batch_in_epoch == len(train_dl)
            lr = scheduler.get_last_lr()[0]
            history["train"].append({"step": step, "loss": running / counted, "lr": lr})
            bar.update(1)
            bar.set_postfix(loss=f"{running / counted:.3f}", lr=f"{lr:.2e}")
            if args.with_tracking:
                accelerator.log({"train_loss": running / counted, "lr": lr}, step=step)
            running, counted = 0.0, 0
            if (eval_steps and step % eval_steps == 0) or (not eval_steps and epoch_done):
                metrics = evaluate() | {"step": step, "epoch": epoch}
                history["eval"].append(metrics)
                say(json.dumps(metrics))
                if args.with_tracking:
                    accelerator.log({k: v for k, v in metrics.items() if k != "step"}, step=step)
            if (every and step % every == 0) or (args.checkpointing_steps == "epoch" and epoch_done) \
                    or (step == stop_at < max_train_steps):
                position = (epoch + 1, 0) if epoch_done else (epoch, batch_in_epoch)
                save_checkpoint(
                    accelerator, args.output_dir, step, model, optimizer, scheduler, fingerprint, settings,
                    {"step": step, "epoch": position[0], "batch_in_epoch": position[1], "history": history},
                    generators, save_extra, total_limit,
                )
            if step >= stop_at:
                break
        else:
            epoch, batch_in_epoch = epoch + 1, 0
            continue
        if batch_in_epoch == len(train_dl):
            epoch, batch_in_epoch = epoch + 1, 0
    bar.close()
    return {"step": step, "history": history, "stopped": step < max_train_steps}


def finish_run(accelerator, args: argparse.Namespace, model: nn.Module, evaluate: Callable[[], dict], result: dict,
               output_dir: str | os.PathLike):
    """The end of an Accelerate example run after :func:`train_loop`: when ``--stop_after_steps``
    stopped it, say how to resume, end training and return ``(None, None)``; otherwise evaluate
    once more, log the final figures, save the model (weights, config and code) into
    ``output_dir`` from the main process with ``eval_results.json`` beside it (the final metrics,
    the evaluation history and the training losses) and return ``(final metrics, unwrapped model)``."""
    step = result["step"]
    if result["stopped"]:
        accelerator.print(f"stopped after step {step} (--stop_after_steps); resume with --resume_from_checkpoint latest")
        accelerator.end_training()
        return None, None
    final = evaluate() | {"step": step}
    accelerator.print("final " + json.dumps(final))
    if args.with_tracking:
        accelerator.log({f"final_{k}": v for k, v in final.items() if k != "step"}, step=step)
    accelerator.wait_for_everyone()
    unwrapped = save_final_model(accelerator, model, output_dir)
    if accelerator.is_main_process:
        history = result["history"]
        (Path(output_dir) / "eval_results.json").write_text(
            json.dumps({"final": final, "history": history["eval"], "train_history": history["train"]}, indent=2))
    return final, unwrapped


def save_final_model(accelerator, model: nn.Module, output_dir: str | os.PathLike) -> nn.Module:
    """Save the trained model (weights, config and code) into ``output_dir`` with
    ``save_pretrained``; every process must call it. The weights are gathered whole first
    (``accelerator.get_state_dict``: from FSDP shards or DeepSpeed ZeRO-3 partitions) and written by
    the main process. Returns the unwrapped model."""
    state_dict = accelerator.get_state_dict(model)
    unwrapped = accelerator.unwrap_model(model)
    if accelerator.is_main_process:
        unwrapped.save_pretrained(output_dir, state_dict=state_dict)
    accelerator.wait_for_everyone()
    return unwrapped


def push_if_asked(args: argparse.Namespace, folder: str | os.PathLike, report: Callable[[str], None] = logger.info) -> None:
    """``--push_to_hub``: publish the saved model ``folder`` (``hf_kernattn.push.push_folder``).
    A failed push (offline, no token, a refused token) ends the run with one ``error: not
    pushed: ...`` line on stderr and exit status 1; the saved folder stays as it is."""
    if not args.push_to_hub:
        return
    from ..push import PushError, exit_not_pushed, push_folder

    repo_id = args.hub_model_id or Path(folder).name
    try:
        url = push_folder(folder, repo_id, private=args.hub_private_repo, token=args.hub_token)
    except (PushError, ValueError) as err:
        exit_not_pushed(err)
    report(f"pushed to {url}")


def end_run(accelerator, args: argparse.Namespace, folder: str | os.PathLike, saved: Optional[str] = None) -> None:
    """The last step of an example run, on every process once the main process has written
    ``folder``: the main process says what it saved there (``saved``, when given) and publishes
    it (:func:`push_if_asked`); then every process waits for the others and ends training."""
    if accelerator.is_main_process:
        if saved:
            accelerator.print(f"saved {saved} to {folder}")
        push_if_asked(args, folder, accelerator.print)
    accelerator.wait_for_everyone()
    accelerator.end_training()
