// Ragged paged attention for CPUs, as an XLA FFI custom call.
//
// Same contract as kernels_pallas.ragged_paged_attention (see its docstring): sequence s owns
// query tokens cu_q_lens[s]..cu_q_lens[s+1] and KV positions 0..kv_lens[s]-1 in the pages
// page_indices[s]; the cache is [num_pages, page_size, 2 * num_kv_heads, head_dim] with K in the
// even and V in the odd slots of axis 2.
//
// The work is split into items of (sequence, KV head, block of query tokens); an item holds the
// block's query rows for all heads of the group (rows = tokens x group), walks only the KV
// positions its rows can see (causal, or per-token kv_bound, and sliding-window bounds per
// block, so a prefill does
// about half the work of a full square) in tiles of kTile keys with an online softmax, and reads
// each K/V row of the cache once per item. Items run on XLA's intra-op thread pool.
//
// Inner loops use GCC/Clang vector extensions (16 floats; the compiler maps them to AVX-512,
// AVX2 or NEON): S = Q K^T is an outer product over a transposed K tile, O += P V an outer
// product over V rows, and exp is a vector polynomial. Accumulation is float32 whatever the
// cache dtype (float32 or bfloat16 with q and out of the same dtype; float8 e4m3fn or e5m2, scale
// 1, with q and out in float32: each 8-bit value becomes a float through a 256-entry table).

#include <algorithm>
#include <array>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <memory>
#include <thread>
#include <vector>

#include "simd.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

using namespace jaxrunner_simd;

constexpr int kTile = 64;                 // keys per tile
constexpr int kTileVecs = kTile / kLanes;
constexpr int kRowBlock = 4;              // query rows per register block
// Vectors of columns (keys for S, head dims for O) per register block: kRowBlock x kColVecs
// accumulators, kColVecs loaded operands and a broadcast stay within the register file.
constexpr int kColVecs = kVecRegs >= 32 ? 4 : 2;
static_assert(kTileVecs % kColVecs == 0, "a tile is whole column blocks");
constexpr int kTargetRows = 64;           // query rows (tokens x group) per work item
constexpr int kDirectRows = 8;            // at most this many rows read K/V in place
constexpr float kNegInf = -std::numeric_limits<float>::infinity();

JR_INLINE vf vmax(vf a, vf b) { return a > b ? a : b; }

inline float hmax(vf v) {
  float m = v[0];
  for (int i = 1; i < kLanes; ++i) m = std::max(m, v[i]);
  return m;
}

inline float hsum(vf v) {
  float s = 0.f;
  for (int i = 0; i < kLanes; ++i) s += v[i];
  return s;
}

// exp(x) for x <= 0 (logits minus their running max), relative error ~2e-7; -inf gives 0.
JR_INLINE vf vexp(vf x) {
  const vf lo = splat(-87.0f);
  vi underflow = x < lo;
  x = x < lo ? lo : x;
  const vf t = x * splat(1.44269504088896341f);  // x / ln 2
  // Round to nearest: adding and removing 1.5 * 2^23 leaves the integer part (|t| < 2^22).
  const vf n = (t + splat(12582912.0f)) - splat(12582912.0f);
  vf r = x - n * splat(0.693359375f);             // ln 2, split in two for accuracy
  r = r - n * splat(-2.12194440e-4f);
  vf p = splat(1.9875691500e-4f);
  p = p * r + splat(1.3981999507e-3f);
  p = p * r + splat(8.3334519073e-3f);
  p = p * r + splat(4.1665795894e-2f);
  p = p * r + splat(1.6666665459e-1f);
  p = p * r + splat(5.0000001201e-1f);
  p = p * r * r + r + splat(1.0f);
  const vi bits = (__builtin_convertvector(n, vi) + 127) << 23;
  vf scale;
  std::memcpy(&scale, &bits, sizeof(scale));
  p = p * scale;
  return underflow ? splat(0.0f) : p;
}

// ---- element types ------------------------------------------------------------------------

inline void from_f32(float x, float* out) { *out = x; }
inline void from_f32(float x, BF16* out) { *out = to_bf16(x); }

// 8-bit floats as stored in the cache (scale 1), decoded through a table of all 256 values.
struct F8E4M3 {  // float8_e4m3fn: no infinities, S.1111.111 is NaN, max 448
  uint8_t bits;
};
struct F8E5M2 {  // float8_e5m2: IEEE-like, exponent 31 is inf / NaN
  uint8_t bits;
};

std::array<float, 256> fp8_table(int exp_bits, int mant_bits, bool fn) {
  std::array<float, 256> table{};
  const int bias = (1 << (exp_bits - 1)) - 1, max_exp = (1 << exp_bits) - 1;
  for (int b = 0; b < 256; ++b) {
    const int sign = b >> 7, e = (b >> mant_bits) & max_exp, m = b & ((1 << mant_bits) - 1);
    float x;
    if (fn && e == max_exp && m == (1 << mant_bits) - 1)
      x = std::numeric_limits<float>::quiet_NaN();
    else if (!fn && e == max_exp)
      x = m ? std::numeric_limits<float>::quiet_NaN() : std::numeric_limits<float>::infinity();
    else if (e == 0)
      x = std::ldexp(float(m), 1 - bias - mant_bits);
    else
      x = std::ldexp(float(m + (1 << mant_bits)), e - bias - mant_bits);
    table[b] = sign ? -x : x;
  }
  return table;
}
const std::array<float, 256> kE4M3 = fp8_table(4, 3, /*fn=*/true);
const std::array<float, 256> kE5M2 = fp8_table(5, 2, /*fn=*/false);

