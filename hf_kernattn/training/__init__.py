"""Shared training code of the example scripts, one module per concern:

* :mod:`~hf_kernattn.training.args`: the command-line flags the Accelerate scripts have in
  common (:func:`add_training_args`, :func:`check_training_args`, :func:`warmup_steps`), the
  checks of run settings they share with ``linearize`` (:func:`check_training_values`) and small
  parsers of flag values;
* :mod:`~hf_kernattn.training.optimizer`: the weight-decay rule (:func:`decay_parameter_names`,
  :func:`optimizer_grouped_parameters`);
* :mod:`~hf_kernattn.training.checkpoints`: atomic, verified checkpoints and exact resume
  (:func:`save_checkpoint`, :func:`load_checkpoint`, :func:`resolve_checkpoint`), stored through
* :mod:`~hf_kernattn.training.serialization`: state without pickle, safetensors and JSON
  (:func:`save_tree`, :func:`load_tree`), and the random states (:func:`rng_state`);
* :mod:`~hf_kernattn.training.loop`: the start of a run (:func:`start_run`,
  :func:`identify_run`), the
  Accelerate training loop (:func:`train_loop`), the end
  of a run (:func:`finish_run`, :func:`end_run`, :func:`push_if_asked`), the schedule
  (:func:`make_scheduler`) and a script's entry (:func:`run_main`);
* :mod:`~hf_kernattn.training.distributed`: the ``Accelerator`` of a script, honouring FSDP and
  DeepSpeed launches on CPU processes (:func:`make_accelerator`), and its ``prepare`` that keeps
  the models' persistent buffers through FSDP2's memory-efficient loading (:func:`prepare`);
* :mod:`~hf_kernattn.training.threads`: CPU threads per process (:func:`configure_threads`).

Every public name is importable from ``hf_kernattn.training`` itself.
"""

from .args import (
    NOT_FINGERPRINTED,
    SCHEDULER_TYPES,
    add_training_args,
    check_text_files,
    check_training_args,
    check_training_values,
    parse_overrides,
    warmup_steps,
)
from .checkpoints import (
    CHECKPOINT_PREFIX,
    FORMAT_VERSION,
    MODEL_FILE,
    STATE_FILE,
    checkpoint_manifest,
    fingerprint_settings,
    is_complete,
    load_checkpoint,
    prune_checkpoints,
    resolve_checkpoint,
    run_fingerprint,
    save_checkpoint,
    settings_diff,
    verify_checkpoint,
    write_state_file,
)
from .distributed import launch_sharding, make_accelerator, prepare
from .loop import (
    EpochShuffleSampler,
    end_run,
    finish_run,
    identify_run,
    make_scheduler,
    push_if_asked,
    run_main,
    save_final_model,
    start_run,
    start_tracking,
    train_loop,
)
from .optimizer import WEIGHT_DECAY_HELP, decay_parameter_names, optimizer_grouped_parameters
from .serialization import CheckpointError, load_tree, rng_state, save_tree, set_rng_state
from .threads import NUM_THREADS_HELP, configure_threads, local_process_count

__all__ = [
    "CHECKPOINT_PREFIX", "FORMAT_VERSION", "MODEL_FILE", "NOT_FINGERPRINTED", "NUM_THREADS_HELP", "SCHEDULER_TYPES",
    "STATE_FILE", "WEIGHT_DECAY_HELP", "CheckpointError", "EpochShuffleSampler", "add_training_args",
    "check_text_files", "check_training_args", "check_training_values", "checkpoint_manifest", "configure_threads", "decay_parameter_names", "end_run",
    "fingerprint_settings", "finish_run", "identify_run", "is_complete", "launch_sharding", "load_checkpoint", "load_tree", "local_process_count",
    "make_accelerator", "make_scheduler", "optimizer_grouped_parameters", "parse_overrides", "prepare", "prune_checkpoints",
    "push_if_asked",
    "resolve_checkpoint", "rng_state", "run_fingerprint", "run_main", "save_checkpoint", "save_final_model",
    "save_tree", "set_rng_state", "settings_diff", "start_run", "start_tracking", "train_loop", "verify_checkpoint", "warmup_steps",
    "write_state_file",
]
