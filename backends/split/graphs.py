"""Eager split calls replayed from CUDA graphs the split captures itself (docs/design.md, "The
split"): eager, a split call is bound by its host's enqueue at the starved shapes (dozens of
launches and the Python around them, 0.6-1.2 ms per call on the H200's host against 0.5-0.65 ms
of kernels), captured its launches cost nothing.

Per key (the backend, every tensor's shape and dtype, the sequence lengths, the scale and flags,
the device) the first call runs eagerly (it compiles, autotunes and builds the index tensors the
capture then reads), the second captures the split into a graph over static input buffers and
replays it, and later calls copy their inputs in, replay, and return fresh copies of the outputs
(a multi-tensor copy per dtype each way: `copy_all`). Where a call's tensors sit at the same
addresses, with the same strides, as the key's previous call's (the same tensors called again, or
a training step handed the same blocks by the caching allocator), the key is captured once more
on the caller's own tensors, and from then on a call at those addresses replays with no copy in;
one at other addresses goes back to the copies for good (one graph per key: a model whose layers
share a shape calls it from as many addresses as layers). With several address sets per key
(`ADDRESS_SETS`, `PLACED_GPU_VERIFIED`), each set that comes again within the key's last calls
gets its own in-place graph instead, all of the key's graphs on one memory pool, and only calls
at other addresses copy. The graph keeps addresses, never the
caller's tensors. Outputs are fresh copies (autograd may keep a gradient it is handed), or, for
the backward's per-token gradients with lending on (`LEND_GPU_VERIFIED`, the default stream),
the graph's own buffers, never replayed over while anything holds them; the op's forward, whose
outputs autograd keeps until the layer's backward, gives each graph its own memory pool and lends
all of an in-place graph's outputs, one layer's held outputs blocking only its own graph
(`OWN_POOLS_GPU_VERIFIED`).
Where in-place replays are on, known lengths are read from one device constant of their values
(the op's backward gets a fresh copy of cu_seqlens each step). In-place replays run once their GPU test passed
(`IN_PLACE_GPU_VERIFIED`, or GDR_ALLOW_UNVERIFIED=1), never inside the autotuner's timing
(`graph_safe.copied_graph_inputs`: it calls the same tensors again and again).
A key whose capture fails (a backend that reads the device on the host) runs eagerly from then on,
said once; so does one evicted and captured again `MAX_CAPTURES` times (more shapes in turn than
graphs kept: a capture per call costs more than the eager call). At most `LIMIT` graphs with copies are kept, and `LIMIT * ADDRESS_SETS` in place, least recently
used first out; each holds its static
inputs and its memory pool (about three times the call's inputs and outputs), said when captured.
`GDR_SPLIT_GRAPHS=0` turns this off.
"""

from __future__ import annotations

import collections
import contextlib
import logging
from dataclasses import replace
from typing import Callable

import torch

from gdr_dispatch import caches, env
from gdr_dispatch.contract import GDRCall, GDRGrads
from gdr_dispatch.graph_safe import (device_constant, graph_inputs_copied, graph_owned_pins, release_pins, remember,
                                     remembered)
from gdr_dispatch.registry import unverified_allowed

log = logging.getLogger("gdr_dispatch")

#: Graphs kept at once (each with its pool: a starved-grid autotune times several candidates).
LIMIT = 4
#: Captures of one key at most (every capture: after an eviction, in place, back to copies): a key
#: captured this often runs eagerly from then on.
MAX_CAPTURES = 4
TENSORS = ("q", "k", "v", "a", "g", "b", "do", "dht", "h", "initial_state", "cu_seqlens")

