// The attention of decode and verify steps as XLA:CPU custom calls (`jax_backend.paged_attention`).
//
// XLA:CPU has no fused paged-attention kernel: its gathers copy each page chunk into the dots'
// layout first, so a decode step reads every K/V byte about three times (docs/performance.md
// section 27), and at 8-16 queries per sequence the small ops around the dots (query layout, the
// new tokens' block, the merge) cost more than the attention itself (section 29). Two handlers:
//
// sgl_dflash_ragged_attention: `prefix_block_attention` whole. Inputs q [T, Hq, D] (packed rows),
// new_k / new_v [T, Hkv, D] (this step's keys and values, not yet in the pool), pool
// [N, page, 2*Hkv, D] (K on even, V on odd heads), page_indices [S, W], cu_q_lens [S + 1],
// kv_lens [S] (prefix + new tokens), num_seqs [1]; output [T, Hq, D], normalized, zeros in
// padding rows. Head size 64 or 128.
//
// sgl_dflash_paged_prefix_attention: the cached prefix alone, as the online-softmax state
// m, l [S, Hkv, G, Q] and acc [S, Hkv, G, Q, D] of `_attend_pages`. Inputs q [S, Q, Hkv, G, D],
// pool, page_indices, limit [S, Q] (query j of sequence s sees cache positions < limit[s, j]),
// num_seqs [1]; sequences at or past num_seqs, and rows that see nothing, get the empty state.
//
// Both read each cached K and V row once, where it lies in the pool, and score a block of keys
// at a time with an online softmax. For head sizes 64 and 128 the scores and the value sums run
// as register tiles (`TiledRows`): the G * Q query rows of a (sequence, kv head) share each key
// and value load. Work units are (sequence, kv head[, chunk of query rows]) (`parallel_units`).

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <utility>
#include <vector>

#include "common.h"

namespace ffi = xla::ffi;

namespace {

constexpr int64_t kKeyBlock = 128;  // keys scored at a time (bounded scratch, online softmax)

struct Problem {
  const float* q;
  const float* pool;
  const int32_t* pages;
  const int32_t* limit;
  float* m;
  float* l;
  float* acc;
  int64_t num_seqs, max_q, num_kv, group, dim, page_size, width;
  float scale, mask_value;
};

// exp(x) of 16 lanes x <= 0 (glibc's expf is scalar without -ffast-math): 2^k * p(r) with
// x = k ln2 + r, |r| <= ln2 / 2, p a degree-6 Taylor polynomial (relative error < 3e-7, about
// 2 ulp). x below -87 (masked scores, exp(mask_value - m)) gives exactly 0.
inline v16 exp16(v16 x) {
  const v16 low = v16{} - 87.0f, v = x < low ? low : x;
  const i16 k = -__builtin_convertvector(0.5f - v * 1.44269504f, i16);  // round(v / ln2), v <= 0
  const v16 kf = __builtin_convertvector(k, v16);
  const v16 r = (v - kf * 0.693145752f) - kf * 1.42860677e-6f;
  v16 poly = v16{} + 1.0f / 720;
  poly = poly * r + 1.0f / 120;
  poly = poly * r + 1.0f / 24;
  poly = poly * r + 1.0f / 6;
  poly = poly * r + 0.5f;
  poly = poly * r + 1.0f;
  poly = poly * r + 1.0f;
  const i16 bits = (k + 127) << 23;
  v16 scale;
  std::memcpy(&scale, &bits, sizeof(scale));
  return x < low ? v16{} : poly * scale;
}

// exp of n floats x <= 0, in place (the last vector through a padded copy).
inline void exp_inplace(float* x, int64_t n) {
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) store(x + i, exp16(load(x + i)));
  if (i < n) {
    float tail[16] = {};
    std::memcpy(tail, x + i, (n - i) * sizeof(float));
    store(tail, exp16(load(tail)));
    std::memcpy(x + i, tail, (n - i) * sizeof(float));
  }
}

// Asks for a cached position's K and V rows (2 * dim floats, adjacent in the pool) as a block's
// pointers are gathered. A head's rows lie 2 * kv_heads rows apart, a stride the hardware
// prefetchers follow poorly; requested up front, a block's cache misses overlap (decode attention
// with its pool from memory: 0.72-0.75 of the time, docs/performance.md section 32). Into L2, not
// L1: a block's 128 keys are 64 KB of K/V, twice the L1, and asked into L1 they pushed each other
// out before use (batch-32 decode attention 0.72-0.78x the time into L2, section 47).
inline void prefetch_kv(const float* kv, int64_t dim) {
  for (int64_t i = 0; i < 2 * dim; i += 16) __builtin_prefetch(kv + i, 0, 2);
}

