// CUDA C++ twins of two Triton kernels (kernels/kv_store.py, the decode rows of kernels/attention.py), written
// against raw pointers so the .cu files build with nvcc alone; bindings.cpp is the thin torch layer over them.
// All strides are in elements. Launchers only enqueue on `stream` and return the launch status: no host sync.
#pragma once

#include <cstdint>

#include <cuda_runtime.h>

namespace polyserve {

enum class DType : int { kFloat32 = 0, kFloat16 = 1, kBFloat16 = 2 };

struct StoreKVCacheParams {
  const void* k;             // [num_tokens, num_kv_heads, head_dim]
  const void* v;
  void* k_cache;             // [num_blocks, block_size, num_kv_heads, head_dim]
  void* v_cache;
  const void* slot_mapping;  // [num_tokens] int32 or int64; -1 skips the token
  bool slots_are_int64;
  int64_t num_tokens, num_kv_heads, head_dim, block_size;
  int64_t k_stride_token, k_stride_head, v_stride_token, v_stride_head;
  int64_t k_cache_stride_block, k_cache_stride_slot, k_cache_stride_head;
  int64_t v_cache_stride_block, v_cache_stride_slot, v_cache_stride_head;
};

// Needs head_dim and every stride a multiple of 16 bytes' worth of elements, and 16-byte aligned pointers.
cudaError_t launch_store_kvcache(const StoreKVCacheParams& params, DType dtype, cudaStream_t stream);

struct DecodeAttentionParams {
  const void* q;               // [num_seqs, num_q_heads, head_dim]: one query token per sequence
  const void* k_cache;         // [num_blocks, block_size, num_kv_heads, head_dim]
  const void* v_cache;
  const int32_t* block_tables; // [num_seqs, block_table_stride]
  const int32_t* seq_lens;     // [num_seqs], context length including this step's token
  void* out;                   // like q
  float* partial_out;          // [num_splits, num_seqs, num_q_heads, head_dim], used when num_splits > 1
  float* partial_lse;          // [num_splits, num_seqs, num_q_heads] (log2 domain), used when num_splits > 1
  int num_seqs, num_q_heads, num_kv_heads, head_dim, block_size, num_splits;
  int64_t q_stride_token, q_stride_head, out_stride_token, out_stride_head;
  int64_t k_stride_block, k_stride_slot, k_stride_head;
  int64_t v_stride_block, v_stride_slot, v_stride_head;
  int64_t block_table_stride;
  float scale;
};

// head_dim 64 or 128; q/out strides and cache strides multiples of 16 bytes' worth of elements.
cudaError_t launch_decode_attention(const DecodeAttentionParams& params, DType dtype, cudaStream_t stream);

}  // namespace polyserve
