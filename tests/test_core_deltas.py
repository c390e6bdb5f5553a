"""The delta log of the online mode, without a framework: what counts as committed, the
narrowest exact dtype, bounded staging, errors, and the rule for "auto" bases."""
import json
import os
import threading

import pytest
import torch

from adacheck.online import deltas

from adacheck.online import deltalog
from adacheck.errors import FormatError, IntegrityError, StateError

pytestmark = pytest.mark.unit


def write_steps(ckpt, steps, world=2, nonce="n1", grads=None, **kw):
    logs = [deltalog.DeltaLog(ckpt, r, nonce, fsync=False, **kw) for r in range(world)]
    for s in steps:
        for r, lg in enumerate(logs):
            lg.begin(s)
            for k, g in (grads or {f"g{r}": torch.full((3,), float(s))}).items():
                lg.add(k, g)
            lg.submit(s, {"step": s, "rank": r})
    for lg in logs:
        lg.close()
    return logs


def test_committed_steps_stop_at_the_first_incomplete_or_missing_step(tmp_path):
    ck = str(tmp_path)
    write_steps(ck, [2, 3, 4, 5, 7])
    steps, why = deltas.committed_steps(ck, 1, 2)
    assert [s.step for s in steps] == [2, 3, 4, 5] and why == "step 6 was never written"
    os.remove(os.path.join(deltas.step_dir(ck, 4), "rank1.json"))
    steps, why = deltas.committed_steps(ck, 1, 2)
    assert [s.step for s in steps] == [2, 3] and "step 4 is incomplete (rank 1" in why
    with open(os.path.join(deltas.step_dir(ck, 3), "rank0.json"), "w") as f:
        f.write('{"version": 1, "step": 3, "tens')    # a damaged record (records appear by rename, whole)
    with pytest.raises(FormatError, match=r"rank0.json: not valid JSON.*damaged at step 3: to recover step 2"):
        deltas.committed_steps(ck, 1, 2)
    steps, why = deltas.committed_steps(ck, 1, 2, strict=False)
    assert [s.step for s in steps] == [2] and why.startswith("step 3 is damaged: ")
    assert deltas.remove_steps_after(ck, 2) == [3, 4, 5, 7] and deltas.step_dirs(ck) == [2]


def test_records_of_two_runs_never_combine(tmp_path):
    ck = str(tmp_path)
    write_steps(ck, [2, 3])
    os.remove(os.path.join(deltas.step_dir(ck, 3), "rank1.json"))
    write_steps(ck, [3], world=1, nonce="other")    # only rank 0 of a later run wrote step 3
    lg = deltalog.DeltaLog(ck, 1, "n1", fsync=False)       # rank 1 of the old run, late
    lg.begin(3)
    lg.submit(3, {})
    lg.close()
    steps, why = deltas.committed_steps(ck, 1, 2)
    assert [s.step for s in steps] == [2] and "mixes records of different runs" in why


def test_steps_of_an_earlier_save_of_the_tag_are_never_committed_on_the_new_base(tmp_path):
    """Steps 2-6 recorded on generation 0 of a base; the tag saved again (generation 1) and steps
    2-3 recorded on it into the same directories (as a copy from the memory tier writes them):
    steps 4-6 of the earlier save end the chain of generation 1, and a chain file of another
    generation commits nothing.  A record's generation that is not one is damage."""
    ck = str(tmp_path)
    deltas.write_chain(ck, {"base_tag": "t", "base_step": 1, "base_generation": 0}, fsync=False)
    write_steps(ck, [2, 3, 4, 5, 6], generation=0)
    assert [s.step for s in deltas.committed_steps(ck, 1, 2, generation=0)[0]] == [2, 3, 4, 5, 6]
    steps, why = deltas.committed_steps(ck, 1, 2, generation=1)
    assert steps == [] and "the delta log belongs to an earlier save of this tag (generation 0" in why
    deltas.write_chain(ck, {"base_tag": "t", "base_step": 1, "base_generation": 1}, fsync=False)
    write_steps(ck, [2, 3], nonce="n2", generation=1)
    steps, why = deltas.committed_steps(ck, 1, 2, generation=1)
    assert [s.step for s in steps] == [2, 3] and "step 4 was recorded on an earlier save of this tag" in why
    assert len(deltas.committed_steps(ck, 1, 2)[0]) == 5      # (a caller that does not know the base's generation)
    path = os.path.join(deltas.step_dir(ck, 2), "rank1.json")
    rec = json.load(open(path))
    rec["base_generation"] = "1"
    json.dump(rec, open(path, "w"))
    with pytest.raises(FormatError, match="base_generation '1' is not a generation"):
        deltas.committed_steps(ck, 1, 2, generation=1)


