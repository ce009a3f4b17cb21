"""A Hugging Face `Trainer` as a learner of a run: `DilocoCallback` (public as `diloco.hf`).

    from diloco.hf import DilocoCallback
    trainer = Trainer(model=model, args=args, train_dataset=data,
                      callbacks=[DilocoCallback(run="my-run")])   # DILOCO_* settings from the environment
    trainer.train()                                                # joins, trains, finishes

At the start of training the callback wraps the Trainer's model and optimizer in a `Learner` (which
joins the run: the model starts from the latest global versions) and hooks the optimizer's step (the
inner optimizer under Accelerate's wrapper). Before each optimizer step it reports the step's tokens:
`tokens_per_step` if given, else the growth of the Trainer's `num_input_tokens_seen`
(`include_num_input_tokens_seen=True`), else the samples of the step (batch size x gradient
accumulation x processes). The loss it reports is the model output's `loss` (a forward hook, read
without waiting for the device) or, for a model whose output has none, the Trainer's logged loss.
When training ends the learner finishes (its last progress goes out as final pieces); once the run
is finished it asks the Trainer to stop. Needs `pip install 'diloco[hf]'` (transformers, accelerate).

Under torchrun (DDP) every process builds its callback: the Learner treats the processes as one
island (rank 0 talks to the run). FSDP and DeepSpeed wrap the model differently and are not tried.
"""

from __future__ import annotations

import logging
from typing import Any

import torch
from transformers import TrainerCallback

from diloco.storage.settings import Endpoints
from diloco.workers.learner import Learner, LearnerConfig

log = logging.getLogger(__name__)


class DilocoCallback(TrainerCallback):
    """Makes the Trainer it is given to a learner of `run` (see the module docstring). The arguments
    are the `Learner`'s; `learner` is set once training has begun."""

    def __init__(self, run: str, *, endpoints: Endpoints | None = None, learner_id: str | None = None,
                 tokens_per_step: int | None = None, config: LearnerConfig | None = None,
                 handle_sigterm: bool = False) -> None:
        self.run, self.endpoints, self.learner_id = run, endpoints, learner_id
        self.tokens_per_step, self.config, self.handle_sigterm = tokens_per_step, config, handle_sigterm
        self.learner: Learner | None = None
        self._tokens_seen = 0
        self._forward_loss = False
        self._hook: Any = None

    def on_train_begin(self, args: Any, state: Any, control: Any, model: torch.nn.Module | None = None,
                       optimizer: torch.optim.Optimizer | None = None, **_: Any) -> None:
        if model is None or optimizer is None:
            raise TypeError("DilocoCallback needs the Trainer's model and optimizer at the start of training")
        inner = getattr(optimizer, "optimizer", optimizer)  # Accelerate's AcceleratedOptimizer wraps the real one
        self.learner = Learner(model, inner, run=self.run, endpoints=self.endpoints, learner_id=self.learner_id,
                               tokens_per_step=self.tokens_per_step, config=self.config,
                               handle_sigterm=self.handle_sigterm)
        self._tokens_seen = state.num_input_tokens_seen
        self._hook = model.register_forward_hook(self._on_forward)
        self.learner.start()

    def _on_forward(self, module: torch.nn.Module, _inputs: Any, output: Any) -> None:
        loss = getattr(output, "loss", None)
        if module.training and isinstance(loss, torch.Tensor) and loss.numel() == 1 and self.learner is not None:
            self._forward_loss = True
            self.learner.report(loss=loss)

    def on_pre_optimizer_step(self, args: Any, state: Any, control: Any, **_: Any) -> None:
        if self.learner is None or self.tokens_per_step is not None:
            return
        seen = state.num_input_tokens_seen
        tokens = seen - self._tokens_seen if seen > self._tokens_seen else \
            args.per_device_train_batch_size * args.gradient_accumulation_steps * max(1, args.world_size)
        self._tokens_seen = seen
        self.learner.report(tokens=int(tokens))

    def on_log(self, args: Any, state: Any, control: Any, logs: dict | None = None, **_: Any) -> None:
        if self.learner is not None and not self._forward_loss and logs and "loss" in logs:
            self.learner.report(loss=float(logs["loss"]))

    def on_step_end(self, args: Any, state: Any, control: Any, **_: Any) -> None:
        if self.learner is not None and self.learner.run_finished and not control.should_training_stop:
            log.info("run %s is finished: stopping the Trainer", self.run)
            control.should_training_stop = True

    def on_train_end(self, args: Any, state: Any, control: Any, **_: Any) -> None:
        if self._hook is not None:
            self._hook.remove()
            self._hook = None
        if self.learner is not None:
            self.learner.finish()
