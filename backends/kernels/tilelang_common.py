"""TileLang helpers the sm90 kernels share (kernel-side; the launchers' conventions are in
`tilelang_launch.py`)."""

import re

import tilelang.language as T


def parse_build(build: str, defaults: dict, switches: dict, what: str = "build switch") -> dict:
    """`'default'` or switch names joined by '+' or '-' (`switches`: name -> (keyword, value)) ->
    a kernel builder's keyword arguments; an unnamed setting keeps its value in `defaults`."""
    flags = dict(defaults)
    for word in re.split(r"[+-]", build):
        if word in ("", "default"):
            continue
        if word not in switches:
            raise ValueError(f"unknown {what} {word!r} in {build!r}; known: default, {', '.join(switches)}")
        key, value = switches[word]
        flags[key] = value
    return flags


def fence_accumulator(frag):
    """`T.warpgroup_fence_operand` on a warpgroup's fp32 accumulator fragment, over its registers
    per thread (its elements over the group's 128 threads): without `num_regs` TileLang 0.1.15
    fences the fragment's logical size (8192 on a 64-register array), an inline asm loop indexing
    far past the array (docs/kernels.md, "Fused backward"). Needed after `T.wait_wgmma` of an
    asynchronous `T.wgmma_gemm` before the accumulator is read."""
    n = 1
    for d in frag.shape:
        n *= int(d)
    return T.warpgroup_fence_operand(frag, num_regs=n // 128)


@T.macro
def cta_sequence(bx, H: int, group: int, cu_seqlens, chunk_offsets, BT: int):
    """The prologue of a CTA per (sequence, value head) over packed sequences: `(n, hh, hg, bos,
    eos, n_chunks, c0)`: the sequence, its value head and key head, its first and one-past-last
    token, its chunk count and its first chunk in `h` (the calling convention of
    tilelang_launch.packed_sequences)."""
    n = bx // H
    hh = bx % H
    hg = hh // group
    bos = cu_seqlens[n]
    eos = cu_seqlens[n + 1]
    n_chunks = T.ceildiv(eos - bos, BT)
    c0 = chunk_offsets[n]
    return n, hh, hg, bos, eos, n_chunks, c0