# key -> (graph, static inputs or None, static outputs, the caller's addresses it reads or None)
_graphs = caches.memo("split graphs", limit=LIMIT, on_evict=lambda key, hit: (_release(key), _forget_lent(key)))
# key -> the kept index tensors its graph reads (graph_safe.graph_owned_pins), released with it
_pins: dict = {}
# key -> "eager" once run, "refused" if its capture failed, then (captures so far, copies for good)
_seen = caches.memo("split graph keys seen", limit=256)
_callers = caches.memo("split graph callers", limit=256)  # key -> the addresses of its previous call
# key -> (the stream its graph's buffers were last used on, an event recorded there after the copies
# out): a call on another stream waits for it before it writes them
_last_use = caches.memo("split graph streams", limit=256)
#: Whether the in-place replays' GPU tests (tests/test_gpu.py: the split candidates' own graphs,
#: new values read in place) have passed; while False only GDR_ALLOW_UNVERIFIED=1 turns them on.
IN_PLACE_GPU_VERIFIED = True
#: Replays so far, "in place" and "copied" (what a bench reports beside its times).
replays: collections.Counter = collections.Counter()
#: Captures so far, "in place" and "copies" (a bench warms up until they stop: each costs about
#: two eager calls).
captures: collections.Counter = collections.Counter()
#: Bytes the replays copied so far, "in" (inputs into the graph's own) and "out" (fresh outputs):
#: GPU time a step spends beside its kernels (docs/kernels.md, "The split").
copied_bytes: collections.Counter = collections.Counter()

#: In-place graphs kept per key, one per address set its calls come at (a model's layers at one
#: shape; fresh tensors the caching allocator hands back in turn): an address set seen again within
#: the key's last `RECENT` calls is captured on while the latest calls cycle through no more sets
#: than kept (a full key gives up its least recently replayed one, `2 * ADDRESS_SETS` captures in
#: all), and every graph of the key is captured on one stream
#: into one memory pool (each replay writes all it reads of the pool, and its outputs are copied out
#: or, lent, held from every replay of the key, so one graph's scratch may be another's). Other
#: calls replay with copies.
#: 4: with 12 HF Qwen3-Next layers at one shape, 16 sets took 61 % of the bytes copied in off for
#: 1 GiB more and moved the step less than the host's drift (bench/results/nvidia-h200-sm90-hf-starved.md).
ADDRESS_SETS = 4
RECENT = 64
#: Whether several in-place graphs per key are on without GDR_ALLOW_UNVERIFIED=1 (else one address
#: set, then copies for good). Their GPU test (tests/test_gpu.py, three layers at one shape in a
#: moving order) passes on the H200; with `_few_sets` they take the copies in off the training
#: step at the starved shapes (bench/results/nvidia-h200-sm90-training-starved.md).
PLACED_GPU_VERIFIED = True
#: Outputs lent instead of copied out (`run`'s backward: the gradients, which autograd hands on and
#: drops before the layer's next backward): a replay returns the graph's own output buffers, and
#: the key replays again only once nothing holds them (their storages' use counts back where they
#: were when lent); a call that finds them held runs eagerly (never overwriting them), and after
#: `LEND_BLOCKS` such calls in a row the key's graphs go and its next capture copies them out for good. Only
#: calls on the device's default stream lend (the key's next call on a side stream could run while
#: another stream still reads what it lent), and a later call on another stream waits for all the
#: stream of the lending call had queued; a reader of a lent output on a stream of its own is not
#: waited for (autograd's `record_stream` guards the allocator's reuse, not a graph's fixed
#: buffers), nor one that keeps only its storage object or resizes it. Its GPU test
#: (tests/test_gpu.py) passes on the H200; it takes ~97 of the 163 MiB a step copied out at the
#: starved shapes (bench/results/nvidia-h200-sm90-training-starved.md).
LEND_GPU_VERIFIED = True
LEND_BLOCKS = 2
#: Whether `own` calls (the op's split forward: autograd keeps its outputs until the layer's
#: backward) give each graph a memory pool of its own and lend an in-place graph's outputs, held
#: and blocked per graph, without GDR_ALLOW_UNVERIFIED=1. On a key's shared pool a graph's outputs
#: may lie in another graph's freed scratch, so lending there holds every graph of the key: the
#: next layer at the shape would find the key held. Its own pool costs each graph its scratch. Its
#: GPU test (tests/test_gpu.py: three layers at one shape, one layer's outputs held past a step)
#: passes on the H200.
OWN_POOLS_GPU_VERIFIED = True
#: The backward's outputs lent: dq, dk, dv, dg, db (GDRGrads' order); dh0 is copied out.
LENT_GRADS = GDRGrads._fields.index("dh0")
# key -> [(a static output, its storage, its use count when lent)]: the output kept so its storage outlives the
# graph's eviction while listed here
_lent = caches.memo("split graph lent outputs", limit=256)
_lend_blocked = caches.memo("split graph lend blocked", limit=256)  # key -> calls that found its outputs held
# (key, addresses) -> an in-place hit as in _graphs; its pins under the same key in _pins
_placed = caches.memo("split graphs in place", limit=LIMIT * ADDRESS_SETS,
                      on_evict=lambda key, hit: (_release(key), _lent.pop(key, None), _forget_lent(key[0])))
