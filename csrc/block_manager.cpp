#include "block_manager.h"

#include <algorithm>
#include <cstring>
#include <unordered_set>

namespace polyserve {

namespace {

constexpr uint64_t kRootHash = 0;  // parent hash of every sequence's first block
constexpr uint64_t kRootSerial = 0;

// splitmix64's output function (Steele, Lea & Flood, "Fast splittable pseudorandom number generators", OOPSLA 2014):
// a bijection with full avalanche, so chaining it token by token spreads every token over all 64 bits.
inline uint64_t mix(uint64_t x) {
    x += 0x9E3779B97F4A7C15ULL;
    x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ULL;
    x = (x ^ (x >> 27)) * 0x94D049BB133111EBULL;
    return x ^ (x >> 31);
}

std::string seq_name(int64_t seq_id) { return "sequence " + std::to_string(seq_id); }

void require_non_negative(int64_t value, const char* what) {
    if (value < 0) throw std::invalid_argument(std::string(what) + " must be non-negative, got " + std::to_string(value));
}

int64_t blocks_for(int64_t num_tokens, int64_t block_size) { return num_tokens / block_size + (num_tokens % block_size != 0); }

}  // namespace

BlockManager::BlockManager(int64_t num_blocks, int64_t block_size, bool enable_prefix_caching)
    : block_size_(block_size), prefix_caching_(enable_prefix_caching) {
    if (num_blocks < 1) throw std::invalid_argument("num_blocks must be at least 1, got " + std::to_string(num_blocks));
    if (block_size < 1) throw std::invalid_argument("block_size must be at least 1, got " + std::to_string(block_size));
    if (num_blocks > INT32_MAX / block_size)
        throw std::invalid_argument("num_blocks * block_size must fit in int32 (block tables are int32)");
    blocks_.resize(static_cast<size_t>(num_blocks));
    if (prefix_caching_) cached_tokens_.resize(static_cast<size_t>(num_blocks * block_size));
    for (int32_t b = 0; b < static_cast<int32_t>(num_blocks); ++b) push_back(never_cached_, Where::kNeverCached, b);
}

uint64_t BlockManager::hash_block(uint64_t parent_hash, const int64_t* tokens, int64_t block_size) {
    uint64_t h = parent_hash;
    for (int64_t i = 0; i < block_size; ++i) h = mix(h ^ static_cast<uint64_t>(tokens[i]));
    return h;
}

BlockManager::Sequence& BlockManager::find(int64_t seq_id) {
    auto it = seqs_.find(seq_id);
    if (it == seqs_.end()) throw UnknownSequence("unknown " + seq_name(seq_id));
    return it->second;
}

const BlockManager::Sequence& BlockManager::find(int64_t seq_id) const {
    auto it = seqs_.find(seq_id);
    if (it == seqs_.end()) throw UnknownSequence("unknown " + seq_name(seq_id));
    return it->second;
}

void BlockManager::push_back(FreeList& list, Where where, int32_t block_id) {
    Block& b = blocks_[block_id];
    b.where = where;
    b.prev = list.tail;
    b.next = kNone;
    if (list.tail == kNone) list.head = block_id;
    else blocks_[list.tail].next = block_id;
    list.tail = block_id;
    ++list.size;
}

void BlockManager::unlink(FreeList& list, int32_t block_id) {
    Block& b = blocks_[block_id];
    if (b.prev == kNone) list.head = b.next;
    else blocks_[b.prev].next = b.next;
    if (b.next == kNone) list.tail = b.prev;
    else blocks_[b.next].prev = b.prev;
    b.prev = b.next = kNone;
    b.where = Where::kInUse;
    --list.size;
}

void BlockManager::drop_hash(int32_t block_id) {
    Block& b = blocks_[block_id];
    auto it = cache_.find(b.hash);
    if (it != cache_.end() && it->second == block_id) cache_.erase(it);
    b.has_hash = false;
    if (b.where == Where::kEvictable) {
        // A free block that lost its hash can no longer be hit: it joins the blocks handed out before any eviction.
        unlink(evictable_, block_id);
        push_back(never_cached_, Where::kNeverCached, block_id);
    }
}

int32_t BlockManager::take_free_block() {
    int32_t b = never_cached_.head;
    if (b != kNone) {
        unlink(never_cached_, b);
    } else {
        b = evictable_.head;
        unlink(evictable_, b);
        drop_hash(b);
    }
    blocks_[b].ref_count = 1;
    return b;
}

void BlockManager::release(int32_t block_id) {
    Block& b = blocks_[block_id];
    if (--b.ref_count == 0) {
        if (b.has_hash) push_back(evictable_, Where::kEvictable, block_id);
        else push_back(never_cached_, Where::kNeverCached, block_id);
    }
}

bool BlockManager::cached_tokens_equal(int32_t block_id, const int64_t* tokens) const {
    const int64_t* stored = cached_tokens_.data() + static_cast<size_t>(block_id) * block_size_;
    return std::memcmp(stored, tokens, sizeof(int64_t) * static_cast<size_t>(block_size_)) == 0;
}

void BlockManager::reset_chain(Sequence& seq) {
    seq.num_hashed_blocks = 0;
    seq.chain_hash = kRootHash;
    seq.chain_serial = kRootSerial;
}

void BlockManager::add_sequence(int64_t seq_id, const std::vector<int64_t>& token_ids) {
    if (seqs_.count(seq_id)) throw std::invalid_argument(seq_name(seq_id) + " is already registered");
    for (int64_t t : token_ids) require_non_negative(t, "token id");
    Sequence& seq = seqs_[seq_id];
    seq.tokens = token_ids;
    reset_chain(seq);
}

void BlockManager::append_token(int64_t seq_id, int64_t token_id) {
    Sequence& seq = find(seq_id);
    require_non_negative(token_id, "token id");
    seq.tokens.push_back(token_id);
}

int64_t BlockManager::num_tokens(int64_t seq_id) const { return static_cast<int64_t>(find(seq_id).tokens.size()); }

int64_t BlockManager::num_blocks_of(int64_t seq_id) const { return static_cast<int64_t>(find(seq_id).table.size()); }

const std::vector<int32_t>& BlockManager::block_table(int64_t seq_id) const { return find(seq_id).table; }

int64_t BlockManager::ref_count(int64_t block_id) const {
    if (block_id < 0 || block_id >= num_total_blocks())
        throw std::out_of_range("block id " + std::to_string(block_id) + " out of range [0, " +
                                std::to_string(num_total_blocks()) + ")");
    return blocks_[block_id].ref_count;
}

int64_t BlockManager::allocate_cached_prefix(int64_t seq_id) {
    Sequence& seq = find(seq_id);
    if (!seq.table.empty())
        throw std::runtime_error("allocate_cached_prefix: " + seq_name(seq_id) + " already holds " +
                                 std::to_string(seq.table.size()) + " blocks");
    if (!prefix_caching_) return 0;
    // At least one token must be left to compute: its logits give the next token.
    const int64_t max_blocks = std::max<int64_t>(0, static_cast<int64_t>(seq.tokens.size()) - 1) / block_size_;
    for (int64_t i = 0; i < max_blocks; ++i) {
        const int64_t* tokens = seq.tokens.data() + i * block_size_;
        const uint64_t h = hash_block(seq.chain_hash, tokens, block_size_);
        auto it = cache_.find(h);
        if (it == cache_.end()) break;
        const int32_t b = it->second;
        Block& block = blocks_[b];
        if (block.parent_serial != seq.chain_serial || !cached_tokens_equal(b, tokens)) break;
        if (block.ref_count == 0) unlink(evictable_, b);
        ++block.ref_count;
        seq.table.push_back(b);
        seq.num_hashed_blocks = i + 1;
        seq.chain_hash = h;
        seq.chain_serial = block.serial;
    }
    return seq.num_hashed_blocks * block_size_;
}

bool BlockManager::ensure_capacity(int64_t seq_id, int64_t num_tokens) {
    Sequence& seq = find(seq_id);
    require_non_negative(num_tokens, "num_tokens");
    const int64_t missing = blocks_for(num_tokens, block_size_) - static_cast<int64_t>(seq.table.size());
    if (missing <= 0) return true;
    if (missing > num_free_blocks()) return false;
    for (int64_t i = 0; i < missing; ++i) seq.table.push_back(take_free_block());
    return true;
}

void BlockManager::mark_computed(int64_t seq_id, int64_t num_computed_tokens) {
    Sequence& seq = find(seq_id);
    require_non_negative(num_computed_tokens, "num_computed_tokens");
    if (num_computed_tokens > static_cast<int64_t>(seq.tokens.size()))
        throw std::invalid_argument("mark_computed: " + seq_name(seq_id) + " has " + std::to_string(seq.tokens.size()) +
                                    " tokens, cannot have " + std::to_string(num_computed_tokens) + " computed");
    if (num_computed_tokens > static_cast<int64_t>(seq.table.size()) * block_size_)
        throw std::runtime_error("mark_computed: " + seq_name(seq_id) + " holds blocks for " +
                                 std::to_string(seq.table.size() * block_size_) + " tokens, not " +
                                 std::to_string(num_computed_tokens));
    if (!prefix_caching_) return;
    const int64_t num_full = num_computed_tokens / block_size_;
    for (int64_t i = seq.num_hashed_blocks; i < num_full; ++i) {
        const int64_t* tokens = seq.tokens.data() + i * block_size_;
        const uint64_t h = hash_block(seq.chain_hash, tokens, block_size_);
        const int32_t own = seq.table[i];
        auto it = cache_.find(h);
        if (it != cache_.end()) {
            const int32_t existing = it->second;
            if (blocks_[existing].parent_serial == seq.chain_serial && cached_tokens_equal(existing, tokens)) {
                // Same content already cached: the cache keeps that block, later blocks chain onto its identity.
                seq.chain_hash = h;
                seq.chain_serial = blocks_[existing].serial;
                continue;
            }
            // A collision, or an entry whose parent left the cache and that no lookup can reach any more: replace it.
            drop_hash(existing);
        }
        Block& block = blocks_[own];
        block.has_hash = true;
        block.hash = h;
        block.serial = next_serial_++;
        block.parent_serial = seq.chain_serial;
        std::memcpy(cached_tokens_.data() + static_cast<size_t>(own) * block_size_, tokens,
                    sizeof(int64_t) * static_cast<size_t>(block_size_));
        cache_.emplace(h, own);
        seq.chain_hash = h;
        seq.chain_serial = block.serial;
    }
    if (num_full > seq.num_hashed_blocks) seq.num_hashed_blocks = num_full;
}

void BlockManager::free_blocks(int64_t seq_id) {
    Sequence& seq = find(seq_id);
    // Tail first, so a sequence's later blocks are evicted before the prefix other requests are likelier to share.
    for (auto it = seq.table.rbegin(); it != seq.table.rend(); ++it) release(*it);
    seq.table.clear();
    reset_chain(seq);
}

void BlockManager::remove_sequence(int64_t seq_id) {
    free_blocks(seq_id);
    seqs_.erase(seq_id);
}

BatchMetadata BlockManager::build_batch(const int64_t* seq_ids, const int64_t* num_computed, const int64_t* num_new,
                                        int64_t batch_size) {
    // Pass 1: validate everything before writing anything, and size the outputs.
    const uint64_t stamp = ++batch_counter_;
    batch_scratch_.resize(static_cast<size_t>(batch_size));
    int64_t total_tokens = 0;
    int64_t max_blocks = 0;
    int64_t num_samples = 0;
    for (int64_t i = 0; i < batch_size; ++i) {
        auto it = seqs_.find(seq_ids[i]);
        if (it == seqs_.end()) throw UnknownSequence("build_batch: unknown " + seq_name(seq_ids[i]));
        Sequence& seq = it->second;
        if (seq.batch_stamp == stamp)
            throw std::invalid_argument("build_batch: " + seq_name(seq_ids[i]) + " appears twice in the batch");
        seq.batch_stamp = stamp;
        const int64_t start = num_computed[i];
        const int64_t count = num_new[i];
        if (start < 0 || count < 1)
            throw std::invalid_argument("build_batch: " + seq_name(seq_ids[i]) + " needs num_computed >= 0 and num_new >= 1, got " +
                                        std::to_string(start) + " and " + std::to_string(count));
        const int64_t size = static_cast<int64_t>(seq.tokens.size());
        if (start > size || count > size - start)
            throw std::runtime_error("build_batch: " + seq_name(seq_ids[i]) + " has " + std::to_string(size) +
                                     " tokens, the step asks for " + std::to_string(count) + " from " + std::to_string(start));
        const int64_t end = start + count;
        const int64_t needed_blocks = blocks_for(end, block_size_);
        if (needed_blocks > static_cast<int64_t>(seq.table.size()))
            throw std::runtime_error("build_batch: " + seq_name(seq_ids[i]) + " holds " + std::to_string(seq.table.size()) +
                                     " blocks, tokens up to " + std::to_string(end) + " need " + std::to_string(needed_blocks));
        batch_scratch_[i] = &seq;
        total_tokens += count;
        max_blocks = std::max(max_blocks, needed_blocks);
        if (end == size) ++num_samples;
    }
    if (total_tokens > INT32_MAX) throw std::invalid_argument("build_batch: more tokens than int32 query_start_loc can index");

    BatchMetadata out;
    out.num_seqs = batch_size;
    out.max_blocks = max_blocks;
    out.input_ids.resize(total_tokens);
    out.positions.resize(total_tokens);
    out.slot_mapping.resize(total_tokens);
    out.block_tables.resize(static_cast<size_t>(batch_size * max_blocks));
    out.seq_lens.resize(batch_size);
    out.query_start_loc.resize(batch_size + 1);
    out.logits_indices.resize(num_samples);
    out.sample_rows.resize(num_samples);

    // Pass 2: fill.
    int64_t t = 0;
    int64_t s = 0;
    out.query_start_loc[0] = 0;
    for (int64_t i = 0; i < batch_size; ++i) {
        const Sequence& seq = *batch_scratch_[i];
        const int64_t start = num_computed[i];
        const int64_t end = start + num_new[i];
        const int32_t* table = seq.table.data();
        // Walk slots block by block: one division per item, not one per token.
        int64_t block = start / block_size_;
        int64_t offset = start % block_size_;
        for (int64_t p = start; p < end; ++p, ++t) {
            out.input_ids[t] = seq.tokens[p];
            out.positions[t] = p;
            out.slot_mapping[t] = static_cast<int64_t>(table[block]) * block_size_ + offset;
            if (++offset == block_size_) {
                offset = 0;
                ++block;
            }
        }
        const int64_t used = blocks_for(end, block_size_);
        int32_t* row = out.block_tables.data() + i * max_blocks;
        std::memcpy(row, table, sizeof(int32_t) * static_cast<size_t>(used));
        std::fill(row + used, row + max_blocks, kNone);
        out.seq_lens[i] = static_cast<int32_t>(end);
        out.query_start_loc[i + 1] = static_cast<int32_t>(t);
        if (end == static_cast<int64_t>(seq.tokens.size())) {
            out.logits_indices[s] = t - 1;
            out.sample_rows[s] = i;
            ++s;
        }
    }
    return out;
}

void BlockManager::check_invariants() const {
    auto fail = [](const std::string& what) { throw std::runtime_error("BlockManager invariant violated: " + what); };
    const int64_t n = num_total_blocks();

    std::vector<int32_t> refs(static_cast<size_t>(n), 0);
    std::unordered_set<int32_t> in_table;
    for (const auto& [seq_id, seq] : seqs_) {
        in_table.clear();
        for (int32_t b : seq.table) {
            if (b < 0 || b >= n) fail(seq_name(seq_id) + " holds out-of-range block " + std::to_string(b));
            if (!in_table.insert(b).second) fail(seq_name(seq_id) + " holds block " + std::to_string(b) + " twice");
            ++refs[b];
        }
        if (seq.num_hashed_blocks > static_cast<int64_t>(seq.table.size()))
            fail(seq_name(seq_id) + " has more hashed blocks than blocks");
    }

    std::vector<uint8_t> listed(static_cast<size_t>(n), 0);
    auto walk = [&](const FreeList& list, Where where, const char* name) {
        int64_t count = 0;
        int32_t prev = kNone;
        for (int32_t b = list.head; b != kNone; prev = b, b = blocks_[b].next) {
            if (++count > n) fail(std::string(name) + " list has a cycle");
            if (listed[b]) fail("block " + std::to_string(b) + " is on a free list twice");
            listed[b] = 1;
            const Block& block = blocks_[b];
            if (block.prev != prev) fail(std::string(name) + " list back link broken at block " + std::to_string(b));
            if (block.where != where) fail("block " + std::to_string(b) + " is on the " + name + " list but marked elsewhere");
            if (refs[b] != 0) fail("block " + std::to_string(b) + " is both free-listed and referenced");
            if (block.has_hash != (where == Where::kEvictable))
                fail("block " + std::to_string(b) + " on the " + name + " list has the wrong cache state");
        }
        if (prev != list.tail) fail(std::string(name) + " list tail is wrong");
        if (count != list.size) fail(std::string(name) + " list size " + std::to_string(list.size) + " but holds " + std::to_string(count));
    };
    walk(never_cached_, Where::kNeverCached, "never-cached");
    walk(evictable_, Where::kEvictable, "evictable");

    int64_t num_hashed = 0;
    for (int32_t b = 0; b < n; ++b) {
        const Block& block = blocks_[b];
        if (block.ref_count != refs[b])
            fail("block " + std::to_string(b) + " has ref count " + std::to_string(block.ref_count) + " but " +
                 std::to_string(refs[b]) + " table entries");
        if ((block.ref_count == 0) != static_cast<bool>(listed[b]))
            fail("block " + std::to_string(b) + (block.ref_count == 0 ? " is free but on no free list" : " is in use and free-listed"));
        if (block.has_hash) {
            ++num_hashed;
            auto it = cache_.find(block.hash);
            if (it == cache_.end() || it->second != b) fail("block " + std::to_string(b) + " has a hash the cache does not map to it");
        }
    }
    if (num_free_blocks() != n - static_cast<int64_t>(std::count_if(refs.begin(), refs.end(), [](int32_t r) { return r > 0; })))
        fail("free block count is inconsistent");
    for (const auto& [h, b] : cache_) {
        if (b < 0 || b >= n) fail("cache maps to out-of-range block " + std::to_string(b));
        if (!blocks_[b].has_hash || blocks_[b].hash != h) fail("cache entry points to block " + std::to_string(b) + " whose stored hash differs");
    }
    if (num_hashed != static_cast<int64_t>(cache_.size())) fail("hashed blocks and cache entries differ in number");
}

}  // namespace polyserve