def test_narrowest_exact_dtype_and_round_trip(tmp_path):
    ck = str(tmp_path)
    exact = torch.randn(64).to(torch.bfloat16).float()
    inexact = exact.clone()
    inexact[5] += 1e-6
    half = torch.randn(8).half()
    write_steps(ck, [1], world=1, grads={"e": exact, "i": inexact, "h": half})
    (st,), _ = deltas.committed_steps(ck, 0, 1)
    meta = st.records[0]["tensors"]
    assert (meta["e"]["stored"], meta["i"]["stored"], meta["h"]["stored"]) == ("bfloat16", "float32", "float16")
    for k, t in (("e", exact), ("i", inexact), ("h", half)):
        got = deltas.read_grad(ck, st, k, 0)
        assert got.dtype == t.dtype and torch.equal(got, t)
    assert not st.lossy
    info = deltas.summary(ck, 0, 1)      # what `adacheck inspect` shows
    assert info["stored_elements"] == {"bfloat16": 64, "float32": 64, "float16": 8}
    assert info["bf16_share"] == 64 / 136


@pytest.mark.parametrize("compact", [False, True])
def test_split_staging_writes_what_whole_staging_writes(tmp_path, monkeypatch, compact):
    """fp32 gradients staged split (the high and low halves of their bits, the nonzero low halves
    counted where the gradient is: what a GPU gradient gets) write the same files, byte for
    byte, as the same gradients staged whole and proved by the writer, at every step: bf16
    values (-0, infinities and NaN payloads too) stored as their high halves, an fp32 gradient
    after bf16 steps (the hint wrong: put together again from its halves; compact: rounded)
    and the steps after it (staged whole), a gradient whose size changes, a bf16 one.  The
    oracle: safetensors' own reader gives back every bit of each gradient."""
    from safetensors.torch import load_file
    monkeypatch.setattr(deltalog, "_SPLIT_PIECE", 30_000)    # (70,001 values: split in 3 pieces)
    specials = torch.tensor([0x80000000, 0x7F800000, 0xFF800000, 0x7FC00000, 0x7F810000, 0xFFC10000],
                            dtype=torch.int64).to(torch.int32).view(torch.float32)
    exact = torch.randn(70_001).to(torch.bfloat16).float()
    exact[:6] = specials
    off = exact.clone()
    off[40_000] = torch.nextafter(off[40_000], torch.tensor(float("inf")))
    steps = {1: {"a": exact, "b": exact[:100] * 2}, 2: {"a": exact * 4, "b": exact[:100]},
             3: {"a": off, "b": exact[:50] * 8, "c": exact[:9].to(torch.bfloat16)}, 4: {"a": off * 3, "b": exact[:50]},
             5: {"a": exact, "b": exact[:50] * 2}}
    dirs = {}
    for split in (False, True):
        d = dirs[split] = str(tmp_path / f"split{split}")
        lg = deltalog.DeltaLog(d, 0, "n", fsync=False, compact=compact, split=split)
        for step, grads in steps.items():
            lg.begin(step)
            for k, g in grads.items():
                lg.add(k, g)
            lg.submit(step, {"step": step})
            lg.flush()
        lg.close()
    for step, grads in steps.items():
        whole, split = (deltas.step_dir(dirs[x], step) for x in (False, True))
        for name in ("rank0.safetensors", "rank0.json"):
            assert open(f"{whole}/{name}", "rb").read() == open(f"{split}/{name}", "rb").read(), (step, name)
        got = load_file(f"{split}/rank0.safetensors")
        for k, g in grads.items():
            t = got[deltas.GRAD + k]
            if compact and step in (3, 4) and k == "a":     # (rounded: what torch's cast gives)
                assert t.dtype == torch.bfloat16 and torch.equal(t.view(torch.int16),
                                                                 g.to(torch.bfloat16).view(torch.int16)), step
            elif g.dtype == torch.float32 and t.dtype == torch.bfloat16:    # every bit, widened
                assert torch.equal(t.reshape(-1).view(torch.int16).to(torch.int32) << 16,
                                   g.reshape(-1).view(torch.int32)), (step, k)
            else:
                assert t.dtype == g.dtype and torch.equal(t.view(torch.uint8), g.view(torch.uint8)), (step, k)
    stored = [json.load(open(f"{deltas.step_dir(dirs[True], s)}/rank0.json"))["tensors"]["a"]["stored"] for s in steps]
    assert stored == ["bfloat16", "bfloat16"] + (["bfloat16"] * 2 if compact else ["float32"] * 2) + ["bfloat16"]


