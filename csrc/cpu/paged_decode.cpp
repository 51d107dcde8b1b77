// kernels._cpu: paged decode attention (one query token per sequence) on the CPU, reading K and V in place from
// the paged cache. It replaces the CPU engine's "gather every context into a padded copy, then SDPA" decode path,
// whose gather alone cost as much as the attention itself.
//   * one task per (sequence, KV head), spread over threads with at::parallel_for; the query heads that share
//     the KV head are handled together, so each K/V row is read (and converted to fp32) once for all of them;
//   * keys go in tiles of kTile: the tile's rows are converted to fp32 first, then scored, then one online-softmax
//     rescale per head and tile, then P·V; fp32 throughout, the output rounded once to q's dtype;
//   * the cache is far larger than the CPU caches and a sequence's rows are scattered over its blocks, so the
//     next tile's rows are prefetched while the current one is computed;
//   * the arithmetic is on GCC/Clang vector types of kLanes floats (one 512-bit register, or two 256-bit or four
//     128-bit ones, whatever -march allows) rather than on plain loops left to the auto-vectoriser: gcc does
//     not keep a loop's running sums in registers across the keys (it spills them or vectorises across keys
//     with gathers), and a plain-loop dot product needs -ffast-math to vectorise. The sums' order is fixed by
//     the code, so results do not depend on the instruction set;
//   * only slots before a sequence's seq_len are ever read: the rest of the pool may hold anything (NaN).
#include <ATen/Parallel.h>
#include <ATen/record_function.h>
#include <torch/extension.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

namespace {

constexpr int64_t kTile = 16;  // keys scored before each rescale of the running output (measured: 8-16 best)
constexpr int kLanes = 16;
// Below this many multiply-adds a call runs on the calling thread: waking the pool costs more than it saves.
constexpr int64_t kMinParallelWork = 1 << 16;
constexpr int64_t kCacheLine = 64;

using Vec = float __attribute__((vector_size(kLanes * sizeof(float))));
using Vec8 = float __attribute__((vector_size(8 * sizeof(float))));
using Vec4 = float __attribute__((vector_size(4 * sizeof(float))));

inline Vec load(const float* p) {
  Vec v;
  std::memcpy(&v, p, sizeof v);  // unaligned
  return v;
}

inline void store(float* p, const Vec& v) { std::memcpy(p, &v, sizeof v); }

// Pairwise: halves, then quarters, then the last four (gcc emits this as shuffles and adds in registers).
static_assert(kLanes == 16, "sum_lanes folds exactly 16 lanes");
inline float sum_lanes(const Vec& v) {
  const Vec8 h = Vec8{v[0], v[1], v[2], v[3], v[4], v[5], v[6], v[7]} +
                 Vec8{v[8], v[9], v[10], v[11], v[12], v[13], v[14], v[15]};
  const Vec4 q = Vec4{h[0], h[1], h[2], h[3]} + Vec4{h[4], h[5], h[6], h[7]};
  return (q[0] + q[2]) + (q[1] + q[3]);
}

inline float dot(const float* __restrict a, const float* __restrict b, int64_t n) {
  Vec part = {};
  int64_t d = 0;
  for (; d + kLanes <= n; d += kLanes) part += load(a + d) * load(b + d);
  float sum = sum_lanes(part);
  for (; d < n; ++d) sum += a[d] * b[d];
  return sum;
}

// acc[d] += sum_i p[i] rows[i][d] for the outputs from d on, kVecs vectors at a time, held in registers across
// the tile: a sum kept in memory would chain every key's add to the previous key's store, and several
// independent vector sums hide the latency of each multiply-add. Returns the first output not done.
template <int kVecs>
inline int64_t accumulate_from(float* __restrict acc, const float* __restrict p, const float* const* rows,
                               int64_t n, int64_t d, int64_t head_dim) {
  for (; d + kVecs * kLanes <= head_dim; d += kVecs * kLanes) {
    Vec r[kVecs];
    for (int k = 0; k < kVecs; ++k) r[k] = load(acc + d + k * kLanes);
    for (int64_t i = 0; i < n; ++i) {
      const float* v = rows[i] + d;
      for (int k = 0; k < kVecs; ++k) r[k] += p[i] * load(v + k * kLanes);
    }
    for (int k = 0; k < kVecs; ++k) store(acc + d + k * kLanes, r[k]);
  }
  return d;
}

inline void accumulate(float* __restrict acc, const float* __restrict p, const float* const* rows, int64_t n,
                       int64_t head_dim) {
  int64_t d = accumulate_from<4>(acc, p, rows, n, 0, head_dim);
  d = accumulate_from<1>(acc, p, rows, n, d, head_dim);
  for (; d < head_dim; ++d) {
    float r = acc[d];
    for (int64_t i = 0; i < n; ++i) r += p[i] * rows[i][d];
    acc[d] = r;
  }
}

constexpr float kLog2e = 1.44269504088896341f;

// exp(x) for the x <= 0 of a softmax, in plain float arithmetic so that a loop of it vectorises (std::exp is a
// libm call per element). Cephes' expf: x = n ln2 + r with |r| <= ln2 / 2, a degree-6 polynomial for e^r, then
// 2^n from the exponent bits; about 1 ulp. Below -87 e^x is under 2^-125: clamped there, 2^n stays normal.
inline float exp_nonpositive(float x) {
  x = x < -87.f ? -87.f : x;
  const float n = (x * kLog2e + 12582912.f) - 12582912.f;  // round to nearest: 1.5 * 2^23 leaves no fraction bits
  const float r = (x - n * 0.693359375f) - n * -2.12194440e-4f;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  const float e = p * r * r + r + 1.f;
  const int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, sizeof scale);
  return e * scale;
}

