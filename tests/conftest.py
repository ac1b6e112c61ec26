# Loaded by pytest before any test module. Without a GPU the Triton kernels run in Triton's CPU
# interpreter, and triton decides that when a kernel is defined (at `import kernels`), so the switch
# must be set here, before anything imports kernels or triton. (Importing torch does not import
# triton.)
import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


def pytest_sessionstart(session):
    """Every C build the tests load, compiled two at a time before the first test. The tests load
    one build per ISA this CPU runs (tests/test_exactness.py), and one -O3 build of cpu_kernels.c
    takes one core 20-65 s (an AVX-512 build inlines its tile loops into one large function);
    built one after another as each ISA's first test came, they took 3.5 of the suite's 15
    minutes. A build already in the cache dir is loaded, not built again."""
    import concurrent.futures

    import kernels

    isas = list(kernels.ISA_NEEDS)
    below = isas[isas.index(kernels.cpu_isa()) :]  # what this CPU (or NANOSPEC_ISA) runs
    with concurrent.futures.ThreadPoolExecutor(2) as pool:  # (the compiler frees the GIL)
        list(pool.map(kernels.cpu_kernels.__wrapped__, below))
