// Paged-KV block allocator with prefix caching, and the per-step batch metadata builder.
//
// Pure C++ (no Python headers): bindings.cpp exposes it as engine._C. Errors are thrown as
//   std::invalid_argument  bad argument (negative size, duplicate id, ...)   -> ValueError
//   UnknownSequence         seq id not registered                             -> KeyError
//   std::out_of_range       block id out of range                             -> IndexError
//   std::runtime_error      a request the current state cannot satisfy       -> RuntimeError
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <new>
#include <stdexcept>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

namespace polyserve {

struct UnknownSequence : std::runtime_error {
    using std::runtime_error::runtime_error;
};

// Leaves resized elements uninitialised: build_batch writes every element, so zero-filling first is wasted work.
template <typename T>
struct DefaultInitAllocator : std::allocator<T> {
    using value_type = T;
    template <typename U>
    struct rebind {
        using other = DefaultInitAllocator<U>;
    };
    DefaultInitAllocator() = default;
    template <typename U>
    DefaultInitAllocator(const DefaultInitAllocator<U>&) noexcept {}
    template <typename U>
    void construct(U* p) noexcept {
        ::new (static_cast<void*>(p)) U;
    }
    template <typename U, typename... Args>
    void construct(U* p, Args&&... args) {
        ::new (static_cast<void*>(p)) U(std::forward<Args>(args)...);
    }
};

template <typename T>
using OutputArray = std::vector<T, DefaultInitAllocator<T>>;

// The flattened inputs of one step. bindings.cpp hands the arrays to numpy as read-only views.
struct BatchMetadata {
    int64_t num_seqs = 0;
    int64_t max_blocks = 0;  // row length of block_tables
    OutputArray<int64_t> input_ids;        // [T]
    OutputArray<int64_t> positions;        // [T]
    OutputArray<int64_t> slot_mapping;     // [T] block_id * block_size + offset
    OutputArray<int32_t> block_tables;     // [B, max_blocks] row-major, padded with -1
    OutputArray<int32_t> seq_lens;         // [B]
    OutputArray<int32_t> query_start_loc;  // [B + 1]
    OutputArray<int64_t> logits_indices;   // [B'] last token of each item that completes its sequence
    OutputArray<int64_t> sample_rows;      // [B'] batch index of each of those items
};

class BlockManager {
public:
    BlockManager(int64_t num_blocks, int64_t block_size, bool enable_prefix_caching);

    int64_t block_size() const { return block_size_; }
    int64_t num_total_blocks() const { return static_cast<int64_t>(blocks_.size()); }
    int64_t num_free_blocks() const { return never_cached_.size + evictable_.size; }
    int64_t num_cached_blocks() const { return static_cast<int64_t>(cache_.size()); }

    void add_sequence(int64_t seq_id, const std::vector<int64_t>& token_ids);
    void append_token(int64_t seq_id, int64_t token_id);
    int64_t num_tokens(int64_t seq_id) const;
    int64_t allocate_cached_prefix(int64_t seq_id);
    bool ensure_capacity(int64_t seq_id, int64_t num_tokens);
    void mark_computed(int64_t seq_id, int64_t num_computed_tokens);
    void free_blocks(int64_t seq_id);
    void remove_sequence(int64_t seq_id);
    int64_t num_blocks_of(int64_t seq_id) const;
    const std::vector<int32_t>& block_table(int64_t seq_id) const;
    int64_t ref_count(int64_t block_id) const;

    BatchMetadata build_batch(const int64_t* seq_ids, const int64_t* num_computed, const int64_t* num_new,
                              int64_t batch_size);

    void check_invariants() const;

private:
    static constexpr int32_t kNone = -1;

    enum class Where : uint8_t { kInUse, kNeverCached, kEvictable };

    struct Block {
        int32_t ref_count = 0;
        Where where = Where::kNeverCached;
        bool has_hash = false;
        int32_t prev = kNone;  // links in whichever free list `where` names
        int32_t next = kNone;
        uint64_t hash = 0;
        // Identity of this cached content, and of the cached parent block it was computed after. A lookup accepts
        // a block only when its tokens match and its parent_serial is the serial of the block accepted one step
        // earlier, so a hash collision anywhere in the chain can never hand out wrong KV.
        uint64_t serial = 0;
        uint64_t parent_serial = 0;
    };

    // Intrusive doubly linked list over blocks_: O(1) push, pop and unlink of any block.
    struct FreeList {
        int32_t head = kNone;
        int32_t tail = kNone;
        int64_t size = 0;
    };

    struct Sequence {
        std::vector<int64_t> tokens;
        std::vector<int32_t> table;
        int64_t num_hashed_blocks = 0;  // leading full blocks already passed through the prefix cache
        uint64_t chain_hash = 0;        // hash of block num_hashed_blocks - 1 (root hash when none)
        uint64_t chain_serial = 0;      // serial of the cached block holding that content (0 = root)
        uint64_t batch_stamp = 0;       // last build_batch that listed it: catches duplicates in O(1)
    };

    static uint64_t hash_block(uint64_t parent_hash, const int64_t* tokens, int64_t block_size);

    Sequence& find(int64_t seq_id);
    const Sequence& find(int64_t seq_id) const;

    void push_back(FreeList& list, Where where, int32_t block_id);
    void unlink(FreeList& list, int32_t block_id);
    int32_t take_free_block();
    void drop_hash(int32_t block_id);
    void release(int32_t block_id);
    bool cached_tokens_equal(int32_t block_id, const int64_t* tokens) const;
    static void reset_chain(Sequence& seq);

    int64_t block_size_;
    bool prefix_caching_;
    std::vector<Block> blocks_;
    std::vector<int64_t> cached_tokens_;  // [num_blocks, block_size]: the tokens of each hashed block, for verification
    FreeList never_cached_;               // free blocks with no hash: handed out first
    FreeList evictable_;                  // free blocks still in the cache, least recently freed at the head
    std::unordered_map<uint64_t, int32_t> cache_;
    std::unordered_map<int64_t, Sequence> seqs_;
    uint64_t next_serial_ = 1;
    uint64_t batch_counter_ = 0;
    std::vector<Sequence*> batch_scratch_;
};

}  // namespace polyserve
