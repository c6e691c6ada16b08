"""Former home of :func:`kernelized_attention` and the built-in backends, kept so that
``hf_kernattn.modeling.backends`` imports keep working: the entry point is ``dispatch.py``, the
registry and the ``auto`` rule ``registry.py``, the built-in registrations ``builtin_backends.py``.
"""

from __future__ import annotations

from .builtin_backends import (  # noqa: F401
    SPLIT_ARGUMENTS,
    STATE_ARGUMENTS,
    causal_chunked_attention,
    dense_attention,
    fft_attention,
    linear_attention,
    manhattan_attention,
    recurrent_attention,
    windowed_attention,
)
from .dispatch import kernelized_attention  # noqa: F401
from .registry import (  # noqa: F401
    _REGISTRY,
    AUTO_FFT_MAX_ERROR,
    AUTO_MAX_ERROR,
    BACKEND_ARGUMENTS,
    DEFAULT_TAKES,
    DEVICE_TYPES,
    BackendSpec,
    auto_candidates,
    available_backends,
    backends_for,
    choose_backend,
    load_auto_table,
    get_backend,
    register_backend,
)
