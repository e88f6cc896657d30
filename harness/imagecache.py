"""harness/imagecache.py -- the few-shot training images decoded once into one uint8 buffer
(DecodedImages, train.py's --image-cache on), and the sampler that tells the loading processes
the epoch (EpochSampler), so that they live across epochs.

A few-shot training set is small (16 shots of 1,000 classes: 16,000 images) and read every epoch.
Decoding a photo and resampling it again each time costs a loading process about 3 ms an image,
about 350 images/s: tens of processes to feed one fast GPU (benchmarks/bench_loader.py). Decoded
once into memory as uint8, an epoch only crops, flips and normalises tensors: about five times
faster per process (docs/MEASURED.md, "The loader").
"""

from __future__ import annotations

import torch
from PIL import Image
from torch.utils.data import DataLoader, DistributedSampler
from torchvision import transforms as T

import data
from . import devices

CACHED_SIDE = 8 / 7  # with augmentation, each image is kept with its shorter side at 8/7 x size


def kept_transform(size: int, augment: bool) -> T.Compose:
    """A photo as it is kept, PIL -> (3, h, w) uint8. Augmented: resized (bicubic) so that its
    shorter side is CACHED_SIDE x size (256 for 224), the picture the random crop is then taken
    from (our choice, as FFCV's loaders keep them: the crop's pixels come from that, not from
    the full photo). Not augmented: the test transform's own resize and centre crop, so that the
    tensors it gives are test_transform's, bit for bit."""
    if augment:
        resize = [T.Resize(round(size * CACHED_SIDE), interpolation=T.InterpolationMode.BICUBIC)]
    else:
        resize = data.test_transform(size).transforms[:2]  # its resize and centre crop
    return T.Compose([*resize, T.PILToTensor()])


def kept_size(path: str, size: int, augment: bool) -> int:
    """The bytes kept_transform gives for the photo at `path`, from its header: torchvision's
    Resize(S) keeps int(S * long side / short side) on the long side (0 for a file that does not
    open: its decoding names it)."""
    if not augment:
        return 3 * size * size
    side = round(size * CACHED_SIDE)
    try:
        with Image.open(path) as image:
            short, long = sorted(image.size)
    except (OSError, SyntaxError, ValueError, Image.DecompressionBombError):
        return 0
    return 3 * side * int(side * long / short)


def normalised(image: torch.Tensor) -> torch.Tensor:
    """uint8 (3, h, w) -> CLIP's normalised float, as ToTensor and Normalize compute it."""
    return T.functional.normalize(image.float().div(255), data.CLIP_MEAN, data.CLIP_STD)


class DecodedImages(data.ImageDataset):
    """ImageDataset with every image decoded once, up front (`workers` processes), kept in memory
    as uint8 (kept_transform: 256 px on the shorter side for 224: 16,000 take about 3.9 GiB).
    Augmented: train_transform's random resized crop (bicubic, antialiased) and flip, on the
    kept tensor; not: the test transform's result exactly. The augmentation is seeded per image,
    epoch and seed as ImageDataset's.

    The images lie end to end in one buffer (offsets, shapes: image i is buffer[offsets[i]:...]
    seen as shapes[i]): three tensors to hand a loading process, one shared-memory file each
    where the dataset is pickled to it (forkserver, spawn), not one per image (16,000 open files
    against a common limit of 1,024)."""

    def __init__(self, items: list[data.Item], size: int, augment: bool, seed: int | None = None,
                 workers: int = 0):
        crop = T.RandomResizedCrop(size, scale=(0.5, 1.0), antialias=True,
                                   interpolation=T.InterpolationMode.BICUBIC)
        transform = (T.Compose([crop, T.RandomHorizontalFlip(), normalised]) if augment
                     else normalised)
        super().__init__(items, transform, seed)
        reader = data.ImageDataset(self.items, kept_transform(size, augment))  # in `workers`
        # The buffer, sized from the files' headers, filled as the images arrive: each comes
        # in a shared-memory file of its own, copied in at once (thousands held would fill
        # /dev/shm and the open-file limit).
        self.buffer = torch.empty(sum(kept_size(item.path, size, augment) for item in self.items),
                                  dtype=torch.uint8)
        shapes, offsets = [], [0]
        start = devices.LOADER_START if workers else None
        for image, _ in DataLoader(reader, batch_size=None, num_workers=workers,
                                   multiprocessing_context=start):
            self.buffer[offsets[-1]:offsets[-1] + image.numel()] = image.flatten()
            shapes.append(image.shape)
            offsets.append(offsets[-1] + image.numel())
        self.shapes = torch.tensor(shapes).reshape(-1, 3)  # (n, 3)
        self.offsets = torch.tensor(offsets)  # (n + 1,): image i is buffer[offsets[i]:offsets[i+1]]

    def image(self, index: int) -> torch.Tensor:  # the kept tensor, in place of the file
        start, stop = self.offsets[index:index + 2].tolist()
        return self.buffer[start:stop].view(self.shapes[index].tolist())


class EpochSampler(DistributedSampler):
    """DistributedSampler's order (a pure function of seed and epoch, set_epoch), each image's
    number handed on with the epoch, (epoch, number): the loading processes, kept across epochs
    (persistent_workers), read the epoch of each image's augmentation from what they are asked
    for, not from their copy of the dataset, made when they started."""

    def __iter__(self):
        return ((self.epoch, index) for index in super().__iter__())
