"""engine._C.BlockManager: paged-KV allocation, prefix caching, eviction, and the per-step batch metadata."""
import gc
import random

import numpy as np
import pytest

from engine._C import BlockManager


def computed_prompt(bm, seq_id, tokens):
    """Register a sequence and run its whole prompt through the cache the way the engine does."""
    bm.add_sequence(seq_id, tokens)
    cached = bm.allocate_cached_prefix(seq_id)
    assert bm.ensure_capacity(seq_id, len(tokens))
    bm.mark_computed(seq_id, len(tokens))
    return cached


# ---------------------------------------------------------------- allocation


def test_allocate_and_free_basics():
    bm = BlockManager(8, 4, False)
    assert (bm.block_size, bm.num_total_blocks, bm.num_free_blocks()) == (4, 8, 8)
    bm.add_sequence(1, list(range(10)))
    assert bm.num_tokens(1) == 10 and bm.num_blocks_of(1) == 0
    assert bm.ensure_capacity(1, 10)
    assert bm.block_table(1) == [0, 1, 2]
    assert [bm.ref_count(b) for b in range(4)] == [1, 1, 1, 0]
    assert bm.num_free_blocks() == 5
    assert bm.ensure_capacity(1, 4)  # never shrinks
    assert bm.num_blocks_of(1) == 3
    bm.append_token(1, 77)
    assert bm.ensure_capacity(1, 11) and bm.num_blocks_of(1) == 3  # still fits in block 2
    bm.append_token(1, 78)
    assert bm.ensure_capacity(1, 13) and bm.num_blocks_of(1) == 4
    bm.check_invariants()

    bm.free_blocks(1)  # preemption: blocks go, tokens stay
    assert bm.num_blocks_of(1) == 0 and bm.num_tokens(1) == 12
    assert bm.num_free_blocks() == 8 and all(bm.ref_count(b) == 0 for b in range(8))
    bm.check_invariants()
    bm.remove_sequence(1)
    with pytest.raises(KeyError):
        bm.num_tokens(1)


def test_ensure_capacity_is_all_or_nothing():
    bm = BlockManager(4, 4, True)
    bm.add_sequence(1, [1] * 12)
    bm.add_sequence(2, [2] * 8)
    assert bm.ensure_capacity(1, 12)
    assert not bm.ensure_capacity(2, 8)  # needs 2, 1 free
    assert bm.num_blocks_of(2) == 0 and bm.num_free_blocks() == 1
    assert bm.ensure_capacity(2, 4)
    assert not bm.ensure_capacity(2, 8)
    assert bm.block_table(2) == [3]
    bm.check_invariants()


def test_allocate_cached_prefix_off_and_on_a_sequence_with_blocks():
    bm = BlockManager(8, 4, False)
    computed_prompt(bm, 1, list(range(12)))
    bm.add_sequence(2, list(range(13)))
    assert bm.allocate_cached_prefix(2) == 0 and bm.num_blocks_of(2) == 0
    assert bm.num_cached_blocks() == 0
    with pytest.raises(RuntimeError, match="already holds"):
        bm.allocate_cached_prefix(1)


# ---------------------------------------------------------------- prefix caching


def test_prefix_hit_shares_blocks_and_respects_the_cap():
    bm = BlockManager(16, 4, True)
    prompt = list(range(100, 112))  # exactly 3 full blocks
    assert computed_prompt(bm, 1, prompt) == 0
    table = bm.block_table(1)
    assert bm.num_cached_blocks() == 3

    # Same 3-block prompt: the last token must be computed, so only 2 blocks come from the cache.
    bm.add_sequence(2, prompt)
    assert bm.allocate_cached_prefix(2) == 8
    assert bm.block_table(2) == table[:2]
    assert [bm.ref_count(b) for b in table] == [2, 2, 1]

    # One token more: all 3 blocks are cached.
    bm.add_sequence(3, prompt + [5])
    assert bm.allocate_cached_prefix(3) == 12
    assert bm.block_table(3) == table
    assert [bm.ref_count(b) for b in table] == [3, 3, 2]

    # Diverging in the second block: only the first is shared.
    bm.add_sequence(4, prompt[:4] + [0] + prompt[5:] + [5])
    assert bm.allocate_cached_prefix(4) == 4 and bm.block_table(4) == table[:1]
    # Diverging in the first block: nothing, although later blocks are equal (hashes are chained).
    bm.add_sequence(5, [0] + prompt[1:] + [5])
    assert bm.allocate_cached_prefix(5) == 0
    bm.check_invariants()

    # The sequence that computed its third block itself keeps it; the cache keeps the first copy.
    assert bm.ensure_capacity(2, 12)
    bm.mark_computed(2, 12)
    assert bm.block_table(2)[2] != table[2] and bm.num_cached_blocks() == 3
    for seq in (1, 2, 3, 4, 5):
        bm.remove_sequence(seq)
    assert bm.num_free_blocks() == 16 and bm.num_cached_blocks() == 3
    bm.check_invariants()


