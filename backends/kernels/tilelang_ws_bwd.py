"""The fused GDR backward given `h`, warp-specialised for sm90 (TileLang): seed 000's design.

One CTA of 512 threads per (sequence, value head) walks the chunks backwards. Four
warpgroups, one role each (one branch of one if/else on the thread index, with
`set_max_nreg` budgets that add up to the register file):

  * S (threads 0-127): the state gradient `dS` (`[K, V]` fp32) in registers: its decay,
    `<dS', S>` for dG_L, `dS += K^T dUs + Q^T (scale e^G dO)`, and its 16-bit copy for the
    others' gemms; then dg (the reverse cumsum inside the chunk, a warp scan) and db.
  * KV (128-255): U = K S and W = V - e^G U, dV' = e^{G_L-G} K dS' + Pg^T dO, dv = Ag^T dV',
    dUs = -e^G dv, A^T dAr for A (where KV waits anyway), and dk.
  * A (256-383): P = Q K^T, Ag = Gam * A * b, V' = Ag W, dAg, dP, dq, and the chain through
    the inverse (dA, dM, db's row part, dkk), with Gam kept in its registers for the chunk; it
    only arrives at the ends of phases 3 and 4 (nothing it does next depends on the others'
    part). It works over 80 % of a chunk step: the critical path.
  * producer (384-511): TMA loads of the next (earlier) chunk's q, k, v, do, a, h into the
    single shared buffer of each, each issued as soon as the consumers' last read of that
    buffer is done; g and b by plain loads.

The math per chunk is the contract's (docs/contract.md) in FlashQLA's arrangement: W and V'
instead of fla's w and u, so no `[BT, K]` w is formed. The consumer groups move through
seven phases per chunk, each closed by an mbarrier the three consumer groups arrive at
(384 threads); the producer waits on the phase after which a buffer is free, never arrives
there, and publishes a chunk on the `full` barrier (expect-tx of the TMA bytes plus its own
arrival). The first visited chunk of a sequence (the only partial one) is loaded by every
thread with masked loads before the roles split. No `reduce_sum` spans warps inside a role
branch: TileLang's cross-warp all-reduce syncs on the same two hardware barriers in every
group, so concurrent groups would complete each other's (the race of v1; row sums stay within
a quad, the rest goes through shared memory). Notes, predictions and measurements:
docs/kernels.md, "Fused backward".

Outputs: dq/dk per value head in q's dtype (summed over grouped value heads in fp32 by the
launcher), dv, dg (w.r.t. the raw gate), db, dh0 (always written).
"""

import functools
import math

import tilelang
import tilelang.language as T

from gdr_dispatch.contract import as_dtype
from gdr_dispatch.graph_safe import device_constant

from .tilelang_common import cta_sequence, fence_accumulator
from .tilelang_launch import launch_packed, tl_dtype

BT, K, V = 64, 128, 128
LOG2E = 1.4426950408889634  # exp(x) = exp2(x log2 e): one MUFU.EX2 under fast math

#: Register caps per warpgroup (S, KV, A, producer), adding up to 512 slots of 128 threads =
#: the 64K-register file (seed 000 uses 160 / 144 / 184 / 24). Moving 8 or 16 from KV to A
#: costs 10-16 % on the H200 (docs/kernels.md, "Fused backward").
NREG = (160, 160, 168, 24)
#: The caps with "kvregs": KV 168, A 160 (A's "scale" and "mma" cuts leave it room: its spill
#: instructions 4 -> 16, KV's 35 -> 12, 13 of them gone from KV's phase 1, the step's first wall).
NREG_KVREGS = (160, 168, 160, 24)
#: Consumer phases per chunk (each closed by one 384-thread mbarrier).
PHASES = 7
#: How A forms db's column part (the column sums of dAb * A, phase 4): "warp", each warp's
#: partial sums by a shuffle reduce-scatter (`COL_PARTIALS`), added over the four warps by S
#: where it writes db (fp32 throughout); "transpose", row sums of a transposed 16-bit copy.
#: "warp" measured -1.0 % at B4 T4096 H16, B8 T4096 H32 and B1 T8192 H16 on the H200; the same
#: for dG's column sums (phase 5) spilled and was not faster (docs/kernels.md, "Fused backward").
COLSUMS = "warp"
COLSUMS_FORMS = ("warp", "transpose")
#: Cuts of A's element-wise work (`hoist`, words joined by '+'; docs/kernels.md, "Fused backward"
#: and "the next decomposition", has each one's SASS counts, and H200 timings where one ran):
#:   "gam"   Gam's exponents formed unmasked from `G_s` = G log2(e), then the masked exp2 (-2.3 /
#:           -1.4 / -1.6 % at B4 T4096 H16, B8 T4096 H32, B1 T8192 H16, back to back);
#:   "row"   phase 5's dq row factor `scale e^G` once per row, not two multiplies an element;
#:   "scale" `scale` in A's Gam (log2(scale) added to the exponent), so Pg and dP take one
#:           multiply an element; `b_s` holds b / scale, undone once per row where b is needed;
#:   "mma"   (bf16) dG's column sums on the tensor core (`COLSUM_TILE`), not the exact transpose;
#:   "ag"    phase 1's Ag formed in `sq2_f`'s registers (free until phase 4), not `sq_f`'s: with
#:           `sq_f` ptxas injects a wait for the Q K^T gemm before Ag's stmatrix (its note C7517);
#:   "kvregs" the register caps `NREG_KVREGS` instead of `NREG`, with "mma" in a bf16 build only
#:           (`nreg_of`: without it A spills 24 -> 59 instructions at 160, an fp16 build's A too).
#: On: "gam" and "scale" + "mma" + "ag" (beside "gam" alone, back to back on the H200: 0.0 / -1.0
#: / -2.1 % at B4 T4096 H16, B8 T4096 H32, B1 T8192 H16). Off: "row" (adds nothing) and "kvregs"
#: (-0.2 / +2.9 / -4.1 %: it pays only where few CTAs run).
#: Work moved into S's phase-1 wait (dq's dG term, U and W) needs a second accumulator beside dS,
#: and ptxas then serializes every wgmma of the kernel (tools/sass_report.py --ptxas).
HOIST = "gam+scale+mma+ag"
HOIST_WORDS = ("gam", "row", "scale", "mma", "ag", "kvregs")
#: The ones the "mma" column sums multiply by: `[ONES_N, BT]` (wgmma's narrowest N), each 1 / ONES_N,
#: so the row sums of the `[BT, ONES_N]` product are the column sums.
ONES_N = 8
#: The named barrier (id, of A's 128 threads) of `COLSUM_TILE`; TileLang's own take 0-7.
COLSUM_BARRIER = 9

