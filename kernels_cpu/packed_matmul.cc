// y[M, N] = x[M, K] @ w[layer] for weights stored pre-packed: w is [L, P, K, kPanel], P column
// panels of kPanel columns each (zero columns past N), every panel's K rows one after another.
//
// XLA:CPU runs a scanned layer's matmul as a YNNPACK call on a copy of the layer's weights
// (it cannot pass a dynamic slice of the stacked parameter as a buffer), and YNNPACK packs that
// copy again into its own panels before it multiplies: at decode sizes every weight byte crosses
// memory three or four times, with strided reads. Packed once at load time, a panel is what the
// register block consumes, so this kernel reads each weight byte once per row block, in order
// (the hardware prefetcher streams it), straight from the stack (the layer is an operand).
//
// Work items are (a block of up to kMC rows) x (a run of consecutive panels), shared out over
// XLA's intra-op thread pool. Within an item, each panel is walked in kKC-row chunks (16 KB of
// weights, kept in L1) against every kMR-row register block of x's chunk (in L2). The register
// block is kMR rows x 2 native vectors: 12 accumulators, 2 weight vectors and a broadcast with
// AVX2's 16 vector registers, 24 of 32 with AVX-512; the k loop keeps every accumulator in a
// register. float32 only (x, w, y); the model runner packs only float32 weights.

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <memory>
#include <thread>

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

#if defined(__AVX512F__)
constexpr int kLanes = 16;
constexpr int kVecRegs = 32;
#elif defined(__AVX__)
constexpr int kLanes = 8;
constexpr int kVecRegs = 16;
#elif defined(__aarch64__)
constexpr int kLanes = 4;
constexpr int kVecRegs = 32;
#else
constexpr int kLanes = 4;
constexpr int kVecRegs = 16;
#endif
constexpr int kPanelVecs = 2;                  // vectors per row of a panel
constexpr int kPanel = kPanelVecs * kLanes;    // columns per panel
constexpr int kMR = kVecRegs >= 32 ? 12 : 6;   // rows per register block
constexpr int64_t kKC = 256;                   // k per chunk of a panel (kPanel x 256 floats)
constexpr int64_t kMC = 32 * kMR;              // rows per work item

#define JR_INLINE inline __attribute__((always_inline))

typedef float vf __attribute__((vector_size(kLanes * sizeof(float))));
typedef float vf_u __attribute__((vector_size(kLanes * sizeof(float)), aligned(4)));

JR_INLINE vf load(const float* p) { return *reinterpret_cast<const vf_u*>(p); }
JR_INLINE void store(float* p, vf v) { *reinterpret_cast<vf_u*>(p) = v; }
// x - 0 is x for every x (x + 0 is not, for x = -0), so the compiler folds it to a broadcast.
JR_INLINE vf splat(float x) { return x - vf{}; }

// C[R, kPanel] (row stride ldc) = (or +=) A[R, kc] (row stride lda) x panel[kc][kPanel].
template <int R>
JR_INLINE void block(const float* A, int64_t lda, const float* panel, int64_t kc, float* C,
                     int64_t ldc, bool accumulate) {
  vf c[R][kPanelVecs];
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < kPanelVecs; ++j) c[r][j] = vf{};
  for (int64_t k = 0; k < kc; ++k) {
    vf b[kPanelVecs];
    for (int j = 0; j < kPanelVecs; ++j) b[j] = load(panel + k * kPanel + j * kLanes);
    for (int r = 0; r < R; ++r) {
      const vf a = splat(A[r * lda + k]);
      for (int j = 0; j < kPanelVecs; ++j) c[r][j] += a * b[j];
    }
  }
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < kPanelVecs; ++j) {
      float* out = C + r * ldc + j * kLanes;
      store(out, accumulate ? load(out) + c[r][j] : c[r][j]);
    }
}

// The block of exactly `rows` rows (1 <= rows <= kMR).
template <int R = kMR>
JR_INLINE void any_block(int rows, const float* A, int64_t lda, const float* panel, int64_t kc,
                         float* C, int64_t ldc, bool accumulate) {
  if constexpr (R > 0) {
    if (rows == R) return block<R>(A, lda, panel, kc, C, ldc, accumulate);
    any_block<R - 1>(rows, A, lda, panel, kc, C, ldc, accumulate);
  }
}

struct Problem {
  const float* x;  // [M, K]
  const float* w;  // the layer's [P, K, kPanel]
  float* y;        // [M, N]
  int64_t M, K, N, P;
  int64_t panels_per_item, runs, items;
};

