"""Benchmark commands (``hf-kernattn bench NAME``), one module per benchmark.

One contract for all of them: each module defines ``NAME``, ``add_arguments(parser)``,
``build_parser()`` and ``run(args) -> int``, and takes the common flags defined once in
:func:`hf_kernattn.bench.common.add_common_arguments`: ``--out`` (default
``bench_results/NAME``), ``--quick``, ``--threads`` (default 1) and ``--device``. Every run
writes its CSV files (and plot, where it has one) into its ``--out`` folder; the demo passes
``--out bench_results/demo/NAME`` so its results sit beside, never over, a full run's.
"""