// Points rows[i] at the fp32 values of the K or V row at element offset offsets[i]: in place for a float cache,
// else converted into tile (n rows of head_dim).
template <typename scalar_t>
inline void load_rows(const scalar_t* __restrict cache, const int64_t* offsets, int64_t n, int64_t head_dim,
                      float* __restrict tile, const float** rows) {
  for (int64_t i = 0; i < n; ++i) {
    if constexpr (std::is_same_v<scalar_t, float>) {
      rows[i] = cache + offsets[i];
    } else {
      const scalar_t* __restrict src = cache + offsets[i];
      float* __restrict dst = tile + i * head_dim;
      for (int64_t d = 0; d < head_dim; ++d) dst[d] = static_cast<float>(src[d]);
      rows[i] = dst;
    }
  }
}

template <typename scalar_t>
inline void prefetch_rows(const scalar_t* cache, const int64_t* offsets, int64_t n, int64_t row_bytes) {
  for (int64_t i = 0; i < n; ++i) {
    const char* row = reinterpret_cast<const char*>(cache + offsets[i]);
    for (int64_t byte = 0; byte < row_bytes; byte += kCacheLine) __builtin_prefetch(row + byte);
  }
}

struct Cache {
  const void* data;
  int64_t block_stride, slot_stride, head_stride;
};

// Element offsets of the K and V rows of up to kTile consecutive keys of one sequence and KV head.
struct TileRows {
  int64_t n;
  int64_t k[kTile], v[kTile];
};

