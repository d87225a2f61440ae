"""Pipeline transfers through shared memory (comm/shm_pipe.py) between the gloo ranks of one host.

What is sent arrives bitwise, for every dtype and size (a 0-dim tensor, a message cut into
pieces, more than a ring holds: the helper thread writes the rest), in either direction at
once without either side blocking, and in another order than sent (tags pair them).  A
receive with no send names its peer once the collective timeout passes, as does a send
that is never taken; turned off, the
transfers stay on gloo; only transfers that ask for the pipe use it.  A property test runs
both ends of a channel in one process over an anonymous mapping: any sequence of messages,
received in any order, arrives bitwise; so do messages sent and received through bound links
(``PipeLink``, a pipeline's carry) mixed with the general path, whatever the order.  A link's
receive may hold its slot (the receiver computes from it): a held message stays intact until
released, in any order, while its sender's later pieces wait for their slots.  A send may
skip its copy: a message made in the slot ``reserve`` handed out is only published; no slot is
reserved where the send would not take one (a full ring, queued pieces, a message in pieces).
"""
from __future__ import annotations

import glob
import mmap
import time

import pytest
import torch
from hypothesis import given, settings, strategies as st

from conftest import time_limit
from meshdsl.errors import DistributedError
from meshdsl.processes import launcher as launch
from meshdsl.comm import shm
from meshdsl.comm import shm_pipe
from meshdsl.comm.distributed import TorchComm

pytestmark = pytest.mark.skipif(not shm.supported(), reason="shared-memory transfers need x86-64 Linux")

RING = shm_pipe.NUM_SLOTS * shm_pipe.SLOT_DATA


