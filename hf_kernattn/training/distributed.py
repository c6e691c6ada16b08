"""The ``Accelerator`` of the example scripts, with FSDP and DeepSpeed launches honoured on CPU
processes, and the FSDP2 gathering that checkpoints of sharded runs need.
"""

from __future__ import annotations

import argparse
import os
from typing import Optional

import torch
from torch import nn
from transformers.utils import logging

from .threads import configure_threads

logger = logging.get_logger(__name__)


def _launch_flag(name: str) -> bool:
    return os.environ.get(name, "false").lower() == "true"


def make_accelerator(args: argparse.Namespace, **kwargs):
    """The ``Accelerator`` of an example script (``--cpu``, ``--mixed_precision``, tracking,
    gradient accumulation), honouring an FSDP or DeepSpeed ``accelerate launch`` on CPU processes;
    also sets the CPU threads (``--num_threads``, :func:`configure_threads`).

    accelerate (1.15) applies an FSDP or DeepSpeed launch configuration only on GPUs and similar
    devices: on CPU an FSDP launch silently trains with DDP (with ``--cpu``) or as unconnected
    single processes, and a DeepSpeed launch fails on its batch-size check (it sees one process).
    Here an FSDP launch with ``--cpu`` or on a machine without CUDA shards with FSDP over gloo,
    and a DeepSpeed launch with ``--cpu`` or on a machine without CUDA runs DeepSpeed over gloo on
    its CPU accelerator (``DS_ACCELERATOR=cpu``). DeepSpeed
    keeps the optimizer partitioned in its own format, which our checkpoints (safetensors and
    JSON) cannot hold: under DeepSpeed ``--stop_after_steps`` and ``--resume_from_checkpoint``
    are refused with a ``ValueError``, and ``--checkpointing_steps`` is ignored with a warning
    (only the final model is saved)."""
    from accelerate import Accelerator
    from accelerate.utils import DistributedType, InitProcessGroupKwargs

    if args.mixed_precision:
        kwargs["mixed_precision"] = args.mixed_precision
    if args.with_tracking:
        kwargs.update(log_with=args.report_to, project_dir=args.output_dir)
    cpu = args.cpu
    if _launch_flag("ACCELERATE_USE_DEEPSPEED"):
        why = ("resumable checkpoints are not supported under DeepSpeed (it keeps the optimizer partitioned in its "
               "own pickled format; our checkpoints are safetensors and JSON only); FSDP (accelerate config "
               "fsdp_version: 2) checkpoints and resumes")
        flags = [f"--{name}" for name in ("stop_after_steps", "resume_from_checkpoint")
                 if getattr(args, name, None) is not None]
        if flags:
            raise ValueError(f"{', '.join(flags)}: {why}")
        if getattr(args, "checkpointing_steps", None) is not None:
            logger.warning(f"--checkpointing_steps {args.checkpointing_steps} ignored: {why}. Only the final model "
                           "is saved.")
            args.checkpointing_steps = None
        if cpu or not torch.cuda.is_available():
            from deepspeed.accelerator import get_accelerator

            if get_accelerator().device_name() != "cpu":
                raise ValueError(f"--cpu under DeepSpeed needs DeepSpeed's CPU accelerator (set DS_ACCELERATOR=cpu); "
                                 f"it chose {get_accelerator().device_name()!r}")
            # accelerate hands DeepSpeed only to an Accelerator without cpu=True, and on a machine
            # without CUDA it needs the process-group backend named to see every process.
            cpu = False
            kwargs["kwargs_handlers"] = list(kwargs.get("kwargs_handlers", [])) + [InitProcessGroupKwargs(backend="gloo")]
    elif _launch_flag("ACCELERATE_USE_FSDP") and not torch.cuda.is_available():
        cpu = True  # otherwise accelerate runs each process alone on a machine without CUDA
    accelerator = Accelerator(gradient_accumulation_steps=args.gradient_accumulation_steps, cpu=cpu, **kwargs)
    if _launch_flag("ACCELERATE_USE_FSDP") and accelerator.distributed_type == DistributedType.MULTI_CPU:
        _use_fsdp_on_cpu(accelerator)
    batch = getattr(args, "per_device_train_batch_size", None)
    if accelerator.distributed_type == DistributedType.DEEPSPEED and batch is not None:
        # DeepSpeed needs the micro-batch when the model is prepared; scripts that prepare their
        # data loaders separately would leave it unknown ("auto")
        ds_config = accelerator.state.deepspeed_plugin.deepspeed_config
        if ds_config.get("train_micro_batch_size_per_gpu", "auto") == "auto":
            ds_config["train_micro_batch_size_per_gpu"] = batch
    configure_threads(getattr(args, "num_threads", None))
    return accelerator


