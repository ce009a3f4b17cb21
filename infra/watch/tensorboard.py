"""`diloco plot --tensorboard DIR`: the loss series of `diloco plot` as TensorBoard event files.

`tensorboard --logdir DIR` then shows one TensorBoard run per learner process, `{learner}/{incarnation}`
(a restarted learner counts its steps from its start again, so each process is a run of its own), with
two scalars: `loss` against its inner steps and `loss_by_tokens` against its tokens; a point's wall time
is when the learner sampled it (Redis time), so TensorBoard's wall-time axis is the run's clock. With
`--task`, the run `global` holds `eval_loss` against the number of versions committed by then (all
fragments together). Written through `torch.utils.tensorboard.SummaryWriter`, which needs the
`tensorboard` package: `pip install 'diloco[tensorboard]'`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from diloco.storage.errors import ConfigError
from diloco.workers.losses import LossSeries

INSTALL = "pip install 'diloco[tensorboard]'"


def summary_writer() -> Any:
    """The SummaryWriter class; a ConfigError naming the extra to install if tensorboard is missing."""
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError:
        raise ConfigError(f"diloco plot --tensorboard needs the tensorboard package, which is not installed: "
                          f"{INSTALL}") from None
    return SummaryWriter


def write_tensorboard(out: Path, reported: list[LossSeries], evals: list[Any] | None = None) -> list[Path]:
    """Event files under `out`, one folder per TensorBoard run; returns the folders. `evals` are
    `plot.LossPoint`s (the global model's eval loss)."""
    writer_class = summary_writer()
    written = []
    for s in reported:
        folder = out / s.learner / (s.incarnation or "unnamed")
        writer = writer_class(log_dir=str(folder))
        for step, tokens, loss, t in zip(s.steps, s.tokens, s.losses, s.times, strict=True):
            writer.add_scalar("loss", loss, global_step=step, walltime=t)
            writer.add_scalar("loss_by_tokens", loss, global_step=tokens, walltime=t)
        writer.close()
        written.append(folder)
    if evals:
        folder = out / "global"
        writer = writer_class(log_dir=str(folder))
        for p in evals:
            writer.add_scalar("eval_loss", p.loss, global_step=sum(p.heads.values()), walltime=p.t)
        writer.close()
        written.append(folder)
    return written
