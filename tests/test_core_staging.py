"""The async saves' staging arena: one host copy of every box, reused while the boxes keep their
names, shapes and dtypes, replaced when they change; with ``shared=True`` the same bytes are seen
through a second mapping of its memfd (what the writer process maps)."""
import os

import pytest
import torch

from adacheck.checkpoint import LocalShard
from adacheck.staging import ALIGN, Staging, map_shared, view
from adacheck.types import Box


def shards(n=5, extra=()):
    g = torch.Generator().manual_seed(n)
    ts = [("a", torch.randn(n, 3, generator=g)), ("b", torch.randn(7, generator=g).bfloat16()),
          ("c", torch.randint(0, 9, (n,), generator=g)), ("d", torch.rand(4, generator=g) > 0.5),
          ("e", torch.empty(0, 2)), ("f", torch.randn(6, 4, generator=g).t())]   # (f: not contiguous)
    ts += list(extra)
    return [LocalShard(name, "model", tuple(t.shape), Box.full(t.shape), t) for name, t in ts]


@pytest.mark.parametrize("shared", [False, True])
def test_the_arena_holds_the_state_at_the_call_and_is_reused(shared):
    st = Staging(shared=shared)
    first = shards()
    staged, ready = st.stage(first)
    assert ready is None
    arena = st.arena
    for s, c in zip(first, staged):
        assert c.tensor.dtype == s.tensor.dtype and torch.equal(c.tensor, s.tensor), s.name
        if s.tensor.numel():
            assert c.tensor.data_ptr() != s.tensor.data_ptr()
            assert (c.tensor.data_ptr() - arena.data_ptr()) % ALIGN == 0
        s.tensor.add_(1) if s.tensor.dtype != torch.bool else s.tensor.logical_not_()   # training goes on
    assert not any(torch.equal(c.tensor, s.tensor) for s, c in zip(first, staged) if s.tensor.numel())
    # the next save: the same boxes, new values, the same arena
    again = shards(5)
    staged, _ = st.stage(again)
    assert st.arena is arena and st.generation == 1
    assert all(torch.equal(c.tensor, s.tensor) for s, c in zip(again, staged))
    # a box changes shape: a new arena, the old one let go
    other = shards(6)
    staged, _ = st.stage(other)
    assert st.generation == 2 and st.arena is not arena
    assert all(torch.equal(c.tensor, s.tensor) for s, c in zip(other, staged))
    assert st.nbytes == sum(-(-s.tensor.numel() * s.tensor.element_size() // ALIGN) * ALIGN for s in other)
    if shared:      # what the writer process sees through its own mapping of the memfd
        fd = os.dup(st.fd)
        seen, mapping = map_shared(fd, st.nbytes)
        os.close(fd)
        for s, slot in zip(other, st.slots):
            assert torch.equal(view(seen, slot), s.tensor), s.name
        del seen, mapping
    st.release()
    assert st.arena is None and st.fd is None
