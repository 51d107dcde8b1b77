// The CUDA C++ twin of a Triton kernel (kernels/kv_store.py), written against raw pointers so the .cu file builds
// with nvcc alone; bindings.cpp is the thin torch layer over it.
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

}  // namespace polyserve
