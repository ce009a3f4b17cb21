"""A `RunStatus` for a person: plain text (a pipe, a log, `watch -n`) or rich tables (a terminal, `--watch`).

Sizes are decimal (1 kB = 1000 bytes, as every command prints them), ages say how long ago ("3.2 s ago"),
times to come say when ("in 0.4 s"). Pure: no I/O, so the unit tests render made-up statuses.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import TYPE_CHECKING

from diloco.infra.output import human_bytes, table
from diloco.infra.watch.status import LEARNER_STATES, LearnerStatus, RunStatus

if TYPE_CHECKING:
    from rich.console import RenderableType

REASON_WIDTH = 110
"""Refusal reasons are cut to this many characters in the view (`--json` keeps them whole)."""


def size(n: float | None) -> str:
    """Bytes, readable as every command prints them (`output.human_bytes`: '512 B', '1.5 kB', '3.2 MB',
    '1.1 GB'); '-' for unknown."""
    return "-" if n is None else human_bytes(n)


def duration(seconds: float | None) -> str:
    """'0.4 s', '42.0 s', '3.5 min', '2.0 h', '1.5 d'; '-' for unknown."""
    if seconds is None:
        return "-"
    s = abs(seconds)
    if s < 60:
        return f"{s:.1f} s"
    if s < 3600:
        return f"{s / 60:.1f} min"
    if s < 86400:
        return f"{s / 3600:.1f} h"
    return f"{s / 86400:.1f} d"


def ago(seconds: float | None) -> str:
    """'3.2 s ago'; '-' for unknown."""
    return "-" if seconds is None else f"{duration(seconds)} ago"


def until(seconds: float | None) -> str:
    """'in 0.4 s' for a time to come, '1.2 s ago' for one gone by; '-' for unknown."""
    if seconds is None:
        return "-"
    return f"in {duration(seconds)}" if seconds >= 0 else ago(-seconds)


def lease(seconds: float | None) -> str:
    """A learner's lease: '7.9 s left', or 'expired 3.2 s ago'."""
    if seconds is None:
        return "-"
    return f"{duration(seconds)} left" if seconds >= 0 else f"expired {ago(-seconds)}"


def count(n: int | None) -> str:
    """An integer with thousands separators; '-' for unknown."""
    return "-" if n is None else f"{n:,}"


def number(value: float | None, spec: str = ".4g") -> str:
    return "-" if value is None else format(value, spec)


def clip(text: str, width: int = REASON_WIDTH) -> str:
    text = " ".join(text.split())
    return text if len(text) <= width else text[:width - 3] + "..."


def stamp(unix: float) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(unix))


# ---- the lines and rows both renderings share ------------------------------------------------------

def headline(s: RunStatus) -> str:
    if s.finished is not None:
        state = f"FINISHED by {s.finished.by} {ago(s.finished.age_s)}: {s.finished.reason}"
    elif s.finish_requested_by:
        state = f"FINISHING (asked by {s.finish_requested_by})"
    else:
        state = "RUNNING"
    return f"run {s.run} (prefix {s.prefix or '-'}, Redis {s.redis}) at {stamp(s.read_at)}: {state}"


def settings_line(s: RunStatus) -> str:
    if s.spec is None:
        return "settings: no run spec in S3"
    p = s.spec
    codec = f"{p['codec']}{'+zstd' if p['compress'] else ''}"
    return (f"settings: {p['num_fragments']} fragment(s), H={p['sync_every']}, tau={p['overlap_steps']}, {codec}, "
            f"{p['merge_rule']}, {p['cadence']} cadence")


def clock_line(s: RunStatus) -> str:
    c = s.clock
    if c is None:
        return "round clock: unknown (no run spec)"
    if c.cadence != "clock":
        return f"round clock: step cadence, a round every H={c.sync_every} inner steps of each learner (no deadlines)"
    if c.period_s is None:
        return ("round clock: clock cadence, no cadence record yet (the coordinator sets it from the learners' "
                "step times)")
    nxt = ("" if c.next_fragment is None else
           f"; next deadline: fragment {c.next_fragment} {until(c.next_deadline_in_s)}")
    return f"round clock: clock cadence, a fragment's round every {duration(c.period_s)}{nxt}"