// Scratch of one worker thread: the scores of a key block [rows, kKeyBlock] and its K/V rows.
struct Scratch {
  std::vector<float> scores, spare, m, l;
  std::vector<const float*> kv, values, q;
  std::vector<float*> score_rows, acc_rows;
  std::vector<int64_t> visible;
};

// Points w.kv / w.values [0, n) at cached positions [pos0, pos0 + n) of one kv head (`pages`: the
// sequence's page indices; a position's row of `row` floats holds the head's K at `head`, V at
// `head + dim`) and asks for each (prefetch_kv). Page by page, without a division per key.
inline void point_at_cache(Scratch& w, const float* pool, const int32_t* pages, int64_t page_size, int64_t row,
                           int64_t head, int64_t dim, int64_t pos0, int64_t n) {
  int64_t page = pos0 / page_size, slot = pos0 % page_size;
  const float* at = pool + (pages[page] * page_size + slot) * row + head;
  for (int64_t t = 0; t < n; ++t) {
    w.kv[t] = at;
    w.values[t] = at + dim;
    prefetch_kv(at, dim);
    if (++slot < page_size) {
      at += row;
    } else if (t + 1 < n) {
      slot = 0;
      at = pool + pages[++page] * page_size * row + head;
    }
  }
}

// The outputs of one (sequence, kv head) of `PagedPrefixAttention` set to the empty state, and
// how far its queries see (0 for a padding sequence).
struct PrefixUnit {
  float *m, *l, *acc;
  const int32_t* limit;
  int64_t longest = 0;

  PrefixUnit(const Problem& p, int64_t s, int64_t h) {
    const int64_t rows = p.group * p.max_q, first = (s * p.num_kv + h) * rows;
    m = p.m + first;
    l = p.l + first;
    acc = p.acc + first * p.dim;
    limit = p.limit + s * p.max_q;
    std::fill(m, m + rows, p.mask_value);
    std::fill(l, l + rows, 0.0f);
    std::fill(acc, acc + rows * p.dim, 0.0f);
    if (s >= p.num_seqs) return;
    for (int64_t j = 0; j < p.max_q; ++j) longest = std::max<int64_t>(longest, limit[j]);
    longest = std::min(longest, p.width * p.page_size);
  }
};

// One (sequence, kv head): its G * Q query rows (r = g * Q + j, the output layout [.., G, Q])
// against the sequence's cached keys, a block of keys at a time with an online softmax.
void attend_one(const Problem& p, int64_t s, int64_t h, Scratch& w) {
  const int64_t rows = p.group * p.max_q, dim = p.dim, combined = 2 * p.num_kv;
  const PrefixUnit unit(p, s, h);
  float *m = unit.m, *l = unit.l, *acc = unit.acc;
  const int32_t* limit = unit.limit;
  const int64_t longest = unit.longest;
  if (longest <= 0) return;

  w.scores.resize(rows * kKeyBlock);
  w.kv.resize(kKeyBlock);
  for (int64_t start = 0; start < longest; start += kKeyBlock) {
    const int64_t n = std::min(kKeyBlock, longest - start);
    for (int64_t t = 0; t < n; ++t) {
      const int64_t pos = start + t;
      const int64_t page = p.pages[s * p.width + pos / p.page_size];
      w.kv[t] = p.pool + ((page * p.page_size + pos % p.page_size) * combined + 2 * h) * dim;  // V at +dim
      prefetch_kv(w.kv[t], dim);
    }
    for (int64_t g = 0; g < p.group; ++g)
      for (int64_t j = 0; j < p.max_q; ++j) {
        const int64_t r = g * p.max_q + j, visible = std::min<int64_t>(n, limit[j] - start);
        if (visible <= 0) continue;
        const float* q = p.q + (((s * p.max_q + j) * p.num_kv + h) * p.group + g) * dim;
        float* sr = w.scores.data() + r * kKeyBlock;
        float block_max = p.mask_value;
        for (int64_t t = 0; t < visible; ++t) {
          const float* k = w.kv[t];
          float dot = 0.0f;
#pragma omp simd reduction(+ : dot)
          for (int64_t d = 0; d < dim; ++d) dot += q[d] * k[d];
          sr[t] = dot * p.scale;
          block_max = std::max(block_max, sr[t]);
        }
        const float m_new = std::max(m[r], block_max);
        float alpha = m[r] - m_new;
        exp_inplace(&alpha, 1);
        for (int64_t t = 0; t < visible; ++t) sr[t] -= m_new;
        exp_inplace(sr, visible);
        float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
        for (int64_t t = 0; t < visible; ++t) sum += sr[t];
        m[r] = m_new;
        l[r] = alpha * l[r] + sum;
        float* a = acc + r * dim;
#pragma omp simd
        for (int64_t d = 0; d < dim; ++d) a[d] *= alpha;
        for (int64_t t = 0; t < visible; ++t) {
          const float weight = sr[t];
          const float* v = w.kv[t] + dim;
#pragma omp simd
          for (int64_t d = 0; d < dim; ++d) a[d] += weight * v[d];
        }
      }
  }
}

