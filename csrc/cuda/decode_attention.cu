// Paged decode attention (one query token per sequence) with split-KV, the CUDA C++ twin of the decode rows of
// kernels/attention.py. Decode is memory-bound (each K/V byte is used for GROUP multiply-adds), so the design
// is about bytes in flight, not the tensor cores:
//   * a thread block owns (sequence, up to kHeads query heads of one KV head, one KV split); the heads that
//     share a KV head read each K/V row once;
//   * kLanes threads share one key: each holds a 16-byte slice of the key's row, so a warp's loads are whole,
//     coalesced rows; the block has kThreads / kLanes key groups walking the keys in an interleaved order;
//   * keys go in batches of kUnroll per key group, and a batch's registers are refilled with the next batch's
//     rows as soon as they are consumed (K after the scores, V after the products), so loads are in flight
//     while the arithmetic runs instead of each iteration waiting for its own;
//   * each key group keeps its own online-softmax state (max, sum, output slice, log2 domain); the groups are
//     merged through shared memory at the end, and splits by merge_splits_kernel.
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cmath>

#include "kernels.h"

namespace polyserve {
namespace {

constexpr int kThreads = 128;
constexpr float kLog2e = 1.4426950408889634f;

template <typename T>
struct Convert;
template <>
struct Convert<float> {
  static __device__ __forceinline__ float to_float(float x) { return x; }
  static __device__ __forceinline__ float from_float(float x) { return x; }
};
template <>
struct Convert<__half> {
  static __device__ __forceinline__ float to_float(__half x) { return __half2float(x); }
  static __device__ __forceinline__ __half from_float(float x) { return __float2half_rn(x); }
};
template <>
struct Convert<__nv_bfloat16> {
  static __device__ __forceinline__ float to_float(__nv_bfloat16 x) { return __bfloat162float(x); }
  static __device__ __forceinline__ __nv_bfloat16 from_float(float x) { return __float2bfloat16_rn(x); }
};

template <typename T, int kVec>
__device__ __forceinline__ void unpack(const uint4& raw, float (&out)[kVec]) {
  const T* values = reinterpret_cast<const T*>(&raw);
#pragma unroll
  for (int i = 0; i < kVec; ++i) out[i] = Convert<T>::to_float(values[i]);
}

template <typename T, int kHeadDim, int kHeads>
__global__ void __launch_bounds__(kThreads) decode_attention_kernel(const DecodeAttentionParams p) {
  constexpr int kVec = 16 / sizeof(T);
  constexpr int kLanes = kHeadDim / kVec;
  constexpr int kGroups = kThreads / kLanes;
  // Bounds the registers held by q, acc and the staged loads (with the prefetch a batch's rows stay live through
  // the whole iteration, so the batches are half what an unpipelined loop could afford at the same occupancy).
  constexpr int kUnroll = kHeads >= 8 ? 1 : 2;
  static_assert(kLanes <= 32 && 32 % kLanes == 0, "a key's lanes must sit inside one warp");

  const int seq = blockIdx.x;
  const int group_size = p.num_q_heads / p.num_kv_heads;
  const int chunks = (group_size + kHeads - 1) / kHeads;
  const int kv_head = blockIdx.y / chunks;
  const int first_head = kv_head * group_size + (blockIdx.y % chunks) * kHeads;
  const int heads_here = min(kHeads, (kv_head + 1) * group_size - first_head);
  const int split = blockIdx.z;
  const int key_group = threadIdx.x / kLanes;
  const int lane = threadIdx.x % kLanes;

  const int seq_len = p.seq_lens[seq];
  const int per_split = (seq_len + p.num_splits - 1) / p.num_splits;
  const int lo = split * per_split;
  const int hi = min(seq_len, lo + per_split);

  float q[kHeads][kVec];
  const T* q_row = static_cast<const T*>(p.q) + seq * p.q_stride_token + lane * kVec;
#pragma unroll
  for (int h = 0; h < kHeads; ++h) {
    if (h < heads_here) {
      unpack<T, kVec>(*reinterpret_cast<const uint4*>(q_row + (first_head + h) * p.q_stride_head), q[h]);
#pragma unroll
      for (int i = 0; i < kVec; ++i) q[h][i] *= p.scale * kLog2e;
    } else {
#pragma unroll
      for (int i = 0; i < kVec; ++i) q[h][i] = 0.f;
    }
  }

  float m[kHeads], l[kHeads], acc[kHeads][kVec];
#pragma unroll
  for (int h = 0; h < kHeads; ++h) {
    m[h] = -INFINITY;
    l[h] = 0.f;
#pragma unroll
    for (int i = 0; i < kVec; ++i) acc[h][i] = 0.f;
  }

  const int32_t* table = p.block_tables + static_cast<int64_t>(seq) * p.block_table_stride;
  const T* k_base = static_cast<const T*>(p.k_cache) + kv_head * p.k_stride_head + lane * kVec;
  const T* v_base = static_cast<const T*>(p.v_cache) + kv_head * p.v_stride_head + lane * kVec;

  // One batch of keys: kUnroll rows per key group, a 16-byte slice of each per lane (zeros past `hi`).
  auto load_rows = [&](const T* rows, int64_t stride_block, int64_t stride_slot, int first_key,
                       uint4 (&raw)[kUnroll]) {
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int key = first_key + u * kGroups + key_group;
      if (key < hi) {
        const int64_t block = table[key / p.block_size];
        raw[u] = *reinterpret_cast<const uint4*>(rows + block * stride_block + (key % p.block_size) * stride_slot);
      } else {
        raw[u] = make_uint4(0, 0, 0, 0);
      }
    }
  };
  uint4 k_raw[kUnroll], v_raw[kUnroll];
  load_rows(k_base, p.k_stride_block, p.k_stride_slot, lo, k_raw);
  load_rows(v_base, p.v_stride_block, p.v_stride_slot, lo, v_raw);