def test_a_new_chain_stages_into_the_buffers_of_the_chain_before(tmp_path):
    """At every base the online mode starts a new chain's log; it takes over the closed log's
    staging buffers (the same memory: on a GPU host pinned, and on any host with its pages
    touched, which a first step would otherwise pay for on the training thread) and its hint
    that a gradient was not bf16.  What it writes is still each step's gradient, as safetensors'
    own loader reads it."""
    from safetensors.torch import load_file
    exact, inexact = torch.randn(3000).to(torch.bfloat16).float(), torch.randn(2000)

    def record(lg, steps):
        for step in steps:
            lg.begin(step)
            lg.add("a", exact * 2.0 ** step)      # (bf16 at every step)
            lg.add("b", inexact * step)
            lg.submit(step, {"step": step})
            lg.flush()        # (each step written before the next: every slot sees "b" whole)

    def buffers(lg):
        return sorted(b.data_ptr() for slot in list(lg._free.queue) for b in slot.buffers.values())
    first = deltalog.DeltaLog(str(tmp_path / "base1"), 0, "n1", fsync=False, split=True)
    record(first, [1, 2, 3])
    first.close()
    held = buffers(first)
    second = deltalog.DeltaLog(str(tmp_path / "base4"), 0, "n4", fsync=False, split=True, reuse=first)
    assert not second._splits("b", inexact) and second._splits("a", exact)
    record(second, [4, 5, 6])
    assert len(held) == 4 and buffers(second) == held
    second.close()
    for step in (4, 5, 6):
        got = load_file(os.path.join(deltas.step_dir(str(tmp_path / "base4"), step), "rank0.safetensors"))
        a, b = got[deltas.GRAD + "a"], got[deltas.GRAD + "b"]
        assert a.dtype == torch.bfloat16 and torch.equal(a.float(), exact * 2.0 ** step), step
        assert b.dtype == torch.float32 and torch.equal(b, inexact * step), step
    with pytest.raises(RuntimeError, match="only once the log is closed"):
        deltalog.DeltaLog(str(tmp_path / "x"), 0, "n", fsync=False, reuse=deltalog.DeltaLog(str(tmp_path / "y"), 0, "n"))


def test_compact_is_lossy_and_says_by_how_much(tmp_path):
    ck = str(tmp_path)
    g = torch.randn(100)
    write_steps(ck, [1], world=1, grads={"g": g}, compact=True)
    (st,), _ = deltas.committed_steps(ck, 0, 1)
    got = deltas.read_grad(ck, st, "g", 0)
    err = (got - g).abs().max().item()
    assert st.lossy and err > 0 and st.max_abs_error() == pytest.approx(err)
    assert deltas.summary(ck, 0, 1)["lossy"]