// Scores out[r][t0 + n] = q[r] . k[n] of RB query rows and NB keys (16 * DV floats each). The
// accumulators are machine vectors (common.h): lane j sums d = j, j + 16, .. whatever their width.
// With AVX2 the two halves of the lanes are taken in turn (the outer loop), so only RB x NB
// accumulators are live at a time and the tile can be 3 x 4 (docs/performance.md section 37).
template <int DV, int RB, int NB>
inline void score_tile(const float* const* q, const float* const* k, float* const* out, int64_t t0) {
  vn acc[RB * NB * kParts];  // (r, n)'s lanes are acc[(r * NB + n) * kParts + part]
  for (int i = 0; i < RB * NB * kParts; ++i) acc[i] = vn{};
  for (int part = 0; part < kParts; ++part)
    for (int d = 0; d < DV; ++d) {
      const int64_t at = 16 * d + part * kLanes;
      vn kv[NB];
      for (int n = 0; n < NB; ++n) kv[n] = load_n(k[n] + at);
      for (int r = 0; r < RB; ++r) {
        const vn qv = load_n(q[r] + at);
        for (int n = 0; n < NB; ++n) acc[(r * NB + n) * kParts + part] += qv * kv[n];
      }
    }
  float sums[RB * NB];
  lane_sums<RB * NB>(acc, sums);
  for (int r = 0; r < RB; ++r)
    for (int n = 0; n < NB; ++n) out[r][t0 + n] = sums[r * NB + n];
}

// acc[r] += sum over keys t < n of p[r][t] * v[t], for RB rows of 16 * DV floats, kChunk machine
// vectors of each row at a time (on AVX2 a whole row's accumulators do not fit the registers).
template <int DV, int RB>
inline void value_tile(const float* const* p, const float* const* v, int64_t n, float* const* acc) {
  constexpr int kVecs = DV * kParts, kChunk = kAvx512 ? kVecs : 4;
  static_assert(kVecs % kChunk == 0);
  for (int c = 0; c < kVecs; c += kChunk) {
    vn a[RB][kChunk];
    for (int r = 0; r < RB; ++r)
      for (int i = 0; i < kChunk; ++i) a[r][i] = load_n(acc[r] + (c + i) * kLanes);
    for (int64_t t = 0; t < n; ++t) {
      vn vv[kChunk];
      for (int i = 0; i < kChunk; ++i) vv[i] = load_n(v[t] + (c + i) * kLanes);
      for (int r = 0; r < RB; ++r) {
        const float weight = p[r][t];
        for (int i = 0; i < kChunk; ++i) a[r][i] += weight * vv[i];
      }
    }
    for (int r = 0; r < RB; ++r)
      for (int i = 0; i < kChunk; ++i) store_n(acc[r] + (c + i) * kLanes, a[r][i]);
  }
}

// value_tile of `rows` <= RB rows.
template <int DV, int RB>
inline void value_rows(int64_t rows, const float* const* p, const float* const* v, int64_t n, float* const* acc) {
  if constexpr (RB > 0) {
    if (rows == RB) return value_tile<DV, RB>(p, v, n, acc);
    value_rows<DV, RB - 1>(rows, p, v, n, acc);
  }
}

// AVX-512: 24 accumulators of 3 rows x 8 keys; AVX2: 3 x 4 keys, one half of the lanes at a time
// (12 of 16 registers). Keys per tile divide kKeyBlock.
constexpr int kScoreRows = 3, kScoreKeys = kAvx512 ? 8 : 4;
static_assert(kKeyBlock % kScoreKeys == 0);

// The query rows of one (sequence, kv head) for the tiled path: their pointers padded to whole
// tiles (padding rows read row 0, write scratch), and the softmax state they update.
template <int DV>
struct TiledRows {
  // AVX-512: 24 accumulators, 6 rows of 64 floats or 3 of 128; AVX2: 3 rows x 4 (value_tile).
  static constexpr int kValueRows = kAvx512 ? 24 / DV : 3;
  int64_t rows;
  float *m, *l;

