"""harness/devices.py -- where a call computes: the device, the precision (autocast, TF32), the
attention kernel, the CPU threads, the loaders' processes, several processes under torchrun (and
rank 0's waits), and where each line goes (Runtime: printed, and kept in the log files). Called
by train.py at the start of a call.
"""

from __future__ import annotations

import contextlib
import datetime
import json
import os
import shutil
import sys
from dataclasses import dataclass, field
from typing import Callable, Dict, List, Optional, Tuple

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.utils.data import DataLoader

import clip_model
import data
from .errors import TrainError
from .cli import SDPA_BACKENDS


@dataclass
class Runtime:
    """Where the tensors live and how many processes share the work, decided once per call; and
    where its lines go: printed, and kept in the call's log.txt and the current run's."""
    device: torch.device
    rank: int = 0
    world: int = 1
    amp_dtype: Optional[torch.dtype] = None  # autocast dtype on CUDA, None = fp32
    precision: str = "fp32"  # the precision and why (choose_precision), for the header
    waiting_group: Optional[object] = None  # under torchrun: the gloo group of wait_for_main
    attention: str = "sdpa"  # the attention kernel: explicit, or sdpa (the backend torch runs)
    attention_why: str = "sdpa"  # the same and why, for the header (attention_choice)
    kernel: str = "sdpa"  # clip_model's: "sdpa" or "explicit"
    backends: Optional[List[str]] = None  # the sdpa backends allowed (None: torch's choice)
    loaders: Dict[str, Tuple[int, int]] = field(default_factory=lambda: dict(
        train=(0, PREFETCH), eval=(0, PREFETCH)))  # (workers, in flight): loader_plan's
    call_log: Optional[object] = None  # <output>/log.txt, open while the run folder exists
    run_log: Optional[object] = None  # the current run's <folder>/log.txt
    pending: List[str] = field(default_factory=list)  # lines before the run folder existed
    runs_after: int = 0  # the call's runs after the current one that train (its time left)

    @property
    def main(self) -> bool:  # rank 0 alone prints and writes files
        return self.rank == 0

    def log(self, line: str) -> None:
        """A line for the reader: printed, and kept in the log files."""
        if self.main:
            print(line, flush=True)
            self.keep(line)

    def detail(self, line: str) -> None:
        """A line for the log files alone: every progress line, the long tables."""
        if self.main:
            self.keep(line)

    def keep(self, line: str) -> None:
        if self.call_log is None:
            self.pending.append(line)  # written once the run folder's log.txt opens
        for log in (self.call_log, self.run_log):
            if log is not None:
                log.write(line + "\n")
                log.flush()


def pick_device(name: str) -> torch.device:
    mps = torch.backends.mps.is_available()
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "mps" if mps else "cpu")
    try:
        device = torch.device(name)
    except (RuntimeError, TypeError):
        device = None  # e.g. "gpu": refused below, in one line
    # torch knows more device types (meta, xla, hpu, ...) than this script drives.
    if (device is None or device.type not in ("cpu", "cuda", "mps")
            or (device.type != "cuda" and device.index)):
        raise TrainError(f"--device {name}: not a device; use auto, cpu, cuda, cuda:N or mps")
    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if device.type == "cuda" and (device.index or 0) >= count:
        raise TrainError(f"--device {name}: this machine has "
                         + (f"{count} CUDA devices (cuda:0 to cuda:{count - 1})"
                            if count else "no CUDA device; use --device auto or cpu"))
    if device.type == "mps" and not mps:
        raise TrainError(f"--device {name}: MPS is not available here; use --device auto or cpu")
    return device


# Rank 0 does some work alone (the head analysis, after waiting for another call's lock on it);
# the other processes wait for it on a CPU-side gloo group with this timeout, never in a
# collective of the device's group, whose timeout (NCCL's: 10 minutes) that work may outlast.
# Constants, not flags (our choice): they only end a wait on a rank 0 that hangs (one that dies
# ends the run at once: torchrun stops every process when one exits), so one generous value
# serves every run. The analysis lock's bound is the shorter, so that rank 0 still has an hour
# for the analysis itself (ViT-B/16's 2,000 images: minutes on a GPU).
ANALYSIS_LOCK_TIMEOUT = datetime.timedelta(hours=1)  # another call analysing the same heads


