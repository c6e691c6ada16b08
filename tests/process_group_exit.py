"""The clean end of a test worker's part in a ``torch.distributed`` process group (not a test module).

A worker process that leaves its gloo process group for interpreter exit to clean up can abort
after all its work is done ("terminate called without an active exception", SIGABRT, exit code
-6), now and then, on a loaded machine. A gloo worker thread of torch (``pt_gloo_runloop``) keeps
the last reference to a finished collective for a moment after the collective has returned,
and with it tensors that Python created; releasing them takes the GIL. When that happens while
the interpreter is already finalizing, CPython ends the thread with ``pthread_exit``, whose
unwinding meets a ``noexcept`` destructor of torch, and the process aborts (the core shows
``~AsyncAllgatherWork`` -> ``TensorImpl::decref_pyobject`` -> ``take_gil`` ->
``PyThread_exit_thread`` on the worker thread, the main thread in ``Py_FinalizeEx``).

:func:`end_process_group` closes the group while the interpreter is fully alive: destroying a
gloo group joins its worker threads with the GIL released, so they finish what they hold first.
"""

from __future__ import annotations

import gc
import os
import sys
import time

GLOO_WORKER_THREAD = "pt_gloo_runloop"  # the name torch gives the worker threads of a gloo group


def gloo_worker_threads() -> int:
    """How many gloo worker threads this process runs (0 where threads cannot be listed)."""
    count = 0
    try:
        tasks = os.listdir("/proc/self/task")
    except OSError:
        return 0
    for task in tasks:
        try:
            with open(f"/proc/self/task/{task}/comm") as f:
                count += f.read().strip() == GLOO_WORKER_THREAD
        except OSError:  # the thread ended meanwhile
            pass
    return count


def end_process_group(wait: float = 2.0) -> None:
    """Leave the default process group (and every other group) for good, once every rank is
    done with its collectives: a barrier (no rank leaves while another still has a collective
    in flight), a garbage collection (models and wrappers in reference cycles would keep the
    group, and its threads, alive), then ``destroy_process_group()``. Does nothing when no
    process group is initialized.

    Returns once the group's gloo worker threads have ended (waiting at most ``wait`` seconds
    for them to go). If they still run, torch itself still holds the group (under FSDP2 its
    DTensor caches keep the device mesh, and with it the group, until the process ends): then
    this ends the process right here, with exit status 0, after flushing the standard streams
    (``os._exit``: no interpreter finalization for the threads to race with). So call it last,
    on every rank, and on the success path only (after a failure, call
    ``destroy_process_group()``: the other ranks may never reach the barrier)."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return
    dist.barrier()
    gc.collect()
    dist.destroy_process_group()
    deadline = time.monotonic() + wait
    while gloo_worker_threads():
        if time.monotonic() > deadline:
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(0)
        time.sleep(0.01)