using jaxrunner_simd::to_f32;  // beside the 8-bit overloads below, not hidden by them
inline float to_f32(F8E4M3 x) { return kE4M3[x.bits]; }
inline float to_f32(F8E5M2 x) { return kE5M2[x.bits]; }

// The dtype of q and out for a cache of T: T itself, float32 for an 8-bit cache.
template <typename T>
struct QueryType {
  using type = T;
};
template <>
struct QueryType<F8E4M3> {
  using type = float;
};
template <>
struct QueryType<F8E5M2> {
  using type = float;
};

// kLanes consecutive elements as floats.
JR_INLINE vf load_row(const float* p) { return load(p); }
JR_INLINE vf load_row(const BF16* p) { return load(p); }
template <typename F8>
JR_INLINE vf load_row(const F8* p) {
  vf f;
  for (int i = 0; i < kLanes; ++i) f[i] = to_f32(p[i]);
  return f;
}

// Lane c of the result is the sum of the lanes of p[c]: kLanes horizontal sums in
// log2(kLanes) levels of shuffle-and-add, halving the lanes per input at each level.
#if JR_LANES == 16
JR_INLINE vf sum_lanes(const vf p[kLanes]) {
  vf a[8], b[4], c[2];
  for (int i = 0; i < 8; ++i)
    a[i] = __builtin_shufflevector(p[2 * i], p[2 * i + 1], 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18,
                                   19, 20, 21, 22, 23) +
           __builtin_shufflevector(p[2 * i], p[2 * i + 1], 8, 9, 10, 11, 12, 13, 14, 15, 24, 25,
                                   26, 27, 28, 29, 30, 31);
  for (int i = 0; i < 4; ++i)
    b[i] = __builtin_shufflevector(a[2 * i], a[2 * i + 1], 0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18,
                                   19, 24, 25, 26, 27) +
           __builtin_shufflevector(a[2 * i], a[2 * i + 1], 4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22,
                                   23, 28, 29, 30, 31);
  for (int i = 0; i < 2; ++i)
    c[i] = __builtin_shufflevector(b[2 * i], b[2 * i + 1], 0, 1, 4, 5, 8, 9, 12, 13, 16, 17, 20,
                                   21, 24, 25, 28, 29) +
           __builtin_shufflevector(b[2 * i], b[2 * i + 1], 2, 3, 6, 7, 10, 11, 14, 15, 18, 19, 22,
                                   23, 26, 27, 30, 31);
  return __builtin_shufflevector(c[0], c[1], 0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26,
                                 28, 30) +
         __builtin_shufflevector(c[0], c[1], 1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27,
                                 29, 31);
}
#elif JR_LANES == 8
JR_INLINE vf sum_lanes(const vf p[kLanes]) {
  vf a[4], b[2];
  for (int i = 0; i < 4; ++i)
    a[i] = __builtin_shufflevector(p[2 * i], p[2 * i + 1], 0, 1, 2, 3, 8, 9, 10, 11) +
           __builtin_shufflevector(p[2 * i], p[2 * i + 1], 4, 5, 6, 7, 12, 13, 14, 15);
  for (int i = 0; i < 2; ++i)
    b[i] = __builtin_shufflevector(a[2 * i], a[2 * i + 1], 0, 1, 4, 5, 8, 9, 12, 13) +
           __builtin_shufflevector(a[2 * i], a[2 * i + 1], 2, 3, 6, 7, 10, 11, 14, 15);
  return __builtin_shufflevector(b[0], b[1], 0, 2, 4, 6, 8, 10, 12, 14) +
         __builtin_shufflevector(b[0], b[1], 1, 3, 5, 7, 9, 11, 13, 15);
}
#else
JR_INLINE vf sum_lanes(const vf p[kLanes]) {
  const vf a0 = __builtin_shufflevector(p[0], p[1], 0, 1, 4, 5) +
                __builtin_shufflevector(p[0], p[1], 2, 3, 6, 7);
  const vf a1 = __builtin_shufflevector(p[2], p[3], 0, 1, 4, 5) +
                __builtin_shufflevector(p[2], p[3], 2, 3, 6, 7);
  return __builtin_shufflevector(a0, a1, 0, 2, 4, 6) + __builtin_shufflevector(a0, a1, 1, 3, 5, 7);
}
#endif

// ---- problem ------------------------------------------------------------------------------

template <typename T>
struct Problem {
  using Q = typename QueryType<T>::type;
  const Q* q;            // [num_tokens, num_q_heads, head_dim]
  const T* kv;           // [num_pages, page_size, 2 * num_kv_heads, head_dim]
  const int32_t* kv_lens;
  const int32_t* pages;  // [max_num_seqs, pages_per_seq]
  const int32_t* cu_q_lens;
  Q* out;
  int64_t num_tokens, num_q_heads, num_kv_heads, head_dim, group;
  int64_t num_pages, page_size, pages_per_seq;
  float sm_scale, soft_cap;  // soft_cap 0: none
  int64_t window;            // 0: none
  const int32_t* bound;      // [num_tokens]: token t sees KV positions < bound[t]; null: causal
  // [num_tokens, tree_words]: a draft tree's mask (kernels_pallas/ragged_paged_attention/
  // tree_mask.py): bit j says whether token t sees its sequence's j-th new token; null: none.
  const int32_t* tree;
  int64_t tree_words;
  // [num_q_heads]: a logit per query head that joins its softmax's denominator and takes no
  // value (attention sinks); null: none.
  const float* sinks;
};

