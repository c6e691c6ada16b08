"""Former home of the Toeplitz kernel product by FFT, kept so that
``hf_kernattn.modeling.kernels_toeplitz`` imports keep working: the product and the attention
built on it are one file, ``kernels_fft.py``.
"""

from __future__ import annotations

from .kernels_fft import (  # noqa: F401
    FFT_BLOCK_BYTES,
    ToeplitzKernelProduct,
    spatial_shape,
    toeplitz_kernel_product_reference,
    toeplitz_kernel_spectrum,
)