  // `query(r)` and `acc(r)` give row r's query and accumulator; accumulators start at zero.
  template <class Query, class Acc>
  TiledRows(Scratch& w, int64_t rows_, int64_t dim, float* m_, float* l_, Query query, Acc acc)
      : rows(rows_), m(m_), l(l_) {
    const int64_t padded = rows + kScoreRows + kValueRows;  // room for either stage's padding
    w.scores.assign(padded * kKeyBlock, 0.0f);               // rows past `rows`: scratch (and zeros)
    w.spare.assign(padded * dim, 0.0f);                      // scratch accumulator rows
    w.kv.resize(kKeyBlock);
    w.values.resize(kKeyBlock);
    w.q.resize(padded);
    w.score_rows.resize(padded);
    w.acc_rows.resize(padded);
    w.visible.resize(padded);
    for (int64_t r = 0; r < padded; ++r) {
      w.q[r] = r < rows ? query(r) : w.q[0];
      w.score_rows[r] = w.scores.data() + r * kKeyBlock;
      w.acc_rows[r] = r < rows ? acc(r) : w.spare.data() + r * dim;
    }
  }

  // One block of n keys (w.kv / w.values hold n real entries, padded to whole tiles by the caller
  // with repeats) seen by row r up to w.visible[r] keys: scores, online softmax, value sums.
  void block(Scratch& w, int64_t n, float scale, float mask_value, int64_t dim) const {
    const int64_t n_tiled = (n + kScoreKeys - 1) / kScoreKeys * kScoreKeys;
    for (int64_t r = 0; r < rows; r += kScoreRows)
      for (int64_t t = 0; t < n_tiled; t += kScoreKeys)
        score_tile<DV, kScoreRows, kScoreKeys>(w.q.data() + r, w.kv.data() + t, w.score_rows.data() + r, t);
    // Row by row, 16 scores at a time (rows have kKeyBlock floats, so whole vectors fit).
    const i16 lanes = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15};
    for (int64_t r = 0; r < rows; ++r) {
      const int64_t visible = std::min<int64_t>(n, w.visible[r]);
      float* sr = w.score_rows[r];
      if (visible <= 0) {  // sees none of this block: its state stays, its weights are zero
        std::fill(sr, sr + n, 0.0f);
        continue;
      }
      const i16 seen = i16{} + static_cast<int32_t>(visible);
      v16 vmax = v16{} + mask_value;
      for (int64_t t = 0; t < visible; t += 16) {
        const v16 x = load(sr + t) * scale;
        store(sr + t, x);
        const v16 masked = lanes + static_cast<int32_t>(t) < seen ? x : v16{} + mask_value;
        vmax = masked > vmax ? masked : vmax;
      }
      float block_max = mask_value;
      for (int i = 0; i < 16; ++i) block_max = std::max(block_max, vmax[i]);
      const float m_new = std::max(m[r], block_max);
      float alpha = std::min(m[r] - m_new, 0.0f);
      exp_inplace(&alpha, 1);
      v16 vsum = v16{};
      for (int64_t t = 0; t < n; t += 16) {
        const v16 e = exp16(load(sr + t) - m_new), p = lanes + static_cast<int32_t>(t) < seen ? e : v16{};
        store(sr + t, p);
        vsum += p;
      }
      float sum = 0.0f;
      for (int i = 0; i < 16; ++i) sum += vsum[i];
      m[r] = m_new;
      l[r] = alpha * l[r] + sum;
      float* a = w.acc_rows[r];
      for (int64_t d = 0; d < dim; d += 16) store(a + d, load(a + d) * alpha);
    }
    // Whole tiles, then the rows left in a tile of their own size (a decode step's G = 3 rows of a
    // kv head filled half of a 6-row tile with padding: attention alone 0.94-0.97x, docs/performance.md
    // section 50). Each row's sums are the same either way.
    int64_t r = 0;
    for (; r + kValueRows <= rows; r += kValueRows)
      value_tile<DV, kValueRows>(w.score_rows.data() + r, w.values.data(), n, w.acc_rows.data() + r);
    if (r < rows) value_rows<DV, kValueRows - 1>(rows - r, w.score_rows.data() + r, w.values.data(), n, w.acc_rows.data() + r);
  }
};

// Pads the block's key and value pointers [n, n_tiled) with repeats of the last real one.
inline void pad_keys(Scratch& w, int64_t n) {
  const int64_t n_tiled = (n + kScoreKeys - 1) / kScoreKeys * kScoreKeys;
  for (int64_t t = n; t < n_tiled; ++t) {
    w.kv[t] = w.kv[n - 1];
    w.values[t] = w.values[n - 1];
  }
}