// The tree mask of token t for the kLanes keys from `rel` (key - its sequence's first new
// token): prefix keys (rel < 0) are kept, new ones where t's bit is set.
template <typename T>
inline vi tree_keep(const Problem<T>& P, int64_t t, int64_t rel) {
  const int32_t* words = P.tree + t * P.tree_words;
  vi out;
  for (int i = 0; i < kLanes; ++i) {
    const int64_t j = rel + i;
    const bool seen = j < 0 || (j < 32 * P.tree_words &&
                                ((uint32_t(words[j >> 5]) >> (j & 31)) & 1u));
    out[i] = seen ? -1 : 0;
  }
  return out;
}

struct Item {
  int32_t seq, kv_head, token_begin, token_end;
  int64_t cost;
  int32_t num_heads = 1;  // KV heads kv_head .. kv_head + num_heads - 1, one after another
};

// Per-thread scratch, grown on demand.
struct Scratch {
  std::vector<float> q, o, s, kt, v, m, l;
  void reserve(int64_t rows, int64_t head_dim, int64_t head_dim_padded) {
    q.resize(rows * head_dim);
    o.resize(rows * head_dim_padded);
    s.resize(rows * kTile);
    kt.resize(head_dim * kTile);
    v.resize(kTile * head_dim_padded);
    m.resize(rows);
    l.resize(rows);
  }
};

// S[r, :] = Q[r, :] . KT for NR rows, kColVecs vectors of keys at a time: the accumulators
// stay in registers, the K tile comes from L1.
template <int NR>
JR_INLINE void scores_block(const float* q, int64_t head_dim, const float* kt, float* s) {
  for (int j0 = 0; j0 < kTileVecs; j0 += kColVecs) {
    vf acc[NR][kColVecs] = {};
    for (int64_t d = 0; d < head_dim; ++d) {
      vf k[kColVecs];
      for (int j = 0; j < kColVecs; ++j) k[j] = load(kt + d * kTile + (j0 + j) * kLanes);
      for (int r = 0; r < NR; ++r) {
        const vf qb = splat(q[r * head_dim + d]);
        for (int j = 0; j < kColVecs; ++j) acc[r][j] += qb * k[j];
      }
    }
    for (int r = 0; r < NR; ++r)
      for (int j = 0; j < kColVecs; ++j) store(s + r * kTile + (j0 + j) * kLanes, acc[r][j]);
  }
}

// O[r, d0 : d0 + NV * kLanes] += P[r, :n] V[:n, same columns] for NR rows. `v_row(c)` gives
// key c's V row (a gathered tile or the cache in place) and `load_v` reads kLanes of it.
template <int NR, int NV, typename Row>
JR_INLINE void pv_block(const float* p, int n, Row v_row, int64_t dp, int64_t d0, float* o) {
  vf acc[NR][NV];
  for (int r = 0; r < NR; ++r)
    for (int j = 0; j < NV; ++j) acc[r][j] = load(o + r * dp + d0 + j * kLanes);
  for (int c = 0; c < n; ++c) {
    const auto* vr = v_row(c);
    vf vv[NV];
    for (int j = 0; j < NV; ++j) vv[j] = load_row(vr + d0 + j * kLanes);
    for (int r = 0; r < NR; ++r) {
      const vf pb = splat(p[r * kTile + c]);
      for (int j = 0; j < NV; ++j) acc[r][j] += pb * vv[j];
    }
  }
  for (int r = 0; r < NR; ++r)
    for (int j = 0; j < NV; ++j) store(o + r * dp + d0 + j * kLanes, acc[r][j]);
}

// O[r, :dp] += P[r, :n] V[:n, :dp] for NR rows (dp a multiple of kLanes).
template <int NR, typename Row>
JR_INLINE void pv_rows(const float* p, int n, Row v_row, int64_t dp, float* o) {
  int64_t d0 = 0;
  for (; d0 + kColVecs * kLanes <= dp; d0 += kColVecs * kLanes)
    pv_block<NR, kColVecs>(p, n, v_row, dp, d0, o);
  for (; d0 < dp; d0 += kLanes) pv_block<NR, 1>(p, n, v_row, dp, d0, o);
}

// Few rows (a decode token's group of heads): transposing a K tile would cost more than the dot
// products, so keys are read in place, kColVecs keys at a time (each Q load serves all of them),
// and each row's per-key partial sums are reduced kLanes keys at a time. Needs head_dim % kLanes
// == 0.
template <int NR, typename T>
JR_INLINE void scores_direct(const float* q, int64_t head_dim, const T* const* k_rows, int n,
                             float* s) {
  const int64_t dv = head_dim / kLanes;
  for (int c0 = 0; c0 < n; c0 += kLanes) {
    vf part[NR][kLanes];
    for (int c = 0; c < kLanes; c += kColVecs) {
      vf acc[NR][kColVecs] = {};
      const T* k[kColVecs];
      for (int j = 0; j < kColVecs; ++j)  // keys past n read a valid row; their sums are unused
        k[j] = k_rows[std::min(c0 + c + j, n - 1)];
      for (int64_t i = 0; i < dv; ++i) {
        vf kv[kColVecs];
        for (int j = 0; j < kColVecs; ++j) kv[j] = load_row(k[j] + i * kLanes);
        for (int r = 0; r < NR; ++r) {
          const vf qr = load(q + r * head_dim + i * kLanes);
          for (int j = 0; j < kColVecs; ++j) acc[r][j] += qr * kv[j];
        }
      }
      for (int r = 0; r < NR; ++r)
        for (int j = 0; j < kColVecs; ++j) part[r][c + j] = acc[r][j];
    }
    for (int r = 0; r < NR; ++r) store(s + r * kTile + c0, sum_lanes(part[r]));
  }
}

