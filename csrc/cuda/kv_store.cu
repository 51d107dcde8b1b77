// KV-cache store: one thread block per token; each thread moves 16-byte vectors of K and V from the token's row to
// its cache slot. Pure copy, so the only goal is full-width, coalesced accesses: a head's row is head_dim
// contiguous elements in both places, and consecutive threads take consecutive vectors.
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include "kernels.h"

namespace polyserve {
namespace {

template <typename T, typename Index>
__global__ void store_kvcache_kernel(const StoreKVCacheParams p) {
  const int64_t token = blockIdx.x;
  const int64_t slot = static_cast<int64_t>(static_cast<const Index*>(p.slot_mapping)[token]);
  if (slot < 0) return;
  const int64_t block = slot / p.block_size;
  const int64_t offset = slot % p.block_size;

  constexpr int kVec = 16 / sizeof(T);
  const int vecs_per_head = static_cast<int>(p.head_dim / kVec);
  const int total = static_cast<int>(p.num_kv_heads) * vecs_per_head;
  const T* k = static_cast<const T*>(p.k) + token * p.k_stride_token;
  const T* v = static_cast<const T*>(p.v) + token * p.v_stride_token;
  T* k_cache = static_cast<T*>(p.k_cache) + block * p.k_cache_stride_block + offset * p.k_cache_stride_slot;
  T* v_cache = static_cast<T*>(p.v_cache) + block * p.v_cache_stride_block + offset * p.v_cache_stride_slot;
  for (int i = threadIdx.x; i < total; i += blockDim.x) {
    const int64_t head = i / vecs_per_head;
    const int64_t dim = static_cast<int64_t>(i % vecs_per_head) * kVec;
    const uint4 k_vec = *reinterpret_cast<const uint4*>(k + head * p.k_stride_head + dim);
    const uint4 v_vec = *reinterpret_cast<const uint4*>(v + head * p.v_stride_head + dim);
    *reinterpret_cast<uint4*>(k_cache + head * p.k_cache_stride_head + dim) = k_vec;
    *reinterpret_cast<uint4*>(v_cache + head * p.v_cache_stride_head + dim) = v_vec;
  }
}

template <typename T>
cudaError_t launch_typed(const StoreKVCacheParams& p, cudaStream_t stream) {
  const int vectors = static_cast<int>(p.num_kv_heads * p.head_dim / (16 / sizeof(T)));
  const int threads = vectors >= 256 ? 256 : ((vectors + 31) / 32) * 32;
  const dim3 grid(static_cast<unsigned>(p.num_tokens));
  if (p.slots_are_int64) {
    store_kvcache_kernel<T, int64_t><<<grid, threads, 0, stream>>>(p);
  } else {
    store_kvcache_kernel<T, int32_t><<<grid, threads, 0, stream>>>(p);
  }
  return cudaGetLastError();
}

}  // namespace

cudaError_t launch_store_kvcache(const StoreKVCacheParams& params, DType dtype, cudaStream_t stream) {
  if (params.num_tokens == 0) return cudaSuccess;
  switch (dtype) {
    case DType::kFloat32: return launch_typed<float>(params, stream);
    case DType::kFloat16: return launch_typed<__half>(params, stream);
    case DType::kBFloat16: return launch_typed<__nv_bfloat16>(params, stream);
  }
  return cudaErrorInvalidValue;
}

}  // namespace polyserve