template <typename scalar_t, typename index_t>
void decode(const torch::Tensor& q, const Cache& kc, const Cache& vc, const torch::Tensor& block_tables,
            const std::vector<int64_t>& lens, int64_t block_size, int64_t num_kv_heads, float scale,
            torch::Tensor& out, int64_t grain) {
  const int64_t num_seqs = q.size(0), num_q_heads = q.size(1), head_dim = q.size(2);
  const int64_t group = num_q_heads / num_kv_heads;
  const scalar_t* q_data = q.data_ptr<scalar_t>();
  scalar_t* out_data = out.data_ptr<scalar_t>();
  const index_t* tables = block_tables.data_ptr<index_t>();
  const int64_t q_seq = q.stride(0), q_head = q.stride(1), o_seq = out.stride(0), o_head = out.stride(1);
  const int64_t table_row = block_tables.stride(0), table_col = block_tables.stride(1);
  const auto* k_data = static_cast<const scalar_t*>(kc.data);
  const auto* v_data = static_cast<const scalar_t*>(vc.data);
  const int64_t row_bytes = head_dim * static_cast<int64_t>(sizeof(scalar_t));

  at::parallel_for(0, num_seqs * num_kv_heads, grain, [&](int64_t begin, int64_t end) {
    // one allocation per thread: the group's query rows, outputs, scores and softmax state, one fp32 tile
    std::vector<float> buffer(2 * group * head_dim + group * kTile + 2 * group + kTile * head_dim);
    float* qf = buffer.data();
    float* acc = qf + group * head_dim;
    float* scores = acc + group * head_dim;  // [group, kTile]
    float* run_max = scores + group * kTile;
    float* run_sum = run_max + group;
    float* tile = run_sum + group;  // [kTile, head_dim]: the tile's K, then its V
    TileRows tiles[2];  // the current tile's and the next one's
    const float* rows[kTile];

    for (int64_t task = begin; task < end; ++task) {
      const int64_t seq = task / num_kv_heads, kv_head = task % num_kv_heads;
      const int64_t len = lens[seq], first_head = kv_head * group;
      if (len == 0) {  // nothing to attend to (a padding sequence): zeros, not 0/0
        for (int64_t g = 0; g < group; ++g) {
          scalar_t* o = out_data + seq * o_seq + (first_head + g) * o_head;
          std::fill(o, o + head_dim, scalar_t(0.f));
        }
        continue;
      }
      for (int64_t g = 0; g < group; ++g) {
        const scalar_t* qs = q_data + seq * q_seq + (first_head + g) * q_head;
        for (int64_t d = 0; d < head_dim; ++d) qf[g * head_dim + d] = static_cast<float>(qs[d]);
      }
      std::fill(acc, acc + group * head_dim, 0.f);
      std::fill(run_max, run_max + group, -std::numeric_limits<float>::infinity());
      std::fill(run_sum, run_sum + group, 0.f);
      const index_t* table = tables + seq * table_row;

      auto locate = [&](int64_t t0, TileRows& rows_of) {
        rows_of.n = std::min(kTile, len - t0);
        for (int64_t i = 0, block = t0 / block_size, offset = t0 % block_size; i < rows_of.n; ++i) {
          const int64_t base = static_cast<int64_t>(table[block * table_col]);
          rows_of.k[i] = base * kc.block_stride + offset * kc.slot_stride + kv_head * kc.head_stride;
          rows_of.v[i] = base * vc.block_stride + offset * vc.slot_stride + kv_head * vc.head_stride;
          if (++offset == block_size) {
            offset = 0;
            ++block;
          }
        }
      };

      locate(0, tiles[0]);
      for (int64_t t0 = 0, cur = 0; t0 < len; t0 += kTile, cur ^= 1) {
        const TileRows& here = tiles[cur];
        const int64_t n = here.n;
        if (t0 + kTile < len) {
          TileRows& next = tiles[cur ^ 1];
          locate(t0 + kTile, next);
          prefetch_rows(k_data, next.k, next.n, row_bytes);
          prefetch_rows(v_data, next.v, next.n, row_bytes);
        }
        load_rows(k_data, here.k, n, head_dim, tile, rows);
        for (int64_t i = 0; i < n; ++i) {
          for (int64_t g = 0; g < group; ++g) {
            scores[g * kTile + i] = dot(qf + g * head_dim, rows[i], head_dim) * scale;
          }
        }
        for (int64_t g = 0; g < group; ++g) {
          float* s = scores + g * kTile;
          float tile_max = run_max[g];
          for (int64_t i = 0; i < n; ++i) tile_max = std::max(tile_max, s[i]);
          // exp(-inf) = 0 on the first tile: nothing accumulated yet to rescale
          const float alpha = std::exp(run_max[g] - tile_max);
          for (int64_t i = 0; i < n; ++i) s[i] = exp_nonpositive(s[i] - tile_max);
          float sum = 0.f;
          for (int64_t i = 0; i < n; ++i) sum += s[i];
          run_sum[g] = run_sum[g] * alpha + sum;
          run_max[g] = tile_max;
          if (alpha != 1.f) {
            float* a = acc + g * head_dim;
            for (int64_t d = 0; d < head_dim; ++d) a[d] *= alpha;
          }
        }
        load_rows(v_data, here.v, n, head_dim, tile, rows);
        for (int64_t g = 0; g < group; ++g) accumulate(acc + g * head_dim, scores + g * kTile, rows, n, head_dim);
      }
      for (int64_t g = 0; g < group; ++g) {
        const float inv = 1.f / run_sum[g];
        scalar_t* o = out_data + seq * o_seq + (first_head + g) * o_head;
        for (int64_t d = 0; d < head_dim; ++d) o[d] = static_cast<scalar_t>(acc[g * head_dim + d] * inv);
      }
    }
  });
}

void check_rows(const torch::Tensor& t, const char* name) {
  TORCH_CHECK(t.device().is_cpu(), name, " must be a CPU tensor");
  TORCH_CHECK(t.stride(-1) == 1, name, " needs a contiguous last dimension");
}

