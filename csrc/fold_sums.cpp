#include "fold_sums.h"

#include <cstring>

#if !defined(__BYTE_ORDER__) || __BYTE_ORDER__ != __ORDER_LITTLE_ENDIAN__
#error "the checksum's words are little-endian: a big-endian host would need a byte swap per word"
#endif

namespace polyserve {

namespace {

std::uint64_t word_at(const unsigned char* at) {
    std::uint64_t word;
    std::memcpy(&word, at, sizeof word);  // a plain load on the hosts we build for, whatever the alignment
    return word;
}

}  // namespace

void add_fold_sums(const unsigned char* data, std::size_t rows, std::size_t width, std::uint64_t* sums) {
    const std::size_t row_bytes = width * sizeof(std::uint64_t);
    std::size_t row = 0;
    // four rows to one pass over the sums: the sums' loads and stores, not the data's, are what bound numpy's
    // row-by-row reduction
    for (; row + 4 <= rows; row += 4) {
        const unsigned char* at = data + row * row_bytes;
        for (std::size_t column = 0; column < width; ++column) {
            const std::size_t offset = column * sizeof(std::uint64_t);
            sums[column] += word_at(at + offset) + word_at(at + row_bytes + offset) +
                            word_at(at + 2 * row_bytes + offset) + word_at(at + 3 * row_bytes + offset);
        }
    }
    for (; row < rows; ++row) {
        const unsigned char* at = data + row * row_bytes;
        for (std::size_t column = 0; column < width; ++column)
            sums[column] += word_at(at + column * sizeof(std::uint64_t));
    }
}

}  // namespace polyserve
