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
// register. float32 or bfloat16 (x, w and y of one dtype; bfloat16 panels are widened to
// float32 as they are loaded, x is widened once per call, and the accumulation is float32,
// rounded to bfloat16 once at the end as XLA's dot does).

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstring>
#include <memory>
#include <thread>
#include <type_traits>
#include <vector>

#include "simd.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

using namespace jaxrunner_simd;

constexpr int kPanelVecs = 2;                  // vectors per row of a panel
constexpr int kPanel = kPanelVecs * kLanes;    // columns per panel
constexpr int kMR = kVecRegs >= 32 ? 12 : 6;   // rows per register block
constexpr int64_t kKC = 256;                   // k per chunk of a panel (kPanel x 256 floats)
constexpr int64_t kMC = 32 * kMR;              // rows per work item

// C[R, kPanel] (row stride ldc) = (or +=) A[R, kc] (row stride lda) x panel[kc][kPanel].
template <int R, typename W>
JR_INLINE void block(const float* A, int64_t lda, const W* panel, int64_t kc, float* C,
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
template <int R = kMR, typename W>
JR_INLINE void any_block(int rows, const float* A, int64_t lda, const W* panel, int64_t kc,
                         float* C, int64_t ldc, bool accumulate) {
  if constexpr (R > 0) {
    if (rows == R) return block<R>(A, lda, panel, kc, C, ldc, accumulate);
    any_block<R - 1, W>(rows, A, lda, panel, kc, C, ldc, accumulate);
  }
}

// One register block of n rows x one panel's `cols` columns (through `edge` when N ends inside
// the panel).
template <typename W>
JR_INLINE void tile(int n, int64_t cols, const float* A, int64_t lda, const W* panel, int64_t kc,
                    float* C, int64_t ldc, bool acc, float* edge) {
  if (cols == kPanel) {
    if (n == kMR) block<kMR>(A, lda, panel, kc, C, ldc, acc);
    else any_block(n, A, lda, panel, kc, C, ldc, acc);
    return;
  }
  for (int i = 0; i < n; ++i)
    for (int j = 0; j < cols; ++j) edge[i * kPanel + j] = acc ? C[i * ldc + j] : 0.f;
  any_block(n, A, lda, panel, kc, edge, kPanel, acc);
  for (int i = 0; i < n; ++i)
    for (int j = 0; j < cols; ++j) C[i * ldc + j] = edge[i * kPanel + j];
}

template <typename T>
struct Problem {
  const float* x;  // [M, K] (bfloat16 x widened into x32)
  const T* w;      // the layer's [P, K, kPanel]
  T* y;            // [M, N]
  int64_t M, K, N, P;
  int64_t panels_per_item, runs, items;
  std::vector<float> x32;
};

// Rows [m0, m0 + rows) x panels [p0, p1) of y. A float32 y is accumulated in place; a bfloat16
// one in a per-thread float32 block, rounded into y at the end.
template <typename T>
void run_item(const Problem<T>& P, int64_t item) {
  constexpr bool kF32 = std::is_same_v<T, float>;
  const int64_t m0 = (item / P.runs) * kMC;
  const int64_t rows = std::min(kMC, P.M - m0);
  const int64_t p0 = (item % P.runs) * P.panels_per_item;
  const int64_t p1 = std::min(P.P, p0 + P.panels_per_item);
  const int64_t c0 = p0 * kPanel, width = std::min<int64_t>((p1 - p0) * kPanel, P.N - c0);
  thread_local std::vector<float> block32;
  if constexpr (!kF32) block32.resize(rows * width);
  float* out = kF32 ? reinterpret_cast<float*>(P.y) + m0 * P.N + c0 : block32.data();
  const int64_t ldo = kF32 ? P.N : width;
  alignas(64) float edge[kMR * kPanel];  // the last panel's block when N ends inside it
  // A bfloat16 chunk that several row blocks read is widened once, into L1.
  alignas(64) float wide[kF32 ? 1 : kKC * kPanel];
  for (int64_t p = p0; p < p1; ++p) {
    const int64_t n0 = p * kPanel;
    const int64_t cols = std::min<int64_t>(kPanel, P.N - n0);
    for (int64_t k0 = 0; k0 < P.K; k0 += kKC) {
      const int64_t kc = std::min(kKC, P.K - k0);
      const T* chunk = P.w + (p * P.K + k0) * kPanel;
      const bool widen = !kF32 && rows > kMR;
      if constexpr (!kF32)
        if (widen)
          for (int64_t i = 0; i < kc * kPanel; i += kLanes) store(wide + i, load(chunk + i));
      const bool acc = k0 > 0;
      for (int64_t r = 0; r < rows; r += kMR) {
        const int n = int(std::min<int64_t>(kMR, rows - r));
        const float* A = P.x + (m0 + r) * P.K + k0;
        float* C = out + r * ldo + (n0 - c0);
        if (widen) {
          tile(n, cols, A, P.K, static_cast<const float*>(wide), kc, C, ldo, acc, edge);
        } else {
          tile(n, cols, A, P.K, chunk, kc, C, ldo, acc, edge);
        }
      }
    }
  }
  if constexpr (!kF32)
    for (int64_t i = 0; i < rows; ++i)
      for (int64_t j = 0; j < width; ++j)
        P.y[(m0 + i) * P.N + c0 + j] = to_bf16(block32[i * width + j]);
}


struct Progress {
  std::atomic<int64_t> next{0};
  std::atomic<int64_t> done{0};
};

template <typename T>
void run_items(const Problem<T>& P, Progress& progress) {
  for (int64_t i; (i = progress.next.fetch_add(1)) < P.items;) {
    run_item(P, i);
    progress.done.fetch_add(1, std::memory_order_release);
  }
}

template <typename T>
ffi::Error run(ffi::ThreadPool pool, ffi::AnyBuffer x, ffi::AnyBuffer w, int64_t index,
               ffi::Result<ffi::AnyBuffer> y) {
  const auto xd = x.dimensions();
  const auto wd = w.dimensions();
  const auto yd = y->dimensions();
  auto P = std::make_shared<Problem<T>>();
  P->M = xd[0];
  P->K = xd[1];
  P->N = yd[1];
  P->P = wd[1];
  if (wd[3] != kPanel || wd[2] != P->K || yd[0] != P->M || P->P * kPanel < P->N ||
      (P->P - 1) * kPanel >= std::max<int64_t>(P->N, 1))
    return ffi::Error::InvalidArgument("packed_matmul: shapes do not match (w must be "
                                       "[L, ceil(N / panel), K, panel] for this build's panel)");
  if (index >= wd[0])
    return ffi::Error::InvalidArgument("packed_matmul: layer index out of range");
  P->w = reinterpret_cast<const T*>(w.untyped_data()) + index * P->P * P->K * kPanel;
  P->y = reinterpret_cast<T*>(y->untyped_data());
  if (P->M == 0 || P->N == 0) return ffi::Error::Success();
  if (P->K == 0) {
    std::memset(static_cast<void*>(P->y), 0, P->M * P->N * sizeof(T));
    return ffi::Error::Success();
  }
  if constexpr (std::is_same_v<T, float>) {
    P->x = reinterpret_cast<const float*>(x.untyped_data());
  } else {
    const T* x16 = reinterpret_cast<const T*>(x.untyped_data());
    P->x32.resize(P->M * P->K);
    for (int64_t i = 0; i < P->M * P->K; ++i) P->x32[i] = to_f32(x16[i]);
    P->x = P->x32.data();
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

ffi::Error packed_matmul(ffi::ThreadPool pool, ffi::AnyBuffer x, ffi::AnyBuffer w,
                         ffi::Buffer<ffi::S32> layer, ffi::Result<ffi::AnyBuffer> y) {
  if (x.dimensions().size() != 2 || w.dimensions().size() != 4 || y->dimensions().size() != 2)
    return ffi::Error::InvalidArgument("packed_matmul: x must be [M, K], w [L, P, K, panel], "
                                       "y [M, N]");
  if (x.element_type() != w.element_type() || y->element_type() != x.element_type())
    return ffi::Error::InvalidArgument("packed_matmul: x, w and y must share a dtype");
  if (layer.element_count() != 1)
    return ffi::Error::InvalidArgument("packed_matmul: layer must hold one index");
  const int64_t index = layer.typed_data()[0];
  if (index < 0) return ffi::Error::InvalidArgument("packed_matmul: layer index out of range");
  switch (x.element_type()) {
    case ffi::F32: return run<float>(pool, x, w, index, y);
    case ffi::BF16: return run<BF16>(pool, x, w, index, y);
    default: return ffi::Error::InvalidArgument("packed_matmul: dtype must be f32 or bf16");
  }
}

}  // namespace

// The panel width this build packs for (the Python side packs the weights to match).
extern "C" int JaxrunnerPackedMatmulPanel() { return kPanel; }

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxrunnerPackedMatmul, packed_matmul,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::AnyBuffer>()         // x [M, K]
                                  .Arg<ffi::AnyBuffer>()         // w [L, P, K, panel]
                                  .Arg<ffi::Buffer<ffi::S32>>()  // layer [1]
                                  .Ret<ffi::AnyBuffer>());       // y [M, N]