void decode_attention(torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache, torch::Tensor block_tables,
                      torch::Tensor seq_lens, double scale, torch::Tensor out) {
  RECORD_FUNCTION("polyserve::cpu_decode_attention", std::vector<c10::IValue>());
  TORCH_CHECK(q.dim() == 3, "q must be [seqs, q_heads, head_dim] (one query token per sequence)");
  TORCH_CHECK(k_cache.dim() == 4 && k_cache.sizes() == v_cache.sizes(),
              "k_cache and v_cache must both be [blocks, block_size, kv_heads, head_dim]");
  TORCH_CHECK(out.sizes() == q.sizes(), "out must have q's shape");
  const int64_t num_seqs = q.size(0), num_q_heads = q.size(1), head_dim = q.size(2);
  const int64_t num_blocks = k_cache.size(0), block_size = k_cache.size(1), num_kv_heads = k_cache.size(2);
  TORCH_CHECK(k_cache.size(3) == head_dim, "cache head_dim ", k_cache.size(3), " differs from q's ", head_dim);
  TORCH_CHECK(num_kv_heads > 0 && num_q_heads % num_kv_heads == 0, num_q_heads,
              " query heads are not a multiple of ", num_kv_heads, " KV heads");
  const auto dtype = q.scalar_type();
  TORCH_CHECK(dtype == torch::kFloat32 || dtype == torch::kBFloat16 || dtype == torch::kFloat16,
              "q must be float32, bfloat16 or float16, got ", dtype);
  TORCH_CHECK(k_cache.scalar_type() == dtype && v_cache.scalar_type() == dtype && out.scalar_type() == dtype,
              "q, the caches and out must share one dtype");
  check_rows(q, "q");
  check_rows(k_cache, "k_cache");
  check_rows(v_cache, "v_cache");
  check_rows(out, "out");
  TORCH_CHECK(block_tables.dim() == 2 && block_tables.size(0) == num_seqs && block_tables.device().is_cpu() &&
                  (block_tables.scalar_type() == torch::kInt32 || block_tables.scalar_type() == torch::kInt64),
              "block_tables must be a CPU int32/int64 [seqs, max_blocks] tensor");
  TORCH_CHECK(seq_lens.dim() == 1 && seq_lens.size(0) == num_seqs && seq_lens.device().is_cpu() &&
                  (seq_lens.scalar_type() == torch::kInt32 || seq_lens.scalar_type() == torch::kInt64),
              "seq_lens must be a CPU int32/int64 [seqs] tensor");

  const Cache kc{k_cache.data_ptr(), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2)};
  const Cache vc{v_cache.data_ptr(), v_cache.stride(0), v_cache.stride(1), v_cache.stride(2)};
  const float fscale = static_cast<float>(scale);
  auto run = [&](auto scalar_tag, auto index_tag) {
    using scalar_t = decltype(scalar_tag);
    using index_t = decltype(index_tag);
    // Checked here, on one thread, so that a bad table is an error rather than a read outside the pool.
    std::vector<int64_t> lens(num_seqs);
    const auto* table_data = block_tables.data_ptr<index_t>();
    const int64_t max_len = block_tables.size(1) * block_size;
    int64_t total_len = 0;
    for (int64_t s = 0; s < num_seqs; ++s) {
      lens[s] = seq_lens.scalar_type() == torch::kInt32 ? seq_lens.data_ptr<int32_t>()[s * seq_lens.stride(0)]
                                                       : seq_lens.data_ptr<int64_t>()[s * seq_lens.stride(0)];
      TORCH_CHECK(lens[s] >= 0 && lens[s] <= max_len, "seq_lens[", s, "] = ", lens[s], " outside [0, ", max_len,
                  "]");
      for (int64_t b = 0; b * block_size < lens[s]; ++b) {
        const int64_t block = table_data[s * block_tables.stride(0) + b * block_tables.stride(1)];
        TORCH_CHECK(block >= 0 && block < num_blocks, "block_tables[", s, "][", b, "] = ", block,
                    " outside the cache's ", num_blocks, " blocks");
      }
      total_len += lens[s];
    }
    // Tasks per thread such that each thread gets at least kMinParallelWork multiply-adds (all on one thread
    // when the whole call is smaller than that).
    const int64_t tasks = num_seqs * num_kv_heads;
    const int64_t work = 2 * total_len * num_q_heads * head_dim;
    const int64_t grain = std::max<int64_t>(1, kMinParallelWork * tasks / std::max<int64_t>(work, 1));
    decode<scalar_t, index_t>(q, kc, vc, block_tables, lens, block_size, num_kv_heads, fscale, out, grain);
  };
  auto with_index = [&](auto scalar_tag) {
    if (block_tables.scalar_type() == torch::kInt32) {
      run(scalar_tag, int32_t{});
    } else {
      run(scalar_tag, int64_t{});
    }
  };
  if (dtype == torch::kFloat32) {
    with_index(float{});
  } else if (dtype == torch::kBFloat16) {
    with_index(c10::BFloat16{});
  } else {
    with_index(c10::Half{});
  }
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "CPU paged decode attention over the KV cache in place (csrc/cpu)";
  // Without the GIL, as torch's own ops run: the async engine's server threads keep going meanwhile.
  m.def("decode_attention", &decode_attention,
        "Attention of one query token per sequence over its paged context, written into out", py::arg("q"),
        py::arg("k_cache"), py::arg("v_cache"), py::arg("block_tables"), py::arg("seq_lens"), py::arg("scale"),
        py::arg("out"), py::call_guard<py::gil_scoped_release>());
}