def test_prompt_shorter_than_a_block_and_empty_prompt_get_no_hit():
    bm = BlockManager(4, 4, True)
    computed_prompt(bm, 1, [1, 2, 3, 4, 5])
    bm.add_sequence(2, [1, 2, 3, 4])  # the only full block holds the token that must be computed
    assert bm.allocate_cached_prefix(2) == 0
    bm.add_sequence(3, [])
    assert bm.allocate_cached_prefix(3) == 0


def test_chain_continues_across_a_block_cached_by_another_sequence():
    bm = BlockManager(16, 4, True)
    prompt = list(range(8))
    # Both compute the same 2 blocks without a hit (neither was cached when they started).
    bm.add_sequence(1, prompt + [50])
    bm.add_sequence(2, prompt + [60, 61, 62, 63, 64])
    for seq in (1, 2):
        assert bm.allocate_cached_prefix(seq) == 0
        assert bm.ensure_capacity(seq, bm.num_tokens(seq))
    bm.mark_computed(1, 9)
    bm.mark_computed(2, 13)
    first, second = bm.block_table(1), bm.block_table(2)
    assert set(first).isdisjoint(second)
    assert bm.num_cached_blocks() == 3  # prompt's 2 blocks once (sequence 1's), sequence 2's third block

    # A newcomer finds sequence 1's prefix blocks, then sequence 2's own third block chained onto them.
    bm.add_sequence(3, prompt + [60, 61, 62, 63, 99])
    assert bm.allocate_cached_prefix(3) == 12
    assert bm.block_table(3) == first[:2] + [second[2]]
    bm.check_invariants()


def test_eviction_takes_unused_blocks_first_then_least_recently_freed():
    bm = BlockManager(4, 2, True)
    for seq, tokens in ((1, [1, 1]), (2, [2, 2]), (3, [3, 3])):
        computed_prompt(bm, seq, tokens)
    assert [bm.block_table(s) for s in (1, 2, 3)] == [[0], [1], [2]]
    for seq in (2, 1, 3):  # freed in this order: block 1, then 0, then 2
        bm.remove_sequence(seq)
    assert bm.num_free_blocks() == 4 and bm.num_cached_blocks() == 3

    bm.add_sequence(10, [9, 9, 9, 9, 9, 9])
    assert bm.ensure_capacity(10, 2) and bm.block_table(10) == [3]  # the never-used block, nothing evicted
    assert bm.num_cached_blocks() == 3
    assert bm.ensure_capacity(10, 4) and bm.block_table(10) == [3, 1]  # evicts sequence 2's block
    assert bm.num_cached_blocks() == 2

    # Sequence 2's content is gone from the cache; sequence 1's is still there and a hit takes it off the LRU list.
    bm.add_sequence(11, [2, 2, 0])
    assert bm.allocate_cached_prefix(11) == 0
    bm.add_sequence(12, [1, 1, 0])
    assert bm.allocate_cached_prefix(12) == 2 and bm.block_table(12) == [0]
    assert bm.num_free_blocks() == 1
    assert bm.ensure_capacity(10, 6) and bm.block_table(10) == [3, 1, 2]  # next in LRU order: sequence 3's
    assert bm.num_cached_blocks() == 1
    assert not bm.ensure_capacity(11, 2)
    bm.check_invariants()


def test_free_releases_the_tail_first_so_the_prefix_outlives_it():
    bm = BlockManager(3, 2, True)
    computed_prompt(bm, 1, [1, 2, 3, 4, 5, 6])
    bm.remove_sequence(1)
    bm.add_sequence(2, [7, 7])
    assert bm.ensure_capacity(2, 2) and bm.block_table(2) == [2]  # the last block went first
    bm.add_sequence(3, [1, 2, 3, 4, 0])
    assert bm.allocate_cached_prefix(3) == 4 and bm.block_table(3) == [0, 1]


def _mix(x):
    """splitmix64's output function, as block_manager.cpp chains it over a block's tokens."""
    mask = (1 << 64) - 1
    x = (x + 0x9E3779B97F4A7C15) & mask
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & mask
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & mask
    return x ^ (x >> 31)