def coordinator_lines(s: RunStatus) -> list[str]:
    c = s.coordinator
    epoch = "none (Redis lost it)" if c.epoch is None else str(c.epoch)
    if c.holder is None:
        holder = "nobody holds the lease (no coordinator running?)"
    else:
        holder = f"lease held by {c.holder} (expires {until(c.lease_expires_in_s)})"
    since = "" if c.holder_since_age_s is None else f", epoch claimed {ago(c.holder_since_age_s)}"
    lines = [f"coordinator: epoch {epoch}, {holder}{since}"]
    if c.shards:
        lines = [f"coordinator: {len(c.shards)} shards"]
        for row in c.shards:
            held = ("nobody holds its lease" if row.holder is None else
                    f"lease held by {row.holder} (expires {until(row.lease_expires_in_s)})")
            frags = ", ".join(map(str, row.fragments)) or "none"
            lines.append(f"  shard {row.shard} (fragments {frags}): epoch "
                         f"{'none' if row.epoch is None else row.epoch}, {held}")
    for consumer in c.consumers:
        lines.append(f"  consumer {consumer.name}: {consumer.pending} pending, last read {ago(consumer.idle_s)}")
    return lines


def pending_line(s: RunStatus) -> str:
    p = s.pending
    if not p.group:
        return (f"announcements: {p.stream_length} in the stream, no coordinator group yet (never read); "
                f"oldest {ago(p.lag_s)}")
    undelivered = "?" if p.undelivered is None else str(p.undelivered)
    lag = "none (all dealt with)" if p.lag_s is None else duration(p.lag_s)
    return (f"announcements: {p.stream_length} in the stream, {p.pending} pending (read, not acknowledged), "
            f"{undelivered} not read yet; coordinator lag {lag}")


FRAGMENT_COLUMNS = ("fragment", "head", "committed", "merged", "next deadline")


def fragment_rows(s: RunStatus) -> list[list[str]]:
    return [[str(f.fragment), "-" if f.head is None else str(f.head), ago(f.head_age_s), count(f.contributions),
             until(f.next_deadline_in_s)] for f in s.fragments]


LEARNER_COLUMNS = ("learner", "state", "lease", "step", "tokens", "loss", "step time", "staleness", "last sent",
                   "adopted", "uploaded", "failed", "up", "down")


def learner_row(r: LearnerStatus) -> list[str]:
    stale = "-" if r.staleness is None else str(r.staleness)
    if len(r.staleness_by_fragment) > 1:
        stale += " (" + " ".join(f"f{f}:{v}" for f, v in r.staleness_by_fragment.items()) + ")"
    step_time = "-" if not r.step_time_s else f"{r.step_time_s * 1000:.0f} ms" if r.step_time_s < 1 else \
        duration(r.step_time_s)
    held = lease(r.lease_left_s) if r.left_age_s is None else f"left {ago(r.left_age_s)}"
    return [r.learner, r.state, held, count(r.step), count(r.tokens), number(r.loss, ".4f"),
            step_time, stale, ago(r.last_sent_age_s), count(r.adopted), count(r.uploaded), count(r.upload_failed),
            size(r.bytes_up), size(r.bytes_down)]


FINISHED_COLUMNS = ("learner", "finished", "steps", "final pieces")


def finished_rows(s: RunStatus) -> list[list[str]]:
    return [[f.learner, ago(f.finished_age_s), count(f.steps), str(f.final_pieces)] for f in s.finished_learners]


REFUSAL_COLUMNS = ("when", "code", "learner", "reason")


def refusal_rows(s: RunStatus) -> list[list[str]]:
    return [[ago(r.age_s), r.code, r.learner or "?", clip(r.reason)] for r in s.refusals]


def refusals_title(s: RunStatus) -> str:
    codes = ", ".join(f"{code} {n}" for code, n in s.refused_by_code.items())
    shown = f"; the last {len(s.refusals)}" if s.refusals else ""
    return f"refusals: {s.refused_total} in all" + (f" ({codes})" if codes else "") + shown


