"""A small CNN on synthetic images labelled by a fixed random teacher network, with SGD + Nesterov
momentum and weight decay: a classification task whose floor (the Bayes loss) is exact.

Images are 1 x S x S white noise. A random teacher CNN (fixed seed) maps each one to logits over
C classes, scaled so that their standard deviation over images is `logit_scale`; a training label
is drawn from the teacher's softmax (label noise). The held-out loss is the cross-entropy against
the teacher's whole distribution, -sum_y p(y|x) log q(y|x), averaged over a fixed set of images:
the expected loss over label draws, with no sampling noise. Its minimum, reached by q = p, is the
mean entropy of the teacher's distributions over the same images: the floor, exact.

Unlike the language tasks: a convolutional model without attention or embeddings, a momentum SGD
inner optimizer with weight decay (warmup, then cosine to 0), and samples instead of tokens.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Iterator
from dataclasses import dataclass
from typing import ClassVar

import torch
import torch.nn.functional as F
from torch import nn

from diloco.workers.tasks.base import Batch, TaskBase
_SCALE_SAMPLES = 8192
"""Images the teacher's logit scale is measured on (their own generator, from the teacher seed)."""


@dataclass(frozen=True)
class VisionTask(TaskBase):
    kind: ClassVar[str] = "vision"
    # The data: noise images and the teacher that labels them.
    image_size: int = 8
    """Images are 1 x image_size x image_size (even)."""
    classes: int = 10
    """Number of classes."""
    teacher_width: int = 8
    """Channels of the teacher's two conv layers."""
    teacher_seed: int = 0
    """Seed of the teacher's weights."""
    logit_scale: float = 3.0
    """Standard deviation of the teacher's logits over images: higher, less label noise, a lower floor."""
    # The student.
    width: int = 16
    """Channels of the student's first conv layer (the second has twice as many)."""
    hidden: int = 64
    """Width of the student's hidden fully connected layer."""
    # Data and evaluation (the held-out seed: TaskBase).
    batch_size: int = 64
    eval_samples: int = 4096
    """Size of the fixed held-out set."""
    # Inner optimizer: SGD with Nesterov momentum and weight decay on every parameter; warmup, then
    # cosine to 0 (the fields: TaskBase).
    momentum: float = 0.9
    """SGD momentum (Nesterov)."""
    lr: float = 0.05
    weight_decay: float = 5e-4
    warmup_steps: int = 20
    min_lr_ratio: float = 0.0
    grad_clip: float | None = None

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.image_size < 2 or self.image_size % 2 or self.classes < 2 or self.logit_scale <= 0:
            raise ValueError(f"need an even image_size >= 2, classes >= 2, logit_scale > 0: {self}")

    # ---- data ----

    def teacher_probs(self, images: torch.Tensor) -> torch.Tensor:
        """The teacher's class probabilities p(y|x), float64 [n, classes]."""
        return _teacher(self.image_size, self.classes, self.teacher_width, self.teacher_seed,
                        self.logit_scale).probs(images)

    def images(self, n: int, generator: torch.Generator) -> torch.Tensor:
        return torch.randn(n, 1, self.image_size, self.image_size, generator=generator)

    def tokens_per_step(self) -> int:
        return self.batch_size

    def train_batches(self, stream_seed: int) -> Iterator[Batch]:
        """(images, labels drawn from the teacher) batches; same seed, same stream."""
        generator = self.train_generator(stream_seed)
        while True:
            x = self.images(self.batch_size, generator)
            yield x, torch.multinomial(self.teacher_probs(x), 1, generator=generator).squeeze(1)

    def eval_set(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The fixed held-out images and the teacher's probabilities for them (float32)."""
        return _eval_set(self)

    def entropy_floor(self) -> float:
        """Mean entropy of the teacher's distributions over the held-out images: the Bayes loss."""
        _, p = self.eval_set()
        p = p.double()
        return float(-(p * torch.where(p > 0, p.log(), torch.zeros_like(p))).sum(1).mean())

    # ---- model, optimizer, loss ----

    def make_model(self, seed: int) -> SmallCNN:
        with torch.random.fork_rng(devices=[]):  # torch's default init draws from the global RNG
            torch.manual_seed(seed)
            return SmallCNN(self.image_size, self.classes, self.width, self.hidden)

    def make_inner_optimizer(self, model: torch.nn.Module) -> torch.optim.SGD:
        return torch.optim.SGD(model.parameters(), lr=self.lr, momentum=self.momentum, nesterov=True,
                               weight_decay=self.weight_decay)

    def loss(self, model: torch.nn.Module, batch: Batch) -> torch.Tensor:
        images, labels = batch
        return F.cross_entropy(model(images), labels)

    @torch.no_grad()
    def eval_loss(self, model: torch.nn.Module) -> float:
        """Cross-entropy against the teacher's distributions: -sum_y p(y|x) log q(y|x), mean over images."""
        was_training = model.training
        model.eval()
        try:
            images, p = self.eval_set()
            return float(-(p * F.log_softmax(model(images), dim=1)).sum(1).mean())
        finally:
            model.train(was_training)


class SmallCNN(nn.Module):
    """conv 3x3 -> ReLU -> conv 3x3 -> ReLU -> avg-pool 2 -> linear -> ReLU -> linear (logits).
    Parameters are `net.<i>.weight|bias`: each layer is a unit of its own for the fragment planner."""

    def __init__(self, image_size: int, classes: int, width: int, hidden: int) -> None:
        super().__init__()
        self.net = nn.Sequential(
            nn.Conv2d(1, width, 3, padding=1), nn.ReLU(),
            nn.Conv2d(width, 2 * width, 3, padding=1), nn.ReLU(),
            nn.AvgPool2d(2), nn.Flatten(),
            nn.Linear(2 * width * (image_size // 2) ** 2, hidden), nn.ReLU(),
            nn.Linear(hidden, classes))

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        return self.net(images)


class _Teacher:
    """A random CNN (conv-tanh-conv-tanh-pool-linear), weights N(0, 1/fan_in) from its seed, logits
    scaled to standard deviation `logit_scale` over images."""

    def __init__(self, image_size: int, classes: int, width: int, seed: int, logit_scale: float) -> None:
        g = torch.Generator().manual_seed(seed)
        self.conv1 = torch.randn(width, 1, 3, 3, generator=g) / 3.0
        self.conv2 = torch.randn(width, width, 3, 3, generator=g) / math.sqrt(9 * width)
        features = width * (image_size // 2) ** 2
        self.linear = torch.randn(classes, features, generator=g) / math.sqrt(features)
        reference = torch.randn(_SCALE_SAMPLES, 1, image_size, image_size, generator=g)
        self.scale = logit_scale / float(self._logits(reference).std())

    def _logits(self, images: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(F.conv2d(images, self.conv1, padding=1))
        h = torch.tanh(F.conv2d(h, self.conv2, padding=1))
        return F.avg_pool2d(h, 2).flatten(1) @ self.linear.T

    def probs(self, images: torch.Tensor) -> torch.Tensor:
        return torch.softmax(self._logits(images).double() * self.scale, dim=1)


@functools.lru_cache(maxsize=4)
def _teacher(image_size: int, classes: int, width: int, seed: int, logit_scale: float) -> _Teacher:
    return _Teacher(image_size, classes, width, seed, logit_scale)


@functools.lru_cache(maxsize=4)
def _eval_set(task: VisionTask) -> tuple[torch.Tensor, torch.Tensor]:
    images = task.images(task.eval_samples, task.eval_generator())
    return images, task.teacher_probs(images).float()