def test_a_corrupted_gradient_is_refused(tmp_path):
    ck = str(tmp_path)
    write_steps(ck, [1], world=1, grads={"g": torch.randn(1000)})
    path = os.path.join(deltas.step_dir(ck, 1), "rank0.safetensors")
    data = bytearray(open(path, "rb").read())
    data[-3] ^= 0x10
    open(path, "wb").write(bytes(data))
    (st,), _ = deltas.committed_steps(ck, 0, 1)
    # the error says what can still be recovered, and how
    with pytest.raises(IntegrityError, match=r"does not match its recorded hash \(corrupted, or not what the record says it is\); to recover "
                                             r"step 0 instead, remove .*0000000001 and the step directories"):
        deltas.read_grad(ck, st, "g", 0)


def test_staging_is_bounded_by_queue_depth(tmp_path):
    """With queue_depth=1 the second step waits until the writer has finished the first."""
    ck = str(tmp_path)
    lg = deltalog.DeltaLog(ck, 0, "n", fsync=False, queue_depth=1)
    gate = threading.Event()
    orig = lg._write

    def slow_write(*a):
        gate.wait(10)
        orig(*a)
    lg._write = slow_write
    lg.begin(1)
    lg.add("g", torch.ones(4))
    lg.submit(1, {})
    waited = threading.Event()

    def second():
        lg.begin(2)
        waited.set()
    t = threading.Thread(target=second)
    t.start()
    t.join(0.3)
    assert not waited.is_set()          # blocked: the only slot is still being written
    gate.set()
    t.join(10)
    assert waited.is_set()
    lg.add("g", torch.ones(4))
    lg.submit(2, {})
    lg.close()
    assert [s.step for s in deltas.committed_steps(ck, 0, 1)[0]] == [1, 2]


def test_write_error_disables_or_raises(tmp_path):
    blocker = tmp_path / "ck"
    blocker.write_text("a file where the checkpoint directory should be")
    for on_error in ("disable", "raise"):
        lg = deltalog.DeltaLog(str(blocker), 0, "n", fsync=False, on_error=on_error)
        lg.begin(1)
        lg.add("g", torch.ones(4))
        lg.submit(1, {})
        lg._jobs.join()
        if on_error == "raise":
            with pytest.raises(OSError):
                lg.begin(2)
            with pytest.raises(OSError):    # closing says so too (and stops the writer thread)
                lg.close()
            assert not lg._thread.is_alive()
        else:
            with pytest.warns(UserWarning, match="online mode disabled on rank 0"):
                lg.begin(2)
            assert lg.disabled
            lg.add("g", torch.ones(4))      # ignored from now on
            lg.submit(2, {})
            lg.close()


@pytest.mark.parametrize("base_bytes,base_s,delta_bytes,replay_s,want", [
    (1000, 10.0, 100, 0.1, 10),      # bytes decide: 10 deltas cost a base
    (1000, 1.0, 10, 0.25, 4),        # replay time decides
    (1000, 1.0, 5000, 0.1, 1),       # one delta already costs more than a base: base every step
    (1000, 1.0, 0, 0.0, 100000),     # free deltas: capped
])
def test_auto_base_rule(base_bytes, base_s, delta_bytes, replay_s, want):
    n = deltas.auto_interval(base_bytes, base_s, delta_bytes, replay_s)
    assert n == want
    if want < 100000:    # n deltas stay within a base's bytes and time, n + 1 would not (unless n = 1)
        assert n == 1 or (n * delta_bytes <= base_bytes and n * replay_s <= base_s)
        assert n == 1 or ((n + 1) * delta_bytes > base_bytes or (n + 1) * replay_s > base_s)