# key -> its last `RECENT` calls' address sets, in order, and each one's count among them
_recent = caches.memo("split graph recent addresses", limit=256)
_streams = caches.memo("split graph capture streams", limit=256)  # key -> the stream its graphs are captured on
_placed_captures = caches.memo("split graph in-place captures", limit=256)  # key -> captures so far


def signature(tensors) -> tuple:
    """Each tensor's shape and dtype (None for an absent one): what a graph key holds of them
    (`torch.Size` is a tuple: it hashes and compares as one)."""
    return tuple(None if x is None else (x.shape, x.dtype) for x in tensors)


def key_of(name: str, call: GDRCall) -> tuple:
    return (name, signature(getattr(call, n) for n in TENSORS), call.seq_lens, call.scale, call.chunk_size,
            call.state_v_first, str(call.q.device))


def wanted(q: torch.Tensor) -> bool:
    """Whether a split call on `q`'s device replays from graphs: on CUDA, outside a capture of the
    caller's, unless GDR_SPLIT_GRAPHS=0."""
    return q.is_cuda and env.split_graphs() and not torch.cuda.is_current_stream_capturing()


def run(name: str, call: GDRCall, fn: Callable[..., GDRGrads], extra: tuple = ()) -> GDRGrads:
    """`fn(call, *extra)`, replayed from a graph from the second call with the same key on (module
    docstring); `extra` (tensors) are graph inputs beside the call's, and their shapes part of the key."""
    if not wanted(call.q):
        return fn(call, *extra)
    n = len(TENSORS)

    def on(tensors):
        return tuple(fn(replace(call, **dict(zip(TENSORS, tensors[:n]))), *tensors[n:]))

    key = key_of(name, call) + ((signature(extra),) if extra else ())
    # the per-token gradients are lent (autograd hands them to the layer's earlier ops and drops
    # them); dh0 is copied out: a learnt initial state's .grad keeps it, which would block lending
    return GDRGrads(*run_tensors(name, key, tuple(getattr(call, n) for n in TENSORS) + tuple(extra), on,
                                 call.seq_lens, lend=LENT_GRADS))


