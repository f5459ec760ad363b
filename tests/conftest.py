"""Test-wide setup.

TRITON_INTERPRET is read when a Triton kernel is decorated, so it must be set before any kernel
module is imported: here, at collection start. On CPU-only machines the interpreter runs the
Triton kernels with numpy (small fp32 shapes only).
"""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