def test_bf16_exactness_is_proved_bit_for_bit():
    """A gradient is stored as bf16 only when widening it back gives every fp32 bit: exact
    values (also -0, inf and NaN payloads) are, a single inexact element anywhere is not."""
    from adacheck.online.deltalog import bf16_exact

    def bits(t):
        return t.contiguous().view(torch.int32)

    exact = torch.randn(300_001).to(torch.bfloat16).float()
    specials = torch.tensor([0x80000000, 0x7F800000, 0xFF800000, 0x7FC00000, 0x7F810000, 0xFFC10000],
                            dtype=torch.int64).to(torch.int32).view(torch.float32)   # -0, +-inf, NaNs
    exact[:6] = specials
    ok, b = bf16_exact(exact.view(1, -1))
    assert ok and b.dtype == torch.bfloat16 and b.shape == (1, 300_001)
    assert torch.equal(bits(b.float().view(-1)), bits(exact))          # every bit, NaN payloads too
    assert torch.equal(b.view(-1)[6:], exact[6:].to(torch.bfloat16))    # what a cast gives
    out = torch.full((300_001,), 7.0, dtype=torch.bfloat16)                # the writer's reused copy
    ok, b2 = bf16_exact(exact.view(1, -1), out)
    assert ok and b2.data_ptr() == out.data_ptr() and b2.shape == (1, 300_001) and torch.equal(bits(b2.float()), bits(b.float()))
    for pos in (7, 150_000, 300_000):   # one element off a bf16 value, in or out of the sample
        t = exact.clone()
        t[pos] = torch.nextafter(t[pos], torch.tensor(float("inf")))
        assert bf16_exact(t) == (False, None), pos
    strided = exact.view(-1)[6::2]      # not contiguous: the cast-and-compare path, same answer
    ok, b = bf16_exact(strided)
    assert ok and torch.equal(b, strided.to(torch.bfloat16))
    assert bf16_exact(torch.empty(0))[0]


def test_the_shadow_of_a_compact_chain_is_the_state_replay_reaches():
    """compact mode measures its deviation on a Shadow: stepped with the gradients as stored, it
    is bit for bit what a recovery replaying them from the base reaches, and stepping it leaves
    the live tensors, moments and hyper-parameters alone; its distance to the live state is
    then exactly the recovery's."""
    from adacheck.online.optimtap import OptimizerTap, Shadow
    torch.manual_seed(0)

    def make():
        ps = [torch.nn.Parameter(torch.randn(64, 8)), torch.nn.Parameter(torch.randn(8))]
        return ps, torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.1)
    live, opt = make()
    tap = OptimizerTap([opt])
    base = [p.detach().clone() for p in live]
    shadow = Shadow(tap)
    log = []
    for step in range(4):
        grads = {k: torch.randn(t.shape) * 1e-3 for k, t in sorted(tap.tensors.items())}
        for k, g in grads.items():
            tap.tensors[k].grad = g.clone()
        opt.param_groups[0]["lr"] = 1e-2 / (step + 1)
        opt.step()
        calls = tap.take_calls()
        stored = {k: deltalog.compact_form(g).float() for k, g in grads.items()}
        before = ([t.clone() for t in tap.tensors.values()],
                  {id(p): {n: v.clone() for n, v in s.items()} for p, s in opt.state.items()},
                  dict(opt.param_groups[0], params=None))
        tap.replay(calls, {k: g.clone() for k, g in stored.items()}, shadow=shadow)
        assert all(torch.equal(a, b) for a, b in zip(before[0], tap.tensors.values()))
        assert all(torch.equal(v, before[1][id(p)][n]) for p, s in opt.state.items() for n, v in s.items())
        assert dict(opt.param_groups[0], params=None) == before[2]
        assert all(torch.equal(tap.tensors[k].grad, g) for k, g in grads.items())    # live gradients kept
        assert all(t.grad is None for t in shadow.tensors.values())
        log.append((calls, stored))
    dev = shadow.deviation(tap)
    assert dev["weights"] > 0 and dev["state"] > 0
    # a recovery: the base, then the stored gradients replayed through a tap of a new optimizer
    rec, opt2 = make()
    with torch.no_grad():
        for p, b in zip(rec, base):
            p.copy_(b)
    tap2 = OptimizerTap([opt2])
    for calls, stored in log:
        tap2.replay(calls, {k: g.clone() for k, g in stored.items()})
    for k in tap.tensors:
        assert torch.equal(tap2.tensors[k], shadow.tensors[k])
    far = max((tap2.tensors[k] - tap.tensors[k]).abs().max().item() for k in tap.tensors)
    assert far == dev["weights"]
    moments = max((opt2.state[tap2.tensors[k]][n] - opt.state[tap.tensors[k]][n]).abs().max().item()
                  for k in tap.tensors for n in ("exp_avg", "exp_avg_sq"))
    assert moments == dev["state"]
    exact = Shadow(tap)          # a shadow of the live state itself is at distance 0
    assert exact.deviation(tap) == {"weights": 0.0, "state": 0.0}
    for k, t in tap.tensors.items():   # inf where the live state is not finite and the shadow is
        with torch.no_grad():
            t.view(-1)[0] = float("inf")
        assert exact.deviation(tap)["weights"] == float("inf")
        exact.tensors[k].view(-1)[0] = float("inf")   # equal infinities are no distance
        break
    assert exact.deviation(tap) == {"weights": 0.0, "state": 0.0}