def run_tensors(name: str, key: tuple, tensors: tuple, fn: Callable[[tuple], tuple], seq_lens: tuple,
                lend: int = 0, own: bool = False) -> tuple:
    """`fn(tensors)` (a tuple of tensors or None in, the same out), replayed from a graph from the
    second call with the same `key` on: the eager split's backward (`run`) and the op's split
    forward (forward.py). Inputs are copied into the graph's own, or read in place while they come
    at the addresses it was captured on; outputs come back as fresh copies (module docstring), the
    first `lend` of them as the graph's own buffers while nothing holds them from the call before
    (`LEND_GPU_VERIFIED`). With `own` (the forward, whose outputs autograd keeps until the layer's
    backward) every graph of the key has a memory pool of its own, and an in-place graph lends all
    its outputs, held and blocked per graph (`OWN_POOLS_GPU_VERIFIED`)."""
    allowed, own_allowed, multi, lend_allowed = _gates()  # one read of the context, the same answers
    own = own and own_allowed
    if own:  # its graphs apart from those captured on a shared pool (the gate may change between calls)
        key = key + ("own pools",)
    key = _interned(key)  # hashed once: a call looks it up in a dozen memos
    if allowed:  # stable lengths' addresses: what lets the op's backward replay in place
        # (floats and absent inputs skip the call: they are what `_lengths_constant` returns unchanged)
        tensors = tuple([x if x is None or x.is_floating_point() else _lengths_constant(x) for x in tensors])
    where = addresses(tensors)
    # `multi`: an in-place graph per address set that comes back
    # the previous call's addresses: what one in-place graph per key goes by (`multi` goes by `_recent`)
    before = None
    if not multi:
        before, _callers[key] = _callers.get(key), where
    state = _seen.get(key)
    if state is None:
        _seen[key] = "eager"
        if multi:  # a second call at these addresses is captured on them
            _note(key, where)
        return fn(tensors)  # the warm-up: compiles, caches the index tensors the capture reads
    if state == "refused":
        return fn(tensors)
    if _held(key):  # outputs it lent are still held: a replay would overwrite them
        return fn(tensors)
    lend = _lendable(key, lend, lend_allowed)
    captures, copies_only = state if isinstance(state, tuple) else (0, False)
    if multi:  # an in-place graph for these addresses, kept or captured now; else copies (below)
        placed = _placed_hit(name, key, tensors, fn, seq_lens, where, own)
        if placed is not None:
            if not own:
                return _replay(key, placed, tensors, lend)
            mine = (key, where)  # its own pool: what it lent is held and blocked on its own
            if _held(mine):
                return fn(tensors)
            return _replay(mine, placed, tensors, _lendable(mine, len(placed[2]), lend_allowed))
    hit = _graphs.get(key)
    if hit is not None and hit[3] is not None and (hit[3] != where or not allowed or multi):
        copies_only, hit = True, None  # captured on another caller's tensors: copies for good
    # the same addresses twice in a row (with several address sets kept, `_placed_hit` decided)
    in_place = not copies_only and before == where and allowed and not multi
    if hit is not None and in_place and hit[3] is None and captures >= MAX_CAPTURES:
        copies_only, in_place = True, False  # no captures left: the working graph with copies stays
    if hit is None or (in_place and hit[3] is None):
        if captures >= MAX_CAPTURES:
            # captured again and again (evicted by more keys in turn than LIMIT, or addresses that
            # came and went): a capture per call would cost more than running eagerly
            _drop(key)
            _seen[key] = "refused"
            if caches.first_time(("split graph thrash", name)):
                log.info("gdr_dispatch: %s runs eagerly: it was captured %d times (more shapes in turn than the "
                         "%d graphs kept)", name, captures, LIMIT)
            return fn(tensors)
        new = _capture(name, key, tensors, fn, seq_lens, in_place=in_place, **(_shared(key, own) if multi else {}))
        captures += 1
        if new is None and in_place:  # no capture on the caller's tensors: copies for good
            copies_only = True
            if hit is None:
                new = _capture(name, key, tensors, fn, seq_lens)
                captures += 1
            else:
                new = hit
        if new is None:
            _seen[key] = "refused"
            _drop(key)
            return fn(tensors)
        hit = new
    _seen[key] = (captures, copies_only)
    _graphs[key] = hit  # most recently used
    return _replay(key, hit, tensors, lend)


class _Key(tuple):
    """A graph key that hashes once (`_interned`): equal to the plain tuple and hashed as it is, so
    a plain tuple finds what it keys."""

    def __hash__(self):
        return self.h

    def __reduce__(self):  # a plain tuple elsewhere: its hash is this process's
        return tuple, (tuple(self),)


_keys = caches.memo("split graph keys", limit=256)  # a key -> its `_Key`


def _interned(key: tuple) -> _Key:
    """`key` as the one `_Key` kept for it: a call looks its key up in a dozen memos, and a tuple
    of the tensors' shapes hashes and compares itself afresh at each (~0.4 us a lookup on a CPU);
    one `_Key` hashes once and compares by identity."""
    k = _keys.get(key)
    if k is None:
        k = _Key(key)
        k.h = tuple.__hash__(key)  # set before it is shared
        _keys[key] = k
    return k


