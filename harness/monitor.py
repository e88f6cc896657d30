"""harness/monitor.py -- one run's training, watched (Progress): the loss terms' and the
accuracy's running sums kept on the device and read every --log-every steps, the wait for
data, and the guard that stops a run at a non-finite loss or gradient (Diverged); before it, the
run in two lines (describe). Called by train.train_job.
"""

from __future__ import annotations

import itertools
import time
from typing import List

import torch
import torch.distributed as dist

import dear
from .errors import TrainError
from .devices import Runtime, format_time, precision_name
from .plan import Job


LOSS_TERMS = ("total", "ce", "reg", "fusion", "branch")  # dear.dear_loss's (branch: branch-ce's)


# fp16: when the loss scaler's skipped steps stop a run, as a NaN would (our choices). A skipped
# step is an overflow or a kernel's NaN, and the scaler cannot tell them apart; a healthy run
# skips a handful at the start while the scale settles, then at most one each time the scale
# grows (every 2,000 steps): the toy world under simulated fp16 skipped 1 or 2 of each run's 480
# steps, all in its first 52 (docs/MEASURED.md, "Healthy skips").
MAX_SKIPPED_IN_A_ROW = 20  # the scale has then halved 20 times, from 65,536 to 1/16
MAX_SKIPPED_SHARE = 0.05  # of the call's steps, counted over at least SHARE_STEPS steps
SHARE_STEPS = 200  # so the first 200 steps may skip 10 (the scale's settling, with room)
MIN_LOSS_SCALE = 1.0  # below 1 an overflow is the unscaled gradient's own: not fp16's range


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
    scaler's to skip (it halves its scale), counted per epoch, and the run stops the same way at
    MAX_SKIPPED_IN_A_ROW in a row, more than MAX_SKIPPED_SHARE of the call's steps, or a scale
    below MIN_LOSS_SCALE. Nothing non-finite reaches a checkpoint: end_epoch saves after the
    epoch's last read, and not while steps are being skipped in a row."""

    def __init__(self, job: Job, settings, runtime: Runtime, model: dear.DeAR, scaler,
                 steps: int, steps_per_epoch: int, kept: int):
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
        self.skipped = torch.zeros(2, dtype=torch.long, device=device)  # fp16: this epoch, call
        self.scaler, self.kept = scaler, kept  # the epoch of the last checkpoint (0: none)

    def epoch(self, epoch: int, loader):
        """Epoch `epoch`'s batches as (step from 1, batch), timing the wait for each."""
        self.current = epoch
        self.epoch_started, self.waited, self.images = time.time(), 0.0, 0
        # per loss term, then correct predictions, the finite gradient norms' sum and count
        self.sums = torch.zeros(len(LOSS_TERMS) + 3, device=self.runtime.device)
        self.skipped[0] = 0  # metrics.jsonl counts each epoch's skips
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
        norm = gradient_norm(self.parameters)  # unscaled (train.py's scaler.unscale_)
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
        """The one host sync of the last --log-every steps: the guard's verdict, then the line.
        Under torchrun the guard's state is every process's worst (MAX), so that all stop at the
        same read: a NaN loss on one process reaches the others only as non-finite gradients."""
        guard = torch.cat([self.first_bad[None], self.bad_what, self.in_a_row[None],
                           self.skipped]).float()
        if self.runtime.world > 1:
            dist.all_reduce(guard, op=dist.ReduceOp.MAX)
        scale = [self.scaler._get_scale_async().float()[None]] if self.fp16 else []  # (1,) or none
        values = torch.cat([guard, *scale, self.sums]).tolist()
        first_bad, *bad_what = values[:len(self.bad_what) + 1]
        # skips in a row and this epoch's (as of this read), this call's
        self.in_a_row_read, self.skipped_steps, skipped = map(int, values[len(bad_what) + 1:][:3])
        self.loss_scale = values[len(guard)] if self.fp16 else None
        sums = values[-len(self.sums):]
        what = self.went_wrong(bad_what) if first_bad >= 0 else self.skips_wrong(skipped)
        if what:  # at the first non-finite step, else at this read
            at = int(first_bad) if first_bad >= 0 else self.current * self.steps_per_epoch + step
            raise Diverged(self.diverged(at, what))
        elapsed = max(time.time() - self.epoch_started, 1e-9)
        mean = {key: value / self.images for key, value in zip(LOSS_TERMS, sums)}
        self.last = dict(epoch=self.current + 1, lr=lr, loss={k: mean[k] for k in LOSS_TERMS
                                                            if k != "branch" or mean[k]},
                         train_accuracy=100 * sums[-3] / self.images,
                         gradient_norm=sums[-2] / max(sums[-1], 1),
                         images_per_second=self.images * self.runtime.world / elapsed,
                         data_wait=self.waited / elapsed, skipped_steps=self.skipped_steps,
                         **(dict(steps=step, loss_scale=self.loss_scale) if self.fp16 else {}))
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

    def went_wrong(self, bad_what: list) -> str:
        """What the first non-finite step had: which loss terms, the gradients, or the skips."""
        if bad_what[len(LOSS_TERMS) + 1]:
            return f"{MAX_SKIPPED_IN_A_ROW} steps in a row skipped by fp16's loss scaler"
        terms = [key for key, bad in zip(LOSS_TERMS, bad_what) if bad]
        what = [f"loss ({', '.join(terms)})"] if terms else []
        what += ["gradients"] if bad_what[len(LOSS_TERMS)] else []
        return " and ".join(what) + " not finite"

    def skips_wrong(self, skipped: int) -> str:
        """fp16's bounds on the loss scaler at a read: the share of skipped steps, the scale
        ("": within both)."""
        if skipped > MAX_SKIPPED_SHARE * max(self.done, SHARE_STEPS):
            return (f"{skipped} of {self.done} steps skipped by fp16's loss scaler (above "
                    f"{MAX_SKIPPED_SHARE:.0%})")
        if self.fp16 and self.loss_scale < MIN_LOSS_SCALE:
            return f"fp16's loss scale fell to {self.loss_scale:g} (below {MIN_LOSS_SCALE:g})"
        return ""

    def diverged(self, at: int, what: str) -> str:
        """The one line a diverged run gets: which run, where, what, in what arithmetic, what
        was kept and what to try."""
        epoch, step = divmod(at - 1, self.steps_per_epoch)
        kept = f"epoch {self.kept}'s checkpoint kept" if self.kept else "no checkpoint yet"
        return (f"[{self.job.label}] diverged at epoch {epoch + 1}, step {step + 1}: {what} "
                f"({precision_name(self.runtime.amp_dtype)}, attention {self.runtime.attention}); "
                f"{kept}; try --attention explicit or another --amp, then --resume")


def describe(job: Job, model: dear.DeAR, split, runtime: Runtime) -> None:
    """The run in two lines: its data, J and the fallback; the learnable parameters (per
    component of the token construction, and their shapes, in the log files)."""
    alone = "; the class branch alone (no attribute head)" if model.class_branch_only else ""
    runtime.log(f"[{job.label}] {len(split.train)} training images, {len(split.classnames)} "
                f"classes; attribute tokens from layer J={model.first_layer} (1-based){alone}")
    counts = model.parameter_counts()
    frozen = sum(p.numel() for p in model.clip.parameters())
    runtime.log(f"[{job.label}] learnable ({model.construction} tokens): "
                f"{sum(counts.values()):,} ({100 * sum(counts.values()) / frozen:.2f}% of CLIP)")
    runtime.detail(f"[{job.label}] learnable: "
                   + " + ".join(f"{name} {n:,}" for name, n in counts.items()))
    runtime.detail(f"[{job.label}] {model.parameter_summary()}")
