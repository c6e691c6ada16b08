#!/usr/bin/env python
"""Train the relative-performer ViT for image classification with Accelerate.

* Data: ``--train_dir`` (and optionally ``--validation_dir``): image folders with one sub-folder
  per class (the ``imagefolder`` layout), or ``--dataset_name`` (a ``datasets`` dataset from the
  Hub, online) with ``--image_column_name`` / ``--label_column_name``. Without a validation
  split, ``--train_val_split`` of the training images are held out (seeded).
* Model: ``--model_name_or_path`` (a relative-performer ViT checkpoint, e.g. one this script
  saved), or from scratch ``RelativePerformerViTConfig`` fields given as
  ``--config_overrides key=value,...`` (``image_size``, ``patch_size``, ``rpe``, ``pooling``, ...).
  The labels come from the data.
* Preprocessing: the checkpoint's image processor (``AutoImageProcessor``), or from scratch a
  ``ViTImageProcessor`` of the model's image size (``--image_mean`` / ``--image_std``). Training
  images get the standard augmentations, a random resized crop (``--crop_scale``) and a
  horizontal flip (``--hflip_probability``), drawn in the training loop from a generator per
  process that is saved in the checkpoints.
* Training: AdamW with the schedule of ``--lr_scheduler_type`` after a warm-up, gradient
  accumulation, mixed precision where the device has it (``--mixed_precision``), a progress bar,
  evaluation accuracy (scikit-learn) every ``--eval_steps`` or each epoch, checkpoints into
  ``--output_dir/step_N`` (no pickle, every file checksummed; ``--checkpoints_total_limit`` keeps
  the newest N); ``--resume_from_checkpoint latest`` continues the newest complete and intact
  checkpoint of the same run (a damaged one is skipped with a warning) and ends bitwise where the
  uninterrupted run ends (same number of processes and threads); ``--num_threads`` sets torch's
  CPU threads per process.
* Output: a Hub-ready folder: ``model.safetensors``, ``config.json`` with ``auto_map`` and the
  modeling code (loads with ``trust_remote_code=True`` where hf_kernattn is not installed),
  ``preprocessor_config.json``, a model card (``README.md``) with the evaluation results, and
  ``eval_results.json``.

Examples::

    python examples/run_image_classification.py --train_dir data/train --validation_dir data/val \\
        --config_overrides image_size=32,patch_size=4,hidden_size=128,num_hidden_layers=4,num_attention_heads=4 \\
        --output_dir out/vit --num_train_epochs 10

    accelerate launch --multi_gpu --num_processes 2 --num_machines 1 --mixed_precision no \\
        --dynamo_backend no examples/run_image_classification.py --cpu --train_dir data/train \\
        --config_overrides image_size=32,patch_size=4 --output_dir out/vit --max_train_steps 200
"""

from __future__ import annotations

import argparse
import importlib.util
import logging
import math
import os
from pathlib import Path
from typing import Optional

import numpy as np
import torch
from PIL import Image
from sklearn.metrics import accuracy_score
from torch.utils.data import DataLoader
import transformers
from transformers import AutoImageProcessor, AutoModelForImageClassification

import hf_kernattn  # noqa: F401  (registers the families with the Auto classes)
from hf_kernattn import RelativePerformerViTConfig, RelativePerformerViTForImageClassification
from hf_kernattn.cards import save_model_card
from hf_kernattn import training  # the flags, loop and checkpoints the example scripts share
from hf_kernattn.training import run_main

logger = logging.getLogger(__name__)