def _replay(key: tuple, hit: tuple, tensors: tuple, lend: int = 0) -> tuple:
    """Replay `hit` (a graph of `key`) on `tensors`: their copies in where it holds static inputs,
    then fresh copies of its outputs (the first `lend` of them its output buffers themselves,
    remembered in `_lent`, on the device's default stream only), ordered after the key's last use
    on another stream."""
    graph, static, out, reads = hit
    dev = (out[0] if out[0] is not None else next(x for x in out if x is not None)).device
    stream = torch.cuda.current_stream(dev) if dev.type == "cuda" else None  # (a CPU test's stand-in graph)
    if lend and stream is not None and stream != torch.cuda.default_stream(dev):
        # a call on a side stream (a branch run beside another): the next call of the key may run on
        # it while another stream still reads what this one lent, which no wait here can see
        lend = 0
    last = _last_use.get(key)
    if last is not None and last[0] != stream:  # the graph's buffers were last used on another stream
        if last[2]:  # lent there: the caller read them on that stream after the replay, so all of it
            stream.wait_stream(last[0])
        else:
            stream.wait_event(last[1])
    if reads is None:  # the copies in, a foreach call per group; lengths whose values the key holds stay
        # (an integer input that is no such length, the split forward's carried plan, is copied)
        pairs = [(s, x) for x, s in zip(tensors, static)
                 if x is not None and (x.is_floating_point() or remembered(x) is None)]
        copy_all(pairs)
        copied_bytes["in"] += sum(x.nbytes for _, x in pairs)
    replays["copied" if reads is None else "in place"] += 1
    graph.replay()
    # lent: aliases of its buffers (each holds its storage while alive, which `_held` counts);
    # the rest copied out
    result = list(out)
    lent = [x for x in out[:lend] if x is not None]
    if lent:  # the use counts before the aliases handed out (`_storage_uses`)
        _lent[key] = [(x, u, _storage_uses(u)) for x, u in zip(lent, map(_storage_of, lent))]
        _lend_blocked.pop(key, None)  # blocked calls count in a row
        replays["lent"] += 1
    copied = []
    for i, x in enumerate(out):
        if x is not None:
            if i < lend:
                result[i] = x.detach()
            else:
                copied.append((torch.empty_like(x), x))
                result[i] = copied[-1][0]
    if copied:
        copy_all(copied)
        copied_bytes["out"] += sum(x.nbytes for _, x in copied)
    if stream is not None:
        event = last[1] if last is not None else torch.cuda.Event()
        event.record(stream)
        _last_use[key] = (stream, event, bool(lent))
    return tuple(result)


def _lendable(key, n: int, allowed: bool) -> int:
    """How many of `key`'s outputs a replay lends: `n`, or none where lending is not `allowed` now
    (`_gates`) or `LEND_BLOCKS` calls in a row found what it lent held."""
    return n if n and allowed and _lend_blocked.get(key, 0) < LEND_BLOCKS else 0


#: Whether this torch counts a storage's uses (what lending reads, `_held`).
_COUNTS_USES = hasattr(torch._C, "_storage_Use_Count")


def _gates() -> tuple[bool, bool, bool, bool]:
    """What a call may do now, from one read of the context (the unverified gate, the autotuner's
    timing): read its inputs in place (verified or GDR_ALLOW_UNVERIFIED=1, and not inside the
    autotuner's timing, `graph_safe.copied_graph_inputs`); besides that, give each forward graph a
    memory pool of its own (`OWN_POOLS_GPU_VERIFIED`); keep in-place graphs for several address
    sets (`ADDRESS_SETS`, `PLACED_GPU_VERIFIED`); lend its outputs (`LEND_GPU_VERIFIED`, torch
    counting storage uses, and not inside the timing: it may keep one run's outputs to compare
    with the next's). The unverified gate (an environment read) is read only where a gate is not
    verified."""
    copied = graph_inputs_copied()
    verified = IN_PLACE_GPU_VERIFIED and OWN_POOLS_GPU_VERIFIED and PLACED_GPU_VERIFIED and LEND_GPU_VERIFIED
    unverified = not verified and unverified_allowed()
    in_place = not copied and (IN_PLACE_GPU_VERIFIED or unverified)
    return (in_place, in_place and (OWN_POOLS_GPU_VERIFIED or unverified),
            in_place and ADDRESS_SETS > 1 and (PLACED_GPU_VERIFIED or unverified),
            _COUNTS_USES and not copied and (LEND_GPU_VERIFIED or unverified))