// `attend_one` for head size 16 * DV: the same online softmax, its two products as tiles.
template <int DV>
void attend_tiled(const Problem& p, int64_t s, int64_t h, Scratch& w) {
  const int64_t rows = p.group * p.max_q, dim = p.dim, combined = 2 * p.num_kv;
  const PrefixUnit unit(p, s, h);
  float *m = unit.m, *l = unit.l, *acc = unit.acc;
  const int32_t* limit = unit.limit;
  const int64_t longest = unit.longest;
  if (longest <= 0) return;
  // Row r = g * Q + j (the output layout [.., G, Q]).
  const TiledRows<DV> tiled(
      w, rows, dim, m, l,
      [&](int64_t r) { return p.q + (((s * p.max_q + r % p.max_q) * p.num_kv + h) * p.group + r / p.max_q) * dim; },
      [&](int64_t r) { return acc + r * dim; });
  for (int64_t start = 0; start < longest; start += kKeyBlock) {
    const int64_t n = std::min(kKeyBlock, longest - start);
    point_at_cache(w, p.pool, p.pages + s * p.width, p.page_size, combined * dim, 2 * h * dim, dim, start, n);
    pad_keys(w, n);
    for (int64_t r = 0; r < rows; ++r) w.visible[r] = limit[r % p.max_q] - start;
    tiled.block(w, n, p.scale, p.mask_value, dim);
  }
}

void attend(const Problem& p, int64_t s, int64_t h, Scratch& w) {
  if (p.dim == 64) return attend_tiled<4>(p, s, h, w);
  if (p.dim == 128) return attend_tiled<8>(p, s, h, w);
  attend_one(p, s, h, w);
}

ffi::Error PagedPrefixAttention(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q, ffi::Buffer<ffi::F32> kv_pool,
                                ffi::Buffer<ffi::S32> page_indices, ffi::Buffer<ffi::S32> limit,
                                ffi::Buffer<ffi::S32> num_seqs, float sm_scale, float mask_value,
                                ffi::ResultBuffer<ffi::F32> m, ffi::ResultBuffer<ffi::F32> l,
                                ffi::ResultBuffer<ffi::F32> acc) {
  auto qd = q.dimensions();
  auto pd = kv_pool.dimensions();
  if (qd.size() != 5 || pd.size() != 4 || page_indices.dimensions().size() != 2 || pd[2] != 2 * qd[2] ||
      pd[3] != qd[4])
    return ffi::Error::InvalidArgument("paged_prefix_attention: incompatible shapes");
  const Problem problem{q.typed_data(), kv_pool.typed_data(), page_indices.typed_data(), limit.typed_data(),
                        m->typed_data(), l->typed_data(), acc->typed_data(),
                        std::min<int64_t>(num_seqs.typed_data()[0], qd[0]), qd[1], qd[2], qd[3], qd[4],
                        pd[1], page_indices.dimensions()[1], sm_scale, mask_value};
  parallel_units(pool, qd[0] * qd[2], [&problem, scratch = Scratch{}](int64_t u) mutable {
    attend(problem, u / problem.num_kv, u % problem.num_kv, scratch);
  });
  return ffi::Error::Success();
}

// ---- the whole attention of a packed ragged step ------------------------------------------------

// `prefix_block_attention` in one call: query j of sequence s (packed row cu[s] + j) attends to
// the s's cached prefix (kv_lens[s] - q_len positions, in the pages) and to the step's new tokens
// 0..j (new_k / new_v rows cu[s]..), and gets the normalized output. Padding rows get zeros.
struct Ragged {
  const float *q, *new_k, *new_v, *pool;
  const int32_t *pages, *cu, *kv_lens;
  float* out;
  int64_t num_heads, num_kv, dim, page_size, width;
  float scale, mask_value;
};

constexpr int64_t kChunkRows = 12;  // query rows of one work unit: a verify block's spread over threads

// Rows [chunk * kChunkRows, ..) of sequence s and kv head h.
template <int DV>
void attend_ragged(const Ragged& p, int64_t s, int64_t h, int64_t chunk, Scratch& w) {
  const int64_t group = p.num_heads / p.num_kv, begin = p.cu[s], q_len = p.cu[s + 1] - begin;
  const int64_t first = chunk * kChunkRows, rows = std::min(q_len * group - first, kChunkRows);
  if (rows <= 0) return;
  const int64_t prefix = std::clamp<int64_t>(p.kv_lens[s] - q_len, 0, p.width * p.page_size);
  const int64_t dim = p.dim, combined = 2 * p.num_kv;
  // Row r of the chunk = j * G + g - first: query j's head h * G + g, accumulated where its output goes.
  const auto offset = [&](int64_t r) {
    return ((begin + (first + r) / group) * p.num_heads + h * group + (first + r) % group) * dim;
  };
  w.m.assign(rows, p.mask_value);
  w.l.assign(rows, 0.0f);
  const TiledRows<DV> tiled(w, rows, dim, w.m.data(), w.l.data(), [&](int64_t r) { return p.q + offset(r); },
                            [&](int64_t r) {
                              float* o = p.out + offset(r);
                              std::fill(o, o + dim, 0.0f);
                              return o;
                            });
  const int64_t total = prefix + (first + rows - 1) / group + 1;  // what the chunk's last query sees
  for (int64_t start = 0; start < total; start += kKeyBlock) {
    const int64_t n = std::min(kKeyBlock, total - start);
    const int64_t cached = std::clamp<int64_t>(prefix - start, 0, n);  // keys of the block in the pages
    if (cached > 0) point_at_cache(w, p.pool, p.pages + s * p.width, p.page_size, combined * dim, 2 * h * dim, dim, start, cached);
    for (int64_t t = cached; t < n; ++t) {  // this step's own tokens
      const int64_t row = (begin + start + t - prefix) * p.num_kv + h;
      w.kv[t] = p.new_k + row * dim;
      w.values[t] = p.new_v + row * dim;
    }
    pad_keys(w, n);
    for (int64_t r = 0; r < rows; ++r) w.visible[r] = prefix + (first + r) / group + 1 - start;  // causal
    tiled.block(w, n, p.scale, p.mask_value, dim);
  }
  for (int64_t r = 0; r < rows; ++r) {
    float* o = p.out + offset(r);
    const float inv = 1.0f / w.l[r];
#pragma omp simd
    for (int64_t d = 0; d < dim; ++d) o[d] *= inv;
  }
}