template <int NR, typename T>
JR_INLINE void direct_rows(const float* q, int64_t head_dim, const T* const* k_rows,
                           const T* const* v_rows, int n, float* s, float* o, bool scores) {
  if (scores)
    scores_direct<NR>(q, head_dim, k_rows, n, s);
  else
    pv_rows<NR>(s, n, [v_rows](int c) { return v_rows[c]; }, head_dim, o);
}

// Runs direct_rows over `rows` rows in blocks of kRowBlock (the remainder one size down).
template <typename T>
inline void direct_all(int64_t rows, const float* q, int64_t head_dim, const T* const* k_rows,
                       const T* const* v_rows, int n, float* s, float* o, bool scores) {
  int64_t r = 0;
  for (; r + 4 <= rows; r += 4)
    direct_rows<4>(q + r * head_dim, head_dim, k_rows, v_rows, n, s + r * kTile,
                   o + r * head_dim, scores);
  switch (rows - r) {
    case 3: direct_rows<3>(q + r * head_dim, head_dim, k_rows, v_rows, n, s + r * kTile,
                           o + r * head_dim, scores); break;
    case 2: direct_rows<2>(q + r * head_dim, head_dim, k_rows, v_rows, n, s + r * kTile,
                           o + r * head_dim, scores); break;
    case 1: direct_rows<1>(q + r * head_dim, head_dim, k_rows, v_rows, n, s + r * kTile,
                           o + r * head_dim, scores); break;
    default: break;
  }
}

