"""The chunk-start states `h` of a call in one warp-specialised sm90 kernel (TileLang).

The state recompute a backend needs with `h=None` (fla does it in two stages, `recompute_w_u`
then `chunk_gated_delta_rule_fwd_h`). One CTA of 512 threads per (sequence,
value head) walks the chunks forwards; four warpgroups, one role each:

  * S0, S1 (threads 0-255): half of the state's value columns each, `[K, V/2]` fp32 in
    registers (a state's columns evolve independently, so the halves never meet). Per chunk:
    the 16-bit copy of the chunk-start state (written to `h` and read by the next gemm),
    `Y = e^{G_L} K S - diag(e^{G_L - G}) V`, then `S <- e^{G_L} S + X^T Y`.
  * X (256-383): `X = -diag(b) A^T K` per chunk; it needs no state, so it runs ahead.
  * producer (384-511): TMA loads of each chunk's k, v, a, g and b into a two-stage ring (g and
    b from the launcher's head-major fp32 copies: 256-byte boxes, which must start 16-byte
    aligned, so a sequence starting off a multiple of 4 tokens loads them by plain loads); a
    sequence's last chunk, when partial, by masked loads (rows past the end are zero, g is padded
    with the last valid G).

Why `X^T Y`: the contract's update `S' = e^{G_L} S + (K * e^{G_L - G})^T U` with `U = (Gam * A)
diag(b) (V - diag(e^G) K S)` is, because `Gam * A = diag(e^G) A diag(e^-G)` for the lower
triangular A, `e^{G_L} S + X^T Y`: every exponent in it is <= 0 (G is a cumsum of log decays),
so strong decay underflows towards 0 and never overflows (`e^-G` alone would).

Barriers per stage: `ready` (the producer's 128 arrivals plus the TMA bytes), `xready` (X's
128), `free` (X and both state groups, 384: the stage's tiles, X's included, may be refilled).
Design, floor and measurements: docs/kernels.md, "State kernel".
"""

import functools

import tilelang
import tilelang.language as T

from gdr_dispatch.contract import packed
from gdr_dispatch.graph_safe import device_constant

from .tilelang_common import cta_sequence
from .tilelang_launch import packed_sequences, tl_dtype

BT, K, V = 64, 128, 128
VH = V // 2  # value columns per state group
LOG2E = 1.4426950408889634  # exp(x) = exp2(x log2 e)

#: Register caps per warpgroup (S0, S1, X, producer), adding up to 512 slots of 128 threads.
#: A state group holds 64 fp32 registers of state and 32 of Y; X holds 64 of X. Not measured.
NREG = (168, 168, 152, 24)

#: Whether the GPU tests (tests/test_gpu.py: `h` against the float64 walk, the backends' h=None
#: paths on it) have passed on the H200; while False, backends use it only with
#: GDR_ALLOW_UNVERIFIED=1 (fla's stages 1-2 otherwise).
GPU_VERIFIED = True

#: Stages of the producer's load ring (three cost more shared memory and measured no faster on
#: the H200: docs/kernels.md, "State kernel").
STAGES = 2

#: `timing=True` builds: int32 cycle counters per CTA and role group (S0, S1, X, producer), summed
#: over the chunks: the work before and the wait at each barrier a group waits on, in order
#: (`TIMING_NAMES`), then the whole loop [6] and the chunk count [7] (bench/bench_states.py --timing).
TIMING_SLOTS = 8
TIMING_NAMES = {"S0": ("work", "ready wait", "work", "xready wait", "work"),
                "S1": ("work", "ready wait", "work", "xready wait", "work"),
                "X": ("ready wait", "work"), "producer": ("free wait", "work")}