def test_records_of_an_earlier_naming_replay_through_aliases():
    """A tap whose optimizers are named by per-optimizer prefixes reads a record made under
    the prefixes an earlier version used (``aliases``): the calls and pre-clip entries get
    today's keys, each renamed gradient is read under its stored name, and replaying them is
    the same step as replaying a record made today."""
    from adacheck.online.optimtap import OptimizerTap
    torch.manual_seed(0)

    def make():
        a = [torch.nn.Parameter(torch.ones(4)), torch.nn.Parameter(torch.ones(2))]
        b = [torch.nn.Parameter(torch.ones(3))]
        return a + b, [torch.optim.AdamW(a, lr=1e-2), torch.optim.SGD(b, lr=0.5, momentum=0.9)]
    ps, opts = make()
    old = OptimizerTap(opts, prefix="tp0.ep1.")
    grads = {}
    for k, t in old.tensors.items():
        t.grad = grads[k] = torch.randn(t.shape)
    for o in opts:
        o.step()
    calls = old.take_calls()
    old.remove()
    assert {k for c in calls for g in c[1] for k in g[2]} == {"tp0.ep1.o0.g0.p0", "tp0.ep1.o0.g0.p1", "tp0.ep1.o1.g0.p0"}

    ps2, opts2 = make()
    tap = OptimizerTap(opts2, prefix=["tp0.", "ep1.etp0."], aliases=["tp0.ep1.", "tp0.ep1."])
    assert set(tap.tensors) == {"tp0.o0.g0.p0", "tp0.o0.g0.p1", "ep1.etp0.o1.g0.p0"}
    tree, stored = tap.current({"calls": calls, "preclip": {"tp0.ep1.o1.g0.p0": [1.0]}, "step": 3})
    assert tree["step"] == 3 and set(tree["preclip"]) == {"ep1.etp0.o1.g0.p0"}
    assert stored == {"tp0.o0.g0.p0": "tp0.ep1.o0.g0.p0", "tp0.o0.g0.p1": "tp0.ep1.o0.g0.p1",
                      "ep1.etp0.o1.g0.p0": "tp0.ep1.o1.g0.p0"}
    keys = tap.grad_keys(tree["calls"], "the record")
    tap.replay(tree["calls"], {k: grads[stored[k]] for k in keys})
    assert all(torch.equal(a, b) for a, b in zip(ps, ps2))
    assert tap.current({"calls": tree["calls"]})[1] == {}      # today's names are left as they are
    with pytest.raises(StateError):       # without the aliases the old record names unknown tensors
        OptimizerTap(make()[1], prefix=["tp0.", "ep1.etp0."]).grad_keys(calls, "the record")


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (the copies are asynchronous there)")
def test_gpu_gradients_are_written_only_after_their_copies_land(tmp_path):
    """A gradient produced on the GPU behind a long kernel is staged with a non-blocking copy into
    pinned memory and handed to the writer thread at once: the writer must wait on the slot's
    CUDA event, not read the buffer early (it held the previous step's values, or nothing).
    The file holds exactly the gradient, at every step; the training stream is never
    synchronized by the staging (the step returns before the kernel ends).  The gradients are
    fp32, staged split (bf16 proved by the device) while they are bf16 values; step 4's is not
    (put together again from its halves), steps 5-6 are staged whole (bf16 again, proved by the
    writer)."""
    lg = deltalog.DeltaLog(str(tmp_path), 0, "n", fsync=False, queue_depth=2)
    waited = []

    def gradient(step):
        return torch.full((1 << 22,), float(step), device="cuda") * 3.0 + (1e-3 if step == 4 else 0.0)
    warm = deltalog.DeltaLog(str(tmp_path / "warm"), 0, "n", fsync=False)   # (the kernels loaded: a kernel's
    warm.begin(1)                                                          # first launch may wait for the device)
    warm.add("w", gradient(0))
    warm.submit(1, {})
    warm.close()
    try:
        for step in range(1, 7):
            norm = torch.tensor([float(step)], device="cuda")   # (a copy from pageable memory: it waits)
            torch.cuda._sleep(int(2e8))                     # ~0.1-0.2 s of GPU time ahead of the gradient
            g = gradient(step)
            lg.begin(step)
            lg.add("w", g)
            lg.submit(step, {"step": step}, {"norm": norm * 1.0})
            waited.append(torch.cuda.current_stream().query())   # False: still busy, nothing waited
        lg.flush()
    finally:
        lg.close()
    assert not any(waited), f"the staging waited for the device at steps {[i + 1 for i, w in enumerate(waited) if w]}"
    steps, _ = deltas.committed_steps(str(tmp_path), 0, 1)
    assert [st.step for st in steps] == list(range(1, 7))
    for st in steps:
        got = deltas.read_grad(str(tmp_path), st, "w", 0)
        assert torch.equal(got, gradient(st.step).cpu()), st.step
        assert st.records[0]["tensors"]["w"]["stored"] == ("float32" if st.step == 4 else "bfloat16"), st.step
        assert deltas.read_extra(str(tmp_path), st, 0)["step"] == st.step


