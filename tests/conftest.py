# Loaded by pytest before any test module. Without a GPU the Triton kernels run in Triton's CPU
# interpreter, and triton decides that when a kernel is defined (at `import kernels`), so the switch
# must be set here, before anything imports kernels or triton. (Importing torch does not import
# triton.)
import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


def pytest_configure(config):
    """Hugging Face's `kernels` package, where installed, shares its import name with this
    project's kernels.py, and transformers imports names from it at start-up: every test that
    compares with transformers would then fail with an ImportError naming neither. Said once, here.
    (transformers 5.25 requires that package: pyproject.toml holds transformers below 5.25.)"""
    import importlib.metadata

    try:
        importlib.metadata.distribution("kernels")
    except importlib.metadata.PackageNotFoundError:
        return
    raise pytest.UsageError(
        "Hugging Face's `kernels` package is installed, and transformers would import this "
        "project's kernels.py in its place: pip uninstall kernels, and keep transformers<5.25"
    )


def pytest_sessionstart(session):
    """Every C build the tests load, compiled two at a time before the first test. The tests load
    one build per ISA this CPU runs (tests/test_exactness.py), and one -O3 build of cpu_kernels.c
    takes one core 20-65 s (an AVX-512 build inlines its tile loops into one large function);
    built one after another as each ISA's first test came, they took 3.5 of the suite's 15
    minutes. A build already in the cache dir is loaded, not built again."""
    import concurrent.futures
    import functools

    import kernels

    isas = list(kernels.ISA_NEEDS)
    below = isas[isas.index(kernels.cpu_isa()) :]  # what this CPU (or NANOSPEC_ISA) runs
    builds = [functools.partial(kernels.cpu_kernels.__wrapped__, isa) for isa in below]
    # Third in line, so that both threads stay busy to the end: on an AMX Xeon the first two
    # builds take a minute each, the split one a minute, avx512 a minute, avx2 20 s, generic a few.
    builds.insert(2, build_under_split_fma_chains)
    with concurrent.futures.ThreadPoolExecutor(2) as pool:  # (the compiler frees the GIL)
        list(pool.map(lambda build: build(), builds))


def split_fma_chains(build_command):
    """build_command(isa, source) behind a compiler whose default tuning splits FMA chains of up to
    512 bits into a multiply and an add, as GCC 13's does: kernels.build_command's own flags come
    after it, and must win (tests/test_exactness.py)."""

    def command(isa, source):
        compiler, *rest = build_command(isa, source)
        return [compiler, "--param=avoid-fma-max-bits=512", *rest]

    return command


def build_under_split_fma_chains():
    """The native build under split_fma_chains, which tests/test_exactness.py loads: built here,
    in a process of its own that swaps kernels.build_command, into the cache dir where the test
    then finds it (the library's name hashes its command). In the test itself it took a minute
    of the suite with one core idle. A failure here is the test's to report."""
    import subprocess
    import sys

    tests = os.path.dirname(os.path.abspath(__file__))
    path = os.pathsep.join([tests, os.path.dirname(tests), os.environ.get("PYTHONPATH", "")])
    swap = "kernels.build_command = conftest.split_fma_chains(kernels.build_command)"
    code = f"import conftest, kernels; {swap}; kernels.cpu_kernels()"
    subprocess.run(
        [sys.executable, "-c", code], env=dict(os.environ, PYTHONPATH=path), capture_output=True
    )