def launch_sharding() -> Optional[str]:
    """``"FSDP"`` or ``"DeepSpeed"`` when ``accelerate launch`` was given such a configuration (its
    ``ACCELERATE_USE_*`` variables), else ``None``."""
    if _launch_flag("ACCELERATE_USE_FSDP"):
        return "FSDP"
    if _launch_flag("ACCELERATE_USE_DEEPSPEED"):
        return "DeepSpeed"
    return None


def _use_fsdp_on_cpu(accelerator) -> None:
    """Switch an ``Accelerator`` of CPU processes (gloo) from DDP to the FSDP plugin of the launch
    configuration (the ``FSDP_*`` variables ``accelerate launch`` sets), as accelerate does on GPUs."""
    from accelerate import FullyShardedDataParallelPlugin
    from accelerate.state import PartialState
    from accelerate.utils import DistributedType

    plugin = FullyShardedDataParallelPlugin()
    if accelerator.mixed_precision != "no":
        plugin.set_mixed_precision(accelerator.mixed_precision)
    state = accelerator.state
    state.fsdp_plugin = plugin
    state.distributed_type = DistributedType.FSDP
    PartialState._shared_state["distributed_type"] = DistributedType.FSDP
    logger.info(f"FSDP{plugin.fsdp_version} on {accelerator.num_processes} CPU processes (gloo)")


def sharding_of(accelerator) -> str:
    """How the model's weights are laid out over the processes: ``"fsdp2"`` (torch FSDP2
    shards, through ``accelerate launch`` with ``fsdp_version: 2``) or ``"none"`` (every process
    holds them whole: one process, DDP)."""
    return "fsdp2" if getattr(accelerator, "is_fsdp2", False) else "none"


def fsdp2_full_state(model: nn.Module, optim: torch.optim.Optimizer) -> tuple[dict, dict]:
    """The whole model's and optimizer's state gathered from FSDP2 shards onto the CPU of the
    main process (parameter names as keys; other processes get empty dicts)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, get_optimizer_state_dict

    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    return get_model_state_dict(model, options=options), get_optimizer_state_dict(model, optim, options=options)


def fsdp2_load_full_state(model: nn.Module, optim: torch.optim.Optimizer, model_state: dict, optim_state: dict,
                          path) -> None:
    """Load what :func:`fsdp2_full_state` gathered into an FSDP2 model and its optimizer (every
    process reads the whole state and keeps its own shards)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict, set_optimizer_state_dict

    options = StateDictOptions(full_state_dict=True)
    try:
        set_model_state_dict(model, model_state, options=options)
        set_optimizer_state_dict(model, optim, optim_state, options=options)
    except (KeyError, RuntimeError, ValueError) as err:
        raise ValueError(f"the checkpoint {path} does not fit the model: {err}") from err


def prepare(accelerator, *objects):
    """``accelerator.prepare(*objects)``, keeping the models' persistent buffers through FSDP2's
    ``cpu_ram_efficient_loading`` (accelerate's default for ``--use_fsdp``).

    That loading path moves the model to the meta device and broadcasts the main process's state
    dict into the shards, treating every entry as a sharded parameter; our feature maps keep
    persistent buffers (random projections, draw and step counters), which it cannot place.
    They are held aside while the model is prepared, then registered again (persistent, so
    checkpoints keep them) with the main process's values broadcast to every process, as the
    loading path does for parameters."""
    plugin = getattr(accelerator.state, "fsdp_plugin", None)
    if not (getattr(accelerator, "is_fsdp2", False) and getattr(plugin, "cpu_ram_efficient_loading", False)):
        return accelerator.prepare(*objects)
    held = []  # (module, buffer name, value)
    for model in (o for o in objects if isinstance(o, nn.Module)):
        for module in model.modules():
            for name, buf in module._buffers.items():
                if buf is None or name in module._non_persistent_buffers_set:
                    continue
                if buf.is_meta:  # a process that loaded no weights (transformers under this option)
                    module._buffers[name] = buf = torch.zeros(buf.shape, dtype=buf.dtype)
                held.append((module, name, buf.detach().clone()))
                module._non_persistent_buffers_set.add(name)
    try:
        prepared = accelerator.prepare(*objects)
    finally:
        for module, name, _ in held:
            module._non_persistent_buffers_set.discard(name)
    for module, name, value in held:
        value = value.to(accelerator.device)
        torch.distributed.broadcast(value, src=0)
        module.register_buffer(name, value, persistent=True)
    return prepared