MAIN_WORK_TIMEOUT = datetime.timedelta(hours=2)  # the other processes, for rank 0's analysis


BF16_CAPABILITY = (8, 0)  # CUDA compute capability with bf16 in hardware (Ampere and later)


def choose_precision(device_type: str, amp: str, capability: Optional[Tuple[int, int]]):
    """-> (the autocast dtype, None for fp32; the choice and why), training and evaluation
    alike. --amp on (the default): fp16 with a loss scaler, the lineage's (CoOp, MaPLe, MMRL run
    CLIP in fp16), chosen by measurement: on the toy world it moves the logits about a tenth as
    far as bf16 and changed no prediction where bf16 changed one (benchmarks/precision_table.py,
    docs/USAGE.md "Precision"). --amp bf16: bf16 (no scaler), from compute capability 8.0, where
    it is in hardware (below it emulated: refused). --amp off: fp32. Autocast on CUDA only: CPU
    and MPS run fp32."""
    if device_type != "cuda":
        return None, f"fp32 (autocast on CUDA only; {device_type} runs fp32)"
    if amp == "off":
        return None, "fp32 (--amp off)"
    where = f"compute capability {capability[0]}.{capability[1]}"
    if amp == "bf16":
        if tuple(capability) < BF16_CAPABILITY:
            raise TrainError(f"--amp bf16: this GPU ({where}) has no bf16 in hardware; use "
                             "--amp on (fp16 with a loss scaler) or --amp off")
        return torch.bfloat16, f"bf16 autocast (--amp bf16; {where})"
    return torch.float16, (f"fp16 autocast with a loss scaler (--amp {amp}: the lineage's, the "
                           "closest to fp32 as measured), training and evaluation")


def precision_name(amp_dtype: Optional[torch.dtype]) -> str:
    return {None: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}[amp_dtype]


def setup_runtime(settings) -> Runtime:
    """One process, or one of several started by torchrun (which sets RANK and WORLD_SIZE):
    each then drives one device and DistributedDataParallel averages the gradients. A CUDA
    device is made the current one (kernels, the allocator and NCCL use that one); the process
    group is left by end_runtime."""
    device, world, rank = pick_device(settings["device"]), int(os.environ.get("WORLD_SIZE", "1")), 0
    if world > 1:
        rank = int(os.environ["RANK"])
        if device.type == "cuda":
            device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
    if device.type == "cuda" and device.index is not None:  # --device cuda:1 in one process too
        torch.cuda.set_device(device)
    waiting_group = None
    if world > 1:
        # gloo: CPU (and the tests)
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
        waiting_group = dist.new_group(backend="gloo", timeout=MAIN_WORK_TIMEOUT)
    capability = torch.cuda.get_device_capability(device) if device.type == "cuda" else None
    amp_dtype, precision = choose_precision(device.type, settings["amp"], capability)
    if device.type == "cuda":  # fp32 means fp32: no TF32 in matmuls or cuDNN's convolutions
        torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
        precision += "; TF32 off"
    kernel, backends, why = attention_choice(settings["attention"], device)
    attention = "explicit"
    if kernel == "sdpa":  # which fused kernel that is, found by running it
        attention = f"sdpa ({sdpa_kernel_used(device, amp_dtype, backends)})"
    # decided once: nothing below decides again
    return Runtime(device, rank, world, amp_dtype, precision, waiting_group, attention,
                   f"{attention}: --attention {settings['attention']}, {why}", kernel, backends)


def attention_record() -> str:
    """Where device_check.py keeps its verdict on each fused kernel, per GPU and torch build."""
    return os.path.join(clip_model.default_cache_dir(), "device_check", "attention.json")


def gpu_build(device: torch.device) -> str:
    """This GPU and the software that decides its kernels, as a key of attention_record."""
    return (f"{torch.cuda.get_device_name(device)}, torch {torch.__version__}, "
            f"cuDNN {torch.backends.cudnn.version()}")