// One KV head of an item. `prefetch_bytes`: how much of each K row's slot to prefetch (the
// head's K and V rows, or the whole slot for the heads that follow in the same item).
template <typename T>
void attend(const Problem<T>& P, const Item& it, Scratch& sc, int64_t prefetch_bytes) {
  const int64_t D = P.head_dim, G = P.group;
  const int64_t Dp = (D + kLanes - 1) / kLanes * kLanes;
  const int64_t q_begin = P.cu_q_lens[it.seq];
  const int64_t q_len = P.cu_q_lens[it.seq + 1] - q_begin;
  const int64_t kv_len = P.kv_lens[it.seq];
  const int64_t first_pos = kv_len - q_len;  // position of the sequence's first query token
  const int64_t rows = int64_t(it.token_end - it.token_begin) * G;
  sc.reserve(rows, D, Dp);
  float *q = sc.q.data(), *o = sc.o.data(), *s = sc.s.data();
  float *kt = sc.kt.data(), *v = sc.v.data(), *m = sc.m.data(), *l = sc.l.data();

  // Row r is token token_begin + r / G, query head kv_head * G + r % G.
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t t = it.token_begin + r / G, h = it.kv_head * G + r % G;
    const auto* src = P.q + (t * P.num_q_heads + h) * D;
    for (int64_t d = 0; d < D; ++d) q[r * D + d] = to_f32(src[d]) * P.sm_scale;
    // A sink is the softmax's state before any key: max = the sink, sum = exp(0) (-inf: none).
    m[r] = P.sinks ? P.sinks[h] : kNegInf;
    l[r] = m[r] == kNegInf ? 0.f : 1.f;
  }
  std::fill(o, o + rows * Dp, 0.f);

  const int64_t pos_lo = first_pos + (it.token_begin - q_begin);
  const int64_t kv_begin = P.window > 0 ? std::max<int64_t>(0, pos_lo - P.window + 1) : 0;
  // The KV end each row sees: its position + 1 (causal) or its bound.
  auto row_end = [&](int64_t t) {
    const int64_t end = P.bound ? int64_t(P.bound[t]) : first_pos + (t - q_begin) + 1;
    return std::min<int64_t>(kv_len, end);
  };
  int64_t kv_end = row_end(it.token_end - 1);
  if (P.bound)
    for (int64_t t = it.token_begin; t < it.token_end - 1; ++t)
      kv_end = std::max(kv_end, row_end(t));
  const int64_t stride_token = 2 * P.num_kv_heads * D;  // one slot of a page
  const int32_t* page_row = P.pages + int64_t(it.seq) * P.pages_per_seq;

  const bool direct = D % kLanes == 0 && rows <= kDirectRows;
  // K and V row pointers of the current and the next tile. The next tile's rows are prefetched
  // into L2 while this one is computed: rows come from scattered pages, and without the
  // prefetch each K load waits on memory (decode ran at a third of the bandwidth). A direct
  // (decode) item prefetches them a group of keys at a time between its score groups: issued
  // all at once, the prefetches fill the miss buffers and the core stalls on them (1.1x).
  const T* rows_buf[2][2][kTile];
  // The first K row of the sequence's page `i` (clamped, so padding reads a real page).
  auto page_base = [&](int64_t i) {
    int64_t page = page_row[std::min(i, P.pages_per_seq - 1)];
    page = std::min<int64_t>(std::max<int64_t>(page, 0), P.num_pages - 1);
    return P.kv + page * P.page_size * stride_token + 2 * it.kv_head * D;
  };
  auto prefetch_row = [prefetch_bytes](const T* row) {
    const char* line = reinterpret_cast<const char*>(row);
    for (int64_t b = 0; b < prefetch_bytes; b += 64) __builtin_prefetch(line + b, 0, 2);
  };
  auto locate = [&](int64_t c0, const T** k_rows, const T** v_rows) {
    const int n = int(std::min<int64_t>(kTile, kv_end - c0));
    // One division per tile: the slot walks its page and steps to the next one at the end.
    int64_t page = c0 / P.page_size, slot = c0 % P.page_size;
    const T* base = page_base(page);
    for (int c = 0; c < n; ++c) {
      k_rows[c] = base + slot * stride_token;
      v_rows[c] = k_rows[c] + D;
      if (!direct || c0 == kv_begin) prefetch_row(k_rows[c]);
      if (++slot == P.page_size) {
        slot = 0;
        base = page_base(++page);
      }
    }
  };
  if (kv_begin < kv_end) locate(kv_begin, rows_buf[0][0], rows_buf[0][1]);
  for (int64_t c0 = kv_begin, tile = 0; c0 < kv_end; c0 += kTile, ++tile) {
    const int n = int(std::min<int64_t>(kTile, kv_end - c0));
    const T* const* k_rows = rows_buf[tile & 1][0];
    const T* const* v_rows = rows_buf[tile & 1][1];
    if (c0 + kTile < kv_end)
      locate(c0 + kTile, rows_buf[(tile + 1) & 1][0], rows_buf[(tile + 1) & 1][1]);
    int64_t r = 0;
    if (direct) {
      // A next tile exists only after a full one, so this tile's groups cover all its keys.
      const int n_next = int(std::clamp<int64_t>(kv_end - c0 - kTile, 0, kTile));
      const T* const* next_rows = rows_buf[(tile + 1) & 1][0];
      for (int g = 0; g < n; g += kLanes) {
        for (int c = g; c < std::min(g + kLanes, n_next); ++c) prefetch_row(next_rows[c]);
        direct_all(rows, q, D, k_rows + g, v_rows + g, std::min(kLanes, n - g), s + g, o,
                   /*scores=*/true);
      }
    } else {
      // Gather the tile: K transposed to [D, kTile], V as [kTile, Dp]; unused keys are zero.
      for (int c = 0; c < n; ++c) {
        for (int64_t d = 0; d < D; ++d) kt[d * kTile + c] = to_f32(k_rows[c][d]);
        for (int64_t d = 0; d < D; ++d) v[c * Dp + d] = to_f32(v_rows[c][d]);
        for (int64_t d = D; d < Dp; ++d) v[c * Dp + d] = 0.f;
      }
      if (n < kTile)
        for (int64_t d = 0; d < D; ++d) std::fill(kt + d * kTile + n, kt + (d + 1) * kTile, 0.f);
      for (; r + kRowBlock <= rows; r += kRowBlock)
        scores_block<kRowBlock>(q + r * D, D, kt, s + r * kTile);
      for (; r < rows; ++r) scores_block<1>(q + r * D, D, kt, s + r * kTile);
    }

    // Online softmax per row; masked scores become -inf, so exp gives exactly 0.
    for (r = 0; r < rows; ++r) {
      float* sr = s + r * kTile;
      const int64_t pos = pos_lo + r / G;
      // Visible keys of this row within the tile: [lo, hi).
      const int64_t hi = std::min<int64_t>(n, row_end(it.token_begin + r / G) - c0);
      const int64_t lo = P.window > 0 ? std::max<int64_t>(0, pos - P.window + 1 - c0) : 0;
      if (hi <= lo) {
        std::fill(sr, sr + kTile, 0.f);  // nothing visible: contributes p = 0
        continue;
      }
      if (P.soft_cap > 0.f)
        for (int64_t c = lo; c < hi; ++c) sr[c] = P.soft_cap * std::tanh(sr[c] / P.soft_cap);
      vf mx = splat(kNegInf);
      for (int j = 0; j < kTileVecs; ++j) {
        vi idx;
        for (int i = 0; i < kLanes; ++i) idx[i] = j * kLanes + i;
        vi keep = (idx >= int32_t(lo)) & (idx < int32_t(hi));
        if (P.tree) keep &= tree_keep(P, it.token_begin + r / G, c0 + j * kLanes - first_pos);
        const vf x = keep ? load(sr + j * kLanes) : splat(kNegInf);
        store(sr + j * kLanes, x);
        mx = vmax(mx, x);
      }
      const float m_new = std::max(m[r], hmax(mx));
      if (m_new == kNegInf) {  // the tree hides every key so far: contributes p = 0
        std::fill(sr, sr + kTile, 0.f);
        continue;
      }
      const float correction = m[r] == kNegInf ? 0.f : std::exp(m[r] - m_new);
      vf sum = {};
      for (int j = 0; j < kTileVecs; ++j) {
        const vf p = vexp(load(sr + j * kLanes) - splat(m_new));
        store(sr + j * kLanes, p);
        sum += p;
      }
      l[r] = l[r] * correction + hsum(sum);
      m[r] = m_new;
      if (correction != 1.f)
        for (int64_t d = 0; d < Dp; d += kLanes) store(o + r * Dp + d, load(o + r * Dp + d) * splat(correction));
    }

    if (direct) {
      direct_all(rows, q, D, k_rows, v_rows, n, s, o, /*scores=*/false);
      continue;
    }
    auto v_row = [v, Dp](int c) { return v + c * Dp; };
    for (r = 0; r + kRowBlock <= rows; r += kRowBlock)
      pv_rows<kRowBlock>(s + r * kTile, n, v_row, Dp, o + r * Dp);
    for (; r < rows; ++r) pv_rows<1>(s + r * kTile, n, v_row, Dp, o + r * Dp);
  }

  for (int64_t r = 0; r < rows; ++r) {
    const int64_t t = it.token_begin + r / G, h = it.kv_head * G + r % G;
    auto* dst = P.out + (t * P.num_q_heads + h) * D;
    const float inv = l[r] > 0.f ? 1.f / l[r] : 0.f;
    for (int64_t d = 0; d < D; ++d) from_f32(o[r * Dp + d] * inv, dst + d);
  }
}