def learners_title(s: RunStatus) -> str:
    """'learners: 2 live, 1 lapsed, 1 preempted (joined, not finished), 1 finished'."""
    counts = {state: sum(r.state == state for r in s.learners) for state in LEARNER_STATES if state != "live"}
    others = ", ".join(f"{n} {state}" for state, n in counts.items() if n)
    return f"learners: {len(s.live)} live" + (f", {others} (joined, not finished)" if others else "") + \
        f", {len(s.finished_learners)} finished"


def counters_line(s: RunStatus) -> str:
    c = s.counters
    return (f"counters: {c.get('versions_committed', 0)} versions committed, {c.get('contributions_applied', 0)} "
            f"contributions applied, {c.get('contributions_refused', 0)} refused")


# ---- plain text ----------------------------------------------------------------------------------

def _section(title: str, headers: Sequence[str], rows: list[list[str]], align: str = "") -> list[str]:
    return [title, table(headers, rows, align=align)] if rows else [title]


def render_text(s: RunStatus) -> str:
    """The whole view as plain text (for a pipe, a file or a log)."""
    lines = [headline(s), settings_line(s), *[f"note: {n}" for n in s.notes], ""]
    heads = "heads" + (" (from S3: Redis holds none)" if s.heads_from == "s3" else "")
    lines += _section(heads, FRAGMENT_COLUMNS, fragment_rows(s), align="lrrrr")
    lines += [clock_line(s), *coordinator_lines(s), pending_line(s), counters_line(s), ""]
    lines += _section(learners_title(s), LEARNER_COLUMNS, [learner_row(r) for r in s.learners],
                      align="llrrrrrrrrrrrr")
    if s.finished_learners:
        lines += ["", *_section("finished learners", FINISHED_COLUMNS, finished_rows(s), align="lrrr")]
    lines += ["", *_section(refusals_title(s), REFUSAL_COLUMNS, refusal_rows(s), align="rlll")]
    return "\n".join(lines)


# ---- rich ------------------------------------------------------------------------------------------

def _rich_table(title: str, headers: Sequence[str], rows: list[list[str]], align: str,
                styles: Sequence[str] = ()) -> RenderableType:
    from rich.table import Table

    t = Table(title=title, title_justify="left", expand=False, pad_edge=False)
    for h, a in zip(headers, align.ljust(len(headers), "r"), strict=False):
        t.add_column(h, justify="left" if a == "l" else "right", overflow="fold")
    for row, style in zip(rows, [*styles, *[""] * (len(rows) - len(styles))], strict=True):
        t.add_row(*row, style=style or None)
    return t


def render_rich(s: RunStatus) -> RenderableType:
    """The whole view as rich renderables, for a terminal and `--watch`."""
    from rich.console import Group
    from rich.text import Text

    style = "bold green" if s.finished is None else "bold blue"
    parts: list[RenderableType] = [Text(headline(s), style=style), Text(settings_line(s))]
    parts += [Text(f"note: {n}", style="yellow") for n in s.notes]
    heads = "heads" + (" (from S3: Redis holds none)" if s.heads_from == "s3" else "")
    parts.append(_rich_table(heads, FRAGMENT_COLUMNS, fragment_rows(s), "lrrrr"))
    parts += [Text(clock_line(s)), *(Text(line) for line in coordinator_lines(s)),
              Text(pending_line(s), style="yellow" if (s.pending.lag_s or 0) > 30 else ""), Text(counters_line(s))]
    learners = _rich_table(learners_title(s), LEARNER_COLUMNS, [learner_row(r) for r in s.learners],
                           "llrrrrrrrrrrrr", styles=["" if r.state == "live" else "red" for r in s.learners])
    parts.append(learners)
    if s.finished_learners:
        parts.append(_rich_table("finished learners", FINISHED_COLUMNS, finished_rows(s), "lrrr"))
    if s.refusals:
        parts.append(_rich_table(refusals_title(s), REFUSAL_COLUMNS, refusal_rows(s), "rlll"))
    else:
        parts.append(Text(refusals_title(s)))
    return Group(*parts)
