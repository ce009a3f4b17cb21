"""A Hugging Face `Trainer` as a learner (`diloco.hf.DilocoCallback`): a real Trainer training a tiny GPT-2
(built from a config, nothing downloaded, CPU) against the session's Redis and S3 and a real coordinator
serving in a background thread. The run must publish versions merged from the Trainer's contributions,
store the losses the model computed, and count the learner finished when `trainer.train()` returns.
"""

from __future__ import annotations

import math

import pytest
import torch

pytest.importorskip("accelerate")  # the Trainer needs it (the hf extra)
transformers = pytest.importorskip("transformers")

from diloco.hf import DilocoCallback  # noqa: E402
from diloco.storage.history import read_manifest  # noqa: E402
from diloco.workers.learner import LearnerConfig  # noqa: E402
from diloco.workers.losses import read_losses  # noqa: E402
from harness import make_coordinator, serving, wait_for  # noqa: E402

SEQ = 16
STEPS = 24


class Copying(torch.utils.data.Dataset):
    """Sequences of a repeated random pattern: a tiny GPT-2 learns them quickly."""

    def __init__(self, n: int) -> None:
        g = torch.Generator().manual_seed(0)
        self.rows = [torch.randint(0, 32, (4,), generator=g).repeat(SEQ // 4) for _ in range(n)]

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.rows[i], "labels": self.rows[i]}


@pytest.mark.slow  # transformers' import and a Trainer's start-up: `make test-slow`
def test_a_trainer_trains_as_a_learner_of_a_run(endpoints, run_id, tmp_path):
    torch.manual_seed(0)
    config = transformers.GPT2Config(vocab_size=32, n_positions=SEQ, n_embd=32, n_layer=2, n_head=2)
    model = transformers.GPT2LMHeadModel(config)
    args = transformers.TrainingArguments(
        output_dir=str(tmp_path / "out"), max_steps=STEPS, per_device_train_batch_size=4, learning_rate=3e-3,
        logging_steps=8, save_strategy="no", report_to=[], use_cpu=True, disable_tqdm=True,
        include_num_input_tokens_seen=True)
    callback = DilocoCallback(run_id, endpoints=endpoints, learner_id="trainer",
                              config=LearnerConfig(heartbeat_s=0.05))
    trainer = transformers.Trainer(model=model, args=args, train_dataset=Copying(256), callbacks=[callback])
    coord = make_coordinator(endpoints, run_id)
    try:
        with serving(coord):
            trainer.train()
            # The learner finished: the coordinator merges its final pieces, then ends the run.
            wait_for("the run's end", lambda: coord.ended is not None, timeout_s=60)
            heads = coord.bus.heads()
            merged = {f: read_manifest(coord.store, coord.keys, f, v).merged_tokens for f, v in heads.items()}
            finished = coord.bus.finished_learners()
    finally:
        coord.close()

    learner = callback.learner
    assert learner.step == STEPS and learner.tokens == STEPS * 4 * SEQ  # the Trainer's own token count
    # Every token the Trainer trained reached every fragment, in versions merged from its pieces (how
    # many versions depends on the clock's rounds: a regular piece and the final one may share one).
    assert min(heads.values()) >= 1, heads
    assert merged == {f: STEPS * 4 * SEQ for f in heads}, merged
    assert finished["trainer"].steps == STEPS
    [series], problems = read_losses(coord.store, coord.keys)
    assert problems == [] and series.learner == "trainer" and series.steps[-1] == STEPS
    assert len(series.steps) >= 3 and all(math.isfinite(v) for v in series.losses)
    assert series.losses[-1] < series.losses[0]  # the model's own loss, reported every step
    assert series.tokens == [n * 4 * SEQ for n in series.steps]