#: "mma"'s operand: the m64nNk16 accumulator layout (`COL_PARTIALS`' comment) puts rows `16 w +
#: l / 4` and `+ 8` in one thread, so their sum `y` (row `q = 8 w + l / 4` of 32) needs no other
#: thread; `y`'s bf16 hi goes to row q and its rounded remainder to row 32 + q of a 64 x 64 bf16
#: tile in TileLang's 128-byte swizzle (16-byte chunk `c / 8` of row r at `(c / 8) ^ (r % 8)`).
#: A's threads meet at `COLSUM_BARRIER` before the stores (others' reads of the tile) and after
#: them (the tensor core reads every thread's stores).
COLSUM_TILE = r"""
#include <cuda_bf16.h>
// volatile shared stores between volatile barriers: kept in order without a "memory" clobber (which
// would pin A's register tiles to local memory)
__device__ __forceinline__ void gdr_st_shared(unsigned addr, __nv_bfloat162 v) {
  asm volatile("st.shared.b32 [%0], %1;" : : "r"(addr), "r"(*reinterpret_cast<unsigned*>(&v)));
}

__device__ __forceinline__ void gdr_colsum_tile(const float* x, void* tile_v) {
  const unsigned tile = static_cast<unsigned>(__cvta_generic_to_shared(tile_v));
  const int lane = threadIdx.x & 31, w = (threadIdx.x >> 5) & 3, q = 8 * w + (lane >> 2);
  asm volatile("bar.sync %0, 128;" : : "n"(GDR_COLSUM_BARRIER));
#pragma unroll
  for (int n = 0; n < 8; ++n) {
    const float y0 = x[4 * n] + x[4 * n + 2], y1 = x[4 * n + 1] + x[4 * n + 3];
    const __nv_bfloat162 hi = __floats2bfloat162_rn(y0, y1);
    const float2 h = __bfloat1622float2(hi);
    const unsigned at = tile + (((n ^ (q & 7)) << 4) | ((lane & 3) << 2));  // (32 + q) % 8 == q % 8
    gdr_st_shared(at + q * 128, hi);
    gdr_st_shared(at + (32 + q) * 128, __floats2bfloat162_rn(y0 - h.x, y1 - h.y));
  }
  asm volatile("fence.proxy.async.shared::cta;");
  asm volatile("bar.sync %0, 128;" : : "n"(GDR_COLSUM_BARRIER));
}
""".replace("GDR_COLSUM_BARRIER", str(COLSUM_BARRIER))
#: "scale" folds only a scale in this range (log2 of it exact enough, b / scale finite), and not
#: in an fp16 build of the transpose form (its 16-bit copy would hold scaled values); others build
#: as without the word.
SCALE_FOLD_RANGE = (2.0 ** -20, 2.0 ** 20)


def mma_applies(words, dtype: str) -> bool:
    """Whether "mma" is among the words and takes effect: bf16 only (hi and lo share bf16's range;
    fp16's would overflow)."""
    return "mma" in words and dtype == "bfloat16"


def nreg_of(hoist: str, dtype: str = "bfloat16") -> tuple:
    """The register caps (S, KV, A, producer) of a build with these hoist words and dtype:
    "kvregs"' only where "mma" relieves A."""
    words = hoist.split("+")
    return NREG_KVREGS if "kvregs" in words and mma_applies(words, dtype) else NREG


def hoist_form(words) -> str:
    """The `hoist` argument of the given words (any order; others refused): `HOIST_WORDS`' order,
    joined by '+', one spelling per build."""
    given = set(words)
    unknown = given - set(HOIST_WORDS) - {""}
    if unknown:
        raise ValueError(f"hoist: expected words of {HOIST_WORDS}, got {sorted(unknown)}")
    return "+".join(w for w in HOIST_WORDS if w in given)


#: The kernel's own build as the tools name a form (tools/ws_probe.py's `--colsums`, the words of
#: tools/precompile_tilelang.py and tools/sass_report.py): the column sums' form, then `+<word>`
#: for each hoisted word.
FORM = "+".join([COLSUMS, *(w for w in HOIST.split("+") if w)])


def form_keywords(form: str) -> dict:
    """`build_ws_bwd`'s `colsums` and `hoist` for a form (`FORM`'s spelling); ValueError for a
    form it does not name."""
    base, *extra = form.split("+")
    if base not in COLSUMS_FORMS:
        raise ValueError(f"colsums: expected one of {COLSUMS_FORMS}, got {base!r}")
    return {"colsums": base, "hoist": hoist_form(extra)}


def build_keywords(name: str) -> dict:
    """`build_ws_bwd`'s keywords for a build the tools name by words joined by '-': `timing`, a
    mode of `MODES`, a form (`form_keywords`; without one the kernel's own). "" or "default":
    the backend's build."""
    kw = {"timing": False, "mode": "full", **form_keywords(FORM)}
    for word in name.split("-"):
        if word in ("", "default"):
            continue
        if word == "timing":
            kw["timing"] = True
        elif word in MODES:
            kw["mode"] = word
        elif word.split("+")[0] in COLSUMS_FORMS:
            kw.update(form_keywords(word))
        else:
            raise ValueError(f"build {name!r}: {word!r} is none of default, timing, a mode of {MODES}, a form "
                             f"({'/'.join(COLSUMS_FORMS)}, then +{'/+'.join(HOIST_WORDS)})")
    return kw

#: A warp's partial column sums of a warpgroup's 64 x 64 fp32 wgmma accumulator: element
#: `4 n + 2 r + c` of lane l in warp w is row `16 w + 8 r + l / 4`, column `8 n + 2 (l % 4) + c`
#: (the m64nNk16 accumulator layout, TileLang's fragment for it). The two rows a thread holds
#: are added, then the eight lanes sharing a column quad halve their columns three times
#: (14 shuffles instead of 48 for an all-reduce), leaving lane l the columns `8 (l / 4) +
#: 2 (l % 4) + {0, 1}` of its warp's 16 rows, stored to `out[w][.]` (fp32 `[4, 64]`).
COL_PARTIALS = r"""
// a select nvcc cannot turn into an indexed (local-memory) load of the array it picks from
__device__ __forceinline__ float gdr_select(int up, float a, float b) {
  float r;
  asm("{\n .reg .pred p;\n setp.ne.s32 p, %3, 0;\n selp.f32 %0, %1, %2, p;\n}" : "=f"(r) : "f"(a), "f"(b), "r"(up));
  return r;
}

// one step of the reduce-scatter: lanes `d` apart add their halves, each keeping the upper
// half (`up`) or the lower one in p[0, half)
template <int half>
__device__ __forceinline__ void gdr_halve(float* p, int up, int d) {
#pragma unroll
  for (int k = 0; k < half; ++k) {
    const float send = gdr_select(up, p[k], p[half + k]);
    const float keep = gdr_select(up, p[half + k], p[k]);
    p[k] = keep + __shfl_xor_sync(0xffffffffu, send, d);
  }
}

__device__ __forceinline__ void gdr_col_partials(const float* x, void* out_v) {
  float* out = reinterpret_cast<float*>(out_v);
  const int lane = threadIdx.x & 31, g = lane >> 2, w = (threadIdx.x >> 5) & 3;
  float p[16];
#pragma unroll
  for (int n = 0; n < 8; ++n) {
    p[2 * n] = x[4 * n] + x[4 * n + 2];
    p[2 * n + 1] = x[4 * n + 1] + x[4 * n + 3];
  }
  gdr_halve<8>(p, g & 4, 16);
  gdr_halve<4>(p, g & 2, 8);
  gdr_halve<2>(p, g & 1, 4);
  *reinterpret_cast<float2*>(out + w * 64 + 8 * g + 2 * (lane & 3)) = make_float2(p[0], p[1]);
}
"""


#: `timing=True` builds: int32 counters per consumer group (S, KV, A), each a sum over the
#: chunks of clock cycles: [2 s] working before sync point s, [2 s + 1] waiting there (s = 0
#: the producer's `full` barrier, 1-7 the phase ends), [16] the whole chunk loop, [17] chunks.
TIMING_SLOTS = 18
#: Prototype builds (`mode`; wrong results, for their cycles only: docs/kernels.md, "Fused
#: backward: the next decomposition"): `reconly`, S and KV run only the recurrence (K dS',
#: the 16-bit dU, Ag^T dU, dUs, K^T dUs + Q^T dO_g, the 16-bit dS) and A only keeps the phases;
#: `nowait`, every consumer group arrives at the phase barriers without waiting (the producer's
#: `full` still paces the chunks). `full` is the kernel.
MODES = ("full", "reconly", "nowait")


