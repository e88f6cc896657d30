"""train.py with rank 1's loss NaN at its 2nd step: do torchrun's processes stop together?

    torchrun --standalone --nproc_per_node=2 benchmarks/nan_on_rank.py <train.py's flags>

In fp16 with a loss scaler the NaN reaches the other processes only as DDP's averaged gradients,
non-finite, which their scaler skips as it skips fp16's healthy overflows: only the guard's state,
reduced over the processes at each read (harness/monitor.py), stops every process at the same
step. Where the device is not CUDA fp16 is forced (CPU autocast simulates it); on CUDA train.py's
own choice stands: its default (--amp on) is this very case, fp16 with a loss scaler. Run by
tests/test_train.py and benchmarks/device_check.py (section 5).
"""

import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import train  # noqa: E402
from harness import devices  # noqa: E402

RANK, STEP = 1, 2  # whose loss turns NaN, at which of its steps (counted over the process's runs)
real_precision, real_loss, steps = devices.choose_precision, train.dear.dear_loss, [0]


def precision(device_type: str, amp: str, capability):
    if device_type == "cuda":
        return real_precision(device_type, amp, capability)
    return torch.float16, "fp16 autocast with a loss scaler (forced; simulated on the CPU)"


def loss(*args, **kwargs) -> dict:
    losses = real_loss(*args, **kwargs)
    steps[0] += 1
    if int(os.environ.get("RANK", "0")) == RANK and steps[0] == STEP:
        losses = {**losses, "total": losses["total"] * float("nan")}
    return losses


devices.choose_precision, train.dear.dear_loss = precision, loss  # what train.py calls
sys.exit(train.main(sys.argv[1:]))
