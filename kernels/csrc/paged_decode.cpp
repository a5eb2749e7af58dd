// Paged decode attention on the CPU: each decode query reads its keys and values straight
// from the pool's blocks (no gather into a padded copy), one (sequence, KV head) per task,
// with an online softmax over whole blocks. float32 and bfloat16 pools; math in float32.
// A sliding window (window > 0) starts each query at its first visible key,
// len - window: the blocks before it are never read. Attention sinks (gpt-oss: one float32
// logit per query head; an empty tensor for none) add exp(sink) to each softmax's
// denominator and no value.
#include <torch/extension.h>

#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

static inline void load(const float* src, float* dst, int64_t n) {
  std::memcpy(dst, src, n * sizeof(float));
}

// bfloat16 is the top half of a float32: widen by a shift (vectorizes, unlike the
// conversion operator)
static inline void load(const at::BFloat16* src, float* dst, int64_t n) {
  const uint16_t* bits = reinterpret_cast<const uint16_t*>(src);
  uint32_t* out = reinterpret_cast<uint32_t*>(dst);
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) out[i] = static_cast<uint32_t>(bits[i]) << 16;
}

template <typename T>
static void decode(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                   const at::Tensor& blocks, const at::Tensor& lens, const at::Tensor& rows,
                   double scale, int64_t window, const at::Tensor& sinks, at::Tensor& out) {
  const int64_t heads = q.size(1), d = q.size(2);
  const int64_t bs = k.size(1), kvh = k.size(2), g = heads / kvh;
  const int64_t n_seqs = rows.size(0), width = blocks.size(1);
  const T* qp = q.data_ptr<T>();
  const T* kp = k.data_ptr<T>();
  const T* vp = v.data_ptr<T>();
  T* op = out.data_ptr<T>();
  const int64_t* bp = blocks.data_ptr<int64_t>();
  const int64_t* lp = lens.data_ptr<int64_t>();
  const int64_t* rp = rows.data_ptr<int64_t>();
  const float* sp = sinks.numel() > 0 ? sinks.data_ptr<float>() : nullptr;
  const int64_t token_stride = kvh * d, block_stride = bs * kvh * d, n_blocks = k.size(0);
  const float fscale = static_cast<float>(scale);
  const float neg_inf = -std::numeric_limits<float>::infinity();
  at::parallel_for(0, n_seqs * kvh, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> qf(g * d), acc(g * d), x(bs * d), s(g * bs), m(g), l(g);
    for (int64_t task = begin; task < end; ++task) {
      const int64_t n = task / kvh, h = task % kvh, len = lp[n];
      const int64_t q_off = (rp[n] * heads + h * g) * d;  // the group's first query head
      load(qp + q_off, qf.data(), g * d);
      for (int64_t i = 0; i < g * d; ++i) qf[i] *= fscale;
      std::fill(acc.begin(), acc.end(), 0.0f);
      std::fill(m.begin(), m.end(), neg_inf);
      std::fill(l.begin(), l.end(), 0.0f);
      const int64_t first = window > 0 ? std::max<int64_t>(0, len - window) : 0;
      for (int64_t start = first / bs * bs; start < len; start += bs) {
        const int64_t cnt = std::min(bs, len - start);
        const int64_t skip = std::max<int64_t>(0, first - start);  // keys before the window
        const int64_t block = bp[n * width + start / bs];
        TORCH_CHECK(block >= 0 && block < n_blocks, "a block id is out of the pool");
        const T* kb = kp + block * block_stride + h * d;
        const T* vb = vp + block * block_stride + h * d;
        for (int64_t j = skip; j < cnt; ++j) load(kb + j * token_stride, x.data() + j * d, d);
        for (int64_t gi = 0; gi < g; ++gi) {
          const float* qg = qf.data() + gi * d;
          float* sg = s.data() + gi * bs;
          float top = m[gi];
          for (int64_t j = skip; j < cnt; ++j) {
            const float* kj = x.data() + j * d;
            float dot = 0.0f;
#pragma omp simd reduction(+ : dot)
            for (int64_t e = 0; e < d; ++e) dot += qg[e] * kj[e];
            sg[j] = dot;
            top = std::max(top, dot);
          }
          const float corr = m[gi] == neg_inf ? 0.0f : std::exp(m[gi] - top);
          float sum = l[gi] * corr;
#pragma omp simd reduction(+ : sum)
          for (int64_t j = skip; j < cnt; ++j) {
            sg[j] = std::exp(sg[j] - top);
            sum += sg[j];
          }
          float* ag = acc.data() + gi * d;
#pragma omp simd
          for (int64_t e = 0; e < d; ++e) ag[e] *= corr;
          m[gi] = top;
          l[gi] = sum;
        }
        for (int64_t j = skip; j < cnt; ++j) load(vb + j * token_stride, x.data() + j * d, d);
        for (int64_t gi = 0; gi < g; ++gi) {
          const float* sg = s.data() + gi * bs;
          float* ag = acc.data() + gi * d;
          for (int64_t j = skip; j < cnt; ++j) {
            const float p = sg[j];
            const float* vj = x.data() + j * d;
#pragma omp simd
            for (int64_t e = 0; e < d; ++e) ag[e] += p * vj[e];
          }
        }
      }
      for (int64_t gi = 0; gi < g; ++gi) {
        float inv = l[gi] > 0.0f ? 1.0f / l[gi] : 0.0f;
        if (sp != nullptr) {  // l * e^m + e^sink, over a common max so that neither overflows
          const float sink = sp[h * g + gi], top = std::max(m[gi], sink);
          const float kept = m[gi] == neg_inf ? 0.0f : std::exp(m[gi] - top);
          inv = kept / (l[gi] * kept + std::exp(sink - top));
        }
        T* og = op + q_off + gi * d;
        const float* ag = acc.data() + gi * d;
        for (int64_t e = 0; e < d; ++e) og[e] = static_cast<T>(ag[e] * inv);
      }
    }
  });
}