def _colliding_first_block(a0, a1):
    """Another 2-token first block whose chained hash equals that of [a0, a1] (hash = mix(mix(0 ^ t0) ^ t1))."""
    target = _mix(a0) ^ a1
    for b0 in range(a0 + 1, a0 + 1000):
        b1 = _mix(b0) ^ target
        if b1 < 1 << 63:  # token ids are non-negative int64
            return b0, b1
    raise AssertionError("no colliding block found")


def test_hash_collisions_never_hand_out_wrong_blocks():
    bm = BlockManager(16, 2, True)
    a0, a1 = 5, 6
    b0, b1 = _colliding_first_block(a0, a1)
    computed_prompt(bm, 1, [a0, a1, 8, 9, 0])
    first = bm.block_table(1)
    assert bm.num_cached_blocks() == 2

    # Same hash, other tokens: a lookup rejects the entry.
    bm.add_sequence(2, [b0, b1, 8, 9, 0])
    assert bm.allocate_cached_prefix(2) == 0
    assert bm.ensure_capacity(2, 5)
    bm.mark_computed(2, 2)
    # Its first block replaced sequence 1's colliding entry; without a collision there would be 3 entries.
    assert bm.num_cached_blocks() == 2, "the test did not force a collision: hash function changed?"

    # Sequence 1's second block is still cached under the same chained hash as [b0, b1, 8, 9] and holds equal
    # tokens, but its KV was computed after [a0, a1]: a lookup must stop before it.
    bm.add_sequence(3, [b0, b1, 8, 9, 1])
    assert bm.allocate_cached_prefix(3) == 2 and bm.block_table(3) == bm.block_table(2)[:1]
    assert bm.ref_count(first[1]) == 1

    # Registering sequence 2's own second block replaces that entry too.
    bm.mark_computed(2, 5)
    assert bm.num_cached_blocks() == 2
    bm.add_sequence(4, [b0, b1, 8, 9, 1])
    assert bm.allocate_cached_prefix(4) == 4 and bm.block_table(4) == bm.block_table(2)[:2]
    bm.add_sequence(5, [a0, a1, 8, 9, 1])
    assert bm.allocate_cached_prefix(5) == 0
    bm.check_invariants()


# ---------------------------------------------------------------- build_batch


def test_build_batch_mixed_decode_and_mid_block_prefill_chunk():
    bm = BlockManager(8, 4, False)
    bm.add_sequence(20, list(range(200, 211)))  # 11-token prompt, chunked
    bm.add_sequence(10, list(range(100, 106)))  # 6-token prompt, decoding
    bm.add_sequence(30, [300, 301, 302])  # short prompt, finished in this step
    assert bm.ensure_capacity(20, 4)  # [0]
    assert bm.ensure_capacity(10, 6)  # [1, 2]
    bm.mark_computed(10, 6)
    bm.append_token(10, 106)
    assert bm.ensure_capacity(10, 7)
    bm.mark_computed(20, 4)
    assert bm.ensure_capacity(20, 9)  # + [3, 4]
    assert bm.ensure_capacity(30, 3)  # [5]
    assert [bm.block_table(s) for s in (10, 20, 30)] == [[1, 2], [0, 3, 4], [5]]

    # Seq 20 already has 5 tokens computed (its chunk starts mid-block, at offset 1 of its 2nd block).
    meta = bm.build_batch(np.array([10, 20, 30]), np.array([6, 5, 0]), np.array([1, 4, 3]))
    expected = {
        "input_ids": (np.int64, [106, 205, 206, 207, 208, 300, 301, 302]),
        "positions": (np.int64, [6, 5, 6, 7, 8, 0, 1, 2]),
        # block_id * 4 + offset: pos 6 of seq 10 -> block 2; pos 5..7 of seq 20 -> block 3, pos 8 -> block 4
        "slot_mapping": (np.int64, [10, 13, 14, 15, 16, 20, 21, 22]),
        "block_tables": (np.int32, [[1, 2, -1], [0, 3, 4], [5, -1, -1]]),
        "seq_lens": (np.int32, [7, 9, 3]),
        "query_start_loc": (np.int32, [0, 1, 5, 8]),
        "logits_indices": (np.int64, [0, 7]),  # seq 20 stops short of its 11 tokens: no sample
        "sample_rows": (np.int64, [0, 2]),
    }
    for name, (dtype, values) in expected.items():
        array = getattr(meta, name)
        assert array.dtype == dtype, name
        np.testing.assert_array_equal(array, np.array(values, dtype=dtype), err_msg=name)

    # Views keep the metadata alive; lists work as input too.
    ids = meta.input_ids
    del meta
    gc.collect()
    np.testing.assert_array_equal(ids, [106, 205, 206, 207, 208, 300, 301, 302])
    again = bm.build_batch([20], [0], [9])
    np.testing.assert_array_equal(again.slot_mapping, [0, 1, 2, 3, 12, 13, 14, 15, 16])
    assert again.logits_indices.shape == (0,) and again.sample_rows.shape == (0,)
    np.testing.assert_array_equal(again.block_tables, [[0, 3, 4]])


