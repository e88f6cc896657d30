"""harness/monitor.py -- one run's training, watched (Progress): the loss terms' and the
accuracy's running sums kept on the device and read every --log-every steps, the wait for
data, and the guard that stops a run at a non-finite loss or gradient (Diverged). Called by
train.train_job's loop.
"""

from __future__ import annotations

import itertools
import time
from typing import List

import torch

import dear
from .errors import TrainError
from .devices import Runtime, format_time, precision_name
from .plan import Job


LOSS_TERMS = ("total", "ce", "reg", "fusion", "branch")  # dear.dear_loss's (branch: branch-ce's)


# fp16: the loss scaler's skipped steps in a row that stop a run (our choice: its scale has then
# halved 20 times, from 65,536 to 1/16; an overflow that survives that is no overflow).
MAX_SKIPPED_IN_A_ROW = 20


class Diverged(TrainError):
    """A run met a non-finite loss or gradient: it stops, keeps its last finite checkpoint, and
    the call goes on with its other runs (--resume continues it from that checkpoint)."""


def gradient_norm(parameters: List[torch.Tensor]) -> torch.Tensor:
    """The L2 norm of every gradient together, () on the device: non-finite if any entry is."""
    norms = [torch.linalg.vector_norm(p.grad.float()) for p in parameters if p.grad is not None]
    return torch.linalg.vector_norm(torch.stack(norms)) if norms else torch.zeros(())