template <typename T>
std::vector<Item> make_items(const Problem<T>& P, int32_t num_seqs) {
  std::vector<Item> items;
  const int64_t block = std::max<int64_t>(1, kTargetRows / P.group);
  for (int32_t s = 0; s < num_seqs; ++s) {
    const int64_t begin = P.cu_q_lens[s], end = P.cu_q_lens[s + 1];
    const int64_t kv_len = P.kv_lens[s];
    for (int64_t t0 = begin; t0 < end; t0 += block) {
      const int64_t t1 = std::min(end, t0 + block);
      // Cost ~ rows x keys they can see (the block's last token sees the most).
      const int64_t keys = P.bound ? std::max<int64_t>(1, kv_len)
                                   : std::max<int64_t>(1, std::min(kv_len, kv_len - (end - t1)));
      const int64_t span = P.window > 0 ? std::min<int64_t>(keys, P.window + (t1 - t0)) : keys;
      if ((t1 - t0) * P.group <= kDirectRows) {
        // Few rows (decode): one item walks every KV head of the sequence in turn, so one
        // thread reads a page's slots whole and in order (1.2x at 64 x 512 keys, 2 heads).
        items.push_back({s, 0, int32_t(t0), int32_t(t1),
                         (t1 - t0) * span * P.num_kv_heads, int32_t(P.num_kv_heads)});
        continue;
      }
      for (int64_t h = 0; h < P.num_kv_heads; ++h)
        items.push_back({s, int32_t(h), int32_t(t0), int32_t(t1), (t1 - t0) * span});
    }
  }
  // Longest first, so the last items to start are short and the threads finish together; ties
  // in sequence order, so the threads walk neighbouring pages (5% faster decode than any order).
  std::sort(items.begin(), items.end(), [](const Item& a, const Item& b) {
    if (a.cost != b.cost) return a.cost > b.cost;
    if (a.seq != b.seq) return a.seq < b.seq;
    if (a.token_begin != b.token_begin) return a.token_begin < b.token_begin;
    return a.kv_head < b.kv_head;
  });
  return items;
}

struct Shared {
  std::atomic<int64_t> next{0};
  std::atomic<int64_t> done{0};
};

template <typename T>
void run_items(const Problem<T>& P, const std::vector<Item>& items, Shared& shared) {
  thread_local Scratch scratch;
  const int64_t n = int64_t(items.size());
  for (int64_t i; (i = shared.next.fetch_add(1)) < n;) {
    const Item& it = items[i];
    const int64_t rows_bytes = 2 * P.head_dim * sizeof(T);  // a head's K and V rows
    // The item's first head prefetches every head's rows of each slot it visits.
    for (int32_t h = 0; h < it.num_heads; ++h) {
      Item head = it;
      head.kv_head = it.kv_head + h;
      head.num_heads = 1;
      attend(P, head, scratch, h == 0 ? rows_bytes * it.num_heads : rows_bytes);
    }
    shared.done.fetch_add(1, std::memory_order_release);
  }
}

template <typename T>
ffi::Error run(ffi::ThreadPool pool, ffi::AnyBuffer q, ffi::AnyBuffer kv,
               ffi::Buffer<ffi::S32> kv_lens, ffi::Buffer<ffi::S32> page_indices,
               ffi::Buffer<ffi::S32> cu_q_lens, ffi::Buffer<ffi::S32> num_seqs,
               const int32_t* bound, const int32_t* tree, int64_t tree_words,
               const float* sinks, ffi::Result<ffi::AnyBuffer> out, float sm_scale,
               float soft_cap, int64_t sliding_window) {
  const auto q_dims = q.dimensions();
  const auto kv_dims = kv.dimensions();
  if (q_dims.size() != 3 || kv_dims.size() != 4 || page_indices.dimensions().size() != 2)
    return ffi::Error::InvalidArgument("ragged_paged_attention: bad ranks");
  auto P = std::make_shared<Problem<T>>();
  using Q = typename Problem<T>::Q;
  P->q = reinterpret_cast<const Q*>(q.untyped_data());
  P->kv = reinterpret_cast<const T*>(kv.untyped_data());
  P->kv_lens = kv_lens.typed_data();
  P->pages = page_indices.typed_data();
  P->cu_q_lens = cu_q_lens.typed_data();
  P->out = reinterpret_cast<Q*>(out->untyped_data());
  P->num_tokens = q_dims[0];
  P->num_q_heads = q_dims[1];
  P->head_dim = q_dims[2];
  P->num_pages = kv_dims[0];
  P->page_size = kv_dims[1];
  P->num_kv_heads = kv_dims[2] / 2;
  P->group = P->num_q_heads / P->num_kv_heads;
  P->pages_per_seq = page_indices.dimensions()[1];
  P->sm_scale = sm_scale;
  P->soft_cap = soft_cap;
  P->window = sliding_window;
  P->bound = bound;
  P->tree = tree;
  P->tree_words = tree_words;
  P->sinks = sinks;

  const int64_t max_num_seqs = kv_lens.element_count();
  const int32_t seqs = std::clamp<int32_t>(num_seqs.typed_data()[0], 0, int32_t(max_num_seqs));
  // Tokens past the last real sequence are padding: their rows are zero.
  const int64_t real_tokens = std::clamp<int64_t>(P->cu_q_lens[seqs], 0, P->num_tokens);
  const int64_t row = P->num_q_heads * P->head_dim;
  std::memset(static_cast<void*>(P->out + real_tokens * row), 0,
              (P->num_tokens - real_tokens) * row * sizeof(Q));

  auto items = std::make_shared<std::vector<Item>>(make_items(*P, seqs));
  auto shared = std::make_shared<Shared>();
  const int64_t helpers =
      std::min<int64_t>(pool.num_threads(), int64_t(items->size()) - 1);
  for (int64_t i = 0; i < helpers; ++i)
    // Shared pointers keep the problem alive for a helper that starts after we return.
    pool.Schedule([P, items, shared] { run_items(*P, *items, *shared); });
  run_items(*P, *items, *shared);
  // The items we did not run are in flight on helpers; they finish without blocking.
  const int64_t total = int64_t(items->size());
  while (shared->done.load(std::memory_order_acquire) < total) std::this_thread::yield();
  return ffi::Error::Success();
}