def test_build_batch_rejects_bad_items():
    bm = BlockManager(8, 4, False)
    bm.add_sequence(1, list(range(10)))
    assert bm.ensure_capacity(1, 8)
    with pytest.raises(RuntimeError, match="sequence 1 holds 2 blocks"):
        bm.build_batch([1], [6], [3])
    with pytest.raises(RuntimeError, match="sequence 1 has 10 tokens"):
        bm.build_batch([1], [8], [3])
    with pytest.raises(RuntimeError, match="sequence 1 has 10 tokens"):
        bm.build_batch([1], [2**62], [2**62])  # no overflow into a 'valid' range
    with pytest.raises(KeyError, match="sequence 2"):
        bm.build_batch([1, 2], [0, 0], [1, 1])
    with pytest.raises(ValueError, match="twice"):
        bm.build_batch([1, 1], [0, 1], [1, 1])
    with pytest.raises(ValueError, match="num_new"):
        bm.build_batch([1], [0], [0])
    with pytest.raises(ValueError, match="num_computed"):
        bm.build_batch([1], [-1], [1])
    with pytest.raises(ValueError, match="length"):
        bm.build_batch([1], [0, 0], [1])
    with pytest.raises(ValueError, match="1-D"):
        bm.build_batch(np.zeros((1, 1), dtype=np.int64), [0], [1])
    assert bm.build_batch([], [], []).query_start_loc.tolist() == [0]


# ---------------------------------------------------------------- bad input


def test_bad_input_errors():
    for args in ((0, 4, True), (-3, 4, True), (4, 0, True)):
        with pytest.raises(ValueError):
            BlockManager(*args)
    bm = BlockManager(4, 4, True)
    bm.add_sequence(1, [1, 2, 3])
    with pytest.raises(ValueError, match="already registered"):
        bm.add_sequence(1, [1])
    with pytest.raises(ValueError, match="token id"):
        bm.add_sequence(2, [1, -5])
    with pytest.raises(ValueError, match="token id"):
        bm.append_token(1, -1)
    with pytest.raises(ValueError, match="num_tokens"):
        bm.ensure_capacity(1, -1)
    assert not bm.ensure_capacity(1, 2**63 - 1) and bm.num_blocks_of(1) == 0
    with pytest.raises(ValueError, match="num_computed_tokens"):
        bm.mark_computed(1, -1)
    with pytest.raises(ValueError, match="3 tokens"):
        bm.mark_computed(1, 4)
    with pytest.raises(RuntimeError, match="holds blocks for 0 tokens"):
        bm.mark_computed(1, 2)
    with pytest.raises(IndexError):
        bm.ref_count(4)
    with pytest.raises(IndexError):
        bm.ref_count(-1)
    for call in (lambda: bm.append_token(9, 1), lambda: bm.num_tokens(9), lambda: bm.allocate_cached_prefix(9),
                 lambda: bm.ensure_capacity(9, 1), lambda: bm.mark_computed(9, 0), lambda: bm.free_blocks(9),
                 lambda: bm.remove_sequence(9), lambda: bm.num_blocks_of(9), lambda: bm.block_table(9)):
        with pytest.raises(KeyError, match="sequence 9"):
            call()
    bm.check_invariants()


# ---------------------------------------------------------------- randomized workload


class PrefixIds:
    """Interns every token prefix as an int, so 'same KV' is an integer comparison."""

    def __init__(self):
        self.ids = {}

    def extend(self, ids, tokens):
        for token in tokens:
            key = (ids[-1] if ids else -1, token)
            ids.append(self.ids.setdefault(key, len(self.ids)))


