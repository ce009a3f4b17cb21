"""The benchmark tasks beside the demo's: seeds fix data and init, floors are right, wire forms round-trip."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
import torch.nn.functional as F

from diloco.infra.bench.quality_tasks import TASKS, pick
from diloco.workers.tasks.language import MarkovLanguage
from diloco.workers.tasks.demo import DemoTask
from diloco.workers.tasks.base import TaskBase, train_baseline
from diloco.workers.tasks.gpt2 import GPT2Task, window_nll
from diloco.workers.tasks.kinds import KINDS, task_from_wire
from diloco.workers.tasks.vision import VisionTask

VISION = VisionTask(image_size=4, classes=5, teacher_width=4, width=4, hidden=16, batch_size=32, eval_samples=512,
                    warmup_steps=5)
GPT2 = GPT2Task(vocab_size=12, n_layer=1, n_embd=16, n_head=2, seq_len=16, batch_size=4, eval_tokens=256)


def test_every_task_round_trips_through_its_wire_form() -> None:
    tasks = [dataclasses.replace(VISION, lr=0.1, grad_clip=2.0), dataclasses.replace(GPT2, betas=(0.8, 0.99)),
             DemoTask(lr=1e-3), *(b.task for b in TASKS.values())]
    for task in tasks:
        wire = task.to_wire()
        assert wire["kind"] == task.kind and task_from_wire(wire) == task == type(task).from_wire(wire)
    assert set(KINDS) == {"demo", "gpt2", "vision"}


def test_a_wire_form_without_a_kind_is_a_demo_task_and_kinds_are_checked() -> None:
    old = {k: v for k, v in DemoTask(d_model=32).to_wire().items() if k != "kind"}  # a task.json of an older demo
    assert task_from_wire(old) == DemoTask(d_model=32)
    with pytest.raises(ValueError, match="unknown task kind"):
        task_from_wire({**GPT2.to_wire(), "kind": "audio"})
    with pytest.raises(ValueError, match="is not a 'vision' task"):
        VisionTask.from_wire(GPT2.to_wire())
    with pytest.raises(ValueError, match="schema"):
        task_from_wire({**VISION.to_wire(), "schema": 99})


def _lrs(task, steps: int) -> list[float]:
    optimizer = task.make_inner_optimizer(task.make_model(0))
    schedule = task.make_lr_schedule(optimizer, steps)
    lrs = []
    for _ in range(steps):
        lrs.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        schedule.step()
    return lrs


def test_every_task_shares_one_piece_for_its_batch_held_out_seed_and_inner_schedule() -> None:
    shared = {f.name for f in dataclasses.fields(TaskBase)}
    assert shared >= {"batch_size", "eval_seed", "lr", "weight_decay", "warmup_steps", "min_lr_ratio", "grad_clip"}
    for cls in KINDS.values():
        assert issubclass(cls, TaskBase) and shared <= {f.name for f in dataclasses.fields(cls)}
    # A wire form from before the shared piece has no min_lr_ratio: gpt2 and vision read as before
    # (cosine down to 0), the demo as before (constant after its warmup).
    for task, floor in ((VISION, 0.0), (GPT2, 0.0), (DemoTask(), 1.0)):
        old = {k: v for k, v in task.to_wire().items() if k != "min_lr_ratio"}
        assert task_from_wire(old).min_lr_ratio == floor
    # Every kind's schedule ends at its floor, min_lr_ratio x lr, and the shared checks hold for each.
    small_demo = DemoTask(d_model=16, n_layers=1, n_heads=2, d_ff=32, seq_len=8, eval_tokens=64)
    for task in (VISION, GPT2, small_demo):
        task = dataclasses.replace(task, warmup_steps=2, min_lr_ratio=0.25)
        assert _lrs(task, 40)[-1] == pytest.approx(0.25 * task.lr, rel=0.01)
        with pytest.raises(ValueError, match="min_lr_ratio"):
            dataclasses.replace(task, min_lr_ratio=1.5)
        with pytest.raises(ValueError, match="batch_size"):
            dataclasses.replace(task, batch_size=0)


def test_vision_data_and_init_are_fixed_by_their_seeds() -> None:
    first, second, other = VISION.train_batches(3), VISION.train_batches(3), VISION.train_batches(4)
    for _ in range(2):
        (x1, y1), (x2, y2), (x3, _) = next(first), next(second), next(other)
        assert torch.equal(x1, x2) and torch.equal(y1, y2) and not torch.equal(x1, x3)
    assert x1.shape == (32, 1, 4, 4) and y1.shape == (32,) and int(y1.max()) < 5
    state = torch.random.get_rng_state()
    a, b, c = (VISION.make_model(s).state_dict() for s in (0, 0, 1))
    assert torch.equal(torch.random.get_rng_state(), state), "building a model must not move the global RNG"
    assert all(torch.equal(a[k], b[k]) for k in a) and not torch.equal(a["net.0.weight"], c["net.0.weight"])
    assert {"net.0.weight", "net.2.weight", "net.6.weight", "net.8.bias"} <= a.keys()  # one unit per layer


def test_vision_floor_is_the_teachers_loss_and_labels_follow_the_teacher() -> None:
    class Teacher(torch.nn.Module):  # predicts exactly the teacher's distribution
        def forward(self, images: torch.Tensor) -> torch.Tensor:
            return VISION.teacher_probs(images).log().float()

    floor = VISION.entropy_floor()
    assert 0 < floor < math.log(5)
    assert VISION.eval_loss(Teacher()) == pytest.approx(floor, abs=1e-5)
    assert VISION.eval_loss(VISION.make_model(0)) > floor + 0.1
    # The training labels are draws from the teacher: their mean log loss under it estimates the floor.
    batches = VisionTask(**{**dataclasses.asdict(VISION), "batch_size": 4000}).train_batches(0)
    images, labels = next(batches)
    nll = F.nll_loss(VISION.teacher_probs(images).log(), labels).item()
    assert nll == pytest.approx(floor, abs=0.05)


def test_vision_schedule_warms_up_then_decays_to_zero_and_training_learns() -> None:
    lrs = _lrs(VISION, 20)
    assert lrs[0] == pytest.approx(VISION.lr / 5) and lrs[4] == pytest.approx(VISION.lr)
    assert lrs[5:] == sorted(lrs[5:], reverse=True) and lrs[-1] < 0.02 * VISION.lr
    curve = train_baseline(dataclasses.replace(VISION, lr=0.1), 60, seed=0)
    assert curve[-1][0] == 60 and curve[-1][1] < VISION.eval_loss(VISION.make_model(0)) - 0.05


def test_gpt2_task_data_floor_and_init() -> None:
    x1, y1 = next(GPT2.train_batches(0))
    x2, _ = next(GPT2.train_batches(1))
    assert torch.equal(x1, next(GPT2.train_batches(0))[0]) and not torch.equal(x1, x2)
    assert x1.shape == (4, 16) and torch.equal(x1[:, 1:], y1[:, :-1])
    assert 0 < GPT2.entropy_floor() < math.log(12)
    assert GPT2.entropy_floor() == pytest.approx(GPT2.language.window_floor_nats(17), abs=0.15)  # 240 tokens


def test_gpt2_floor_is_the_languages_own_loss_on_the_windows() -> None:
    """Averaged over many windows, the Bayes predictor's loss is the language's exact window floor,
    position by position (the first order-1 positions lack part of their context)."""
    lang = MarkovLanguage(vocab_size=5, order=3, branching=3, seed=2, concentration=0.7)
    nll = window_nll(lang, lang.windows(40_000, 9, torch.Generator().manual_seed(0)))
    assert nll.shape == (40_000, 8)
    assert nll.mean().item() == pytest.approx(lang.window_floor_nats(9), abs=0.01)
    first = lang._prefix_entropy_nats(2) - lang._prefix_entropy_nats(1)  # H(X_1 | X_0)
    assert nll[:, 0].mean().item() == pytest.approx(first, abs=0.02)
    assert nll[:, 3:].mean().item() == pytest.approx(lang.entropy_rate_nats(), abs=0.01)
    assert GPT2.tokens_per_step() == 64 and GPT2.eval_set().shape == (16, 17)


def test_gpt2_model_is_a_seeded_unmodified_hugging_face_model() -> None:
    pytest.importorskip("transformers")
    state = torch.random.get_rng_state()
    a, b = GPT2.make_model(0), GPT2.make_model(0)
    assert torch.equal(torch.random.get_rng_state(), state)
    assert type(a).__name__ == "GPT2LMHeadModel" and a.lm_head.weight is a.transformer.wte.weight
    assert all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters(), strict=True))
    assert GPT2.eval_loss(a) == pytest.approx(math.log(12), abs=0.1)
    schedule = GPT2.make_lr_schedule(GPT2.make_inner_optimizer(a), 100)
    assert schedule.get_last_lr()[0] == 0.0  # linear warmup from 0


def test_bench_tasks_are_picked_by_name_and_sync_every_divides_their_steps() -> None:
    assert list(pick("all")) == list(TASKS) and list(pick("gpt2, demo")) == ["demo", "gpt2"]
    with pytest.raises(SystemExit, match="unknown task"):
        pick("demo,cifar")
    for name, bench in TASKS.items():
        assert name == "demo" or bench.steps % bench.sync_every == 0, name