@functools.lru_cache(maxsize=None)
def build_ws_bwd(H: int, Hg: int, scale: float, dtype: str, b_dtype: str, timing: bool = False, mode: str = "full",
                 colsums: str = COLSUMS, hoist: str = HOIST):
    """Compile (once per configuration) the warp-specialised kernel (K = V = 128, chunk 64).
    `mode` other than "full": a prototype build (`MODES`), never the backend's.

    `timing` adds cycle counters at every sync point (written to the `clk` argument, CTA by
    CTA: `[N * H, 3, TIMING_SLOTS]`): the instrument behind docs/kernels.md's phase table.
    Choices in the schedule, each measured against its alternative on the H200 (docs/kernels.md):
    - db's column sums come from a 16-bit copy of dAb * A (rounded as FlashQLA does); dG's column
      sums of dAg * Ag and dPg * Pg are taken once, of their sum.
    - phase 5's dO S^T is issued after dPg's dG terms, so its accumulator is not live beside theirs.
    - KV forms W in U's registers and stores it with stmatrix; A forms its 16-bit tiles (Ag in
      phase 1; dP, dkk, dkk + dkk^T in phases 5-6) in free accumulator registers likewise.
    - S computes its G_L rows in phase 3; it arrives at phases 4 and 6 before its work there
      (no other group reads that work before the next chunk) and waits after it.
    - Gam is exp2 of a selected exponent (no branch), and its zeros above the diagonal make Pg's
      and dP's causal mask.
    - The producer loads the next k once KV's phase-7 gemm has read k_s (its own barrier), and the
      next g and b rows into registers after phase 1.
    """
    if mode not in MODES:
        raise ValueError(f"mode: expected one of {MODES}, got {mode!r}")
    if colsums not in COLSUMS_FORMS:
        raise ValueError(f"colsums: expected one of {COLSUMS_FORMS}, got {colsums!r}")
    warp_cols = colsums == "warp"
    hoisted = hoist_form(hoist.split("+")).split("+")
    gam_first, row_factor = "gam" in hoisted, "row" in hoisted
    # with "scale" A's Gam carries the scale (exp2 of log2(scale) more) and b_s holds b / scale
    # (not where fp16 holds scaled values: the transpose form's 16-bit copy of db's column terms)
    fold = "scale" in hoisted and SCALE_FOLD_RANGE[0] <= scale <= SCALE_FOLD_RANGE[1] and (
        warp_cols or dtype == "bfloat16")
    log2_scale, b_unit = (math.log2(scale), 1.0 / scale) if fold else (0.0, 1.0)
    # with "mma" dG's column sums by a gemm
    mma_cols = mma_applies(hoisted, dtype)
    # with "ag" phase 1's Ag in sq2_f (no wait injected before its stmatrix)
    ag_in_sq2 = "ag" in hoisted
    # CUDA helpers the build calls (T.call_extern)
    prelude = "".join(src for src, on in ((COL_PARTIALS, warp_cols), (COLSUM_TILE, mma_cols)) if on) or None
    # with "gam" G_s holds G log2(e) (its only reader is Gam's exponent): no multiply per element
    g_scale = LOG2E if gam_first else 1.0
    reconly, nowait = mode == "reconly", mode == "nowait"
    accum = "float32"
    TT = T.dynamic("num_tokens")
    NC = T.dynamic("num_chunks")
    N = T.dynamic("num_seqs")
    NP1 = T.dynamic("num_seqs_plus_1")
    NCLK = T.dynamic("num_clk")
    group = H // Hg
    nreg_s, nreg_kv, nreg_a, nreg_p = nreg_of(hoist, dtype)
    NS = TIMING_SLOTS

    @T.macro
    def clock_into(tick, i):
        tick[i] = T.cast(T.call_extern("int64", "clock64"), "int32")

    @T.macro
    def account(tick, tm_s, grp, slot):
        # lane 0 of the group adds the cycles before the sync point (work) and in it (wait)
        clock_into(tick, 2)
        if T.get_thread_binding() % 128 == 0:
            tm_s[grp, 2 * slot] = tm_s[grp, 2 * slot] + (tick[1] - tick[0])
            tm_s[grp, 2 * slot + 1] = tm_s[grp, 2 * slot + 1] + (tick[2] - tick[1])
        tick[0] = tick[2]

    @T.macro
    def phase_sync(bars, p, parity, slot, grp, tick, tm_s, arrive=True):
        """Close phase `p`: arrive at its barrier (not with `arrive=False`: a group that arrived
        early, its work in the phase being its own) and wait for the other consumer groups."""
        if timing:
            clock_into(tick, 1)
        if arrive:
            T.barrier_arrive(bars[p])
        if not nowait:
            T.barrier_wait(bars[p], parity)
        if timing:
            account(tick, tm_s, grp, slot)

    @T.macro
    def phase_arrive(bars, p, slot, grp, tick, tm_s):
        """Close phase `p` without waiting: the group's part is done and nothing it does next
        depends on the others' part (A at phases 3 and 4)."""
        if timing:
            clock_into(tick, 1)
        T.barrier_arrive(bars[p])
        if timing:
            account(tick, tm_s, grp, slot)

    @T.macro
    def full_wait(bar, parity, grp, tick, tm_s):
        """Wait for the producer's loads of this chunk."""
        if timing:
            clock_into(tick, 1)
        T.barrier_wait(bar, parity)
        if timing:
            account(tick, tm_s, grp, 0)

    fence = fence_accumulator

    @T.macro
    def gl_rows(hrow_f, dh_s, h_s, gls_s, egl):
        """S: the G_L term's rows, e^{G_L} <dS', S> per row of the state (from the 16-bit copies,
        as fla does), into `gls_s`, summed by `store_dg` in phase 6 (per row: no reduction across
        warps, docs/kernels.md's rules)."""
        for i in T.Parallel(K):
            hrow_f[i] = 0
            for j in T.unroll(V):
                hrow_f[i] += T.cast(dh_s[i, j], accum) * T.cast(h_s[i, j], accum)
        for i in T.Parallel(K):
            gls_s[i] = hrow_f[i] * egl[0]

    @T.macro
    def store_u_w(frag, u_s, w_s, v_s, eG_s):
        """U = K S (in `frag`) and W = V - e^G U into shared memory (W formed in `frag`, which U
        no longer needs once it is in `u_s`)."""
        T.copy(frag, u_s)
        for i, j in T.Parallel(BT, V):
            frag[i, j] = T.cast(v_s[i, j], accum) - eG_s[i] * frag[i, j]
        T.copy(frag, w_s)

    def dq_row(x_f, eG_s, i, j):
        """scale e^G[i] x[i, j] (dq's dO S^T term); with "row" the row factor once per row."""
        return x_f[i, j] * (scale * eG_s[i]) if row_factor else x_f[i, j] * scale * eG_s[i]

    def gated(x_f, gam_f, i, j):
        """scale Gam[i, j] x[i, j] (Pg from Q K^T, dP from dPg), 0 above the diagonal through
        Gam's own zeros there (with "scale" the scale is in A's Gam)."""
        return x_f[i, j] * gam_f[i, j] if fold else scale * x_f[i, j] * gam_f[i, j]

    def over_scale(x):
        """x / scale with "scale": b as `b_s` holds it, and db's column sums (taken with A's Gam,
        which carries the scale) back to their value."""
        return x * b_unit if fold else x

    def b_true(x):
        """b from `b_s`'s value (its row factor once per row with "scale")."""
        return x * scale if fold else x

    @T.macro
    def store_pg(pg_f, pg_s, gam_f):
        """Pg = scale Gam * (Q K^T) (`pg_f`, in place) into shared memory."""
        for i, j in T.Parallel(BT, BT):
            pg_f[i, j] = gated(pg_f, gam_f, i, j)
        T.copy(pg_f, pg_s)

    @T.macro
    def store_ag(ag_f, ag_s, gam_f, a_s, b_s):
        """Ag = Gam A b (`ag_f`, free registers) into shared memory."""
        for i, j in T.Parallel(BT, BT):
            ag_f[i, j] = gam_f[i, j] * T.cast(a_s[i, j], accum) * b_s[j]
        T.copy(ag_f, ag_s)

    @T.macro
    def write_rows(src, out, t0, eos, hh):
        """A chunk's rows of `out` before `eos` from `src` (64 x 128)."""
        for i, j in T.Parallel(BT, K):
            if t0 + i < eos:
                out[t0 + i, hh, j] = T.cast(src[i, j], dtype)

    @T.macro
    def store_rows(frag, stage_s, out, t0, eos, hh):
        """A chunk's dq or dk rows from a group's fragment, through `stage_s` (a free 64 x 128
        buffer), so the global stores are whole rows instead of a wgmma fragment's 4-byte pieces."""
        T.copy(frag, stage_s)
        write_rows(stage_s, out, t0, eos, hh)

    @T.macro
    def store_and_close(frag, stage_s, out, t0, eos, hh, bars, it, grp, tick, tm_s):
        """KV's dk and A's dq: `store_rows`, then phase 7's rendezvous."""
        if not reconly:
            store_rows(frag, stage_s, out, t0, eos, hh)
        phase_sync(bars, PHASES - 1, it % 2, PHASES, grp, tick, tm_s)

    @T.macro
    def column_sums(x_f, buf_s, xt_f, out_r):
        """`out_r` = the column sums of the fp32 fragment `x_f`, as row sums of its transpose
        `xt_f`: moved through the 16-bit 64 x 64 buffer `buf_s` in two halves of its bits, so
        the transpose is exact (no cross-warp reduction, see the module
        docstring)."""
        for i, j in T.Parallel(BT, BT):
            buf_s[i, j] = T.reinterpret(T.cast(T.shift_right(T.reinterpret(x_f[i, j], "uint32"), T.uint32(16)),
                                               "uint16"), dtype)
        for i, j in T.Parallel(BT, BT):
            xt_f[i, j] = T.reinterpret(T.shift_left(T.cast(T.reinterpret(buf_s[j, i], "uint16"), "uint32"),
                                                    T.uint32(16)), accum)
        for i, j in T.Parallel(BT, BT):
            buf_s[i, j] = T.reinterpret(T.cast(T.reinterpret(x_f[i, j], "uint32"), "uint16"), dtype)
        for i, j in T.Parallel(BT, BT):
            xt_f[i, j] = T.reinterpret(T.bitwise_or(T.reinterpret(xt_f[i, j], "uint32"),
                                                    T.cast(T.reinterpret(buf_s[j, i], "uint16"), "uint32")), accum)
        T.reduce_sum(xt_f, out_r, dim=1)

    @T.macro
    def col_partials(x_f, out_s):
        """A's warps' partial column sums of `x_f` into `out_s` (`[4, BT]` fp32, `COL_PARTIALS`),
        added by S after a phase barrier."""
        T.evaluate(T.call_extern("handle", "gdr_col_partials", x_f.data, out_s.data))

    def warp_sum(part_s, i):
        return part_s[0, i] + part_s[1, i] + part_s[2, i] + part_s[3, i]

    @T.macro
    def store_dg(gscan_s, dGk_s, dGa_s, gls_s, glk_s, dg, t0, L, hh):
        """dg = reverse cumsum of dG inside the chunk plus the G_L terms (the chunk end's decay
        reaches every token of it), by S."""
        for i in T.Parallel(BT):
            gscan_s[0, i] = T.if_then_else(i < L, dGk_s[i] + dGa_s[i], T.cast(0, accum))
            gscan_s[1, i] = gls_s[i] + gls_s[i + BT] + glk_s[i]
        T.cumsum(gscan_s, dim=1, reverse=True)  # warp shuffles in S's first two warps
        for i in T.Parallel(BT):
            if i < L:
                dg[t0 + i, hh] = gscan_s[0, i] + gscan_s[1, 0]

    @T.macro
    def loop_start(tick, tm_s, grp):
        if timing:
            clock_into(tick, 0)
            clock_into(tick, 3)

    @T.macro
    def loop_end(tick, tm_s, grp, n_chunks, clk, bx):
        if timing:
            clock_into(tick, 2)
            if T.get_thread_binding() % 128 == 0:
                tm_s[grp, NS - 2] = tick[2] - tick[3]
                tm_s[grp, NS - 1] = n_chunks
                for j in T.serial(NS):
                    clk[(bx * 3 + grp) * NS + j] = tm_s[grp, j]

    @tilelang.jit(target={"kind": "cuda", "arch": "sm_90a"}, out_idx=None,
                  pass_configs={tilelang.PassConfigKey.TL_DISABLE_DATA_RACE_CHECK: True,
                                tilelang.PassConfigKey.TL_ENABLE_FAST_MATH: True})
    def kernel_factory():
        @T.prim_func
        def gdr_bwd_ws(
            q: T.Tensor((TT, Hg, K), dtype),
            k: T.Tensor((TT, Hg, K), dtype),
            v: T.Tensor((TT, H, V), dtype),
            do: T.Tensor((TT, H, V), dtype),
            a: T.Tensor((TT, H, BT), dtype),
            g: T.Tensor((TT, H), accum),
            b: T.Tensor((TT, H), b_dtype),
            h: T.Tensor((NC, H, K, V), dtype),
            dht: T.Tensor((N, H, K, V), accum),
            cu_seqlens: T.Tensor((NP1,), "int32"),
            chunk_offsets: T.Tensor((NP1,), "int32"),
            dq: T.Tensor((TT, H, K), dtype),
            dk: T.Tensor((TT, H, K), dtype),
            dv: T.Tensor((TT, H, V), dtype),
            dg: T.Tensor((TT, H), accum),
            db: T.Tensor((TT, H), b_dtype),
            dh0: T.Tensor((N, H, K, V), accum),
            clk: T.Tensor((NCLK,), "int32"),  # timing builds only (one element otherwise)
        ):
            with T.Kernel(N * H, threads=512, prelude=prelude) as bx:
                n, hh, hg, bos, eos, n_chunks, c0 = cta_sequence(bx, H, group, cu_seqlens, chunk_offsets, BT)

                # ---- shared memory (~208 KiB) ----
                # loaded per chunk (producer)
                q_s = T.alloc_shared((BT, K), dtype)
                k_s = T.alloc_shared((BT, K), dtype)
                v_s = T.alloc_shared((BT, V), dtype)
                do_s = T.alloc_shared((BT, V), dtype)
                a_s = T.alloc_shared((BT, BT), dtype)
                h_s = T.alloc_shared((K, V), dtype)
                G_s = T.alloc_shared((BT,), accum)  # padded with the last valid G (times log2(e) with `hoist`)
                eG_s = T.alloc_shared((BT,), accum)  # e^G (e^{G_L} on the last row)
                eGL_s = T.alloc_shared((BT,), accum)  # e^{G_L - G}
                b_s = T.alloc_shared((BT,), accum)  # 0 past the end
                # exchanged between consumer groups
                pg_s = T.alloc_shared((BT, BT), dtype)  # Pg = scale Gam Q K^T, then dP
                ag_s = T.alloc_shared((BT, BT), dtype)  # Ag = Gam A b, then A^T dAr (KV, phase 5), then dkk + dkk^T
                x3_s = T.alloc_shared((BT, BT), dtype)  # dAr (A, phase 4; the transpose form first its db column copy), then dkk
                dvp_s = T.alloc_shared((BT, V), dtype)  # dV', then scale e^G dO
                w_s = T.alloc_shared((BT, V), dtype)  # W, then V' (v_new)
                u_s = T.alloc_shared((BT, V), dtype)  # U = K S, then dUs
                dh_s = T.alloc_shared((K, V), dtype)  # dS' (the chunk-end state gradient)
                dGk_s = T.alloc_shared((BT,), accum)  # dG per row: the part from KV, the part from A
                dGa_s = T.alloc_shared((BT,), accum)
                gls_s = T.alloc_shared((K,), accum)  # the G_L term: rows of e^{G_L} dS' * S (S, phase 3)
                glk_s = T.alloc_shared((BT,), accum)  # the G_L term: rows of dk's part * K (KV, phase 5)
                gscan_s = T.alloc_shared((2, BT), accum)  # S, phase 6: dG's reverse cumsum, the G_L sum
                db_s = T.alloc_shared((BT,), accum)  # db's row part (A, phase 6; the transpose form adds its column part)
                dbc_s = T.alloc_shared((4, BT), accum)  # db's column part: A's warps' partial sums (phase 4)
                tm_s = T.alloc_shared((3, NS), "int32")  # timing builds: the counters
                if mma_cols:
                    ones_s = T.alloc_shared((ONES_N, BT), dtype)  # "mma": 1 / ONES_N (the gemm's B, K-major)

                # ---- registers ----
                dS_f = T.alloc_fragment((K, V), accum)  # S
                hrow_f = T.alloc_fragment((K,), accum)
                egl = T.alloc_local((1,), accum)
                tick = T.alloc_local((4,), "int32")  # timing builds: clock readings
                gpre = T.alloc_local((3,), accum)  # the producer's g, g at the chunk end, b
                kv1_f = T.alloc_fragment((BT, V), accum)  # KV
                kv2_f = T.alloc_fragment((BT, K), accum)
                kvr_f = T.alloc_fragment((BT,), accum)
                kvx_f = T.alloc_fragment((BT, BT), accum)  # A^T dAr (phase 5 only)
                pg_f = T.alloc_fragment((BT, BT), accum)  # A
                sq_f = T.alloc_fragment((BT, BT), accum)
                sq2_f = T.alloc_fragment((BT, BT), accum)
                a1_f = T.alloc_fragment((BT, V), accum)
                a2_f = T.alloc_fragment((BT, K), accum)
                ar_f = T.alloc_fragment((BT,), accum)
                gam_f = T.alloc_fragment((BT, BT), accum)  # A's copy of Gam for the chunk
                ac_f = T.alloc_fragment((BT,), accum)
                if mma_cols:
                    cs_f = T.alloc_fragment((BT, ONES_N), accum)  # "mma": X^T ones / ONES_N

                # ---- barriers ----
                full = T.alloc_barrier(arrive_count=128)  # the producer publishes a chunk
                start = T.alloc_barrier(arrive_count=384)  # dS' copy of dht is in dh_s
                phase = T.alloc_barrier(arrive_count=[384] * PHASES)
                kfree = T.alloc_barrier(arrive_count=128)  # KV's phase-7 gemm has read k_s

                T.annotate_layout({
                    q_s: tilelang.layout.make_swizzled_layout(q_s),
                    k_s: tilelang.layout.make_swizzled_layout(k_s),
                    v_s: tilelang.layout.make_swizzled_layout(v_s),
                    do_s: tilelang.layout.make_swizzled_layout(do_s),
                    a_s: tilelang.layout.make_swizzled_layout(a_s),
                    h_s: tilelang.layout.make_swizzled_layout(h_s),
                    pg_s: tilelang.layout.make_swizzled_layout(pg_s),
                    ag_s: tilelang.layout.make_swizzled_layout(ag_s),
                    x3_s: tilelang.layout.make_swizzled_layout(x3_s),
                    dvp_s: tilelang.layout.make_swizzled_layout(dvp_s),
                    w_s: tilelang.layout.make_swizzled_layout(w_s),
                    u_s: tilelang.layout.make_swizzled_layout(u_s),
                    dh_s: tilelang.layout.make_swizzled_layout(dh_s),
                })

                tx = T.get_thread_binding()

                # ---- prologue: the first visited chunk (the sequence's last, maybe partial) ----
                if n_chunks > 0:
                    t_first = bos + (n_chunks - 1) * BT
                    for i, j in T.Parallel(BT, K):
                        q_s[i, j] = T.if_then_else(t_first + i < eos, q[t_first + i, hg, j], T.cast(0, dtype))
                        k_s[i, j] = T.if_then_else(t_first + i < eos, k[t_first + i, hg, j], T.cast(0, dtype))
                    for i, j in T.Parallel(BT, V):
                        v_s[i, j] = T.if_then_else(t_first + i < eos, v[t_first + i, hh, j], T.cast(0, dtype))
                        do_s[i, j] = T.if_then_else(t_first + i < eos, do[t_first + i, hh, j], T.cast(0, dtype))
                    for i, j in T.Parallel(BT, BT):
                        a_s[i, j] = T.if_then_else(t_first + i < eos, a[t_first + i, hh, j], T.cast(0, dtype))
                    for i, j in T.Parallel(K, V):
                        h_s[i, j] = h[c0 + n_chunks - 1, hh, i, j]
                    for i in T.Parallel(BT):
                        G_s[i] = g[T.min(t_first + i, eos - 1), hh] * g_scale
                        eG_s[i] = T.exp2(g[T.min(t_first + i, eos - 1), hh] * LOG2E)
                        eGL_s[i] = T.exp2((g[eos - 1, hh] - g[T.min(t_first + i, eos - 1), hh]) * LOG2E)
                        b_s[i] = T.if_then_else(t_first + i < eos, over_scale(T.cast(b[t_first + i, hh], accum)),
                                                T.cast(0, accum))
                if timing:
                    for i, j in T.Parallel(3, NS):
                        tm_s[i, j] = 0
                if mma_cols:
                    for i, j in T.Parallel(ONES_N, BT):
                        ones_s[i, j] = T.cast(1.0 / ONES_N, dtype)  # a power of two: exact
                T.fence_proxy_async()
                T.sync_threads()

                if tx < 128:
                    # ================= S: the state gradient =================
                    T.set_max_nreg(nreg_s, 1)
                    T.copy(dht[n, hh, :, :], dS_f)
                    T.copy(dS_f, dh_s)
                    T.fence_proxy_async()
                    T.barrier_arrive(start)
                    T.barrier_wait(start, 0)
                    loop_start(tick, tm_s, 0)
                    for it in T.serial(n_chunks):
                        c = n_chunks - 1 - it
                        t0 = bos + c * BT
                        L = T.min(BT, eos - t0)
                        if it > 0:
                            full_wait(full, (it - 1) % 2, 0, tick, tm_s)
                        # 1: dS <- e^{G_L} dS'; e^{G_L} <dS', S> (from the 16-bit copies, as fla does)
                        egl[0] = eG_s[BT - 1]
                        for i, j in T.Parallel(K, V):
                            dS_f[i, j] = dS_f[i, j] * egl[0]
                        phase_sync(phase, 0, it % 2, 1, 0, tick, tm_s)
                        # 2: nothing; 3: the G_L rows (h_s is reloaded after phase 5, dh_s in 6)
                        phase_sync(phase, 1, it % 2, 2, 0, tick, tm_s)
                        if not reconly:
                            gl_rows(hrow_f, dh_s, h_s, gls_s, egl)
                        phase_sync(phase, 2, it % 2, 3, 0, tick, tm_s)
                        # 4: scale e^G dO into dvp_s (dV' is read by now; only S reads it, in 5)
                        T.barrier_arrive(phase[3])
                        for i, j in T.Parallel(BT, V):
                            dvp_s[i, j] = T.cast(scale * eG_s[i] * T.cast(do_s[i, j], accum), dtype)
                        T.fence_proxy_async()
                        phase_sync(phase, 3, it % 2, 4, 0, tick, tm_s, arrive=False)
                        # 5: dS += K^T dUs + Q^T (scale e^G dO)
                        T.wgmma_gemm(k_s, u_s, dS_f, transpose_A=True)
                        T.wgmma_gemm(q_s, dvp_s, dS_f, transpose_A=True)
                        T.wait_wgmma(0)
                        fence(dS_f)
                        phase_sync(phase, 4, it % 2, 5, 0, tick, tm_s)
                        # 6: the 16-bit copy for the next chunk (dh_s was last read in 5; read again
                        # after phase 7, which S closes after this)
                        T.barrier_arrive(phase[5])
                        T.copy(dS_f, dh_s)
                        T.fence_proxy_async()
                        if not reconly:
                            store_dg(gscan_s, dGk_s, dGa_s, gls_s, glk_s, dg, t0, L, hh)  # every dG part is in by now
                        phase_sync(phase, 5, it % 2, 6, 0, tick, tm_s, arrive=False)
                        # 7: db = its two parts (A's row part lands in phase 6)
                        if not reconly:
                            for i in T.Parallel(BT):
                                if i < L:
                                    if warp_cols:  # A's row part and its warps' column partials
                                        db[t0 + i, hh] = T.cast(db_s[i] + over_scale(warp_sum(dbc_s, i)), b_dtype)
                                    else:
                                        db[t0 + i, hh] = T.cast(db_s[i], b_dtype)
                        phase_sync(phase, 6, it % 2, 7, 0, tick, tm_s)
                    loop_end(tick, tm_s, 0, n_chunks, clk, bx)
                    T.copy(dS_f, dh0[n, hh, :, :])

                elif tx < 256:
                    # ================= KV: dV', dv, dUs, dk =================
                    T.set_max_nreg(nreg_kv, 1)
                    T.barrier_arrive(start)
                    T.barrier_wait(start, 0)
                    loop_start(tick, tm_s, 1)
                    for it in T.serial(n_chunks):
                        c = n_chunks - 1 - it
                        t0 = bos + c * BT
                        if it > 0:
                            full_wait(full, (it - 1) % 2, 1, tick, tm_s)
                        # 1: dV' = e^{G_L - G} K dS'
                        # and U = K S, W = V - e^G U (A forms P, Pg, Ag)
                        if not reconly:
                            T.wgmma_gemm(k_s, h_s, kv2_f, clear_accum=True)
                        T.wgmma_gemm(k_s, dh_s, kv1_f, clear_accum=True)
                        if not reconly:
                            T.wait_wgmma(1)
                            fence(kv2_f)
                            store_u_w(kv2_f, u_s, w_s, v_s, eG_s)  # while K dS' runs
                        T.wait_wgmma(0)
                        fence(kv1_f)
                        for i, j in T.Parallel(BT, V):
                            kv1_f[i, j] = kv1_f[i, j] * eGL_s[i]
                        T.fence_proxy_async()
                        phase_sync(phase, 0, it % 2, 1, 1, tick, tm_s)
                        # 2: dV' += Pg^T dO (dh-independent: not the recurrence's)
                        if not reconly:
                            T.gemm(pg_s, do_s, kv1_f, transpose_A=True)
                        T.copy(kv1_f, dvp_s)
                        T.fence_proxy_async()
                        phase_sync(phase, 1, it % 2, 2, 1, tick, tm_s)
                        # 3: dv = Ag^T dV' (b is inside Ag); dUs = -e^G dv; dG += rows of dUs * U
                        T.gemm(ag_s, dvp_s, kv1_f, transpose_A=True, clear_accum=True)
                        if reconly:
                            for i, j in T.Parallel(BT, V):
                                kv1_f[i, j] = -kv1_f[i, j] * eG_s[i]
                        else:
                            write_rows(kv1_f, dv, t0, eos, hh)
                            for i, j in T.Parallel(BT, V):
                                kv1_f[i, j] = -kv1_f[i, j] * eG_s[i]
                                kv2_f[i, j] = kv1_f[i, j] * T.cast(u_s[i, j], accum)
                            T.reduce_sum(kv2_f, kvr_f, dim=1)
                            for i in T.Parallel(BT):
                                dGk_s[i] = kvr_f[i]
                        phase_sync(phase, 2, it % 2, 3, 1, tick, tm_s)
                        # 4: dUs into u_s (U is read by now)
                        T.copy(kv1_f, u_s)
                        T.fence_proxy_async()
                        phase_sync(phase, 3, it % 2, 4, 1, tick, tm_s)
                        # 5: dk = e^{G_L - G} V' dS'^T (its dG terms), += dUs S^T
                        if not reconly:
                            T.gemm(w_s, dh_s, kv2_f, transpose_B=True, clear_accum=True)
                            for i, j in T.Parallel(BT, K):
                                kv2_f[i, j] = kv2_f[i, j] * eGL_s[i]
                                kv1_f[i, j] = kv2_f[i, j] * T.cast(k_s[i, j], accum)
                            T.reduce_sum(kv1_f, kvr_f, dim=1)
                            for i in T.Parallel(BT):
                                dGk_s[i] = dGk_s[i] - kvr_f[i]
                                glk_s[i] = kvr_f[i]  # the G_L term's rows, summed by S in phase 6
                            # and A^T dAr (dAr in x3_s since A's phase 4) into ag_s, free since phase 3
                            T.wgmma_gemm(a_s, x3_s, kvx_f, transpose_A=True, clear_accum=True)
                            T.wgmma_gemm(u_s, h_s, kv2_f, transpose_B=True)
                            T.wait_wgmma(1)
                            fence(kvx_f)
                            T.copy(kvx_f, ag_s)
                            T.fence_proxy_async()
                            T.wait_wgmma(0)
                            fence(kv2_f)
                        phase_sync(phase, 4, it % 2, 5, 1, tick, tm_s)
                        # 6: dk += dP^T Q
                        if not reconly:
                            T.gemm(pg_s, q_s, kv2_f, transpose_A=True)
                        phase_sync(phase, 5, it % 2, 6, 1, tick, tm_s)
                        # 7: dk += (dkk + dkk^T) K
                        if not reconly:
                            T.gemm(ag_s, k_s, kv2_f)
                        T.barrier_arrive(kfree)  # k_s is read (A's last read was in 6, S's in 5)
                        store_and_close(kv2_f, u_s, dk, t0, eos, hh, phase, it, 1, tick, tm_s)  # u_s is free after phase 5
                    loop_end(tick, tm_s, 1, n_chunks, clk, bx)

                elif tx < 384:
                    # ================= A: P, Ag, U, W, V', dAg, dP, dq, the inverse =================
                    T.set_max_nreg(nreg_a, 1)
                    T.barrier_arrive(start)
                    T.barrier_wait(start, 0)
                    loop_start(tick, tm_s, 2)
                    if reconly:  # A only keeps the phases (its full-mode arrivals and waits)
                        for it in T.serial(n_chunks):
                            if it > 0:
                                full_wait(full, (it - 1) % 2, 2, tick, tm_s)
                            phase_sync(phase, 0, it % 2, 1, 2, tick, tm_s)
                            phase_sync(phase, 1, it % 2, 2, 2, tick, tm_s)
                            phase_arrive(phase, 2, 3, 2, tick, tm_s)
                            phase_arrive(phase, 3, 4, 2, tick, tm_s)
                            phase_sync(phase, 4, it % 2, 5, 2, tick, tm_s)
                            phase_sync(phase, 5, it % 2, 6, 2, tick, tm_s)
                            phase_sync(phase, PHASES - 1, it % 2, PHASES, 2, tick, tm_s)
                    else:
                        for it in T.serial(n_chunks):
                            c = n_chunks - 1 - it
                            t0 = bos + c * BT
                            if it > 0:
                                full_wait(full, (it - 1) % 2, 2, tick, tm_s)
                            if gam_first:  # the exponents first, unmasked: G's loads are then not predicated per element
                                for i, j in T.Parallel(BT, BT):
                                    gam_f[i, j] = (G_s[i] + log2_scale) - G_s[j] if fold else G_s[i] - G_s[j]
                                for i, j in T.Parallel(BT, BT):
                                    gam_f[i, j] = T.exp2(T.if_then_else(j <= i, gam_f[i, j], T.cast(-1e30, accum)))
                            else:
                                for i, j in T.Parallel(BT, BT):  # Gam once per chunk, for phases 1, 4 and 5
                                    # exp2(-1e30) = 0: no branch around the exp2
                                    exponent = (G_s[i] - G_s[j]) * LOG2E
                                    gam_f[i, j] = T.exp2(T.if_then_else(j <= i, exponent + log2_scale if fold else exponent,
                                                                        T.cast(-1e30, accum)))
                            # 1: Pg = scale Gam Q K^T; Ag = Gam A b (formed while the gemm runs; KV forms U and W)
                            T.wgmma_gemm(q_s, k_s, pg_f, transpose_B=True, clear_accum=True)
                            store_ag(sq2_f if ag_in_sq2 else sq_f, ag_s, gam_f, a_s, b_s)  # sq2_f is free until phase 4, sq_f until 3
                            T.wait_wgmma(0)
                            fence(pg_f)
                            store_pg(pg_f, pg_s, gam_f)
                            T.fence_proxy_async()
                            phase_sync(phase, 0, it % 2, 1, 2, tick, tm_s)
                            # 2: nothing
                            phase_sync(phase, 1, it % 2, 2, 2, tick, tm_s)
                            # 3: dAg = dV' W^T; V' = Ag W
                            T.wgmma_gemm(dvp_s, w_s, sq_f, transpose_B=True, clear_accum=True)
                            T.wgmma_gemm(ag_s, w_s, a1_f, clear_accum=True)
                            T.wait_wgmma(0)
                            fence(sq_f)
                            fence(a1_f)
                            phase_arrive(phase, 2, 3, 2, tick, tm_s)  # phase 4 writes nothing another group still reads
                            # 4: V' into w_s; through Ag = Gam A b: dAg * Ag (its dG terms, summed in phase 5), db's
                            # column part (its warps' partial column sums), dAr = Gam b dAg (the ungated
                            # inverse's gradient) into x3_s (KV may still read Ag)
                            T.copy(a1_f, w_s)
                            for i, j in T.Parallel(BT, BT):
                                sq2_f[i, j] = gam_f[i, j] * sq_f[i, j] * T.cast(a_s[i, j], accum)
                            if warp_cols:  # db's column part: the warps' partial sums, added by S
                                col_partials(sq2_f, dbc_s)
                            else:  # from a transposed 16-bit copy in x3_s (free until dAr)
                                for i, j in T.Parallel(BT, BT):
                                    x3_s[i, j] = T.cast(sq2_f[i, j], dtype)
                                for i, j in T.Parallel(BT, BT):
                                    pg_f[i, j] = T.cast(x3_s[j, i], accum)
                                T.reduce_sum(pg_f, ac_f, dim=1)
                            for i, j in T.Parallel(BT, BT):
                                sq2_f[i, j] = sq2_f[i, j] * b_s[j]  # dAg * Ag, summed with dPg * Pg in phase 5
                            if not warp_cols:
                                for i in T.Parallel(BT):
                                    db_s[i] = over_scale(ac_f[i])
                            for i, j in T.Parallel(BT, BT):
                                x3_s[i, j] = T.cast(gam_f[i, j] * sq_f[i, j] * b_s[j], dtype)
                            T.fence_proxy_async()
                            phase_arrive(phase, 3, 4, 2, tick, tm_s)  # phase 5 reads and writes only A's own tiles
                            # 5: dPg = dO V'^T, its dG (rows - columns of dPg Pg), dP = scale Gam dPg;
                            # dq = scale e^G dO S^T (its dG) + dP K; dO S^T runs while dPg's terms and dP are formed
                            T.wgmma_gemm(do_s, w_s, sq_f, transpose_B=True, clear_accum=True)
                            T.wait_wgmma(0)  # dO S^T waits until dPg's dG terms: its accumulator not live beside theirs
                            fence(sq_f)
                            # dG of Ag and Pg at once: rows - columns of dAg * Ag + dPg * Pg
                            for i, j in T.Parallel(BT, BT):
                                sq2_f[i, j] = sq2_f[i, j] + sq_f[i, j] * T.cast(pg_s[i, j], accum)
                            if mma_cols:  # column sums = (hi + lo tile)^T ones (COLSUM_TILE; Pg is read)
                                for i, j in T.Parallel(BT, BT):  # a copy: passing sq2_f's own registers spills
                                    pg_f[i, j] = sq2_f[i, j]
                                T.evaluate(T.call_extern("handle", "gdr_colsum_tile", pg_f.data, pg_s.data))
                                T.wgmma_gemm(pg_s, ones_s, cs_f, transpose_A=True, transpose_B=True, clear_accum=True)
                                T.reduce_sum(sq2_f, ar_f, dim=1)  # while the column sums run
                                T.wait_wgmma(0)
                                fence(cs_f)
                                T.reduce_sum(cs_f, ac_f, dim=1)
                            else:
                                T.reduce_sum(sq2_f, ar_f, dim=1)
                                column_sums(sq2_f, pg_s, pg_f, ac_f)  # Pg is read; pg_s takes dP next
                            for i in T.Parallel(BT):
                                dGa_s[i] = ar_f[i] - ac_f[i]
                            T.wgmma_gemm(do_s, h_s, a1_f, transpose_B=True, clear_accum=True)
                            for i, j in T.Parallel(BT, BT):  # dP in dPg's registers (not read again), stored with stmatrix
                                sq_f[i, j] = gated(sq_f, gam_f, i, j)
                            T.copy(sq_f, pg_s)
                            T.wait_wgmma(0)
                            fence(a1_f)
                            for i, j in T.Parallel(BT, K):
                                a1_f[i, j] = dq_row(a1_f, eG_s, i, j)
                                a2_f[i, j] = a1_f[i, j] * T.cast(q_s[i, j], accum)
                            T.reduce_sum(a2_f, ar_f, dim=1)
                            for i in T.Parallel(BT):
                                dGa_s[i] = dGa_s[i] + ar_f[i]
                            T.fence_proxy_async()
                            T.gemm(pg_s, k_s, a1_f)
                            phase_sync(phase, 4, it % 2, 5, 2, tick, tm_s)
                            # 6: through A = M^-1: dA = A^T dAr A^T, dM = -dA strictly lower,
                            # db += rows of dM * (K K^T), dkk = b dM; dkk + dkk^T into ag_s
                            T.wgmma_gemm(k_s, k_s, sq2_f, transpose_B=True, clear_accum=True)
                            T.wgmma_gemm(ag_s, a_s, sq_f, transpose_B=True, clear_accum=True)  # KV put A^T dAr in ag_s
                            T.wait_wgmma(0)
                            fence(sq2_f)
                            fence(sq_f)
                            for i, j in T.Parallel(BT, BT):
                                sq_f[i, j] = T.if_then_else(j < i, -sq_f[i, j], T.cast(0, accum))  # dM
                                sq2_f[i, j] = sq_f[i, j] * sq2_f[i, j]
                            T.reduce_sum(sq2_f, ar_f, dim=1)
                            for i in T.Parallel(BT):
                                if warp_cols:
                                    db_s[i] = ar_f[i]
                                else:
                                    db_s[i] = db_s[i] + ar_f[i] * 1.0
                            for i, j in T.Parallel(BT, BT):  # dkk, then dkk + dkk^T, in dM's registers
                                sq_f[i, j] = sq_f[i, j] * b_true(b_s[i])
                            T.copy(sq_f, x3_s)
                            for i, j in T.Parallel(BT, BT):
                                sq_f[i, j] = sq_f[i, j] + T.cast(x3_s[j, i], accum)
                            T.copy(sq_f, ag_s)
                            T.fence_proxy_async()
                            phase_sync(phase, 5, it % 2, 6, 2, tick, tm_s)
                            # 7: dq (S writes dg and db)
                            store_and_close(a1_f, dvp_s, dq, t0, eos, hh, phase, it, 2, tick, tm_s)  # dvp_s is free after phase 5
                    loop_end(tick, tm_s, 2, n_chunks, clk, bx)

                else:
                    # ================= producer: the next (earlier) chunk =================
                    T.set_max_nreg(nreg_p, 0)
                    for it in T.serial(n_chunks - 1):
                        c = n_chunks - 2 - it  # the chunk the consumers need next
                        t0 = bos + c * BT
                        T.barrier_wait(phase[0], it % 2)  # v: read in phase 1
                        T.tma_copy(v[t0:t0 + BT, hh, 0:V], v_s, barrier=full)
                        if tx - 384 < BT:  # one row per thread (producer-loaded chunks are whole)
                            gpre[0] = g[t0 + tx - 384, hh]
                            gpre[1] = g[t0 + BT - 1, hh]
                            gpre[2] = T.cast(b[t0 + tx - 384, hh], accum)
                        T.barrier_wait(phase[4], it % 2)  # h, do: last read in phase 5
                        T.tma_copy(h[c0 + c, hh, 0:K, 0:V], h_s, barrier=full)
                        T.tma_copy(do[t0:t0 + BT, hh, 0:V], do_s, barrier=full)
                        T.barrier_wait(phase[5], it % 2)  # q, a, G, b: last read in phase 6
                        T.tma_copy(q[t0:t0 + BT, hg, 0:K], q_s, barrier=full)
                        T.tma_copy(a[t0:t0 + BT, hh, 0:BT], a_s, barrier=full)
                        if tx - 384 < BT:
                            G_s[tx - 384] = gpre[0] * g_scale
                            eG_s[tx - 384] = T.exp2(gpre[0] * LOG2E)
                            eGL_s[tx - 384] = T.exp2((gpre[1] - gpre[0]) * LOG2E)
                            b_s[tx - 384] = over_scale(gpre[2])
                        T.barrier_wait(kfree, it % 2)  # k: read by KV's phase-7 gemm
                        T.tma_copy(k[t0:t0 + BT, hg, 0:K], k_s, barrier=full)
                        T.barrier_arrive(full)

        return gdr_bwd_ws

    return kernel_factory()