class Progress:
    """One run's training, watched. Per step, on the device (no host sync): the loss terms' and
    the training accuracy's running sums, the gradient norm, the time spent waiting for the
    loader, and the guard against a non-finite step. Every --log-every steps and at each epoch's
    end, one read of them all (the one host sync of those steps): the progress line, and the
    guard's verdict. The first non-finite loss term or gradient stops the run (Diverged) at that
    read, naming the step where it happened; under fp16 a non-finite gradient is the loss
    scaler's to skip (it halves its scale), counted, and MAX_SKIPPED_IN_A_ROW in a row stop the
    run the same way. Nothing non-finite reaches a checkpoint: end_epoch saves after the
    epoch's last read."""

    def __init__(self, job: Job, settings, runtime: Runtime, model: dear.DeAR, scaler,
                 steps: int, steps_per_epoch: int):
        self.job, self.settings, self.runtime, self.model = job, settings, runtime, model
        self.fp16 = scaler.is_enabled()  # non-finite gradients: skipped steps, not a stop
        self.steps, self.steps_per_epoch, self.done = steps, steps_per_epoch, 0
        self.started = time.time()  # for the time left of this run and the call (times)
        device = runtime.device
        self.parameters = model.learnable_parameters()  # fixed for the run: listed once
        self.zero = torch.zeros((), device=device)
        self.first_bad = torch.tensor(-1, device=device)  # the first non-finite step, or -1
        self.bad_what = torch.zeros(len(LOSS_TERMS) + 2, dtype=torch.bool, device=device)
        self.in_a_row = torch.tensor(0, device=device)  # fp16: skipped steps in a row
        self.skipped = torch.tensor(0, device=device)  # fp16: skipped steps of this call

    def epoch(self, epoch: int, loader):
        """Epoch `epoch`'s batches as (step from 1, batch), timing the wait for each."""
        self.current = epoch
        self.epoch_started, self.waited, self.images = time.time(), 0.0, 0
        # per loss term, then correct predictions, the finite gradient norms' sum and count
        self.sums = torch.zeros(len(LOSS_TERMS) + 3, device=self.runtime.device)
        batches = iter(loader)
        for step in itertools.count(1):
            asked = time.perf_counter()
            batch = next(batches, None)
            self.waited += time.perf_counter() - asked  # the loader's share of the step
            if batch is None:
                return
            yield step, batch

    def step(self, step: int, lr: float, losses: dict, logits: torch.Tensor,
             labels: torch.Tensor) -> None:
        """The step's numbers into the sums and the guard; at a logged step, the read."""
        zero = self.zero
        terms = torch.stack([losses.get(key, zero).detach().float() for key in LOSS_TERMS])
        norm = gradient_norm(self.parameters)  # unscaled after scaler.step
        n = len(labels)
        correct = (logits.detach().argmax(-1) == labels).sum()
        gradients_finite = torch.isfinite(norm)
        finite_norm = torch.where(gradients_finite, norm, zero)  # fp16's skipped steps aside
        self.sums += torch.cat([terms * n, correct[None], finite_norm[None],
                                gradients_finite[None].float()])
        self.images += n
        self.done += 1
        # The guard: which of the loss terms, the gradients, the scaler's skips went wrong.
        self.in_a_row = (self.in_a_row + 1) * ~gradients_finite if self.fp16 else self.in_a_row
        self.skipped = self.skipped + (~gradients_finite).long() if self.fp16 else self.skipped
        wrong = torch.cat([~torch.isfinite(terms),
                           (~gradients_finite if not self.fp16 else zero.bool())[None],
                           (self.in_a_row >= MAX_SKIPPED_IN_A_ROW)[None]])
        first = wrong.any() & (self.first_bad < 0)
        global_step = self.current * self.steps_per_epoch + step
        self.first_bad = torch.where(first, global_step, self.first_bad)
        self.bad_what = torch.where(first, wrong, self.bad_what)
        if step % self.settings["log_every"] == 0 or step == self.steps_per_epoch:
            self.read(step, lr)

    def read(self, step: int, lr: float) -> None:
        """The one host sync of the last --log-every steps: the guard's verdict, then the line."""
        values = torch.cat([self.sums, self.first_bad[None].float(), self.bad_what.float(),
                            self.skipped[None].float()]).tolist()
        sums, first_bad = values[:len(self.sums)], int(values[len(self.sums)])
        bad_what = values[len(self.sums) + 1:-1]
        self.skipped_steps = int(values[-1])
        if first_bad >= 0:
            raise Diverged(self.diverged(first_bad, bad_what))
        elapsed = max(time.time() - self.epoch_started, 1e-9)
        mean = {key: value / self.images for key, value in zip(LOSS_TERMS, sums)}
        self.last = dict(epoch=self.current + 1, lr=lr, loss={k: mean[k] for k in LOSS_TERMS
                                                            if k != "branch" or mean[k]},
                         train_accuracy=100 * sums[-3] / self.images,
                         gradient_norm=sums[-2] / max(sums[-1], 1),
                         images_per_second=self.images * self.runtime.world / elapsed,
                         data_wait=self.waited / elapsed, skipped_steps=self.skipped_steps)
        self.runtime.detail(f"[{self.job.label}] epoch {self.current + 1}/"
                            f"{self.settings['epochs']} step {step}/{self.steps_per_epoch} "
                            + self.summary() + f"; {self.times()}")

    def times(self) -> str:
        """This run's time so far, and about how long it and the call have left (the later runs
        that train, Runtime.runs_after, taken to last as long as this one; evaluations not
        counted): 'elapsed 0:00:12, ~0:00:36 left (call ~0:05:00)'."""
        elapsed = time.time() - self.started
        left = elapsed / self.done * (self.steps - self.done)
        call = left + self.runtime.runs_after * (elapsed + left)
        return (f"elapsed {format_time(elapsed)}, ~{format_time(left)} left "
                f"(call ~{format_time(call)})")

    def brief(self) -> str:
        """The printed line's few words (the rest is in log.txt): loss, accuracy, speed, times."""
        last = self.last
        return (f"loss {last['loss']['total']:.3f} acc {last['train_accuracy']:.1f}%, "
                f"{last['images_per_second']:.0f} img/s; {self.times()}")

    def summary(self) -> str:
        """The last read in a few words: losses, training accuracy, lr, speed, data wait."""
        last = self.last
        terms = " ".join(f"{key} {value:.3f}" for key, value in last["loss"].items()
                         if key != "total")
        skipped = f", {last['skipped_steps']} steps skipped by fp16's loss scaler" \
            if self.fp16 and last["skipped_steps"] else ""
        return (f"loss {last['loss']['total']:.3f} ({terms}) acc {last['train_accuracy']:.1f}% "
                f"lr {last['lr']:.1e}, {last['images_per_second']:.0f} img/s "
                f"(data wait {100 * last['data_wait']:.0f}%){skipped}")

    def diverged(self, first_bad: int, bad_what: list) -> str:
        """The one line a non-finite step gets: which run, where, what, in what arithmetic, what
        was kept and what to try."""
        epoch, step = divmod(first_bad - 1, self.steps_per_epoch)
        terms = [key for key, bad in zip(LOSS_TERMS, bad_what) if bad]
        what = [f"loss ({', '.join(terms)})"] if terms else []
        what += ["gradients"] if bad_what[len(LOSS_TERMS)] else []
        what = " and ".join(what) + " not finite"
        if bad_what[len(LOSS_TERMS) + 1]:
            what = f"{MAX_SKIPPED_IN_A_ROW} steps in a row skipped by fp16's loss scaler"
        kept = f"epoch {epoch}'s checkpoint kept" if epoch else "no checkpoint yet"
        return (f"[{self.job.label}] diverged at epoch {epoch + 1}, step {step + 1}: {what} "
                f"({precision_name(self.runtime.amp_dtype)}, attention {self.runtime.attention}); "
                f"{kept}; try --attention explicit or another --amp, then --resume")
