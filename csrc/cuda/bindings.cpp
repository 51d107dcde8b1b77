// Thin torch layer over the raw-pointer launchers of kernels.h: checks shapes, dtypes, devices and alignment,
// allocates the outputs on the current stream's allocator (graph-safe), and launches on the current stream.
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/extension.h>

#include <cstdint>

#include "kernels.h"

namespace {

polyserve::DType dtype_of(const torch::Tensor& t, const char* name) {
  switch (t.scalar_type()) {
    case torch::kFloat32: return polyserve::DType::kFloat32;
    case torch::kFloat16: return polyserve::DType::kFloat16;
    case torch::kBFloat16: return polyserve::DType::kBFloat16;
    default: TORCH_CHECK(false, name, " must be float32, float16 or bfloat16, got ", t.scalar_type());
  }
}

// Every 16-byte vector access needs 16-byte aligned addresses: aligned base, strides in whole vectors.
void check_vectorizable(const torch::Tensor& t, const char* name) {
  const int64_t vec = 16 / static_cast<int64_t>(t.element_size());
  TORCH_CHECK(t.is_cuda(), name, " must be a CUDA tensor");
  TORCH_CHECK(t.stride(-1) == 1, name, " needs a contiguous last dimension");
  TORCH_CHECK(reinterpret_cast<uintptr_t>(t.data_ptr()) % 16 == 0, name, " must be 16-byte aligned");
  for (int64_t d = 0; d + 1 < t.dim(); ++d) {
    TORCH_CHECK(t.stride(d) % vec == 0, name, " stride ", d, " (", t.stride(d), ") is not a multiple of ", vec);
  }
  TORCH_CHECK(t.size(-1) % vec == 0, name, " last dimension ", t.size(-1), " is not a multiple of ", vec);
}

void check_launch(cudaError_t status, const char* what) {
  TORCH_CHECK(status == cudaSuccess, what, " launch failed: ", cudaGetErrorString(status));
}

void store_kvcache(torch::Tensor k, torch::Tensor v, torch::Tensor k_cache, torch::Tensor v_cache,
                   torch::Tensor slot_mapping) {
  TORCH_CHECK(k.dim() == 3 && k.sizes() == v.sizes(), "k and v must both be [tokens, kv_heads, head_dim]");
  TORCH_CHECK(k_cache.dim() == 4 && k_cache.sizes() == v_cache.sizes(),
              "k_cache and v_cache must both be [blocks, block_size, kv_heads, head_dim]");
  TORCH_CHECK(k.size(1) == k_cache.size(2) && k.size(2) == k_cache.size(3), "k rows do not match cache rows");
  TORCH_CHECK(k.scalar_type() == k_cache.scalar_type() && v.scalar_type() == v_cache.scalar_type() &&
                  k.scalar_type() == v.scalar_type(),
              "the CUDA store copies bytes: k, v and the caches must share one dtype");
  TORCH_CHECK(slot_mapping.dim() == 1 && slot_mapping.size(0) == k.size(0) && slot_mapping.is_contiguous() &&
                  (slot_mapping.scalar_type() == torch::kInt32 || slot_mapping.scalar_type() == torch::kInt64),
              "slot_mapping must be a contiguous int32/int64 [tokens] tensor");
  TORCH_CHECK(slot_mapping.is_cuda(), "slot_mapping must be a CUDA tensor");
  check_vectorizable(k, "k");
  check_vectorizable(v, "v");
  check_vectorizable(k_cache, "k_cache");
  check_vectorizable(v_cache, "v_cache");
  const c10::cuda::CUDAGuard guard(k.device());
  polyserve::StoreKVCacheParams p{};
  p.k = k.data_ptr();
  p.v = v.data_ptr();
  p.k_cache = k_cache.data_ptr();
  p.v_cache = v_cache.data_ptr();
  p.slot_mapping = slot_mapping.data_ptr();
  p.slots_are_int64 = slot_mapping.scalar_type() == torch::kInt64;
  p.num_tokens = k.size(0);
  p.num_kv_heads = k.size(1);
  p.head_dim = k.size(2);
  p.block_size = k_cache.size(1);
  p.k_stride_token = k.stride(0);
  p.k_stride_head = k.stride(1);
  p.v_stride_token = v.stride(0);
  p.v_stride_head = v.stride(1);
  p.k_cache_stride_block = k_cache.stride(0);
  p.k_cache_stride_slot = k_cache.stride(1);
  p.k_cache_stride_head = k_cache.stride(2);
  p.v_cache_stride_block = v_cache.stride(0);
  p.v_cache_stride_slot = v_cache.stride(1);
  p.v_cache_stride_head = v_cache.stride(2);
  check_launch(polyserve::launch_store_kvcache(p, dtype_of(k, "k"), c10::cuda::getCurrentCUDAStream()),
               "store_kvcache");
}

torch::Tensor decode_attention(torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache,
                               torch::Tensor block_tables, torch::Tensor seq_lens, double scale,
                               int64_t num_splits) {
  TORCH_CHECK(q.dim() == 3, "q must be [seqs, q_heads, head_dim] (one query token per sequence)");
  TORCH_CHECK(k_cache.dim() == 4 && k_cache.sizes() == v_cache.sizes(),
              "k_cache and v_cache must both be [blocks, block_size, kv_heads, head_dim]");
  const int64_t num_seqs = q.size(0), num_q_heads = q.size(1), head_dim = q.size(2);
  const int64_t num_kv_heads = k_cache.size(2);
  TORCH_CHECK(head_dim == 64 || head_dim == 128, "head_dim ", head_dim, " unsupported (64 or 128)");
  TORCH_CHECK(k_cache.size(3) == head_dim, "cache head_dim differs from q's");
  TORCH_CHECK(num_q_heads % num_kv_heads == 0, num_q_heads, " query heads are not a multiple of ", num_kv_heads,
              " KV heads");
  TORCH_CHECK(q.scalar_type() == k_cache.scalar_type() && q.scalar_type() == v_cache.scalar_type(),
              "q and the caches must share one dtype");
  TORCH_CHECK(block_tables.dim() == 2 && block_tables.size(0) == num_seqs &&
                  block_tables.scalar_type() == torch::kInt32 && block_tables.stride(1) == 1 &&
                  block_tables.is_cuda(),
              "block_tables must be a CUDA int32 [seqs, max_blocks] tensor with contiguous rows");
  TORCH_CHECK(seq_lens.dim() == 1 && seq_lens.size(0) == num_seqs && seq_lens.scalar_type() == torch::kInt32 &&
                  seq_lens.is_contiguous() && seq_lens.is_cuda(),
              "seq_lens must be a contiguous CUDA int32 [seqs] tensor");
  TORCH_CHECK(num_splits >= 1 && num_splits <= 65535, "num_splits must be in [1, 65535], got ", num_splits);
  check_vectorizable(q, "q");
  check_vectorizable(k_cache, "k_cache");
  check_vectorizable(v_cache, "v_cache");

  const c10::cuda::CUDAGuard guard(q.device());
  torch::Tensor out = torch::empty_like(q);
  torch::Tensor partial_out, partial_lse;
  const auto f32 = q.options().dtype(torch::kFloat32);
  if (num_splits > 1) {
    partial_out = torch::empty({num_splits, num_seqs, num_q_heads, head_dim}, f32);
    partial_lse = torch::empty({num_splits, num_seqs, num_q_heads}, f32);
  }
  polyserve::DecodeAttentionParams p{};
  p.q = q.data_ptr();
  p.k_cache = k_cache.data_ptr();
  p.v_cache = v_cache.data_ptr();
  p.block_tables = block_tables.data_ptr<int32_t>();
  p.seq_lens = seq_lens.data_ptr<int32_t>();
  p.out = out.data_ptr();
  p.partial_out = num_splits > 1 ? partial_out.data_ptr<float>() : nullptr;
  p.partial_lse = num_splits > 1 ? partial_lse.data_ptr<float>() : nullptr;
  p.num_seqs = static_cast<int>(num_seqs);
  p.num_q_heads = static_cast<int>(num_q_heads);
  p.num_kv_heads = static_cast<int>(num_kv_heads);
  p.head_dim = static_cast<int>(head_dim);
  p.block_size = static_cast<int>(k_cache.size(1));
  p.num_splits = static_cast<int>(num_splits);
  p.q_stride_token = q.stride(0);
  p.q_stride_head = q.stride(1);
  p.out_stride_token = out.stride(0);
  p.out_stride_head = out.stride(1);
  p.k_stride_block = k_cache.stride(0);
  p.k_stride_slot = k_cache.stride(1);
  p.k_stride_head = k_cache.stride(2);
  p.v_stride_block = v_cache.stride(0);
  p.v_stride_slot = v_cache.stride(1);
  p.v_stride_head = v_cache.stride(2);
  p.block_table_stride = block_tables.stride(0);
  p.scale = static_cast<float>(scale);
  check_launch(polyserve::launch_decode_attention(p, dtype_of(q, "q"), c10::cuda::getCurrentCUDAStream()),
               "decode_attention");
  return out;
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "CUDA C++ twins of the Triton KV-cache store and decode attention (csrc/cuda)";
  m.def("store_kvcache", &store_kvcache, "Write k, v [T, Hkv, D] into the paged caches at slot_mapping (-1 skips)",
        py::arg("k"), py::arg("v"), py::arg("k_cache"), py::arg("v_cache"), py::arg("slot_mapping"));
  m.def("decode_attention", &decode_attention,
        "Paged attention for one query token per sequence, split-KV over num_splits slices", py::arg("q"),
        py::arg("k_cache"), py::arg("v_cache"), py::arg("block_tables"), py::arg("seq_lens"), py::arg("scale"),
        py::arg("num_splits"));
}