// out[rows[n]] = attention of q[rows[n]] over the first lens[n] keys of blocks[n] (only the
// last `window` of them where window > 0), with each query head's sink where `sinks` is not
// empty.
void paged_decode(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                  const at::Tensor& blocks, const at::Tensor& lens, const at::Tensor& rows,
                  double scale, int64_t window, const at::Tensor& sinks, at::Tensor& out) {
  TORCH_CHECK(window >= 0, "window must be >= 0 (0: none)");
  TORCH_CHECK(sinks.numel() == 0 || (sinks.scalar_type() == at::kFloat && sinks.is_contiguous() &&
                                     sinks.numel() == q.size(1)),
              "sinks must be empty or float32, contiguous, one per query head");
  TORCH_CHECK(q.is_contiguous() && out.is_contiguous(), "q and out must be contiguous");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous(), "the pool must be contiguous");
  TORCH_CHECK(q.scalar_type() == k_cache.scalar_type(), "q and the pool differ in dtype");
  TORCH_CHECK(q.size(1) % k_cache.size(2) == 0, "query heads must be a multiple of KV heads");
  TORCH_CHECK(blocks.scalar_type() == at::kLong && lens.scalar_type() == at::kLong &&
                  rows.scalar_type() == at::kLong,
              "blocks, lens and rows must be int64");
  TORCH_CHECK(blocks.is_contiguous() && lens.is_contiguous() && rows.is_contiguous(),
              "blocks, lens and rows must be contiguous");
  const int64_t width = blocks.size(1) * k_cache.size(1);
  for (int64_t n = 0; n < rows.size(0); ++n) {  // cheap: what every task reads is in range
    const int64_t len = lens.data_ptr<int64_t>()[n], row = rows.data_ptr<int64_t>()[n];
    TORCH_CHECK(len >= 1 && len <= width, "a length exceeds its block table");
    TORCH_CHECK(row >= 0 && row < q.size(0), "a row is out of range");
  }
  if (q.scalar_type() == at::kFloat) {
    decode<float>(q, k_cache, v_cache, blocks, lens, rows, scale, window, sinks, out);
  } else if (q.scalar_type() == at::kBFloat16) {
    decode<at::BFloat16>(q, k_cache, v_cache, blocks, lens, rows, scale, window, sinks, out);
  } else {
    TORCH_CHECK(false, "paged_decode: float32 or bfloat16 only");
  }
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("paged_decode", &paged_decode, "paged decode attention over the CPU pool");
}
