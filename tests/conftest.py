# Loaded by pytest before any test module. Without a GPU the Triton kernels run in Triton's CPU
# interpreter, and triton decides that when a kernel is defined (at `import kernels`), so the switch
# must be set here, before anything imports kernels or triton. (Importing torch does not import
# triton.)
import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