ffi::Error RaggedAttention(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q, ffi::Buffer<ffi::F32> new_k,
                           ffi::Buffer<ffi::F32> new_v, ffi::Buffer<ffi::F32> kv_pool,
                           ffi::Buffer<ffi::S32> page_indices, ffi::Buffer<ffi::S32> cu_q_lens,
                           ffi::Buffer<ffi::S32> kv_lens, ffi::Buffer<ffi::S32> num_seqs, float sm_scale,
                           float mask_value, ffi::ResultBuffer<ffi::F32> out) {
  auto qd = q.dimensions();
  auto kd = new_k.dimensions();
  auto pd = kv_pool.dimensions();
  auto wd = page_indices.dimensions();
  if (qd.size() != 3 || kd.size() != 3 || pd.size() != 4 || wd.size() != 2 || kd[0] != qd[0] ||
      new_v.dimensions().size() != 3 || new_v.dimensions()[0] != kd[0] || new_v.dimensions()[1] != kd[1] || pd[2] != 2 * kd[1] || pd[3] != qd[2] || kd[2] != qd[2] || qd[1] % kd[1] ||
      (qd[2] != 64 && qd[2] != 128) || cu_q_lens.dimensions()[0] != wd[0] + 1 || kv_lens.dimensions()[0] != wd[0])
    return ffi::Error::InvalidArgument("ragged_attention: incompatible shapes (head size 64 or 128)");
  const int32_t* cu = cu_q_lens.typed_data();
  const int64_t seqs = std::clamp<int64_t>(num_seqs.typed_data()[0], 0, wd[0]);
  const int64_t used = std::clamp<int64_t>(cu[seqs], 0, qd[0]), row = qd[1] * qd[2];
  std::fill(out->typed_data() + used * row, out->typed_data() + qd[0] * row, 0.0f);  // padding rows
  const Ragged problem{q.typed_data(), new_k.typed_data(), new_v.typed_data(), kv_pool.typed_data(),
                       page_indices.typed_data(), cu, kv_lens.typed_data(), out->typed_data(),
                       qd[1], kd[1], qd[2], pd[1], wd[1], sm_scale, mask_value};
  int64_t longest = 0;
  for (int64_t s = 0; s < seqs; ++s) longest = std::max<int64_t>(longest, cu[s + 1] - cu[s]);
  const int64_t chunks = std::max<int64_t>(1, (longest * (qd[1] / kd[1]) + kChunkRows - 1) / kChunkRows);
  parallel_units(pool, seqs * kd[1] * chunks, [&problem, chunks, scratch = Scratch{}](int64_t u) mutable {
    const int64_t s = u / (problem.num_kv * chunks), h = u / chunks % problem.num_kv, c = u % chunks;
    problem.dim == 64 ? attend_ragged<4>(problem, s, h, c, scratch) : attend_ragged<8>(problem, s, h, c, scratch);
  });
  return ffi::Error::Success();
}

// ---- dense masked attention (the drafter's) -----------------------------------------------------

// `F.scaled_dot_product_attention(q, k, v, attn_mask=mask)` with a boolean mask: q [N, H, R, D],
// k / v [N, H, S, D], mask [N, 1, Rm, S] (Rm 1: one mask for every row; or R), out [N, H, R, D].
// A row attends to the keys its mask row allows, a block of them at a time with the same online
// softmax as the paged kernels; only allowed keys are gathered, so masked ones cost nothing. A row
// that may attend to no key gets NaN, as torch's and XLA's softmax give.
struct Dense {
  const float *q, *k, *v;
  const bool* mask;
  float* out;
  int64_t heads, rows, keys, dim, mask_rows;
  float scale, mask_value;
};

