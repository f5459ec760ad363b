"""Test-wide setup.

TRITON_INTERPRET is read when a Triton kernel is decorated, so it must be set before any kernel
module is imported: here, at collection start. On CPU-only machines the interpreter runs the
Triton kernels with numpy (small fp32 shapes only).
"""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

# CI explores a fixed set of hypothesis examples (reproducible runs); local runs stay random so they
# keep finding new cases.
from hypothesis import settings  # noqa: E402

settings.register_profile("ci", derandomize=True, print_blob=True)
if os.environ.get("CI"):
    settings.load_profile("ci")
