"""The async saves' staging arena: one host copy of every box, reused while the boxes keep their
names, shapes and dtypes, replaced when they change; with ``shared=True`` the same bytes are seen
through a second mapping of its memfd (what the writer process maps)."""
import os

import pytest
import torch

from adacheck.integration import LocalShard
from adacheck.checkpoint.staging import ALIGN, Staging, map_shared, view
from adacheck.types import Box

pytestmark = pytest.mark.unit


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


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (the copies are asynchronous there)")
@pytest.mark.parametrize("shared", [False, True])
def test_device_copies_are_waited_for_by_an_event_not_by_the_device(shared):
    """GPU tensors still being computed behind a long kernel: ``stage`` returns without waiting
    for the device (the training stream is still busy), also at the first save, which allocates the
    arena (pinned: ``cudaHostRegister`` for the shared one), and once ``ready()`` returns the arena
    holds the values at the call, also though training overwrote the originals right after.  Three saves in a row reuse the arena:
    without the event each would read the previous save's values."""
    def values(k):
        return [("a", torch.full((1 << 22,), float(k), device="cuda") * 3.0),
                ("b", (torch.arange(1000, device="cuda", dtype=torch.float32) + k).bfloat16()),
                ("c", (torch.arange(64 * 32, device="cuda", dtype=torch.float32).reshape(64, 32) * k).t())]   # (not contiguous)

    st = Staging(shared=shared)
    waited = []
    # (the kernels loaded: a kernel's first launch may wait for the device)
    warm = Staging(shared=shared)
    warm.stage([LocalShard(n, "model", tuple(t.shape), Box.full(t.shape), t.add_(0)) for n, t in values(0)])[1]()
    warm.release()
    for k in (1, 2, 3):
        torch.cuda._sleep(int(2e8))                      # ~0.1-0.2 s of GPU time ahead of the values
        ts = values(k)
        staged, ready = st.stage([LocalShard(n, "model", tuple(t.shape), Box.full(t.shape), t) for n, t in ts])
        assert ready is not None
        waited.append(torch.cuda.current_stream().query())   # False: still busy, nothing waited for it
        for _, t in ts:
            t.add_(100)                                  # training goes on (queued after the copies)
        ready()
        assert st.arena.is_pinned()
        assert torch.equal(staged[0].tensor, torch.full((1 << 22,), 3.0 * k))
        assert torch.equal(staged[1].tensor, (torch.arange(1000, dtype=torch.float32) + k).bfloat16())
        assert torch.equal(staged[2].tensor, (torch.arange(64 * 32, dtype=torch.float32).reshape(64, 32) * k).t())
        assert st.generation == 1
    st.release()
    assert not any(waited), f"stage waited for the device at saves {[k + 1 for k, w in enumerate(waited) if w]}"