def _storage_of(x: torch.Tensor) -> int:
    """`x`'s storage, as the handle `_storage_uses` reads (taken once, when lent: a storage object
    made per check costs host time and holds a use while alive). Valid while `x` lives:
    `_lent` keeps `x` beside it, so it outlives the graph's eviction while listed."""
    return x.untyped_storage()._cdata


def _storage_uses(storage: int) -> int:
    """How many tensors (and storage objects) hold the storage `storage` (`_storage_of`) now."""
    return torch._C._storage_Use_Count(storage)


def _held(key: tuple) -> bool:
    """Whether outputs the key's graphs lent are still held (any of its graphs may write them: they
    share a memory pool): a blocked call; after `LEND_BLOCKS` of them the key's graphs go and it
    lends no more. Forgotten once none is held."""
    lent = _lent.get(key)
    if not lent:
        return False
    if all(_storage_uses(u) <= n for _, u, n in lent):
        _lent.pop(key, None)
        return False
    replays["blocked"] += 1
    blocked = _lend_blocked[key] = _lend_blocked.get(key, 0) + 1
    if blocked >= LEND_BLOCKS:
        # the holder keeps those buffers: the key's graphs go (none may write them again), and the
        # next capture, on fresh memory, copies its outputs out; an in-place graph of its own pool
        # (`own`, keyed `(key, addresses)`) goes alone
        placed = key in _placed
        _unplace(key) if placed else _drop(key)
        name = key[0][0] if placed else key[0]
        if caches.first_time(("split graph lend", name)):
            log.info("gdr_dispatch: %s: its outputs were still held at the next call %d times: its graph is "
                     "captured again and copies them out from now on", name, blocked)
    return True


def _placed_hit(name: str, key: tuple, tensors: tuple, fn, seq_lens: tuple, where: tuple, own: bool = False):
    """The key's in-place graph for the addresses `where`: kept, or captured now where they came
    within the key's last `RECENT` calls and the key's latest calls cycle through no more sets
    than it keeps (`_few_sets`; a key with `ADDRESS_SETS` kept gives up its least recently
    replayed one; `2 * ADDRESS_SETS` captures in all); None where the call replays with copies."""
    seen = _note(key, where)
    hit = _placed.get((key, where))
    if hit is not None:
        _placed.move_to_end((key, where))  # most recently used
        return hit
    captures = _placed_captures.get(key, 0)
    if not seen or captures >= 2 * ADDRESS_SETS or not _few_sets(key):
        return None
    mine = [k for k in _placed if k[0] == key]  # least recently used first
    for old in mine[:max(0, len(mine) - ADDRESS_SETS + 1)]:
        _unplace(old)
    _placed_captures[key] = captures + 1
    return _capture(name, (key, where), tensors, fn, seq_lens, in_place=True, into=_placed, **_shared(key, own))


def _few_sets(key: tuple) -> bool:
    """Whether the key's last `ADDRESS_SETS + 1` calls came at no more than `ADDRESS_SETS` address
    sets that come back (seen before within `RECENT` calls; one-off sets do not count): a cycle of
    more sets than kept (more layers at one shape, or tensors the allocator places anew) would
    give each graph away before it replays, a capture per call."""
    recent, counts = _recent.get(key) or ((), {})
    tail = list(recent)[-(ADDRESS_SETS + 1):]
    back = {w for w in tail if counts[w] > 1}  # one-off sets do not count
    return len(back) <= ADDRESS_SETS


def _note(key: tuple, where: tuple) -> bool:
    """Remember `where` among the key's last `RECENT` calls' addresses; whether it was there
    already."""
    entry = _recent.get(key)
    if entry is None:
        entry = _recent[key] = (collections.deque(), {})  # the addresses in order, and how often each is among them
    else:
        _recent.move_to_end(key)  # (changed in place below)
    recent, counts = entry
    seen = where in counts
    if len(recent) == RECENT:
        old = recent.popleft()
        if counts[old] == 1:
            del counts[old]
        else:
            counts[old] -= 1
    recent.append(where)
    counts[where] = counts.get(where, 0) + 1
    return seen