def ws_config(q, v, b, scale: float) -> tuple:
    """`build_ws_bwd`'s arguments for a call: one source for the launcher and for precompile
    jobs (backends' `compile_jobs`), so both hit the same compiled kernel."""
    # dq/dk per value head in q's dtype also when heads are grouped (the launcher sums them in
    # fp32, as FlashQLA's caller does): fp32 stores plus their reduction cost about 1 ms at
    # varlen 8x4096 H32 Hg16 (docs/kernels.md)
    return (v.shape[2], q.shape[2], float(scale), tl_dtype(q.dtype), tl_dtype(b.dtype))


def ws_bwd_given_h(q, k, v, do, a, g, b, h, dht, scale: float, seq_lens, chunk_size: int = 64,
                   cu_seqlens=None, has_h0: bool = False, state_v_first: bool = False, clk=None, mode: str = "full",
                   colsums: str = COLSUMS, hoist: str = HOIST):
    """Run the warp-specialised kernel; returns `(dq, dk, dv, dg, db, dh0)` in the contract's form.

    `tilelang_launch.launch_packed`'s calling convention; dq/dk come out in q's dtype, db in b's
    dtype. `clk` (int32, `[N * H * 3 * TIMING_SLOTS]`) asks for the timing build and receives
    its counters (tools/ws_probe.py); `mode` a prototype build (`MODES`: wrong results, for
    tools/ws_probe.py's cycles and wall times only); `colsums` another form of the column sums
    (`COLSUMS_FORMS`) and `hoist` A's work taken out of its per-element loops (`HOIST`), for
    tools/ws_probe.py's comparisons.
    """
    import torch

    H, Hg, Kd, Vd = v.shape[2], q.shape[2], q.shape[3], v.shape[3]
    if (Kd, Vd, chunk_size) != (K, V, BT):
        raise ValueError(f"ws_bwd_given_h: built for K = V = {K}, chunk {BT}; got K={Kd}, V={Vd}, chunk {chunk_size}")
    # the plain build by its positional arguments alone: the key `compile_jobs` warms (lru_cache)
    cfg = ws_config(q, v, b, scale)
    kern = build_ws_bwd(*cfg) if clk is None and mode == "full" and colsums == COLSUMS and hoist == HOIST else \
        build_ws_bwd(*cfg, timing=clk is not None, mode=mode, colsums=colsums, hoist=hoist)
    if clk is None:  # the plain build never touches it: a cached constant, one launch less per call
        clk = device_constant((0,), torch.int32, q.device)
    # TMA copies bytes: h_s holds q's dtype
    return launch_packed(kern, q, k, v, do, a, g, b, as_dtype(h, q.dtype), dht, seq_lens, chunk_size, cu_seqlens, has_h0,
                         state_v_first, dq_dtype=q.dtype, db_dtype=b.dtype, extra=(clk,))