ffi::Error dispatch(ffi::ThreadPool pool, ffi::AnyBuffer q, ffi::AnyBuffer kv,
                    ffi::Buffer<ffi::S32> kv_lens, ffi::Buffer<ffi::S32> page_indices,
                    ffi::Buffer<ffi::S32> cu_q_lens, ffi::Buffer<ffi::S32> num_seqs,
                    const int32_t* bound, const int32_t* tree, int64_t tree_words,
                    const float* sinks, ffi::Result<ffi::AnyBuffer> out, float sm_scale,
                    float soft_cap, int64_t sliding_window) {
  if (out->element_type() != q.element_type())
    return ffi::Error::InvalidArgument("ragged_paged_attention: q and out dtypes differ");
  const bool fp8 = kv.element_type() == ffi::F8E4M3FN || kv.element_type() == ffi::F8E5M2;
  if (fp8 && q.element_type() != ffi::F32)
    return ffi::Error::InvalidArgument("ragged_paged_attention: an fp8 cache needs f32 q");
  if (!fp8 && q.element_type() != kv.element_type())
    return ffi::Error::InvalidArgument("ragged_paged_attention: q and kv_cache dtypes differ");
  // The kernel for the cache's element type (a value of it names the type).
  auto with = [&](auto element) {
    return run<decltype(element)>(pool, q, kv, kv_lens, page_indices, cu_q_lens, num_seqs, bound,
                                  tree, tree_words, sinks, out, sm_scale, soft_cap,
                                  sliding_window);
  };
  switch (kv.element_type()) {
    case ffi::F8E4M3FN: return with(F8E4M3{});
    case ffi::F8E5M2: return with(F8E5M2{});
    case ffi::F32: return with(float{});
    case ffi::BF16: return with(BF16{});
    default:
      return ffi::Error::InvalidArgument(
          "ragged_paged_attention: kv_cache dtype must be f32, bf16, f8e4m3fn or f8e5m2");
  }
}

ffi::Error ragged_paged_attention(ffi::ThreadPool pool, ffi::AnyBuffer q, ffi::AnyBuffer kv,
                                  ffi::Buffer<ffi::S32> kv_lens,
                                  ffi::Buffer<ffi::S32> page_indices,
                                  ffi::Buffer<ffi::S32> cu_q_lens, ffi::Buffer<ffi::S32> num_seqs,
                                  ffi::Result<ffi::AnyBuffer> out, float sm_scale,
                                  float soft_cap, int64_t sliding_window) {
  return dispatch(pool, q, kv, kv_lens, page_indices, cu_q_lens, num_seqs, nullptr, nullptr, 0,
                  nullptr, out, sm_scale, soft_cap, sliding_window);
}

// The same with a per-token KV bound (block-diffusion and other non-causal extends).
ffi::Error ragged_paged_attention_bounded(
    ffi::ThreadPool pool, ffi::AnyBuffer q, ffi::AnyBuffer kv, ffi::Buffer<ffi::S32> kv_lens,
    ffi::Buffer<ffi::S32> page_indices, ffi::Buffer<ffi::S32> cu_q_lens,
    ffi::Buffer<ffi::S32> num_seqs, ffi::Buffer<ffi::S32> kv_bound,
    ffi::Result<ffi::AnyBuffer> out, float sm_scale, float soft_cap, int64_t sliding_window) {
  if (kv_bound.element_count() != q.dimensions()[0])
    return ffi::Error::InvalidArgument("ragged_paged_attention: kv_bound must be [num_tokens]");
  return dispatch(pool, q, kv, kv_lens, page_indices, cu_q_lens, num_seqs,
                  kv_bound.typed_data(), nullptr, 0, nullptr, out, sm_scale, soft_cap,
                  sliding_window);
}

// The same with a bound and a draft tree's mask (speculative verify steps).
ffi::Error ragged_paged_attention_tree(
    ffi::ThreadPool pool, ffi::AnyBuffer q, ffi::AnyBuffer kv, ffi::Buffer<ffi::S32> kv_lens,
    ffi::Buffer<ffi::S32> page_indices, ffi::Buffer<ffi::S32> cu_q_lens,
    ffi::Buffer<ffi::S32> num_seqs, ffi::Buffer<ffi::S32> kv_bound,
    ffi::Buffer<ffi::S32> tree_mask, ffi::Result<ffi::AnyBuffer> out, float sm_scale,
    float soft_cap, int64_t sliding_window) {
  const int64_t num_tokens = q.dimensions()[0];
  if (kv_bound.element_count() != num_tokens)
    return ffi::Error::InvalidArgument("ragged_paged_attention: kv_bound must be [num_tokens]");
  const auto dims = tree_mask.dimensions();
  if (dims.size() != 2 || dims[0] != num_tokens || dims[1] < 1)
    return ffi::Error::InvalidArgument(
        "ragged_paged_attention: kv_tree_mask must be [num_tokens, words]");
  return dispatch(pool, q, kv, kv_lens, page_indices, cu_q_lens, num_seqs,
                  kv_bound.typed_data(), tree_mask.typed_data(), dims[1], nullptr, out,
                  sm_scale, soft_cap, sliding_window);
}

