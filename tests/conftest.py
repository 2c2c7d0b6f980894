import os

import torch

# Triton kernels run on CPU tensors through the interpreter; it must be set before triton is imported.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
