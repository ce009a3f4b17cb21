"""A learner's view of its parameters: one process, or a torchrun island of several ranks.

The learner reads and writes parameters only through `Replica`, as full, unsharded host tensors
(read in the parameters' dtype, written from fp32) that exist on the leader (rank 0) alone; the
other ranks take part in the collectives and get `None`. What a read or a write costs depends on how a parameter is held:

- plain tensors, one process: a local copy;
- plain tensors in an island (DDP-style: every rank holds the same values): reads are local to
  rank 0, writes are broadcast from rank 0;
- DTensors (FSDP2 `fully_shard`, tensor parallelism, HSDP: any mesh and placements): reads
  all-gather the full tensor (`full_tensor()`, every rank takes part), writes broadcast the full
  value from rank 0 and each rank keeps its own shard of it.

In the step hook nothing waits for the device (`workers.hostcopy`): a send takes a `snapshot`
(device clones copied to pinned host buffers on a side stream; the uploader's thread waits for
them), and a merge `blend`s a value computed on the host into the parameters in place on the
device (`p += global - anchor` for the rebase rule), so a merge never reads the parameters back.
`read` and `write` (joining) wait.

Everything here is collective on an island: every rank must make the same calls in the same
order. The learner guarantees that by letting rank 0 decide each step's plan (`share_plan`) and
every rank then carry it out. Control messages are int64 CPU tensors broadcast over a gloo group of
the island's ranks (the default group itself when it is gloo): reading them on the host never waits
for the device, so the per-step plan costs no device synchronization on NCCL islands; nothing is
pickled.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, distribute_tensor

from diloco.workers.hostcopy import HostCopies, Snapshot


def in_island() -> bool:
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


class Replica:
    def __init__(self, params: dict[str, torch.nn.Parameter]) -> None:
        self.params = params
        self.island = in_island()
        self.is_leader = not self.island or dist.get_rank() == 0
        self.device = next(iter(params.values())).device
        self.copies = HostCopies(self.device)
        # Control messages go over gloo on the host: on an NCCL island a device tensor's .item() would
        # synchronize the device every step. new_group is collective: every rank builds its Replica.
        self._control = (dist.new_group(backend="gloo") if self.island and dist.get_backend() != "gloo"
                         else None)

    @torch.no_grad()
    def snapshot(self, names: Iterable[str]) -> Snapshot | None:
        """Full values of `names` as host copies on the leader, in the parameters' own dtype (a bf16
        parameter's copy is bf16: exact, half an fp32 one), taken now but possibly still on their way
        from the device (`workers.hostcopy`); None on the other ranks. Whoever subtracts them does
        so in fp32."""
        clones: dict[str, torch.Tensor] = {}
        for name in names:
            p = self.params[name]
            if isinstance(p, DTensor):
                value = p.full_tensor()  # collective: every rank gathers; a new tensor
                fresh = True
            elif self.is_leader:
                value, fresh = p.detach(), False
            else:
                continue
            if self.is_leader:
                clones[name] = value if fresh else value.clone()  # on the device, in queue order
        return self.copies.snapshot(clones) if self.is_leader else None

    def read(self, names: Iterable[str]) -> dict[str, torch.Tensor] | None:
        """Full values of `names` as host copies (`snapshot`) on the leader, None on the other ranks; waits
        for them (joining; `snapshot` is the step hook's way)."""
        snapshot = self.snapshot(names)
        return None if snapshot is None else snapshot.wait()

    def host_empty(self, shape: tuple[int, ...]) -> torch.Tensor:
        """An fp32 host buffer to compute values to `blend` into (pinned on a device)."""
        return self.copies.host_empty(shape)

    @torch.no_grad()
    def write(self, values: dict[str, torch.Tensor] | None, names: Sequence[str]) -> None:
        """Set `names` on every rank to the leader's `values` (full tensors; ignored on other ranks)."""
        for name in names:
            p = self.params[name]
            if not self.island:
                self._assign(p, values[name])  # type: ignore[index]
                continue
            full = (values[name].to(self.device, p.dtype) if self.is_leader  # type: ignore[index]
                    else torch.empty(p.shape, dtype=p.dtype, device=self.device))
            dist.broadcast(full, src=0)
            self._assign(p, full)

    @torch.no_grad()
    def blend(self, values: dict[str, torch.Tensor] | None, names: Sequence[str], *, keep: float = 1.0,
              add: float = 1.0, staged: bool = False) -> None:
        """`p = keep * p + add * value` on every rank, for `names`, with the leader's host fp32 `values`
        (ignored on other ranks), in place on the device: the parameters are never read back. The
        value goes to the device without waiting (`HostCopies.to_device`), is broadcast on an island,
        and each rank of a sharded parameter adds its own shard of it. `keep` and `add` are the
        leader's too. `staged`: the leader's values are on the device already (`workers.staging`)."""
        if self.island:
            box = torch.tensor([keep, add], dtype=torch.float64)  # on the host, over gloo
            dist.broadcast(box, src=0, group=self._control)
            keep, add = box.tolist()
        for name in names:
            p = self.params[name]
            if self.is_leader:
                value = values[name]  # type: ignore[index]
                full = self.copies.on_compute(value) if staged else self.copies.to_device(value)
            else:
                full = torch.empty(p.shape, dtype=torch.float32, device=self.device)
            if self.island:
                dist.broadcast(full, src=0)
            if isinstance(p, DTensor):
                full = distribute_tensor(full, p.device_mesh, p.placements, src_data_rank=None)
            if keep == 0.0 and add == 1.0:
                p.copy_(full)  # adopt: the global value as it is
            else:
                if keep != 1.0:
                    p.mul_(keep)
                p.add_(full, alpha=add)

    @staticmethod
    def _assign(p: torch.nn.Parameter, full: torch.Tensor) -> None:
        if isinstance(p, DTensor):
            # Every rank holds the full value: cut out this rank's shard without communicating.
            p.copy_(distribute_tensor(full.to(p.device, p.dtype), p.device_mesh, p.placements, src_data_rank=None))
        else:
            p.copy_(full.to(p.device, p.dtype))

    def share(self, values: list[int] | None, length: int) -> list[int]:
        """The leader's `values` (at most `length` ints) on every rank; a no-op outside an island."""
        if not self.island:
            assert values is not None
            return values
        box = torch.zeros(length + 1, dtype=torch.int64)  # on the host, broadcast over gloo
        if self.is_leader:
            assert values is not None and len(values) <= length
            box[0] = len(values)
            box[1:1 + len(values)] = torch.tensor(values, dtype=torch.int64)
        dist.broadcast(box, src=0, group=self._control)
        return box[1:1 + int(box[0].item())].tolist()

    def share_bytes(self, data: bytes | None) -> bytes:
        """The leader's `data` on every rank (a learner's saved state); a no-op outside an island."""
        if not self.island:
            assert data is not None
            return data
        size = torch.tensor([len(data) if self.is_leader else 0], dtype=torch.int64)  # type: ignore[arg-type]
        dist.broadcast(size, src=0, group=self._control)
        n = int(size.item())
        if n == 0:
            return b""
        box = (torch.frombuffer(bytearray(data), dtype=torch.uint8) if self.is_leader  # type: ignore[arg-type]
               else torch.empty(n, dtype=torch.uint8))
        dist.broadcast(box, src=0, group=self._control)
        return data if self.is_leader else box.numpy().tobytes()  # type: ignore[return-value]

    def gather_bytes(self, data: bytes) -> list[bytes] | None:
        """Every rank's `data`, in rank order, on the leader; None on the other ranks. [data] outside
        an island."""
        if not self.island:
            return [data]
        world = dist.get_world_size()
        sizes = [torch.zeros(1, dtype=torch.int64) for _ in range(world)]
        dist.all_gather(sizes, torch.tensor([len(data)], dtype=torch.int64), group=self._control)
        lengths = [int(s.item()) for s in sizes]
        box = torch.zeros(max(1, *lengths), dtype=torch.uint8)
        if data:
            box[:len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
        boxes = [torch.empty_like(box) for _ in range(world)] if self.is_leader else None
        dist.gather(box, boxes, dst=0, group=self._control)
        if boxes is None:
            return None
        return [b[:n].numpy().tobytes() for b, n in zip(boxes, lengths, strict=True)]

    @property
    def world(self) -> int:
        """Ranks in this learner (1 outside an island)."""
        return dist.get_world_size() if self.island else 1

    @property
    def rank(self) -> int:
        return dist.get_rank() if self.island else 0

    def share_plan(self, due: list[int] | None, merge: list[int] | None, num_fragments: int,
                   flags: int = 0) -> tuple[list[int], list[int], int]:
        """Rank 0's plan for this step (fragments to send, fragments to merge, and flags: the learner
        uses them for "the run is finished" and "leave now") on every rank, in one broadcast."""
        packed = None if due is None or merge is None else [len(due), int(flags), *due, *merge]
        got = self.share(packed, 2 * num_fragments + 2)
        n_due = got[0]
        return got[2:2 + n_due], got[2 + n_due:], int(got[1])