def kernel_verdicts(device: torch.device) -> Dict[str, str]:
    """device_check's verdicts on this GPU and build: {backend: "ok" | "wrong" | "unavailable"};
    {} where it never ran."""
    try:
        with open(attention_record(), encoding="utf-8") as f:
            return dict(json.load(f).get(gpu_build(device), {}))
    except (OSError, ValueError, AttributeError):
        return {}


def attention_choice(choice: str, device: torch.device):
    """--attention -> (clip_model's kernel, the sdpa backends allowed or None for torch's own
    choice, the choice in a few words for the header)."""
    if choice == "explicit":
        return "explicit", None, "clip_model's per-head maths"
    if choice in SDPA_BACKENDS:
        return "sdpa", [SDPA_BACKENDS[choice]], f"torch's fused {choice} kernel alone"
    if choice == "sdpa" or device.type != "cuda":
        return "sdpa", None, "torch's choice of fused kernel"
    verdicts = kernel_verdicts(device)  # auto on a GPU
    wrong = [name for name, backend in SDPA_BACKENDS.items() if verdicts.get(backend) == "wrong"]
    allowed = [backend for name, backend in SDPA_BACKENDS.items() if name not in wrong
               and (name != "cudnn" or verdicts.get(backend) == "ok")]
    excluded = [f"{name} (found wrong by device_check on this GPU)" for name in wrong]
    if verdicts.get("CUDNN_ATTENTION") != "ok" and "cudnn" not in wrong:
        excluded.append("cudnn (not yet passed by device_check on this GPU)")
    return "sdpa", allowed, ("torch's choice of fused kernel"
                             + (f", except {' and '.join(excluded)}" if excluded else ""))


def sdpa_backends(backends: Optional[List[str]]):
    """A context in which torch's fused attention picks among `backends` alone (None: all)."""
    if backends is None:
        return contextlib.nullcontext()
    from torch.nn.attention import SDPBackend, sdpa_kernel

    return sdpa_kernel([getattr(SDPBackend, name) for name in backends])


def sdpa_kernel_used(device: torch.device, dtype: Optional[torch.dtype],
                     backends: Optional[List[str]], case: Optional[tuple] = None) -> str:
    """Which backend torch's fused attention runs for `case` (q, k, v, mask), else a DeAR-shaped
    case (ViT-B/16: 12 heads, 197 + 5 tokens, a generalization head's mask on every other head),
    on this device, found by running it once as allowed, then each backend alone: the one that
    gives the same bits."""
    import warnings

    if case is None:
        generator = torch.Generator().manual_seed(0)
        q, k, v = (torch.randn(2, 12, 202, 64, generator=generator).to(device, dtype or torch.float32)
                   for _ in range(3))
        mask = torch.zeros(12, 202, 202)
        mask[::2, :197, 197:] = mask[::2, 197:, :197] = float("-inf")
        case = q, k, v, mask.to(device, q.dtype)[None]  # mask (1, H, N, N)
    q, k, v, mask = case
    with warnings.catch_warnings():  # a backend that cannot run says why in a warning
        warnings.simplefilter("ignore")
        try:
            with sdpa_backends(backends):
                used = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        except RuntimeError:  # none of them runs here (torch: "No viable backend")
            names = " or ".join(n for n, b in SDPA_BACKENDS.items() if b in (backends or []))
            raise TrainError(f"--attention {names or 'sdpa'}: torch's fused kernel cannot run on "
                             f"this {device.type}; use --attention auto, sdpa or explicit") from None
        for name, backend in SDPA_BACKENDS.items():
            try:
                with sdpa_backends([backend]):
                    if torch.equal(F.scaled_dot_product_attention(q, k, v, attn_mask=mask), used):
                        return name
            except RuntimeError:  # this backend cannot run the case
                continue
    return "not found"


# The loaders' processes (--workers; unset: one per CPU core but one, at most MAX_WORKERS, on a
# GPU; none on the CPU, where they would compete with the model) and the batches each keeps in
# flight (torch's 2). The plan is per node: torchrun's processes on it (LOCAL_WORLD_SIZE) share
# its cores and /dev/shm, so each plans for its part. The batches travel through shared memory
# (/dev/shm), which a container often caps at 64 MB; ViT-B/16's training batch of 32 images is
# 19 MB, an evaluation batch of 64 39 MB. So the batches in flight are held to half of a
# process's part of /dev/shm (a lone batch, one worker's one: to all of it): fewer in flight,
# then fewer processes, down to none (the main process loads: no shared memory), said in a line.
MAX_WORKERS = 16