@pytest.mark.parametrize("prefix_caching", [True, False])
def test_random_workload_keeps_invariants_and_kv_contents(prefix_caching):
    rng = random.Random(1234)
    bs, num_blocks, max_len = 4, 24, 40
    bm = BlockManager(num_blocks, bs, prefix_caching)
    prefixes = PrefixIds()
    shared_prompts = [[rng.randrange(3) for _ in range(rng.randrange(4, 14))] for _ in range(3)]
    # Shadow state, independent of the C++ side.
    tokens, prefix_ids, computed = {}, {}, {}
    kv = {}  # block id -> {offset: prefix id whose KV was written there}
    next_id = 0
    counts = dict(hits=0, evictions=0, refused=0, preemptions=0, finished=0)

    def write_kv(seq, start, end):
        table = bm.block_table(seq)
        for p in range(start, end):
            kv.setdefault(table[p // bs], {})[p % bs] = prefix_ids[seq][p]

    def check():
        bm.check_invariants()
        tables = {s: bm.block_table(s) for s in tokens}
        holders = {}
        for s, table in tables.items():
            for k, b in enumerate(table):
                holders.setdefault(b, []).append((s, k))
        for b in range(num_blocks):
            assert bm.ref_count(b) == len(holders.get(b, [])), f"block {b}"
        assert bm.num_free_blocks() == num_blocks - len(holders)
        # A block is shared only through the prefix cache: same position, same tokens up to the block's end.
        for b, users in holders.items():
            (s0, k0), *others = users
            for s, k in others:
                assert k == k0, f"block {b} at positions {k0} and {k}"
                end = (k + 1) * bs
                assert len(tokens[s]) >= end and tokens[s][:end] == tokens[s0][:end], f"block {b} shared across prefixes"
        # Every computed token's KV is still where the table says, computed after the same prefix.
        for s, table in tables.items():
            for p in range(computed[s]):
                assert kv[table[p // bs]][p % bs] == prefix_ids[s][p], f"seq {s} token {p}"

    for _ in range(3000):
        op = rng.random()
        live = sorted(tokens)
        if (op < 0.15 and len(live) < 10) or not live:
            prompt = list(rng.choice(shared_prompts)) if rng.random() < 0.7 else []
            prompt += [rng.randrange(3) for _ in range(rng.randrange(1, 10))]
            bm.add_sequence(next_id, prompt)
            tokens[next_id], prefix_ids[next_id], computed[next_id] = prompt, [], 0
            prefixes.extend(prefix_ids[next_id], prompt)
            s, next_id = next_id, next_id + 1
        elif op < 0.80:
            s = rng.choice(live)
            if bm.num_blocks_of(s) == 0:
                cached_before = bm.num_cached_blocks()
                cached = bm.allocate_cached_prefix(s)
                assert cached % bs == 0 and cached <= max(0, len(tokens[s]) - 1)
                assert bm.num_blocks_of(s) == cached // bs and bm.num_cached_blocks() == cached_before
                assert prefix_caching or cached == 0
                computed[s] = cached
                counts["hits"] += cached > 0
            start = computed[s]
            n = rng.randrange(1, len(tokens[s]) - start + 1)
            table_before, free_before, cached_before = bm.block_table(s), bm.num_free_blocks(), bm.num_cached_blocks()
            if not bm.ensure_capacity(s, start + n):
                assert bm.block_table(s) == table_before and bm.num_free_blocks() == free_before
                assert -(-(start + n) // bs) - len(table_before) > free_before
                counts["refused"] += 1
            else:
                counts["evictions"] += bm.num_cached_blocks() < cached_before
                meta = bm.build_batch([s], [start], [n])
                assert meta.input_ids.tolist() == tokens[s][start:start + n]
                write_kv(s, start, start + n)
                bm.mark_computed(s, start + n)
                computed[s] = start + n
                if computed[s] == len(tokens[s]):
                    assert meta.logits_indices.tolist() == [n - 1]
                    token = rng.randrange(3)
                    bm.append_token(s, token)
                    tokens[s].append(token)
                    prefixes.extend(prefix_ids[s], [token])
                else:
                    assert meta.logits_indices.size == 0
        elif op < 0.90:
            s = rng.choice(live)
            bm.free_blocks(s)
            computed[s] = 0
            counts["preemptions"] += 1
        else:
            s = rng.choice(live)
        if op >= 0.90 or len(tokens.get(s, ())) > max_len:  # aborted, or finished at its length cap
            bm.remove_sequence(s)
            del tokens[s], prefix_ids[s], computed[s]
            counts["finished"] += 1
        check()

    for s in list(tokens):
        bm.remove_sequence(s)
    bm.check_invariants()
    assert bm.num_free_blocks() == num_blocks
    assert all(bm.ref_count(b) == 0 for b in range(num_blocks))
    # The workload must have exercised what it claims to check.
    assert counts["refused"] > 0 and counts["preemptions"] > 0 and counts["finished"] > 0
    if prefix_caching:
        assert counts["hits"] > 0 and counts["evictions"] > 0
    else:
        assert bm.num_cached_blocks() == 0
