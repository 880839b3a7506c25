"""`accept_path` in every cache kind: after a tree step's rows were written at scratch positions
c + i, moving the accepted path's rows to c + 1.. and committing/rolling back leaves each cache as
if only the path had been written as a chain (attention of the next step equals the contiguous
reference fed the path alone, 1e-12 in float64), across ring wraps, pool chunk boundaries, chunks
on the host, int8 rows with their scales, and `select`'s kept queries."""

import random

import pytest
import torch
from test_caches import F64, HQ, KV, D, attend, paged, rows

from lucebox.caches import PagedKV, SlidingRing, Step
from lucebox.caches.contiguous import ContiguousCache


def contiguous():
    return ContiguousCache(KV, D, 2048, **F64)


def paged_int8():
    return PagedKV(paged(40, 2048).s, KV, D, **F64, int8=True)


# cache kind -> (make it, the window, its reference: fed the accepted rows alone, as a chain)
CACHES = {
    "ring": (lambda: SlidingRing(8, 16, KV, D, **F64, windowed=True), 8, contiguous),
    "contiguous": (contiguous, None, contiguous),
    "paged-offload": (lambda: paged(pool_tokens=40, max_context=2048), None, contiguous),
    "paged-int8": (paged_int8, None, paged_int8),  # the same quantization on both sides
}


def random_path(r: random.Random, width: int) -> list[int]:
    """Increasing rows a_j >= j of a tree of `width` rows: what a tree's accepted path can be."""
    rows_, last = [], 0
    for j in range(1, width):
        if last + 1 >= width or r.random() < 0.25:
            break
        last = r.randint(max(last + 1, j), min(width - 1, last + 3))
        rows_.append(last)
    return rows_


@pytest.mark.parametrize("kind", sorted(CACHES))
def test_accepted_path_moves_into_place_as_a_chain_would_write_it(kind):
    make, window, make_reference = CACHES[kind]
    cache, reference = make(), make_reference()
    r, gen = random.Random(0), torch.Generator().manual_seed(0)
    length = 0
    for _ in range(60):
        width = r.randint(1, 16)
        k, v = rows(width, gen), rows(width, gen)
        cache.write(Step(torch.arange(length, length + width)), k, v)
        if isinstance(cache, PagedKV) and cache.select:
            cache.static_block(torch.randn(width, HQ, D, generator=gen, dtype=torch.float64))
        path = random_path(r, width)
        cache.accept_path(length, path)
        kept = [0, *path]
        reference.write(Step(torch.arange(length, length + len(kept))), k[kept], v[kept])
        length += len(kept)
        cache.commit(length)
        cache.rollback(length)
        # The next step's one row: the cache must give the same attention as the reference.
        q = torch.randn(1, HQ, D, generator=gen, dtype=torch.float64)
        step = Step(torch.arange(length, length + 1))
        row_k, row_v = rows(1, gen), rows(1, gen)
        for c in (cache, reference):
            c.write(step, row_k, row_v)
        ours, want = attend(cache, q, step, window), attend(reference, q, step, window)
        assert (ours - want).abs().max() < 1e-12, f"step at {length}"
        for c in (cache, reference):
            c.rollback(length)
        reference.commit(length)
    if kind.startswith("paged"):
        assert cache.host_bytes() > 0  # chunks left for the host along the way


def test_select_keeps_the_query_of_the_last_accepted_row():
    cache = paged(pool_tokens=512, max_context=512, policy="select")
    gen = torch.Generator().manual_seed(1)
    cache.write(Step(torch.arange(0, 6)), rows(6, gen), rows(6, gen))
    q = torch.randn(6, HQ, D, generator=gen, dtype=torch.float64)
    cache.static_block(q)
    cache.accept_path(0, [2, 5])
    held = cache.selection.queries
    assert torch.equal(held[1], q[2]) and torch.equal(held[2], q[5])  # row 2 is the last committed row's