def _shared(key: tuple, own: bool = False) -> dict:
    """`pool` and `stream` for a capture of `key`: the memory pool of a graph of the key still kept
    (a fresh one where none is, or with `own`: a pool whose graphs are gone is not reused) and the
    key's own capture stream (the allocator reuses a freed block only on the stream it was freed
    on); nothing without CUDA (a CPU test's stand-in captures)."""
    if not torch.cuda.is_available():
        return {}
    live = [] if own else [h for k, h in _placed.items() if k[0] == key] + [h for h in (_graphs.get(key),)
                                                                             if h is not None]
    pools = [h[0].pool() for h in live if hasattr(h[0], "pool")]
    stream = _streams.get(key)
    if stream is None:
        stream = _streams[key] = torch.cuda.Stream(key_device(key))
    return {"pool": pools[0] if pools else torch.cuda.graph_pool_handle(), "stream": stream}


def key_device(key: tuple) -> torch.device:
    """The device a graph key's tensors are on (its last field, `key_of`)."""
    dev = next((x for x in key if isinstance(x, str) and x.startswith("cuda")), None)
    return torch.device(dev) if dev else torch.device("cuda", torch.cuda.current_device())


def _lengths_constant(x):
    """An integer input (cu_seqlens, whose lengths the key holds) as the read-only device constant
    of its values where they are known without a read: the same tensor at the same address each
    call, wherever the caller's copy lives (the op's backward gets a fresh copy per step)."""
    if x is None or x.is_floating_point():
        return x
    values = remembered(x)
    if values is None:
        return x
    return device_constant(tuple(values), x.dtype, x.device)  # (which remembers its values)


def copy_all(pairs: list) -> None:
    """`dst.copy_(src)` for every (dst, src) pair, one `torch._foreach_copy_` per (dtype, layout)
    group: torch's multi-tensor copy (one launch for the group) takes only lists of one dtype whose
    pairs have the same strides, and copies anything else one tensor at a time (a cudaMemcpyAsync
    of ~11 us of host each on the H200's host: 25 of them per starved training step)."""
    groups: dict = {}
    for dst, src in pairs:
        groups.setdefault((dst.dtype, src.dtype, dst.stride() == src.stride()), []).append((dst, src))
    for group in groups.values():
        torch._foreach_copy_([d for d, _ in group], [x for _, x in group])


def addresses(tensors) -> tuple:
    """Each tensor's address and strides (None for an absent one): what a graph captured on the
    caller's own tensors reads; its shapes and dtypes are the key's."""
    return tuple(None if x is None else (x.data_ptr(), x.stride()) for x in tensors)