// The same with a bound, a tree mask of zero or more words (zero: no tree) and a sink logit per
// query head (GPT-OSS). Its own binding, so calls without sinks keep their executables.
ffi::Error ragged_paged_attention_sinks(
    ffi::ThreadPool pool, ffi::AnyBuffer q, ffi::AnyBuffer kv, ffi::Buffer<ffi::S32> kv_lens,
    ffi::Buffer<ffi::S32> page_indices, ffi::Buffer<ffi::S32> cu_q_lens,
    ffi::Buffer<ffi::S32> num_seqs, ffi::Buffer<ffi::S32> kv_bound,
    ffi::Buffer<ffi::S32> tree_mask, ffi::Buffer<ffi::F32> sinks,
    ffi::Result<ffi::AnyBuffer> out, float sm_scale, float soft_cap, int64_t sliding_window) {
  const int64_t num_tokens = q.dimensions()[0];
  if (kv_bound.element_count() != num_tokens)
    return ffi::Error::InvalidArgument("ragged_paged_attention: kv_bound must be [num_tokens]");
  const auto dims = tree_mask.dimensions();
  if (dims.size() != 2 || dims[0] != num_tokens)
    return ffi::Error::InvalidArgument(
        "ragged_paged_attention: kv_tree_mask must be [num_tokens, words]");
  if (sinks.element_count() != q.dimensions()[1])
    return ffi::Error::InvalidArgument("ragged_paged_attention: sinks must be [num_q_heads]");
  const int32_t* tree = dims[1] > 0 ? tree_mask.typed_data() : nullptr;
  return dispatch(pool, q, kv, kv_lens, page_indices, cu_q_lens, num_seqs,
                  kv_bound.typed_data(), tree, dims[1], sinks.typed_data(), out, sm_scale,
                  soft_cap, sliding_window);
}

}  // namespace

// The four bindings differ in kv_bound, kv_tree_mask and sinks only (XLA_FFI_DEFINE_HANDLER_SYMBOL
// wants the binding spelled out).
XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxrunnerRaggedPagedAttention, ragged_paged_attention,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::AnyBuffer>()         // q
                                  .Arg<ffi::AnyBuffer>()         // kv_cache
                                  .Arg<ffi::Buffer<ffi::S32>>()  // kv_lens
                                  .Arg<ffi::Buffer<ffi::S32>>()  // page_indices
                                  .Arg<ffi::Buffer<ffi::S32>>()  // cu_q_lens
                                  .Arg<ffi::Buffer<ffi::S32>>()  // num_seqs
                                  .Ret<ffi::AnyBuffer>()         // out
                                  .Attr<float>("sm_scale")
                                  .Attr<float>("soft_cap")
                                  .Attr<int64_t>("sliding_window"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxrunnerRaggedPagedAttentionBounded,
                              ragged_paged_attention_bounded,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::AnyBuffer>()         // q
                                  .Arg<ffi::AnyBuffer>()         // kv_cache
                                  .Arg<ffi::Buffer<ffi::S32>>()  // kv_lens
                                  .Arg<ffi::Buffer<ffi::S32>>()  // page_indices
                                  .Arg<ffi::Buffer<ffi::S32>>()  // cu_q_lens
                                  .Arg<ffi::Buffer<ffi::S32>>()  // num_seqs
                                  .Arg<ffi::Buffer<ffi::S32>>()  // kv_bound
                                  .Ret<ffi::AnyBuffer>()         // out
                                  .Attr<float>("sm_scale")
                                  .Attr<float>("soft_cap")
                                  .Attr<int64_t>("sliding_window"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxrunnerRaggedPagedAttentionTree, ragged_paged_attention_tree,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::AnyBuffer>()         // q
                                  .Arg<ffi::AnyBuffer>()         // kv_cache
                                  .Arg<ffi::Buffer<ffi::S32>>()  // kv_lens
                                  .Arg<ffi::Buffer<ffi::S32>>()  // page_indices
                                  .Arg<ffi::Buffer<ffi::S32>>()  // cu_q_lens
                                  .Arg<ffi::Buffer<ffi::S32>>()  // num_seqs
                                  .Arg<ffi::Buffer<ffi::S32>>()  // kv_bound
                                  .Arg<ffi::Buffer<ffi::S32>>()  // kv_tree_mask
                                  .Ret<ffi::AnyBuffer>()         // out
                                  .Attr<float>("sm_scale")
                                  .Attr<float>("soft_cap")
                                  .Attr<int64_t>("sliding_window"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxrunnerRaggedPagedAttentionSinks, ragged_paged_attention_sinks,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::AnyBuffer>()         // q
                                  .Arg<ffi::AnyBuffer>()         // kv_cache
                                  .Arg<ffi::Buffer<ffi::S32>>()  // kv_lens
                                  .Arg<ffi::Buffer<ffi::S32>>()  // page_indices
                                  .Arg<ffi::Buffer<ffi::S32>>()  // cu_q_lens
                                  .Arg<ffi::Buffer<ffi::S32>>()  // num_seqs
                                  .Arg<ffi::Buffer<ffi::S32>>()  // kv_bound
                                  .Arg<ffi::Buffer<ffi::S32>>()  // kv_tree_mask (0 words: none)
                                  .Arg<ffi::Buffer<ffi::F32>>()  // sinks
                                  .Ret<ffi::AnyBuffer>()         // out
                                  .Attr<float>("sm_scale")
                                  .Attr<float>("soft_cap")
                                  .Attr<int64_t>("sliding_window"));