// Rows [first, first + count) of one (sequence, head): q and out point at its row 0. They attend to
// `total` keys, key t's K and V rows at key(t).first / key(t).second, with the paged kernels'
// online softmax over blocks of kKeyBlock keys; no key: NaN (torch's softmax over none).
template <int DV, class Key>
void attend_listed(const float* q, float* out, int64_t dim, int64_t first, int64_t count, int64_t total, Key key,
                   float scale, float mask_value, Scratch& w) {
  if (total == 0) {
    std::fill(out + first * dim, out + (first + count) * dim, std::nanf(""));
    return;
  }
  w.m.assign(count, mask_value);
  w.l.assign(count, 0.0f);
  const TiledRows<DV> tiled(w, count, dim, w.m.data(), w.l.data(), [&](int64_t r) { return q + (first + r) * dim; },
                            [&](int64_t r) {
                              float* o = out + (first + r) * dim;
                              std::fill(o, o + dim, 0.0f);
                              return o;
                            });
  for (int64_t start = 0; start < total; start += kKeyBlock) {
    const int64_t size = std::min(kKeyBlock, total - start);
    for (int64_t t = 0; t < size; ++t) {
      const auto [k, v] = key(start + t);
      w.kv[t] = k;
      w.values[t] = v;
    }
    pad_keys(w, size);
    std::fill(w.visible.begin(), w.visible.begin() + count, size);
    tiled.block(w, size, scale, mask_value, dim);
  }
  for (int64_t r = 0; r < count; ++r) {
    float* o = out + (first + r) * dim;
    const float inv = 1.0f / w.l[r];
    for (int64_t d = 0; d < dim; ++d) o[d] *= inv;
  }
}

// Rows [first, first + count) of (sequence n, head h), all of them reading mask row `mask_row`.
template <int DV>
void attend_dense(const Dense& p, int64_t n, int64_t h, int64_t first, int64_t count, int64_t mask_row,
                  Scratch& w, std::vector<int32_t>& allowed) {
  const int64_t dim = p.dim, unit = (n * p.heads + h) * p.rows;
  const bool* mask = p.mask + (n * p.mask_rows + mask_row) * p.keys;
  allowed.clear();
  for (int64_t t = 0; t < p.keys; ++t)
    if (mask[t]) allowed.push_back(static_cast<int32_t>(t));
  const float *keys = p.k + (n * p.heads + h) * p.keys * dim, *values = p.v + (n * p.heads + h) * p.keys * dim;
  attend_listed<DV>(p.q + unit * dim, p.out + unit * dim, dim, first, count, static_cast<int64_t>(allowed.size()),
                    [&](int64_t t) { return std::pair{keys + allowed[t] * dim, values + allowed[t] * dim}; }, p.scale,
                    p.mask_value, w);
}

ffi::Error DenseAttention(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q, ffi::Buffer<ffi::F32> k,
                          ffi::Buffer<ffi::F32> v, ffi::Buffer<ffi::PRED> mask, float sm_scale,
                          ffi::ResultBuffer<ffi::F32> out) {
  auto qd = q.dimensions();
  auto kd = k.dimensions();
  auto md = mask.dimensions();
  if (qd.size() != 4 || kd.size() != 4 || md.size() != 4 || v.dimensions().size() != 4 || kd[0] != qd[0] ||
      kd[1] != qd[1] || kd[3] != qd[3] || v.dimensions()[0] != kd[0] || v.dimensions()[1] != kd[1] ||
      v.dimensions()[2] != kd[2] || v.dimensions()[3] != kd[3] || md[0] != qd[0] || md[1] != 1 ||
      (md[2] != 1 && md[2] != qd[2]) || md[3] != kd[2] || (qd[3] != 64 && qd[3] != 128))
    return ffi::Error::InvalidArgument("dense_attention: incompatible shapes (head size 64 or 128)");
  const Dense problem{q.typed_data(), k.typed_data(), v.typed_data(), mask.typed_data(), out->typed_data(),
                      qd[1], qd[2], kd[2], qd[3], md[2], sm_scale, -1e30f};
  // One mask for all rows: units of up to kChunkRows rows (a draft block's rows over the threads);
  // a mask per row: one row per unit, each gathering its own keys.
  const int64_t chunk = problem.mask_rows == 1 ? kChunkRows : 1, chunks = (problem.rows + chunk - 1) / chunk;
  parallel_units(pool, qd[0] * qd[1] * chunks,
                 [&problem, chunk, chunks, scratch = Scratch{}, allowed = std::vector<int32_t>{}](int64_t u) mutable {
                   const int64_t n = u / (problem.heads * chunks), h = u / chunks % problem.heads;
                   const int64_t first = u % chunks * chunk, count = std::min(chunk, problem.rows - first);
                   const int64_t mask_row = problem.mask_rows == 1 ? 0 : first;
                   problem.dim == 64 ? attend_dense<4>(problem, n, h, first, count, mask_row, scratch, allowed)
                                     : attend_dense<8>(problem, n, h, first, count, mask_row, scratch, allowed);
                 });
  return ffi::Error::Success();
}

