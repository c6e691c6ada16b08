"""CPU threads of an example script's process: ``--num_threads``, else ``OMP_NUM_THREADS``, else
the physical cores divided among this machine's processes (what ``accelerate launch`` sets on CPU).
"""

from __future__ import annotations

import os
from typing import Optional

import torch

NUM_THREADS_HELP = (
    "CPU threads of torch in each process (default: OMP_NUM_THREADS when set, else the machine's physical cores "
    "divided among the processes on it, as accelerate launch does; on a machine shared with other jobs, 1 is "
    "often fastest)"
)


def local_process_count() -> int:
    """Processes of this run on this machine (``LOCAL_WORLD_SIZE`` of torchrun / accelerate launch, else 1)."""
    try:
        return max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
    except ValueError:
        return 1


def configure_threads(num_threads: Optional[int] = None, local_processes: Optional[int] = None) -> int:
    """Set torch's CPU thread count for this process and return it: ``num_threads`` when given,
    else ``OMP_NUM_THREADS`` when set, else the physical cores divided among the
    ``local_processes`` of this run on the machine (at least 1), the default of
    ``accelerate launch`` on CPU. torch's own default (every core, in every process) oversubscribes
    the cores when several processes run, and on a shared machine."""
    if num_threads is not None and (isinstance(num_threads, bool) or not isinstance(num_threads, int)
                                    or num_threads < 1):
        raise ValueError(f"num_threads must be a positive integer, got {num_threads!r}")
    if num_threads is None:
        env = os.environ.get("OMP_NUM_THREADS", "").strip()
        if env.isdigit() and int(env) >= 1:
            num_threads = int(env)
        else:
            try:
                import psutil

                cores = psutil.cpu_count(logical=False)
            except ImportError:
                cores = None
            cores = cores or os.cpu_count() or 1
            num_threads = max(1, cores // (local_processes or local_process_count()))
    torch.set_num_threads(num_threads)
    return num_threads