PREFETCH = 2


# How the loaders' processes start, stated because Python 3.14 makes forkserver Linux's default:
# fork on Linux (our choice), where a worker inherits the dataset (the decoded images: GBs)
# copy-on-write, where forkserver and spawn would pickle it to each worker through /dev/shm;
# spawn elsewhere (macOS: fork is unsafe beside its system frameworks).
LOADER_START = "fork" if sys.platform.startswith("linux") else "spawn"


def shared_memory_free() -> Optional[int]:
    """/dev/shm's free bytes (None where there is no /dev/shm: macOS, Windows)."""
    return shutil.disk_usage("/dev/shm").free if os.path.isdir("/dev/shm") else None


def usable_cpus() -> int:
    """The cores this process may run on (a container's or taskset's limit, not the machine's)."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def loader_plan(settings, runtime: Runtime, size: int) -> Dict[str, Tuple[int, int]]:
    """{"train", "eval": (workers, batches in flight per worker)} for images of size x size, that
    fit this process's part of the node: --workers, else the default above; fewer where its part
    of /dev/shm would overflow."""
    node = max(int(os.environ.get("LOCAL_WORLD_SIZE", "1")), 1)  # torchrun's processes here
    requested, gpu = settings["workers"], runtime.device.type == "cuda"
    if requested is None:
        requested = min(usable_cpus() // node - 1, MAX_WORKERS) if gpu else 0
    free, plan, lowered = shared_memory_free(), {}, []
    share = None if free is None else free // node
    for name, batch in (("train", settings["batch_size"]), ("eval", settings["eval_batch_size"])):
        workers, prefetch, batch_bytes = max(requested, 0), PREFETCH, batch * 3 * size * size * 4
        in_flight = lambda: workers * prefetch * batch_bytes  # noqa: E731
        while workers and share is not None and in_flight() > (share if in_flight() == batch_bytes
                                                               else share // 2):
            prefetch, workers = (1, workers) if prefetch > 1 else (prefetch, workers - 1)
        plan[name] = (workers, prefetch)
        if (workers, prefetch) != (max(requested, 0), PREFETCH):
            lowered.append(f"{name} {workers} workers x {prefetch} batch{'es' * (prefetch > 1)}"
                           f" of {batch_bytes / 2**20:.0f} MB"
                           + " (one batch is more than all of it: the main process loads)"
                           * (not workers))
    if lowered:
        part = f", {share / 2**20:.0f} MB for each of this node's {node} processes" * (node > 1)
        runtime.log(f"loader: {', '.join(lowered)} in flight, fewer than asked: /dev/shm has "
                    f"{free / 2**20:.0f} MB free{part}, and they may fill half of it (a lone "
                    "batch: all of it)")
    return plan


def loader(dataset, batch_size: int, runtime: Runtime, kind: str, **options) -> DataLoader:
    """A DataLoader as loader_plan planned `kind` ("train" or "eval"): its workers started as
    LOADER_START and kept across epochs (each image's epoch comes with it: imagecache.EpochSampler),
    its batches in flight, and on CUDA pinned memory, whose copies to the GPU can overlap."""
    workers, in_flight = runtime.loaders[kind]
    return DataLoader(dataset, batch_size=batch_size, num_workers=workers,
                      prefetch_factor=in_flight if workers else None,
                      persistent_workers=workers > 0,
                      multiprocessing_context=LOADER_START if workers else None,
                      pin_memory=runtime.device.type == "cuda", **options)


def loader_of(items: list, settings, size: int, runtime: Runtime) -> DataLoader:
    """The test-transform loader of evaluation, features and the head analysis."""
    return loader(data.ImageDataset(items, data.test_transform(size)), settings["eval_batch_size"],
                  runtime, "eval")


@contextlib.contextmanager
def cpu_threads(toy: bool):
    """torch's CPU threads for this call -> (inside the block) a few words saying which: the toy
    world's fixed toyworld.THREADS (its numbers then do not depend on the machine's cores), else
    torch's default, left as it is (ViT-B/16's large matrices use every core). The caller's
    count is restored after the block (the tests call train.main in their own process)."""
    callers = torch.get_num_threads()
    if not toy:
        yield f"{callers} CPU threads (torch's default)"
        return
    import toyworld  # the project's own world: its one thread

    torch.set_num_threads(toyworld.THREADS)
    try:
        yield f"{toyworld.THREADS} CPU thread (the toy world's, on every machine)"
    finally:
        torch.set_num_threads(callers)


def end_runtime(runtime: Runtime) -> None:
    """Leave the process group setup_runtime joined: on every way out of a call (train.run holds
    this in its ExitStack), early returns and errors included."""
    if runtime.waiting_group is not None:
        dist.destroy_process_group()  # every group: the device's and the waiting one


def wait_for_main(runtime: Runtime, what: str) -> None:
    """Every process meets here once rank 0 has done `what` alone: the others wait on the gloo
    group, a CPU-side wait of up to MAIN_WORK_TIMEOUT (see there)."""
    if runtime.world == 1:
        return
    try:
        dist.barrier(group=runtime.waiting_group)
    except RuntimeError:  # gloo's timeout (DistBackendError)
        waited = format_time(MAIN_WORK_TIMEOUT.total_seconds())
        raise TrainError(f"process {runtime.rank}: waited {waited} for rank 0's {what} in vain "
                         "(devices.MAIN_WORK_TIMEOUT); see rank 0's output, then continue with "
                         "--resume") from None


def autocast(runtime: Runtime):
    if runtime.amp_dtype is None:
        return torch.autocast("cpu", enabled=False)  # a no-op context: fp32
    return torch.autocast(runtime.device.type, dtype=runtime.amp_dtype)  # choose_precision's


def fused_optimizer(runtime: Runtime) -> bool:
    """AdamW's fused kernel on CUDA and wherever fp16's loss scaler runs: the scaler then hands
    it the step's overflow flag on the device, where a plain AdamW's step has the host read it
    first (GradScaler.step's found_inf.item(): a host sync per step). The CPU's fp32 keeps torch's
    default (the quick start's numbers)."""
    return runtime.device.type == "cuda" or runtime.amp_dtype == torch.float16


def grad_scaler(device: torch.device, enabled: bool):
    """fp16's loss scaler on the run's device (disabled: every call passes through); the CPU has
    one too (the tests run it enabled)."""
    return torch.amp.GradScaler(device.type, enabled=enabled)


def load_scaler_state(scaler, state: dict, log: Callable[[str], None],
                      diverged: bool = False) -> None:
    """A checkpoint's loss-scaler state into this call's scaler: the precision may change on
    --resume (--amp, another GPU). A run that had no scaler (bf16 or fp32 save {}) resumed in fp16
    starts a fresh one, as does a run that diverged (its state is not passed); a saved scaler is
    left unused in bf16 or fp32. One line says which."""
    if scaler.is_enabled() and state:
        scaler.load_state_dict(state)
    elif scaler.is_enabled() and diverged:
        log(f"resumed in fp16 after a divergence: a fresh loss scaler ({scaler.get_scale():g})")
    elif scaler.is_enabled():
        log("resumed in fp16 from a run without a loss scaler (bf16 or fp32): a fresh scaler")
    elif state:
        log("resumed in bf16 or fp32 from an fp16 run: its loss scaler is not needed")


def sum_over_processes(values: List[float], runtime: Runtime) -> List[float]:
    if runtime.world == 1:
        return values  # one process: nothing to sum
    tensor = torch.tensor(values, dtype=torch.float64, device=runtime.device)
    dist.all_reduce(tensor)  # in place: every process gets the sums
    return tensor.tolist()  # [correct..., total] summed over processes


def format_time(seconds: float) -> str:
    seconds = int(max(seconds, 0))  # h:mm:ss
    return f"{seconds // 3600}:{seconds % 3600 // 60:02d}:{seconds % 60:02d}"
