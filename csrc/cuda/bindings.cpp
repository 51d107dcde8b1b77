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

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "CUDA C++ twin of the Triton KV-cache store (csrc/cuda)";
  m.def("store_kvcache", &store_kvcache, "Write k, v [T, Hkv, D] into the paged caches at slot_mapping (-1 skips)",
        py::arg("k"), py::arg("v"), py::arg("k_cache"), py::arg("v_cache"), py::arg("slot_mapping"));
}