def test_spare_delta_files_are_written_over_unless_a_reader_holds_them(tmp_path):
    """The memory tier's spare files (a retired chain's delta files): a writer writes over one
    (cut to the new file's size) instead of making a new file, but never over one that a reader
    (a copy to durable storage that fell behind) still holds; a file given away as a spare can no
    longer be read as the old one.  The oracle is safetensors' own loader."""
    from safetensors.torch import load_file
    from adacheck.format.writer import write_safetensors
    from adacheck.storage.direct import DirectFileWriter, SpareFiles
    old, new = str(tmp_path / "old.safetensors"), str(tmp_path / "new.safetensors")
    a = torch.arange(600_000, dtype=torch.float32)
    write_safetensors(old, {"g": a}, fsync=False)
    spares = SpareFiles(str(tmp_path / "spares"))
    before = os.open(old, os.O_RDONLY)       # (the reader's file, whatever becomes of its name)
    try:
        with SpareFiles.held(old):
            assert spares.refill([old]) == 1 and not os.path.exists(old)
            writer = DirectFileWriter(spares)
            writer.write(new, {"g": torch.ones(10)}, fsync=False)
            assert writer.reused == 0                     # (held: a new file instead)
        with open(old + ".check", "wb") as f:
            f.write(os.pread(before, os.fstat(before).st_size, 0))
    finally:
        os.close(before)
    assert torch.equal(load_file(old + ".check")["g"], a)             # the held file kept its bytes
    assert torch.equal(load_file(new)["g"], torch.ones(10)) and os.listdir(spares.dir) == []
    # nobody holds it: the next file is written over a spare, and cut to its own size
    write_safetensors(old, {"g": a}, fsync=False)
    assert spares.refill([old]) == 1
    writer = DirectFileWriter(spares)
    # (1 MiB at a block-aligned address: written straight from its memory, so the file ends on a
    # block with no padding to cut; the longer spare's rest must be cut all the same)
    room = torch.empty(262_144 + 1024)
    at = (-room.data_ptr() % 4096) // 4
    c = room[at:at + 262_144].fill_(3.0)
    writer.write(new, {"g": c}, fsync=False)
    assert writer.reused == 1 and torch.equal(load_file(new)["g"], c)
    assert os.path.getsize(new) < 600_000 * 4 and os.listdir(spares.dir) == []
    with pytest.raises(FileNotFoundError):          # a file given away is not read as itself
        write_safetensors(old, {"g": a}, fsync=False)
        spares.refill([old])
        with SpareFiles.held(old):
            pass