@functools.lru_cache(maxsize=None)
def build_states(H: int, Hg: int, dtype: str, state_v_first: bool, timing: bool = False):
    """Compile (once per configuration) the state kernel (K = V = 128, chunk 64). States in and
    out (`h0`, `h`, `ht`) in the contract's layout: `[..., K, V]`, or `[..., V, K]` with
    `state_v_first` (then each state group holds its half transposed); `timing` adds the cycle
    counters (`TIMING_SLOTS`, into `clk`)."""
    accum = "float32"
    TT = T.dynamic("num_tokens")
    NC = T.dynamic("num_chunks")
    N = T.dynamic("num_seqs")
    NP1 = T.dynamic("num_seqs_plus_1")
    NCLK = T.dynamic("num_clk")
    TTP = T.dynamic("num_tokens_padded")  # g and b come head-major, rows of TTP (a multiple of 4)
    NS = TIMING_SLOTS
    NG = len(TIMING_NAMES)
    group = H // Hg
    nreg_s, _, nreg_x, nreg_p = NREG
    half = (VH, K) if state_v_first else (K, VH)  # a state group's part of the state
    state = (V, K) if state_v_first else (K, V)

    @tilelang.jit(target={"kind": "cuda", "arch": "sm_90a"}, out_idx=None,
                  pass_configs={tilelang.PassConfigKey.TL_ENABLE_FAST_MATH: True})
    def kernel_factory():
        @T.macro
        def mark(acc, marks, i):
            """timing: the cycles since the last mark into slot i."""
            if timing:
                marks[1] = T.cast(T.call_extern("int64", "clock64"), "int32")
                acc[i] = acc[i] + (marks[1] - marks[0])
                marks[0] = marks[1]

        @T.macro
        def timing_start(acc, marks):
            if timing:
                for j in T.serial(NS):
                    acc[j] = 0
                marks[0] = T.cast(T.call_extern("int64", "clock64"), "int32")
                marks[2] = marks[0]

        @T.macro
        def timing_end(acc, marks, grp, n_chunks, clk, bx):
            if timing:
                marks[1] = T.cast(T.call_extern("int64", "clock64"), "int32")
                if T.get_thread_binding() % 128 == 0:
                    for j in T.serial(NS - 2):
                        clk[(bx * NG + grp) * NS + j] = acc[j]
                    clk[(bx * NG + grp) * NS + NS - 2] = marks[1] - marks[2]
                    clk[(bx * NG + grp) * NS + NS - 1] = n_chunks

        @T.macro
        def timed_wait(bars, st, parity, acc, marks, slot):
            """A state group's wait at barrier `bars[st]` (a barrier passed alone reaches a macro as
            a plain variable); timing: the work before it into `slot`, the wait into `slot + 1`."""
            mark(acc, marks, slot)
            T.barrier_wait(bars[st], parity)
            mark(acc, marks, slot + 1)

        @T.macro
        def state_group(S_f, Y_f, s_s, y_s, v0, k_s, v_s, g_s, x_s, ready, xready, free, h0, h,
                        ht, n, hh, bos, eos, n_chunks, c0, acc, marks, grp, clk, bx):
            """One state group: value columns [v0, v0 + VH) of every chunk-start state."""
            T.set_max_nreg(nreg_s, 1)
            if state_v_first:
                T.copy(h0[n, hh, v0:v0 + VH, 0:K], S_f)
            else:
                T.copy(h0[n, hh, 0:K, v0:v0 + VH], S_f)
            timing_start(acc, marks)
            for c in T.serial(n_chunks):
                st = c % STAGES
                par = (c // STAGES) % 2
                last = T.min(BT, eos - (bos + c * BT)) - 1  # the chunk's last valid row
                # the chunk-start state: its 16-bit copy, for h and for K S
                T.copy(S_f, s_s)
                T.fence_proxy_async()
                # one thread's TMA store; its read of s_s is waited for before the next copy
                if state_v_first:
                    T.tma_copy(s_s, h[c0 + c, hh, v0:v0 + VH, 0:K])
                else:
                    T.tma_copy(s_s, h[c0 + c, hh, 0:K, v0:v0 + VH])
                timed_wait(ready, st, par, acc, marks, 0)
                T.gemm(k_s[st, :, :], s_s, Y_f, transpose_B=state_v_first, clear_accum=True)
                # Y = e^{G_L} K S - diag(e^{G_L - G}) V
                for i, j in T.Parallel(BT, VH):
                    Y_f[i, j] = (Y_f[i, j] * T.exp2(g_s[st, last] * LOG2E)
                                 - T.exp2((g_s[st, last] - g_s[st, i]) * LOG2E) * T.cast(v_s[st, i, v0 + j], accum))
                T.copy(Y_f, y_s)
                T.fence_proxy_async()
                for i, j in T.Parallel(half[0], half[1]):
                    S_f[i, j] = S_f[i, j] * T.exp2(g_s[st, last] * LOG2E)
                timed_wait(xready, st, par, acc, marks, 2)
                if state_v_first:  # S^T += Y^T X
                    T.gemm(y_s, x_s[st, :, :], S_f, transpose_A=True)
                else:  # S += X^T Y
                    T.gemm(x_s[st, :, :], y_s, S_f, transpose_A=True)
                T.tma_store_wait(0)  # s_s is rewritten at the next chunk's start
                T.barrier_arrive(free[st])
                mark(acc, marks, 4)
            timing_end(acc, marks, grp, n_chunks, clk, bx)
            if state_v_first:
                T.copy(S_f, ht[n, hh, v0:v0 + VH, 0:K])
            else:
                T.copy(S_f, ht[n, hh, 0:K, v0:v0 + VH])

        @T.prim_func
        def gdr_states(
            k: T.Tensor((TT, Hg, K), dtype),
            v: T.Tensor((TT, H, V), dtype),
            a: T.Tensor((TT, H, BT), dtype),
            g: T.Tensor((H, TTP), accum),  # head-major fp32 (the launcher's copies): TMA boxes per chunk
            b: T.Tensor((H, TTP), accum),
            h0: T.Tensor((N,) + (H,) + state, accum),
            cu_seqlens: T.Tensor((NP1,), "int32"),
            chunk_offsets: T.Tensor((NP1,), "int32"),
            h: T.Tensor((NC, H) + state, dtype),
            ht: T.Tensor((N, H) + state, accum),
            clk: T.Tensor((NCLK,), "int32"),  # timing builds only (one element otherwise)
        ):
            with T.Kernel(N * H, threads=512) as bx:
                n, hh, hg, bos, eos, n_chunks, c0 = cta_sequence(bx, H, group, cu_seqlens, chunk_offsets, BT)

                # ---- shared memory (~161 KiB): the ring of the
                # loaded tiles and X, each state group's 16-bit state and Y ----
                k_s = T.alloc_shared((STAGES, BT, K), dtype)
                v_s = T.alloc_shared((STAGES, BT, V), dtype)
                a_s = T.alloc_shared((STAGES, BT, BT), dtype)
                g_s = T.alloc_shared((STAGES, BT), accum)  # padded with the last valid G
                b_s = T.alloc_shared((STAGES, BT), accum)  # 0 past the end
                x_s = T.alloc_shared((STAGES, BT, K), dtype)
                s0_s = T.alloc_shared(half, dtype)  # each state group's 16-bit state and Y
                s1_s = T.alloc_shared(half, dtype)
                y0_s = T.alloc_shared((BT, VH), dtype)
                y1_s = T.alloc_shared((BT, VH), dtype)

                # ---- registers (each fragment used by one group) ----
                S0_f = T.alloc_fragment(half, accum)
                S1_f = T.alloc_fragment(half, accum)
                Y0_f = T.alloc_fragment((BT, VH), accum)
                Y1_f = T.alloc_fragment((BT, VH), accum)
                X_f = T.alloc_fragment((BT, K), accum)
                acc = T.alloc_local((NS,), "int32")  # timing builds: each thread's counters
                marks = T.alloc_local((3,), "int32")  # timing builds: the last mark, now, the loop's start

                ready = T.alloc_barrier(arrive_count=[128] * STAGES)
                xready = T.alloc_barrier(arrive_count=[128] * STAGES)
                free = T.alloc_barrier(arrive_count=[384] * STAGES)

                tx = T.get_thread_binding()
                if tx < 128:
                    state_group(S0_f, Y0_f, s0_s, y0_s, 0, k_s, v_s, g_s, x_s, ready, xready, free,
                                h0, h, ht, n, hh, bos, eos, n_chunks, c0, acc, marks, 0, clk, bx)
                elif tx < 256:
                    state_group(S1_f, Y1_f, s1_s, y1_s, VH, k_s, v_s, g_s, x_s, ready, xready, free,
                                h0, h, ht, n, hh, bos, eos, n_chunks, c0, acc, marks, 1, clk, bx)
                elif tx < 384:
                    # ================= X: -diag(b) A^T K, a chunk ahead of the states =================
                    T.set_max_nreg(nreg_x, 1)
                    timing_start(acc, marks)
                    for c in T.serial(n_chunks):
                        st = c % STAGES
                        par = (c // STAGES) % 2
                        T.barrier_wait(ready[st], par)
                        mark(acc, marks, 0)
                        T.gemm(a_s[st, :, :], k_s[st, :, :], X_f, transpose_A=True, clear_accum=True)
                        for i, j in T.Parallel(BT, K):
                            X_f[i, j] = -X_f[i, j] * b_s[st, i]
                        T.copy(X_f, x_s[st, :, :])
                        T.fence_proxy_async()
                        T.barrier_arrive(xready[st])
                        T.barrier_arrive(free[st])
                        mark(acc, marks, 1)
                    timing_end(acc, marks, 2, n_chunks, clk, bx)
                else:
                    # ================= producer: chunk c into stage c % STAGES =================
                    T.set_max_nreg(nreg_p, 0)
                    p = tx - 384
                    timing_start(acc, marks)
                    for c in T.serial(n_chunks):
                        st = c % STAGES
                        t0 = bos + c * BT
                        if c >= STAGES:  # the stage's last chunk is done with it
                            T.barrier_wait(free[st], (c // STAGES + 1) % 2)
                        mark(acc, marks, 0)
                        if t0 + BT <= eos:
                            T.tma_copy(k[t0:t0 + BT, hg, 0:K], k_s[st, :, :], barrier=ready[st])
                            T.tma_copy(v[t0:t0 + BT, hh, 0:V], v_s[st, :, :], barrier=ready[st])
                            T.tma_copy(a[t0:t0 + BT, hh, 0:BT], a_s[st, :, :], barrier=ready[st])
                            if bos % 4 == 0:  # a TMA box must start 16-byte aligned
                                T.tma_copy(g[hh, t0:t0 + BT], g_s[st, :], barrier=ready[st])
                                T.tma_copy(b[hh, t0:t0 + BT], b_s[st, :], barrier=ready[st])
                            elif p < BT:  # a sequence starting elsewhere: plain loads
                                g_s[st, p] = g[hh, t0 + p]
                                b_s[st, p] = b[hh, t0 + p]
                        else:  # the sequence's last chunk, partial
                            for i, j in T.Parallel(BT, K):
                                k_s[st, i, j] = T.if_then_else(t0 + i < eos, k[t0 + i, hg, j], T.cast(0, dtype))
                            for i, j in T.Parallel(BT, V):
                                v_s[st, i, j] = T.if_then_else(t0 + i < eos, v[t0 + i, hh, j], T.cast(0, dtype))
                            for i, j in T.Parallel(BT, BT):
                                a_s[st, i, j] = T.if_then_else(t0 + i < eos, a[t0 + i, hh, j], T.cast(0, dtype))
                            if p < BT:
                                g_s[st, p] = g[hh, T.min(t0 + p, eos - 1)]
                                b_s[st, p] = T.if_then_else(t0 + p < eos, b[hh, t0 + p], T.cast(0, accum))
                            T.fence_proxy_async()
                        T.barrier_arrive(ready[st])
                        mark(acc, marks, 1)
                    timing_end(acc, marks, 3, n_chunks, clk, bx)

        return gdr_states

    return kernel_factory()


def states_config(k, v, state_v_first: bool) -> tuple:
    """`build_states`' arguments for a call (the launcher's and precompile jobs')."""
    return (v.shape[2], k.shape[2], tl_dtype(k.dtype), bool(state_v_first))


def chunk_states(k, v, a, g, b, initial_state, seq_lens, chunk_size: int = 64, cu_seqlens=None,
                 state_v_first: bool = False, clk=None):
    """Every chunk-start state of a call and its final state: `(h, ht)`, `h` `[B, NT, H, K, V]`
    (`[1, total chunks, ...]` varlen; `[..., V, K]` with `state_v_first`) in k's dtype, `ht`
    `[N, H, K, V]` fp32 (same layout rule). Fresh outputs; the inputs are read only. `clk`
    (int32, `[N * H * len(TIMING_NAMES) * TIMING_SLOTS]`) asks for the timing build and receives
    its counters."""
    import torch

    B, T_, Hg, Kd = k.shape
    H, Vd = v.shape[2], v.shape[3]
    if (Kd, Vd, chunk_size) != (K, V, BT):
        raise ValueError(f"chunk_states: built for K = V = {K}, chunk {BT}; got K={Kd}, V={Vd}, chunk {chunk_size}")
    N = len(seq_lens)
    dev = k.device
    cu, offsets, counts = packed_sequences(B, T_, seq_lens, chunk_size, cu_seqlens, dev)
    state = (Vd, Kd) if state_v_first else (Kd, Vd)
    if initial_state is None:
        h0 = torch.zeros(N, H, *state, dtype=torch.float32, device=dev)
    else:
        h0 = packed(initial_state.float())
    h = torch.empty(sum(counts), H, *state, dtype=k.dtype, device=dev)
    ht = torch.empty(N, H, *state, dtype=torch.float32, device=dev)
    # the plain build by its positional arguments alone: the key `compile_jobs` warms (lru_cache)
    kern = build_states(*states_config(k, v, state_v_first)) if clk is None else \
        build_states(*states_config(k, v, state_v_first), timing=True)
    if clk is None:  # the plain build never touches it: a cached constant, one launch less per call
        clk = device_constant((0,), torch.int32, dev)
    TT = B * T_
    g, b = g.reshape(TT, H), b.reshape(TT, H)
    # g and b head-major fp32, rows padded to 16 bytes (TMA's stride rule): a chunk's 64 values of
    # each are one TMA box (in v1 the producer's plain loads of them paced the kernel)
    g, b = (_head_major(x, -(-TT // 4) * 4) for x in (g, b))
    kern(packed(k.reshape(TT, Hg, Kd)), packed(v.reshape(TT, H, Vd)),
         packed(a.reshape(TT, H, chunk_size).to(k.dtype)), g, b, h0, cu, offsets, h, ht, clk)
    return h.view(B, -1, H, *state), ht


def _head_major(x, width: int):
    """`[TT, H]` -> a fresh fp32 `[H, width]` (width >= TT; the padding is never read)."""
    import torch

    out = torch.empty(x.shape[1], width, dtype=torch.float32, device=x.device)
    out[:, :x.shape[0]].copy_(x.t())
    return out


def call_states(call, clk=None):
    """`chunk_states` on a validated call (`contract.GDRCall`): `(h, ht)`."""
    return chunk_states(call.k, call.v, call.a, call.g, call.b, call.initial_state, call.seq_lens, call.chunk_size,
                        call.cu_seqlens, call.state_v_first, clk=clk)