def parse_args(argv: Optional[list[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    data = p.add_argument_group("data")
    data.add_argument("--train_dir", default=None, help="image folder: one sub-folder of images per class")
    data.add_argument("--validation_dir", default=None, help="image folder of the validation images")
    data.add_argument("--dataset_name", default=None, help="a datasets dataset on the Hub (needs a connection)")
    data.add_argument("--dataset_config_name", default=None)
    data.add_argument("--image_column_name", default="image")
    data.add_argument("--label_column_name", default="label")
    data.add_argument("--train_val_split", type=float, default=0.15,
                      help="share of the training images held out when there is no validation split")
    data.add_argument("--max_train_samples", type=int, default=None, help="use the first N training images")
    data.add_argument("--max_eval_samples", type=int, default=None, help="use the first N validation images")
    model = p.add_argument_group("model and preprocessing")
    model.add_argument("--model_name_or_path", default=None, help="a relative-performer ViT checkpoint")
    model.add_argument("--config_overrides", default=None,
                       help="key=value,... RelativePerformerViTConfig fields for a model from scratch")
    model.add_argument("--ignore_mismatched_sizes", action="store_true",
                       help="load a checkpoint whose classifier has another number of labels (a new head)")
    model.add_argument("--image_mean", type=float, nargs="+", default=[0.5], help="per channel (one value: all)")
    model.add_argument("--image_std", type=float, nargs="+", default=[0.5], help="per channel (one value: all)")
    model.add_argument("--crop_scale", type=float, nargs=2, default=[0.6, 1.0],
                       help="area range of the random resized crop (1 1: no crop)")
    model.add_argument("--hflip_probability", type=float, default=0.5, help="0 for images whose mirror is another class")
    train = p.add_argument_group("training")
    train.add_argument("--per_device_train_batch_size", type=int, default=32)
    train.add_argument("--per_device_eval_batch_size", type=int, default=64)
    train.add_argument("--num_train_epochs", type=int, default=3)
    train.add_argument("--max_train_steps", type=int, default=None, help="optimizer steps (overrides --num_train_epochs)")
    train.add_argument("--eval_steps", type=int, default=0, help="evaluate every N optimizer steps (0: each epoch)")
    train.add_argument("--preprocessing_num_workers", type=int, default=None)
    training.add_training_args(p, learning_rate=1e-3, weight_decay=0.05, warmup_default="5%% of the optimizer steps",
                               checkpointing_steps="epoch")
    args = p.parse_args(argv)
    training.check_training_args(p, args)
    if (args.train_dir is None) == (args.dataset_name is None):
        p.error("give --train_dir (an image folder) or --dataset_name, not both")
    if args.validation_dir and not args.train_dir:
        p.error("--validation_dir goes with --train_dir")
    for name in ("per_device_train_batch_size", "per_device_eval_batch_size", "num_train_epochs"):
        if getattr(args, name) < 1:
            p.error(f"--{name} must be >= 1, got {getattr(args, name)}")
    for name in ("max_train_steps", "max_train_samples", "max_eval_samples"):
        if getattr(args, name) is not None and getattr(args, name) < 1:
            p.error(f"--{name} must be >= 1, got {getattr(args, name)}")
    if args.eval_steps < 0:
        p.error(f"--eval_steps must be >= 0, got {args.eval_steps}")
    if not 0.0 < args.train_val_split < 1.0:
        p.error(f"--train_val_split must be in (0, 1), got {args.train_val_split}")
    lo, hi = args.crop_scale
    if not 0.0 < lo <= hi <= 1.0:
        p.error(f"--crop_scale must be two numbers 0 < low <= high <= 1, got {args.crop_scale}")
    if not 0.0 <= args.hflip_probability <= 1.0:
        p.error(f"--hflip_probability must be in [0, 1], got {args.hflip_probability}")
    if args.model_name_or_path is None and args.config_overrides is None:
        p.error("give --model_name_or_path, or --config_overrides for a model from scratch")
    for d in (args.train_dir, args.validation_dir):
        if d is not None and not Path(d).is_dir():
            p.error(f"{d} is not a folder")
    return args


def load_images(args: argparse.Namespace):
    """The dataset with ``train`` and ``validation`` splits and the class names."""
    from datasets import load_dataset

    if args.dataset_name:
        raw = load_dataset(args.dataset_name, args.dataset_config_name)
    else:
        files = {"train": os.path.join(args.train_dir, "**")}
        if args.validation_dir:
            files["validation"] = os.path.join(args.validation_dir, "**")
        raw = load_dataset("imagefolder", data_files=files)
    columns = raw["train"].column_names
    for flag, column in (("--image_column_name", args.image_column_name), ("--label_column_name", args.label_column_name)):
        if column not in columns:
            raise ValueError(f"{flag} {column!r} is not a column of the data: {columns}")
    feature = raw["train"].features[args.label_column_name]
    if not hasattr(feature, "names"):
        raise ValueError(f"the label column {args.label_column_name!r} must hold class labels (a ClassLabel), got {feature}")
    if "validation" not in raw:
        split = raw["train"].train_test_split(test_size=args.train_val_split, seed=args.seed,
                                              stratify_by_column=args.label_column_name)
        raw["train"], raw["validation"] = split["train"], split["test"]
    if args.max_train_samples:
        raw["train"] = raw["train"].select(range(min(args.max_train_samples, len(raw["train"]))))
    if args.max_eval_samples:
        raw["validation"] = raw["validation"].select(range(min(args.max_eval_samples, len(raw["validation"]))))
    return raw, list(feature.names)


def build_model(args: argparse.Namespace, labels: list[str]):
    id2label = dict(enumerate(labels))
    label2id = {name: i for i, name in id2label.items()}
    if args.model_name_or_path is not None:
        model = AutoModelForImageClassification.from_pretrained(
            args.model_name_or_path, num_labels=len(labels), id2label=id2label, label2id=label2id,
            ignore_mismatched_sizes=args.ignore_mismatched_sizes, trust_remote_code=True,
        )
        processor = AutoImageProcessor.from_pretrained(args.model_name_or_path)
        return model, processor
    config = RelativePerformerViTConfig(
        **training.parse_overrides(args.config_overrides, "--config_overrides"),
        num_labels=len(labels), id2label=id2label, label2id=label2id,
    )
    model = RelativePerformerViTForImageClassification(config)
    channels = config.num_channels

    def per_channel(values: list[float], flag: str) -> list[float]:
        if len(values) == 1:
            return values * channels
        if len(values) != channels:
            raise ValueError(f"{flag} needs 1 or num_channels={channels} values, got {len(values)}")
        return values

    # transformers' ViT image processor: the torchvision one where torchvision is installed, else the PIL one
    vit_processor = transformers.ViTImageProcessor if importlib.util.find_spec("torchvision") else transformers.ViTImageProcessorPil
    processor = vit_processor(
        size={"height": config.image_size, "width": config.image_size},
        image_mean=per_channel(args.image_mean, "--image_mean"), image_std=per_channel(args.image_std, "--image_std"),
    )
    return model, processor


def random_resized_crop(image, size: tuple[int, int], scale: tuple[float, float], generator: torch.Generator):
    """A crop of ``scale`` of the area and aspect ratio in [3/4, 4/3] (log-uniform), resized to
    ``size`` (height, width); the whole image when 10 draws do not fit."""
    width, height = image.size
    area = width * height
    for _ in range(10):
        u = torch.rand(4, generator=generator).tolist()
        target = area * (scale[0] + (scale[1] - scale[0]) * u[0])
        ratio = math.exp(math.log(3 / 4) + (math.log(4 / 3) - math.log(3 / 4)) * u[1])
        w, h = round(math.sqrt(target * ratio)), round(math.sqrt(target / ratio))
        if 0 < w <= width and 0 < h <= height:
            left, top = int(u[2] * (width - w + 1)), int(u[3] * (height - h + 1))
            return image.resize((size[1], size[0]), Image.BILINEAR, box=(left, top, left + w, top + h))
    return image.resize((size[1], size[0]), Image.BILINEAR)


def main(argv: Optional[list[str]] = None) -> dict:
    args = parse_args(argv)
    accelerator, out, settings, fingerprint, resume = training.start_run(args, "run_image_classification")
    logging.basicConfig(format="%(asctime)s %(levelname)s %(name)s: %(message)s",
                        level=logging.INFO if accelerator.is_main_process else logging.WARNING)

    with accelerator.main_process_first():
        raw, labels = load_images(args)
    model, processor = build_model(args, labels)
    cfg = model.config
    size = (cfg.image_size, cfg.image_size)
    mode = "L" if cfg.num_channels == 1 else "RGB"
    image_col, label_col = args.image_column_name, args.label_column_name

    def collate(examples):
        return {"images": [ex[image_col].convert(mode) for ex in examples],
                "labels": torch.tensor([ex[label_col] for ex in examples], dtype=torch.long)}

    # Augmentations are drawn in the loop (not in the data loader, which runs ahead) from a
    # generator per process whose state goes into every checkpoint: a resumed run draws the same.
    aug_gen = torch.Generator().manual_seed(args.seed + 1_000_003 * accelerator.process_index)

    def pixels(images) -> torch.Tensor:
        return processor(images=images, return_tensors="pt")["pixel_values"]

    def augment(batch) -> dict:
        images = []
        for image in batch["images"]:
            image = random_resized_crop(image, size, tuple(args.crop_scale), aug_gen)
            if torch.rand(1, generator=aug_gen).item() < args.hflip_probability:
                image = image.transpose(Image.Transpose.FLIP_LEFT_RIGHT)
            images.append(image)
        return {"pixel_values": pixels(images).to(accelerator.device), "labels": batch["labels"].to(accelerator.device)}

    sampler = training.EpochShuffleSampler(len(raw["train"]), args.seed)
    train_dl = DataLoader(raw["train"], sampler=sampler, collate_fn=collate, batch_size=args.per_device_train_batch_size,
                          generator=torch.Generator())
    eval_dl = DataLoader(raw["validation"], collate_fn=collate, batch_size=args.per_device_eval_batch_size)

    steps_per_epoch = math.ceil(len(train_dl) / (accelerator.num_processes * args.gradient_accumulation_steps))
    max_train_steps = args.max_train_steps or args.num_train_epochs * max(1, steps_per_epoch)
    optimizer = torch.optim.AdamW(training.optimizer_grouped_parameters(model, args.weight_decay), lr=args.learning_rate)
    warmup = training.warmup_steps(args, max_train_steps, default=math.ceil(0.05 * max_train_steps))
    model, optimizer = training.prepare(accelerator, model, optimizer)
    train_dl = accelerator.prepare_data_loader(train_dl, device_placement=False)
    eval_dl = accelerator.prepare_data_loader(eval_dl, device_placement=False)
    scheduler = training.make_scheduler(accelerator, args, optimizer, max_train_steps, warmup)
    training.start_tracking(accelerator, args, "run_image_classification", settings)

    def evaluate() -> dict:
        model.eval()
        preds, refs, losses = [], [], []
        with torch.no_grad():
            for batch in eval_dl:
                inputs = {"pixel_values": pixels(batch["images"]).to(accelerator.device),
                          "labels": batch["labels"].to(accelerator.device)}
                output = model(**inputs)
                logits, labels_b = accelerator.gather_for_metrics((output.logits, inputs["labels"]))
                preds.append(logits.argmax(-1).cpu().numpy())
                refs.append(labels_b.cpu().numpy())
                losses.append(accelerator.gather_for_metrics(output.loss.detach().float().reshape(1)).cpu())
        model.train()
        return {"eval_accuracy": float(accuracy_score(np.concatenate(refs), np.concatenate(preds))),
                "eval_loss": float(torch.cat(losses).mean())}

    accelerator.print(f"training: {len(raw['train'])} images, {len(raw['validation'])} for validation, "
                      f"{len(labels)} classes, {max_train_steps} steps, warm-up {warmup}")
    result = training.train_loop(
        accelerator, args, model=model, optimizer=optimizer, scheduler=scheduler, train_dl=train_dl, sampler=sampler,
        max_train_steps=max_train_steps, evaluate=evaluate, eval_steps=args.eval_steps, prepare_batch=augment,
        generators={"augmentation": aug_gen}, fingerprint=fingerprint, settings=settings, resume=resume,
        report=accelerator.print, desc="train",
    )
    step = result["step"]
    final, unwrapped = training.finish_run(accelerator, args, model, evaluate, result, out)
    if final is None:
        return {"step": step, "stopped": True}
    if accelerator.is_main_process:
        processor.save_pretrained(out)
        dataset = args.dataset_name or Path(args.train_dir).name
        save_model_card(
            unwrapped, out,
            results=[{"task": "image-classification", "dataset": dataset, "split": "validation",
                      "metric": "accuracy", "value": final["eval_accuracy"]}],
            datasets=[args.dataset_name] if args.dataset_name else None,
            training={"optimizer steps": step, "training images": len(raw["train"])},
        )
    training.end_run(accelerator, args, out, saved="model, image processor and card")
    return final


if __name__ == "__main__":
    run_main(main)