// The drafter's attention over its own cache, read in place: q [N, H, R, D]; k_cache / v_cache
// [S, H, T, D] (head-major: a head's cached rows lie contiguous); sequence n attends to rows
// 0 .. lens[n] - 1 of slot slots[n], then to every row of its block k_block / v_block [N, H, B, D];
// out [N, H, R, D]. The same keys in the same order as `DenseAttention` over the window gathered
// next to the block with a mask allowing those rows, so the same bits, without the window's copy.
ffi::Error CacheAttention(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q, ffi::Buffer<ffi::F32> k_cache,
                          ffi::Buffer<ffi::F32> v_cache, ffi::Buffer<ffi::S32> slots, ffi::Buffer<ffi::S32> lens,
                          ffi::Buffer<ffi::F32> k_block, ffi::Buffer<ffi::F32> v_block, float sm_scale,
                          ffi::ResultBuffer<ffi::F32> out) {
  auto qd = q.dimensions();
  auto cd = k_cache.dimensions();
  auto bd = k_block.dimensions();
  const bool shapes = qd.size() == 4 && cd.size() == 4 && bd.size() == 4 && v_cache.dimensions().size() == 4 &&
                      v_block.dimensions().size() == 4 && (qd[3] == 64 || qd[3] == 128) && cd[1] == qd[1] &&
                      cd[3] == qd[3] && bd[0] == qd[0] && bd[1] == qd[1] && bd[3] == qd[3] &&
                      slots.element_count() == qd[0] && lens.element_count() == qd[0];
  if (!shapes || v_cache.dimensions()[0] != cd[0] || v_cache.dimensions()[2] != cd[2] || v_block.dimensions()[2] != bd[2])
    return ffi::Error::InvalidArgument("cache_attention: incompatible shapes (head size 64 or 128)");
  const int64_t seqs = qd[0], heads = qd[1], rows = qd[2], dim = qd[3], cached = cd[2], block = bd[2];
  const int32_t *slot = slots.typed_data(), *len = lens.typed_data();
  for (int64_t n = 0; n < seqs; ++n)
    if (slot[n] < 0 || slot[n] >= cd[0] || len[n] < 0 || len[n] > cached)
      return ffi::Error::InvalidArgument("cache_attention: a slot or length outside the cache");
  const float *qp = q.typed_data(), *kc = k_cache.typed_data(), *vc = v_cache.typed_data();
  const float *kb = k_block.typed_data(), *vb = v_block.typed_data();
  float* op = out->typed_data();
  const int64_t chunks = (rows + kChunkRows - 1) / kChunkRows;
  parallel_units(pool, seqs * heads * chunks, [&, scratch = Scratch{}](int64_t u) mutable {
    const int64_t n = u / (heads * chunks), h = u / chunks % heads, first = u % chunks * kChunkRows;
    const int64_t count = std::min(kChunkRows, rows - first), past = len[n];
    const int64_t cache_at = (slot[n] * heads + h) * cached * dim, block_at = (n * heads + h) * block * dim;
    auto key = [&](int64_t t) {
      return t < past ? std::pair{kc + cache_at + t * dim, vc + cache_at + t * dim}
                      : std::pair{kb + block_at + (t - past) * dim, vb + block_at + (t - past) * dim};
    };
    const float* qu = qp + (n * heads + h) * rows * dim;
    float* ou = op + (n * heads + h) * rows * dim;
    dim == 64 ? attend_listed<4>(qu, ou, dim, first, count, past + block, key, sm_scale, -1e30f, scratch)
              : attend_listed<8>(qu, ou, dim, first, count, past + block, key, sm_scale, -1e30f, scratch);
  });
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(sgl_dflash_paged_prefix_attention, PagedPrefixAttention,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Attr<float>("sm_scale")
                                  .Attr<float>("mask_value")
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(sgl_dflash_ragged_attention, RaggedAttention,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Attr<float>("sm_scale")
                                  .Attr<float>("mask_value")
                                  .Ret<ffi::Buffer<ffi::F32>>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(sgl_dflash_dense_attention, DenseAttention,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::PRED>>()
                                  .Attr<float>("sm_scale")
                                  .Ret<ffi::Buffer<ffi::F32>>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(sgl_dflash_cache_attention, CacheAttention,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Attr<float>("sm_scale")
                                  .Ret<ffi::Buffer<ffi::F32>>());