  // The trip count depends only on (lo, hi), the same for the whole block, so every lane reaches every shuffle.
  // Each batch's registers are refilled with the next batch's rows as soon as they are consumed: K after the
  // scores, V after the products, so the next loads are in flight while this batch's arithmetic runs.
  for (int base = lo; base < hi; base += kGroups * kUnroll) {
    const int next = base + kGroups * kUnroll;
    bool valid[kUnroll];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) valid[u] = base + u * kGroups + key_group < hi;

    float scores[kUnroll][kHeads];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      float k_vals[kVec];
      unpack<T, kVec>(k_raw[u], k_vals);
#pragma unroll
      for (int h = 0; h < kHeads; ++h) {
        float dot = 0.f;
#pragma unroll
        for (int i = 0; i < kVec; ++i) dot = fmaf(q[h][i], k_vals[i], dot);
#pragma unroll
        for (int offset = kLanes / 2; offset > 0; offset /= 2) dot += __shfl_xor_sync(0xffffffffu, dot, offset);
        scores[u][h] = valid[u] ? dot : -INFINITY;
      }
    }
    load_rows(k_base, p.k_stride_block, p.k_stride_slot, next, k_raw);

#pragma unroll
    for (int h = 0; h < kHeads; ++h) {
      float m_new = m[h];
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) m_new = fmaxf(m_new, scores[u][h]);
      if (m_new == -INFINITY) continue;  // no visible key for this group yet
      const float alpha = exp2f(m[h] - m_new);
      l[h] *= alpha;
#pragma unroll
      for (int i = 0; i < kVec; ++i) acc[h][i] *= alpha;
      m[h] = m_new;
    }

#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      float v_vals[kVec];
      unpack<T, kVec>(v_raw[u], v_vals);
#pragma unroll
      for (int h = 0; h < kHeads; ++h) {
        const float prob = scores[u][h] == -INFINITY ? 0.f : exp2f(scores[u][h] - m[h]);
        l[h] += prob;
#pragma unroll
        for (int i = 0; i < kVec; ++i) acc[h][i] = fmaf(prob, v_vals[i], acc[h][i]);
      }
    }
    load_rows(v_base, p.v_stride_block, p.v_stride_slot, next, v_raw);
  }

  __shared__ float shared_m[kGroups][kHeads];
  __shared__ float shared_l[kGroups][kHeads];
  __shared__ float shared_acc[kGroups][kHeads][kHeadDim];
#pragma unroll
  for (int h = 0; h < kHeads; ++h) {
    if (lane == 0) {
      shared_m[key_group][h] = m[h];
      shared_l[key_group][h] = l[h];
    }
#pragma unroll
    for (int i = 0; i < kVec; ++i) shared_acc[key_group][h][lane * kVec + i] = acc[h][i];
  }
  __syncthreads();

  for (int index = threadIdx.x; index < heads_here * kHeadDim; index += kThreads) {
    const int h = index / kHeadDim;
    const int dim = index % kHeadDim;
    float m_max = -INFINITY;
#pragma unroll
    for (int g = 0; g < kGroups; ++g) m_max = fmaxf(m_max, shared_m[g][h]);
    float denominator = 0.f, numerator = 0.f;
    if (m_max != -INFINITY) {
#pragma unroll
      for (int g = 0; g < kGroups; ++g) {
        const float weight = shared_m[g][h] == -INFINITY ? 0.f : exp2f(shared_m[g][h] - m_max);
        denominator = fmaf(weight, shared_l[g][h], denominator);
        numerator = fmaf(weight, shared_acc[g][h][dim], numerator);
      }
    }
    // A sequence with no keys in range (length 0, or an empty split) gets zeros and log-sum-exp -inf.
    const float value = denominator > 0.f ? numerator / denominator : 0.f;
    const int head = first_head + h;
    if (p.num_splits == 1) {
      static_cast<T*>(p.out)[seq * p.out_stride_token + head * p.out_stride_head + dim] =
          Convert<T>::from_float(value);
    } else {
      const int64_t row = (static_cast<int64_t>(split) * p.num_seqs + seq) * p.num_q_heads + head;
      p.partial_out[row * kHeadDim + dim] = value;
      if (dim == 0) p.partial_lse[row] = denominator > 0.f ? m_max + log2f(denominator) : -INFINITY;
    }
  }
}

