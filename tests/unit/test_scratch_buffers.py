"""`workers.scratch`: buffers handed out as views, given back and handed out again, bounded, and
none kept while memory is short; and `codecs.encode_lost` writing a piece's loss into them with the
bits of fresh tensors."""

from __future__ import annotations

import pytest
import torch

from diloco.storage import codecs
from diloco.workers.scratch import Scratch


def _plenty() -> bool:
    return True  # memory to spare, whatever this machine has free now


def test_a_buffer_given_back_is_handed_out_again_as_views_of_the_shapes_asked():
    scratch = Scratch(keep=2, min_elements=16, spare=_plenty)
    base, views = scratch.views({"w": (4, 8), "b": (3,)})
    assert base.numel() == 35 and views["w"].shape == (4, 8) and views["b"].shape == (3,)
    assert views["w"].is_contiguous() and views["b"].data_ptr() == base.data_ptr() + 32 * 4
    scratch.give(base)
    again, views = scratch.views({"x": (30,)})  # smaller: the same buffer serves it, whole
    assert again is base and views["x"].data_ptr() == base.data_ptr() and scratch.reused == 1
    larger, _ = scratch.views({"x": (40,)})  # none large enough is free: a new one
    assert larger is not base and larger.numel() == 40
    with pytest.raises(ValueError, match="twice"):
        scratch.give(again)
        scratch.give(again)


def test_the_smallest_fitting_buffer_is_taken_and_one_past_keep_or_max_bytes_is_freed():
    scratch = Scratch(keep=2, min_elements=16, spare=_plenty)
    a, b, c = (scratch.views({"x": (n,)})[0] for n in (100, 70, 50))
    for buffer in (a, b, c):
        scratch.give(buffer)
    assert scratch.held_bytes == (100 + 70) * 4  # the third was freed
    assert scratch.views({"x": (60,)})[0] is b and scratch.views({"x": (60,)})[0] is a
    fresh = scratch.views({"x": (60,)})[0]  # none free fits: a new one
    assert all(fresh is not t for t in (a, b, c))
    tiny, _ = scratch.views({"x": (8,)})  # under min_elements: never kept
    scratch.give(tiny)
    assert scratch.held_bytes == 0
    bounded = Scratch(keep=None, max_bytes=150 * 4, min_elements=0, spare=_plenty)
    for buffer in (a, b, c):
        bounded.give(buffer)
    assert bounded.held_bytes == (100 + 50) * 4  # b would have passed max_bytes


def test_while_memory_is_short_no_buffer_is_kept_and_the_kept_ones_are_freed():
    plenty = [True]
    scratch = Scratch(keep=4, min_elements=16, spare=lambda: plenty[0])
    a, b, c = (scratch.views({"x": (n,)})[0] for n in (100, 70, 50))
    scratch.give(a)
    scratch.give(b)
    assert scratch.held_bytes == (100 + 70) * 4
    plenty[0] = False  # the machine runs short: c is not kept, and a and b go too
    scratch.give(c)
    assert scratch.held_bytes == 0 and scratch.released == 3
    fresh = scratch.views({"x": (60,)})[0]
    assert all(fresh is not t for t in (a, b, c)) and scratch.reused == 0
    plenty[0] = True  # memory again: kept as before
    scratch.give(fresh)
    assert scratch.views({"x": (60,)})[0] is fresh and scratch.reused == 1


def test_encode_lost_writes_the_loss_into_buffers_given_with_the_bits_of_its_own():
    gen = torch.Generator().manual_seed(0)
    x = {"w": torch.randn(3000, generator=gen), "b": torch.randn(5, 3, generator=gen)}
    plus = {"w": 0.01 * torch.randn(3000, generator=gen)}
    blob, lost = codecs.encode_lost(x, "int4", plus=plus, compress=True)
    base, into = Scratch(min_elements=1).views({n: t.shape for n, t in x.items()})
    base.fill_(float("nan"))  # what a reused buffer held before: overwritten whole
    again, written = codecs.encode_lost(x, "int4", plus=plus, compress=True, into=into)
    assert again == blob and all(written[n] is into[n] and torch.equal(written[n], lost[n]) for n in x)
    for bad in ({"w": into["w"]}, {"w": into["w"], "b": torch.empty(15)}, {"w": into["w"], "b": into["b"].double()},
                {"w": into["w"], "b": torch.empty(3, 5).t()}):
        with pytest.raises(ValueError, match="contiguous float32, bfloat16 or float16 CPU tensor"):
            codecs.encode_lost(x, "int4", plus=plus, into=bad)
