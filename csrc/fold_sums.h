// The column sums behind a KV chunk's checksum (engine/kv_transfer.py, `chunk_checksum`).
//
// Pure C++ (no Python headers): bindings.cpp exposes it as engine._C.add_fold_sums.
#pragma once

#include <cstddef>
#include <cstdint>

namespace polyserve {

// Adds `rows` rows of `width` 64-bit little-endian words, laid one after another from `data` (any alignment), into
// `sums` column by column, modulo 2**64.
void add_fold_sums(const unsigned char* data, std::size_t rows, std::size_t width, std::uint64_t* sums);

}  // namespace polyserve