// One block per (sequence, query head), one thread per output element: weights each split by its share of the
// total softmax mass.
template <typename T>
__global__ void merge_splits_kernel(const DecodeAttentionParams p) {
  const int seq = blockIdx.x;
  const int head = blockIdx.y;
  const int dim = threadIdx.x;
  const int64_t stride_split = static_cast<int64_t>(p.num_seqs) * p.num_q_heads;
  const int64_t row = static_cast<int64_t>(seq) * p.num_q_heads + head;
  float lse_max = -INFINITY;
  for (int s = 0; s < p.num_splits; ++s) lse_max = fmaxf(lse_max, p.partial_lse[s * stride_split + row]);
  float weight_sum = 0.f, value = 0.f;
  if (lse_max != -INFINITY) {
    for (int s = 0; s < p.num_splits; ++s) {
      const float lse = p.partial_lse[s * stride_split + row];
      const float weight = lse == -INFINITY ? 0.f : exp2f(lse - lse_max);
      weight_sum += weight;
      value = fmaf(weight, p.partial_out[(s * stride_split + row) * p.head_dim + dim], value);
    }
  }
  static_cast<T*>(p.out)[seq * p.out_stride_token + head * p.out_stride_head + dim] =
      Convert<T>::from_float(weight_sum > 0.f ? value / weight_sum : 0.f);
}

template <typename T, int kHeadDim, int kHeads>
cudaError_t launch_with(const DecodeAttentionParams& p, cudaStream_t stream) {
  const int group_size = p.num_q_heads / p.num_kv_heads;
  const int chunks = (group_size + kHeads - 1) / kHeads;
  const dim3 grid(p.num_seqs, p.num_kv_heads * chunks, p.num_splits);
  decode_attention_kernel<T, kHeadDim, kHeads><<<grid, kThreads, 0, stream>>>(p);
  cudaError_t status = cudaGetLastError();
  if (status != cudaSuccess || p.num_splits == 1) return status;
  merge_splits_kernel<T><<<dim3(p.num_seqs, p.num_q_heads), kHeadDim, 0, stream>>>(p);
  return cudaGetLastError();
}

template <typename T, int kHeadDim>
cudaError_t launch_for_group(const DecodeAttentionParams& p, cudaStream_t stream) {
  const int group_size = p.num_q_heads / p.num_kv_heads;
  if (group_size == 1) return launch_with<T, kHeadDim, 1>(p, stream);
  if (group_size == 2) return launch_with<T, kHeadDim, 2>(p, stream);
  if (group_size <= 4) return launch_with<T, kHeadDim, 4>(p, stream);
  return launch_with<T, kHeadDim, 8>(p, stream);  // larger groups take several blocks of 8 heads
}

template <typename T>
cudaError_t launch_typed(const DecodeAttentionParams& p, cudaStream_t stream) {
  if (p.head_dim == 64) return launch_for_group<T, 64>(p, stream);
  if (p.head_dim == 128) return launch_for_group<T, 128>(p, stream);
  return cudaErrorInvalidValue;
}

}  // namespace

cudaError_t launch_decode_attention(const DecodeAttentionParams& params, DType dtype, cudaStream_t stream) {
  if (params.num_seqs == 0) return cudaSuccess;
  if (params.num_kv_heads <= 0 || params.num_q_heads % params.num_kv_heads != 0 || params.num_splits < 1) {
    return cudaErrorInvalidValue;
  }
  switch (dtype) {
    case DType::kFloat32: return launch_typed<float>(params, stream);
    case DType::kFloat16: return launch_typed<__half>(params, stream);
    case DType::kBFloat16: return launch_typed<__nv_bfloat16>(params, stream);
  }
  return cudaErrorInvalidValue;
}

}  // namespace polyserve
