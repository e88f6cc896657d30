"""train.py with rank 1's loss NaN at its 2nd step: do torchrun's processes stop together?

    torchrun --standalone --nproc_per_node=2 benchmarks/nan_on_rank.py <train.py's flags>

In fp16 with a loss scaler the NaN reaches the other processes only as DDP's averaged gradients,
non-finite, which their scaler skips as it skips fp16's healthy overflows: only the guard's state,
reduced over the processes at each read (harness/monitor.py), stops every process at the same
step. (In fp32 or bf16 every process would stop on its own non-finite gradients: nothing to
prove.) Run by tests/test_train.py and benchmarks/device_check.py, whose one-process check of NaN
losses (every 5th) uses nan_loss too.
"""

import contextlib
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import train  # noqa: E402
from harness import devices  # noqa: E402

RANK, STEP = 1, 2  # the script's: whose loss turns NaN, at which of its steps


@contextlib.contextmanager
def nan_loss(at):
    """train.py in this process with its loss NaN at each step where at(step) (1, 2, ...: counted
    over the process's runs), in fp16 with a loss scaler: forced where the device is not CUDA (CPU
    autocast simulates it); on CUDA train.py's own choice stands: its default (--amp on) is that
    fp16 already, and an --amp given is obeyed."""
    real_precision, real_loss, steps = devices.choose_precision, train.dear.dear_loss, [0]

    def precision(device_type: str, amp: str, capability):
        if device_type == "cuda":
            return real_precision(device_type, amp, capability)
        return torch.float16, "fp16 autocast with a loss scaler (forced; simulated on the CPU)"

    def loss(*args, **kwargs) -> dict:
        losses = real_loss(*args, **kwargs)
        steps[0] += 1
        return {**losses, "total": losses["total"] * float("nan")} if at(steps[0]) else losses

    devices.choose_precision, train.dear.dear_loss = precision, loss  # what train.py calls
    try:
        yield
    finally:
        devices.choose_precision, train.dear.dear_loss = real_precision, real_loss


if __name__ == "__main__":
    with nan_loss(lambda step: int(os.environ.get("RANK", "0")) == RANK and step == STEP):
        sys.exit(train.main(sys.argv[1:]))
