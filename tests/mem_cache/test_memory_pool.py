import numpy as np
import pytest

from jaxrunner.mem_cache.kv_cache import TokenToKVPool
from jaxrunner.mem_cache.memory_pool import DUMMY_PAGE, PageAllocator, ReqToTokenPool


def test_allocator_never_hands_out_the_dummy_page_and_is_all_or_nothing():
    alloc = PageAllocator(5)
    assert alloc.capacity == 4
    pages = alloc.alloc(3)
    assert DUMMY_PAGE not in pages and len(set(pages)) == 3
    assert alloc.alloc(2) is None and alloc.num_free == 1
    alloc.free(pages)
    assert sorted(alloc.alloc(4)) == [1, 2, 3, 4]
    assert alloc.num_free == 0


def test_req_to_token_pool_tracks_pages_per_slot():
    pool = ReqToTokenPool(max_reqs=2, max_pages_per_req=3)
    a, b = pool.alloc_slot(), pool.alloc_slot()
    with pytest.raises(RuntimeError, match="no free request slot"):
        pool.alloc_slot()
    pool.append_pages(a, [4, 7])
    pool.append_pages(a, [9])
    assert pool.pages(a).tolist() == [4, 7, 9] and pool.pages(b).tolist() == []
    with pytest.raises(RuntimeError, match="more than 3 pages"):
        pool.append_pages(a, [1])
    assert pool.free_slot(a).tolist() == [4, 7, 9]
    assert pool.page_table[a].tolist() == [DUMMY_PAGE] * 3
    assert pool.alloc_slot() == a


def test_kv_pool_stacks_every_layers_pages_in_one_array():
    pool = TokenToKVPool(num_layers=3, num_pages=4, page_size=8, num_kv_heads=2, head_dim=16,
                         dtype=np.float32)
    assert pool.kv_cache.shape == (3, 4, 8, 4, 16)
    assert pool.layer_shape == (4, 8, 4, 16)   # K and V interleaved on axis 2 of a layer
    assert pool.bytes == 3 * 4 * 8 * 4 * 16 * 4