// Rows [m0, m0 + rows) x panels [p0, p1) of y.
void run_item(const Problem& P, int64_t item) {
  const int64_t m0 = (item / P.runs) * kMC;
  const int64_t rows = std::min(kMC, P.M - m0);
  const int64_t p0 = (item % P.runs) * P.panels_per_item;
  const int64_t p1 = std::min(P.P, p0 + P.panels_per_item);
  alignas(64) float edge[kMR * kPanel];  // the last panel's block when N ends inside it
  for (int64_t p = p0; p < p1; ++p) {
    const int64_t n0 = p * kPanel;
    const int64_t cols = std::min<int64_t>(kPanel, P.N - n0);
    for (int64_t k0 = 0; k0 < P.K; k0 += kKC) {
      const int64_t kc = std::min(kKC, P.K - k0);
      const float* panel = P.w + (p * P.K + k0) * kPanel;
      const bool acc = k0 > 0;
      for (int64_t r = 0; r < rows; r += kMR) {
        const int n = int(std::min<int64_t>(kMR, rows - r));
        const float* A = P.x + (m0 + r) * P.K + k0;
        float* C = P.y + (m0 + r) * P.N + n0;
        if (cols == kPanel) {
          if (n == kMR) block<kMR>(A, P.K, panel, kc, C, P.N, acc);
          else any_block(n, A, P.K, panel, kc, C, P.N, acc);
          continue;
        }
        for (int i = 0; i < n; ++i)
          for (int j = 0; j < cols; ++j) edge[i * kPanel + j] = acc ? C[i * P.N + j] : 0.f;
        any_block(n, A, P.K, panel, kc, edge, kPanel, acc);
        for (int i = 0; i < n; ++i)
          for (int j = 0; j < cols; ++j) C[i * P.N + j] = edge[i * kPanel + j];
      }
    }
  }
}

struct Progress {
  std::atomic<int64_t> next{0};
  std::atomic<int64_t> done{0};
};

void run_items(const Problem& P, Progress& progress) {
  for (int64_t i; (i = progress.next.fetch_add(1)) < P.items;) {
    run_item(P, i);
    progress.done.fetch_add(1, std::memory_order_release);
  }
}

ffi::Error packed_matmul(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::F32> w,
                         ffi::Buffer<ffi::S32> layer, ffi::Result<ffi::Buffer<ffi::F32>> y) {
  const auto xd = x.dimensions();
  const auto wd = w.dimensions();
  const auto yd = y->dimensions();
  if (xd.size() != 2 || wd.size() != 4 || yd.size() != 2)
    return ffi::Error::InvalidArgument("packed_matmul: x must be [M, K], w [L, P, K, panel], "
                                       "y [M, N]");
  auto P = std::make_shared<Problem>();
  P->M = xd[0];
  P->K = xd[1];
  P->N = yd[1];
  P->P = wd[1];
  if (wd[3] != kPanel || wd[2] != P->K || yd[0] != P->M || P->P * kPanel < P->N ||
      (P->P - 1) * kPanel >= std::max<int64_t>(P->N, 1))
    return ffi::Error::InvalidArgument("packed_matmul: shapes do not match (w must be "
                                       "[L, ceil(N / panel), K, panel] for this build's panel)");
  if (layer.element_count() != 1)
    return ffi::Error::InvalidArgument("packed_matmul: layer must hold one index");
  const int64_t index = layer.typed_data()[0];
  if (index < 0 || index >= wd[0])
    return ffi::Error::InvalidArgument("packed_matmul: layer index out of range");
  P->x = x.typed_data();
  P->w = w.typed_data() + index * P->P * P->K * kPanel;
  P->y = y->typed_data();
  if (P->M == 0 || P->N == 0) return ffi::Error::Success();
  if (P->K == 0) {
    std::fill(P->y, P->y + P->M * P->N, 0.f);
    return ffi::Error::Success();
  }
  // About four items per thread per row block, so the threads finish close together.
  const int64_t row_blocks = (P->M + kMC - 1) / kMC;
  const int64_t threads = pool.num_threads() + 1;
  const int64_t per_row_block = std::max<int64_t>(1, 4 * threads / row_blocks);
  P->panels_per_item = std::max<int64_t>(1, (P->P + per_row_block - 1) / per_row_block);
  P->runs = (P->P + P->panels_per_item - 1) / P->panels_per_item;
  P->items = row_blocks * P->runs;
  auto progress = std::make_shared<Progress>();
  const int64_t helpers = std::min<int64_t>(pool.num_threads(), P->items - 1);
  for (int64_t i = 0; i < helpers; ++i)
    pool.Schedule([P, progress] { run_items(*P, *progress); });
  run_items(*P, *progress);
  while (progress->done.load(std::memory_order_acquire) < P->items) std::this_thread::yield();
  return ffi::Error::Success();
}

}  // namespace

// The panel width this build packs for (the Python side packs the weights to match).
extern "C" int JaxrunnerPackedMatmulPanel() { return kPanel; }

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxrunnerPackedMatmul, packed_matmul,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()  // x [M, K]
                                  .Arg<ffi::Buffer<ffi::F32>>()  // w [L, P, K, panel]
                                  .Arg<ffi::Buffer<ffi::S32>>()  // layer [1]
                                  .Ret<ffi::Buffer<ffi::F32>>());  // y [M, N]