def _message(src: int, tag: int) -> torch.Tensor:
    """What rank ``src`` sends with ``tag``: dtypes and sizes vary with the tag."""
    g = torch.Generator().manual_seed(100 * src + tag)
    kind = tag % 5
    if kind == 0:
        return torch.randn((), generator=g)                                  # 0-dim
    if kind == 1:
        return torch.randn(7, generator=g).to(torch.bfloat16)
    if kind == 2:
        return torch.randint(-9, 9, (3, 4), generator=g)                     # int64
    if kind == 3:
        return torch.randn(11, generator=g) > 0                              # bool
    return torch.randn(shm_pipe.SLOT_DATA // 4 * 2 + 5, generator=g)         # three pieces


def _send(comm, x, offset, tag, pipe=True):
    comm.collective("send", [x], ("x",), {"offset": offset, "tag": tag, "pipe": pipe})


def _recv(comm, like, offset, tag, pipe=True):
    return comm.start("recv", [torch.empty_like(like)], ("x",), {"offset": offset, "tag": tag, "pipe": pipe})


def _exchange(comm):
    """Rank r sends tags 0..9 to each neighbour, then receives its neighbours' in reverse order."""
    comm.open_pipe(("x",), [1, -1])
    r, n = comm.rank, comm.mesh.size
    peers = [off for off in (1, -1) if 0 <= r + off < n]
    for tag in range(10):
        for off in peers:
            _send(comm, _message(r, tag), off, tag)
    got = {}
    for tag in reversed(range(10)):
        for off in peers:
            src = r + off
            got[(src, tag)] = _recv(comm, _message(src, tag), -off, tag).wait()[0]
    comm.drain()
    return got, [p is not None for p in comm._pipes.values()]


@pytest.mark.timeout(60)
def test_messages_arrive_bitwise_in_any_order():
    results = launch.spawn(_exchange, 3, mesh="x:3", timeout=50)
    for r, (got, pipes) in enumerate(results):
        assert pipes == [True]
        assert sorted(src for src, _ in got) == sorted([q for q in (r - 1, r + 1) if 0 <= q < 3] * 10)
        for (src, tag), y in got.items():
            x = _message(src, tag)
            assert y.dtype == x.dtype and y.shape == x.shape and torch.equal(y, x), (r, src, tag)
    assert glob.glob("/dev/shm/meshdsl-*") == []


def _both_ways_more_than_a_ring(comm):
    comm.open_pipe(("x",), [1, -1])
    off = 1 if comm.rank == 0 else -1
    big = [torch.full((RING // 4 // 3,), float(10 * comm.rank + i)) for i in range(5)]  # 5/3 of a ring
    for i, x in enumerate(big):
        _send(comm, x, off, i)
    # Both ranks meet here before either receives anything: a send that waited for its peer
    # to take the data would never get here (it would raise at the collective timeout).
    comm.barrier()
    got = [_recv(comm, big[0], -off, i).wait()[0] for i in range(5)]
    comm.drain()
    return [float(y[0]) for y in got], all(float(y[-1]) == float(y[0]) for y in got)


@pytest.mark.timeout(60)
def test_sends_never_block_when_both_rings_are_full():
    results = launch.spawn(_both_ways_more_than_a_ring, 2, mesh="x:2", collective_timeout=20, timeout=50)
    for r, (firsts, whole) in enumerate(results):
        assert firsts == [float(10 * (1 - r) + i) for i in range(5)] and whole


def _nothing_sent(comm):
    comm.open_pipe(("x",), [1])
    if comm.rank == 1:
        return _recv(comm, torch.ones(3), 1, 0).wait()
    time.sleep(6)
    return None


@pytest.mark.slow   # (3 s; the send-side timeout case runs always)
@pytest.mark.timeout(60)
def test_a_receive_with_no_send_names_the_peer_after_the_timeout():
    start = time.monotonic()
    with pytest.raises(DistributedError) as e:
        launch.spawn(_nothing_sent, 2, mesh="x:2", collective_timeout=2.0, timeout=50)
    text = str(e.value)
    assert "rank 1 of 2 raised an exception" in text
    assert "rank 1 received nothing from rank 0 within 2 s" in text
    assert time.monotonic() - start < time_limit(30.0)  # the collective timeout ended it, not the job's 50 s


def _nothing_taken(comm):
    comm.open_pipe(("x",), [1])
    if comm.rank == 0:  # more than the ring holds: the rest waits for slots that never free
        _send(comm, torch.zeros(RING // 4 + 1000), 1, 0)
        comm.drain()
    time.sleep(6)


@pytest.mark.timeout(60)
def test_a_send_never_taken_names_the_receiver_after_the_timeout():
    with pytest.raises(DistributedError) as e:
        launch.spawn(_nothing_taken, 2, mesh="x:2", collective_timeout=2.0, timeout=50)
    assert "rank 0 of 2 raised an exception" in str(e.value)
    assert "rank 1 took nothing that rank 0 sent it for 2 s" in str(e.value)


def _plain_or_pipe(comm, pipe):
    comm.open_pipe(("x",), [1, -1])
    off = 1 if comm.rank == 0 else -1
    x = torch.arange(6.0) + comm.rank
    _send(comm, x, off, 3, pipe)
    y = _recv(comm, x, -off, 3, pipe).wait()[0]
    comm.drain()
    return y, [sum(p.written) for p in comm._pipes.values() if p is not None], comm.shm


@pytest.mark.timeout(60)
@pytest.mark.parametrize("pipe", [True, False])
def test_only_transfers_that_ask_use_the_pipe(pipe):
    for r, (y, pipes, on) in enumerate(launch.spawn(_plain_or_pipe, 2, mesh="x:2", args=(pipe,), timeout=50)):
        assert torch.equal(y, torch.arange(6.0) + (1 - r))
        assert pipes == [1 if pipe else 0] and on   # pieces this rank put in its ring


def _off(comm):
    return _plain_or_pipe(TorchComm("x:2", shm=False), True)


@pytest.mark.timeout(60)
def test_turned_off_the_transfers_stay_on_gloo(monkeypatch):
    for r, (y, pipes, on) in enumerate(launch.spawn(_off, 2, mesh="x:2", timeout=50)):
        assert torch.equal(y, torch.arange(6.0) + (1 - r))
        assert pipes == [] and not on


def test_channels_are_the_pairs_of_the_offsets():
    assert shm_pipe.pairs_for(3, [1, -1]) == [(1, 0), (2, 1), (0, 1), (1, 2)]
    assert shm_pipe.pairs_for(2, [1, 1, 0]) == [(0, 1)]
    assert shm_pipe.pairs_for(4, [-2]) == [(2, 0), (3, 1)]


DTYPES = (torch.float32, torch.bfloat16, torch.int64, torch.bool)


@settings(max_examples=30, deadline=None, derandomize=True)
@given(st.lists(st.tuples(st.sampled_from(DTYPES), st.integers(0, 3 * shm_pipe.SLOT_DATA // 2)),
                min_size=1, max_size=12),
       st.randoms(use_true_random=False))
def test_any_messages_in_any_receive_order_arrive_bitwise(messages, rnd):
    pairs = shm_pipe.pairs_for(2, [1])
    pipe = shm_pipe.ShmPipe(mmap.mmap(-1, len(pairs) * shm_pipe._CHANNEL), pairs, (0, 1), timeout=10.0,
                            describe="one process", spins=100)
    g = torch.Generator().manual_seed(len(messages))
    sent = []
    for dtype, nbytes in messages:   # up to 1.5 slots each, up to 4.5 rings in all: the helper writes the rest
        n = nbytes // torch.empty((), dtype=dtype).element_size()
        sent.append((torch.randn(n, generator=g) * 100).to(dtype))
    for tag, x in enumerate(sent):
        pipe.send(x, 0, 1, tag)
    order = list(range(len(sent)))
    rnd.shuffle(order)
    for tag in order:
        out = torch.empty_like(sent[tag])
        assert pipe.recv(out, 0, 1, tag).wait()
        assert torch.equal(out, sent[tag]), tag
    pipe.drain()
    assert pipe.aside == {} and not any(pipe.queue.values())


@settings(max_examples=30, deadline=None, derandomize=True)
@given(st.lists(st.tuples(st.sampled_from(DTYPES), st.integers(0, 3 * shm_pipe.SLOT_DATA // 2),
                          st.booleans(), st.booleans()), min_size=1, max_size=12),
       st.randoms(use_true_random=False))
def test_links_and_the_general_path_carry_any_messages_in_any_order(messages, rnd):
    """Each message goes through a link or ``send`` and comes out of a link or ``recv``: the
    link's direct copy where the message fits a slot and comes next, the general path where it
    is larger, queued behind a full ring, or another tag's message comes first."""
    pairs = shm_pipe.pairs_for(2, [1])
    pipe = shm_pipe.ShmPipe(mmap.mmap(-1, len(pairs) * shm_pipe._CHANNEL), pairs, (0, 1), timeout=10.0,
                            describe="one process", spins=100)
    g = torch.Generator().manual_seed(len(messages))
    sent, booked = [], []
    for tag, (dtype, nbytes, by_link, _) in enumerate(messages):
        n = nbytes // torch.empty((), dtype=dtype).element_size()
        x = (torch.randn(2, n, generator=g) * 100).to(dtype)[:, ::2]   # not contiguous
        sent.append(x)
        if by_link:
            pipe.link(0, 1, tag, x, lambda nbytes, seconds: booked.append(nbytes)).send(x)
        else:
            pipe.send(x.contiguous(), 0, 1, tag)
    order = list(range(len(sent)))
    rnd.shuffle(order)
    for tag in order:
        x, by_link = sent[tag], messages[tag][3]
        if by_link:
            out = pipe.link(0, 1, tag, x).recv()
        else:
            out = torch.empty(x.shape, dtype=x.dtype)
            assert pipe.recv(out, 0, 1, tag).wait()
        assert out.shape == x.shape and torch.equal(out, x), tag
    pipe.drain()
    assert pipe.aside == {} and not any(pipe.queue.values())
    assert booked == [x.numel() * x.element_size() for x, m in zip(sent, messages) if m[2]]


def test_a_link_is_ready_once_a_piece_waits_in_its_channel():
    """``ready()`` tells a receiver whether ``recv`` would wait (the pipeline frees finished
    activations while it would): not before the send, yes after it, not once it is taken."""
    pairs = shm_pipe.pairs_for(2, [1])
    pipe = shm_pipe.ShmPipe(mmap.mmap(-1, len(pairs) * shm_pipe._CHANNEL), pairs, (0, 1), timeout=10.0,
                            describe="one process", spins=100)
    x = torch.arange(12.0).reshape(3, 4)
    send, recv = pipe.link(0, 1, 7, x), pipe.link(0, 1, 7, x)
    assert not recv.ready()
    send.send(x)
    assert recv.ready()
    assert torch.equal(recv.recv(), x)
    assert not recv.ready()


def _verbose(comm, other_hosts):
    import contextlib
    import io
    if other_hosts:   # every rank its own host: no shared segment, the transfers stay on gloo
        shm._host_key = lambda: comm.rank
    comm.verbose, err = True, io.StringIO()
    with contextlib.redirect_stderr(err):
        comm.open_pipe(("x",), [1, -1])
    y = _plain_or_pipe(comm, True)[0]
    return err.getvalue(), y


@pytest.mark.timeout(60)
@pytest.mark.parametrize("other_hosts,how", [(False, "shared memory"), (True, "gloo (no shared segment)")])
def test_verbose_says_which_path_the_transfers_took(other_hosts, how):
    for rank, (text, y) in enumerate(launch.spawn(_verbose, 2, args=(other_hosts,), mesh="x:2", timeout=50)):
        assert text == f"[meshdsl rank {rank}] pipeline transfers over ('x',) (0, 1): {how}\n"
        assert torch.equal(y, torch.arange(6.0) + (1 - rank))


def _one_process_pipe():
    pairs = shm_pipe.pairs_for(2, [1])
    return shm_pipe.ShmPipe(mmap.mmap(-1, len(pairs) * shm_pipe._CHANNEL), pairs, (0, 1), timeout=10.0,
                            describe="one process", spins=100)


def test_a_held_receive_reads_its_slot_until_released_and_its_sender_waits_meanwhile():
    """``recv(hold=True)`` gives a view of the slot (no copy): while it is held the sender's
    pieces one ring further on wait in its queue instead of overwriting it; released, they come."""
    pipe, n = _one_process_pipe(), shm_pipe.NUM_SLOTS
    xs = [torch.arange(12.0).reshape(3, 4) + 100 * i for i in range(n + 2)]
    links = [pipe.link(0, 1, i, xs[i]) for i in range(n + 2)]
    for link, x in zip(links, xs):
        link.send(x)
    assert len(pipe.queue[0]) == 2                          # the ring is full: two wait in its queue
    held = links[0].recv(hold=True)
    assert links[0].borrows(held) and torch.equal(held, xs[0])
    copies = [link.recv() for link in links[1:n]]          # the ring's other pieces, copied out
    assert not any(links[0].borrows(c) for c in copies)
    time.sleep(0.05)                                        # the helper thread had its chance
    assert torch.equal(held, xs[0])                         # piece n (slot 0) still waits
    assert not links[n].ready()
    links[0].release()
    assert torch.equal(links[n].recv(), xs[n]) and torch.equal(links[n + 1].recv(), xs[n + 1])
    pipe.drain()
    assert pipe.held == [[]] and not any(pipe.queue.values())


@settings(max_examples=25, deadline=None, derandomize=True)
@given(st.lists(st.tuples(st.sampled_from(DTYPES), st.integers(1, 64), st.booleans()), min_size=1, max_size=30),
       st.randoms(use_true_random=False))
def test_held_receives_released_in_any_order_stay_intact(messages, rnd):
    """Messages sent by links (strided tensors) and received held or copied, the held ones
    released in any order (the oldest whenever the next receive would lie a ring beyond it,
    as a pipeline's schedule guarantees): every message arrives bitwise, and a held one stays
    bitwise what was sent until released, whatever its ring's sender writes meanwhile."""
    pipe = _one_process_pipe()
    g = torch.Generator().manual_seed(len(messages))
    sent = [(torch.randn(2, 2 * n, generator=g) * 100).to(dtype)[:, ::2] for dtype, n, _ in messages]
    links = [pipe.link(0, 1, tag, x) for tag, x in enumerate(sent)]
    for link, x in zip(links, sent):
        link.send(x)
    held: dict[int, torch.Tensor] = {}
    for tag, (link, x) in enumerate(zip(links, sent)):
        while held and tag - min(held) >= shm_pipe.NUM_SLOTS:   # else it could not come
            oldest = min(held)
            links[oldest].release()
            del held[oldest]
        out = link.recv(hold=messages[tag][2])
        assert out.shape == x.shape and torch.equal(out, x), tag
        assert link.borrows(out) == messages[tag][2]
        if messages[tag][2]:
            held[tag] = out
        for k in rnd.sample(sorted(held), rnd.randint(0, len(held))):   # some released, any order
            assert torch.equal(held[k], sent[k]), k
            links[k].release()
            del held[k]
    for k, out in held.items():
        assert torch.equal(out, sent[k]), k
        links[k].release()
    pipe.drain()
    assert pipe.held == [[]] and pipe.aside == {} and not any(pipe.queue.values())
    assert pipe.ints[pipe._counter(0, 1)] == len(sent)   # every slot given back


def test_a_held_slot_may_be_written_in_place_without_reaching_the_sender_or_the_next_message():
    """A stage may write into what it received (an in-place op): a held slot is the stage's
    until released, so that changes neither the sent tensor nor any later message."""
    pipe = _one_process_pipe()
    x = torch.arange(6.0)
    a, b = pipe.link(0, 1, 1, x), pipe.link(0, 1, 2, x)
    a.send(x)
    b.send(x * 2)
    got = a.recv(hold=True)
    got.mul_(-1)
    assert torch.equal(x, torch.arange(6.0)) and torch.equal(b.recv(hold=True), x * 2)
    a.release()
    b.release()
    a.send(x + 1)
    assert torch.equal(a.recv(), x + 1)


def test_a_message_made_in_its_reserved_slot_is_sent_without_a_copy(monkeypatch):
    """``reserve`` hands out the slot the next send takes: a kernel writes the message there, and
    the send only publishes it (no copy); the receiver reads it bitwise, and the next reservation
    is the next slot.  A reservation left unused changes nothing: the next send copies as before."""
    pipe = _one_process_pipe()
    like = torch.zeros(3, 4)
    link = pipe.link(0, 1, 5, like)
    a, b = torch.randn(3, 4), torch.randn(3, 4)
    slot = link.reserve()
    assert slot.shape == like.shape and link.borrows(slot) and link.reserve() is slot   # reserving changes nothing
    made = torch.add(a, b, out=slot)
    copies = []
    real_copy = torch.Tensor.copy_
    monkeypatch.setattr(torch.Tensor, "copy_", lambda x, *args, **kw: copies.append(x) or real_copy(x, *args, **kw))
    link.send(made)
    assert copies == []
    monkeypatch.undo()
    assert torch.equal(link.recv(), a + b)                  # torch.add(out=) and a + b: the same kernel
    unused = link.reserve()
    assert unused is not None and unused.data_ptr() != slot.data_ptr()
    link.send(a)                                            # not made in the slot: copied into it
    assert torch.equal(link.recv(), a)


def test_no_slot_is_reserved_where_the_next_send_would_not_take_one():
    """A full ring (the receiver took nothing), pieces waiting in the queue, a message larger than
    a slot: ``reserve`` says None, and the sends copy as before."""
    pipe, n = _one_process_pipe(), shm_pipe.NUM_SLOTS
    small = pipe.link(0, 1, 1, torch.zeros(4))
    big = pipe.link(0, 1, 2, torch.zeros(shm_pipe.SLOT_DATA // 4 + 1))
    assert big.reserve() is None
    for i in range(n):
        small.send(torch.full((4,), float(i)))
    assert small.reserve() is None                          # the ring is full
    small.send(torch.full((4,), float(n)))                  # waits in the queue
    assert small.recv().eq(0).all() and small.reserve() is None   # a slot is free, but pieces are queued
    for i in range(1, n + 1):
        assert torch.equal(small.recv(), torch.full((4,), float(i)))
    pipe.drain()
    assert small.reserve() is not None


def test_a_strided_view_of_its_own_slot_is_sent_as_that_view():
    """A value lying in the reserved slot but not as the slot's tensor (a transposed view of it) is
    copied out of the slot before the slot is written: what arrives is the view's values."""
    pipe = _one_process_pipe()
    link = pipe.link(0, 1, 3, torch.zeros(4, 4))
    slot = link.reserve()
    slot.copy_(torch.arange(16.0).reshape(4, 4))
    link.send(slot.t())
    assert torch.equal(link.recv(), torch.arange(16.0).reshape(4, 4).t())


def test_a_message_in_the_segment_sent_through_the_queue_is_copied_first():
    """A send that finds the ring full queues its message for the helper thread; a message lying in
    the ring itself (a held message passed on) is copied first: the pieces the helper writes before
    it, once the slot is released, cannot overwrite it before it is written."""
    pipe, n = _one_process_pipe(), shm_pipe.NUM_SLOTS
    link = pipe.link(0, 1, 1, torch.zeros(4))
    for i in range(n):
        link.send(torch.full((4,), float(i)))
    first = link.recv(hold=True)                            # slot 0, held: the ring stays full
    link.send(torch.full((4,), -1.0))                       # queued: it goes in slot 0 once released
    link.send(first)                                        # queued behind it
    rest = [link.recv() for _ in range(n - 1)]
    assert [x[0].item() for x in rest] == [float(i) for i in range(1, n)]
    link.release()
    assert torch.equal(link.recv(), torch.full((4,), -1.0))
    assert torch.equal(link.recv(), torch.zeros(4))        # what slot 0 held when it was sent
    pipe.drain()
