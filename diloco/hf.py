"""Hugging Face integration: `DilocoCallback` makes a `transformers.Trainer` a learner of a run
(`pip install 'diloco[hf]'`; see `diloco.workers.hf`)."""

from diloco.workers.hf import DilocoCallback

__all__ = ["DilocoCallback"]