def _capture(name: str, key: tuple, tensors: tuple, fn, seq_lens: tuple, in_place: bool = False, pool=None,
             into=None, stream=None):
    """The key's graph over static copies of `tensors`, or with `in_place` over `tensors` themselves
    (read at their addresses; the hit then holds those addresses, not the tensors): `(graph, static
    inputs or None, static outputs, addresses read or None)`, or None where the capture fails.
    `pool` and `stream`: the memory pool and the stream to capture on (shared with the key's other
    graphs, `_shared`); `into`: the memo it is kept in (`_graphs`)."""
    dev = next(x for x in tensors if x is not None).device
    if in_place:
        static = tensors
    else:
        static = tuple(None if x is None else x.clone(memory_format=torch.contiguous_format) for x in tensors)
        for x, s in zip(tensors, static):  # a cu_seqlens copy holds the lengths read from the caller's
            if x is not None and not x.is_floating_point() and remembered(x) is not None:
                remember(s, remembered(x))
    before = torch.cuda.memory_allocated(dev)
    graph = torch.cuda.CUDAGraph()
    pins: set = set()
    try:
        with torch.cuda.device(dev), graph_owned_pins() as pins:  # the inputs' device (and its own capture stream)
            side = stream if stream is not None else torch.cuda.Stream(dev)
            side.wait_stream(torch.cuda.current_stream(dev))
            with torch.cuda.stream(side):
                fn(static)  # a warm-up on the capture's stream, as torch's capture notes ask
            torch.cuda.current_stream(dev).wait_stream(side)
            # the outer stream context restores the caller's stream even where the capture fails to begin
            with torch.cuda.stream(side), capturing(graph, pool):
                out = fn(static)
    except Exception as e:  # noqa: BLE001 - any failure to capture leaves the call eager (or copied), said once
        release_pins(pins)
        torch.cuda.synchronize(dev)
        if caches.first_time(("split graph refused", name, in_place)):
            log.info("gdr_dispatch: %s %s: its capture into a CUDA graph%s failed (%s: %s)", name,
                     "copies its inputs in" if in_place else "runs eagerly", " on its inputs in place" if in_place
                     else "", type(e).__name__, str(e).splitlines()[0][:200] if str(e) else "")
        return None
    held = torch.cuda.memory_allocated(dev) - before
    captures["in place" if in_place else "copies"] += 1
    if in_place:
        if caches.first_time(("split graph in place", name, seq_lens[:4], len(seq_lens))):
            log.info("gdr_dispatch: %s for %s tokens replays on its inputs in place while they come at the same "
                     "addresses (no copies in); it holds %.0f MiB", name, sum(seq_lens), held / 2 ** 20)
    elif caches.first_time(("split graph", name, seq_lens[:4], len(seq_lens))):
        log.info("gdr_dispatch: %s for %s tokens replays from a CUDA graph from now on; it holds %.0f MiB "
                 "(at most %d such graphs are kept; GDR_SPLIT_GRAPHS=0 turns them off)", name, sum(seq_lens),
                 held / 2 ** 20, LIMIT)
    hit = (graph, None if in_place else static, tuple(out), addresses(tensors) if in_place else None)
    _release(key)  # a graph it replaces reads nothing any more
    _pins[key] = pins
    (_graphs if into is None else into)[key] = hit
    return hit


@contextlib.contextmanager
def capturing(graph, pool=None):
    """Capture the block's work on the current stream into `graph` (`torch.cuda.CUDAGraph`), with
    `pool` its memory pool: `torch.cuda.graph` without what that does first, a device synchronize
    and `torch.cuda.empty_cache()`. Emptying the cache hands every cached block of the caller's
    back to the driver, so a capture in the middle of a model's training step made the step's
    allocations cudaMalloc them afresh (~60 cudaMalloc and cudaFree a capture in an HF Qwen3-Next
    step, +13-17 ms of its 27: docs/design.md, "The split"). `thread_local`: another thread's
    allocation or sync during the capture neither fails there nor spoils this capture."""
    graph.capture_begin(pool=pool, capture_error_mode="thread_local")
    try:
        yield
    finally:
        graph.capture_end()  # (a capture the block broke raises here too, after the block's own error)


def held_graphs() -> int:
    return len(_graphs) + len(_placed)


def _release(key) -> None:
    """A key's graph is dropped: the index tensors it pinned may go (graph_safe.release_pins)."""
    release_pins(_pins.pop(key, None))


def _drop(key) -> None:
    """The key's graphs go, with copies and in place, and what they lent is forgotten (no graph of
    the key writes those buffers any more; the next capture takes fresh memory)."""
    _graphs.pop(key, None)
    _release(key)
    for k in [k for k in _placed if k[0] == key]:
        _unplace(k)
    _lent.pop(key, None)


def _forget_lent(key) -> None:
    """A graph of `key` (a base key) was evicted: once none of the key's is left, what they lent is
    forgotten (kept, it would hold their outputs' memory for good)."""
    if key not in _graphs and not any(k[0] == key for k in _placed):
        _lent.pop(key, None)


def _unplace(placed_key) -> None:
    """One in-place graph goes (`_placed`), with its pins and what it lent of its own pool (`own`)."""
    _placed.pop(placed_key, None)
    _release(placed_key)
    _lent.pop(placed_key, None)


@caches.on_clear
def _forget_pins() -> None:
    _pins.clear()  # (graph_safe forgets its pin counts in the same clear)
