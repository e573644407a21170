// Prefill attention on CPU (several query rows per sequence: a prompt, a prefill chunk, verified drafts)
// straight from the paged KV cache; see paged_attention_cpu.cpp for the library and
// csrc/paged_attention_common.h for what decode and prefill share.

#include <ATen/core/Tensor.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstring>
#include <limits>
#include <memory>
#include <type_traits>
#include <vector>

#include "amx_tiles.h"
#include "paged_prefill_amx.h"
#include "paged_attention_common.h"
#include "parallel_tasks.h"

#if defined(PAGODA_ISA_AVX2) && !defined(PAGODA_ISA_AVX512)
#include "paged_prefill_avx2.h"
#endif

namespace pagoda::attention {
namespace {

// --- prefill: flash attention over KV blocks -------------------------------------------------------------
//
// Work items are (sequence, KV head, tile of query rows). A tile's query vectors (its rows times the G query
// heads sharing the KV head) meet each KV block once: the block is widened to float32 (K transposed, so 16
// keys' scores are one vector op per head-dim element), then every vector updates its running max, sum and
// output (online softmax). Blocks past the tile's last row are never read; the diagonal ones are masked.
// A bfloat16 cache with AVX512_BF16 takes prefill_tile_bf16 instead (no widening), or with AMX
// csrc/paged_prefill_amx.h's tiles; AVX2 without AVX-512 takes csrc/paged_prefill_avx2.h's tiles at head sizes 64
// and 128 (each chunk widened once for all the tiles).

constexpr int64_t kKeysPerChunk = 16;  // keys scored together: one 16-lane float32 vector
constexpr int64_t kTileVectors = 48;  // query vectors per tile (rows x group): the tile's state stays in L1

// The tile's running state: per query vector (row r, head g at r * group + g) its scaled query, output
// accumulator, running max and sum. kWidth: the scratch rows' length (the head size when fixed).
template <int kWidth>
struct TileState {
  alignas(64) float query[kTileVectors][kWidth];
  alignas(64) float acc[kTileVectors][kWidth];
  float row_max[kTileVectors], row_sum[kTileVectors];
  alignas(64) float keys_t[kWidth][kKeysPerChunk];  // the chunk's keys, transposed
  alignas(64) float values[kKeysPerChunk][kWidth];
};

// Folds one chunk's scores s (keys [begin, end) of the chunk visible) into vector v's state.
template <int kWidth>
inline void online_softmax_update(TileState<kWidth>& st, int64_t v, float* s, int64_t begin, int64_t end,
                                  int64_t head_size, float cap) {
  if (cap > 0.f)
    for (int64_t j = begin; j < end; ++j) s[j] = softcap_score(s[j], cap);
  float chunk_max = -std::numeric_limits<float>::infinity();
  for (int64_t j = begin; j < end; ++j) chunk_max = std::max(chunk_max, s[j]);
  const float new_max = std::max(st.row_max[v], chunk_max);
  const float rescale = std::exp(st.row_max[v] - new_max);  // 0 for the first chunk (max was -inf)
  float p[kKeysPerChunk];
  float chunk_sum = 0.f;
  for (int64_t j = begin; j < end; ++j) {
    p[j] = exp_nonpositive(s[j] - new_max);
    chunk_sum += p[j];
  }
  st.row_max[v] = new_max;
  st.row_sum[v] = st.row_sum[v] * rescale + chunk_sum;
  float* o = st.acc[v];
  for (int64_t d = 0; d < head_size; ++d) o[d] *= rescale;
  for (int64_t j = begin; j < end; ++j)
    for (int64_t d = 0; d < head_size; ++d) o[d] += p[j] * st.values[j][d];
}

#if defined(PAGODA_ISA_AVX512)
// Vectors v..v+kVectors-1 against the chunk: their scores share each key row load (kVectors independent
// FMA chains), then each takes its softmax step over its visible keys [begin, end) and adds their weighted
// value rows, kHeadSize/16 vectors wide.
template <int kHeadSize, int kVectors>
inline void chunk_step_avx512(TileState<kHeadSize>& st, int64_t v, const int64_t* begin, const int64_t* end,
                              float cap) {
  constexpr int kLanes = kHeadSize / 16;
  __m512 s[kVectors];
  for (int q = 0; q < kVectors; ++q) s[q] = _mm512_setzero_ps();
  for (int d = 0; d < kHeadSize; ++d) {
    const __m512 k = _mm512_load_ps(st.keys_t[d]);
    for (int q = 0; q < kVectors; ++q) s[q] = _mm512_fmadd_ps(_mm512_set1_ps(st.query[v + q][d]), k, s[q]);
  }
  for (int q = 0; q < kVectors; ++q) {
    if (end[q] <= begin[q]) continue;
    const __mmask16 mask = static_cast<__mmask16>(((1u << end[q]) - 1) & ~((1u << begin[q]) - 1));
    const __m512 scores = cap > 0.f ? softcap16(s[q], cap) : s[q];
    const float chunk_max = _mm512_mask_reduce_max_ps(mask, scores);
    const float new_max = std::max(st.row_max[v + q], chunk_max);
    const float rescale = exp_nonpositive(st.row_max[v + q] - new_max);  // -inf - x: clamped to ~1e-38, times 0
    const __m512 p = _mm512_maskz_mov_ps(mask, exp_nonpositive16(_mm512_sub_ps(scores, _mm512_set1_ps(new_max))));
    st.row_max[v + q] = new_max;
    st.row_sum[v + q] = st.row_sum[v + q] * rescale + _mm512_reduce_add_ps(p);
    alignas(64) float pj[kKeysPerChunk];
    _mm512_store_ps(pj, p);
    __m512 o[kLanes];
    const __m512 r = _mm512_set1_ps(rescale);
    for (int i = 0; i < kLanes; ++i) o[i] = _mm512_mul_ps(_mm512_load_ps(st.acc[v + q] + 16 * i), r);
    for (int j = static_cast<int>(begin[q]); j < end[q]; ++j) {
      const __m512 w = _mm512_set1_ps(pj[j]);
      for (int i = 0; i < kLanes; ++i) o[i] = _mm512_fmadd_ps(w, _mm512_load_ps(st.values[j] + 16 * i), o[i]);
    }
    for (int i = 0; i < kLanes; ++i) _mm512_store_ps(st.acc[v + q] + 16 * i, o[i]);
  }
}
#endif

template <typename scalar_t, typename cache_t, int kHeadSize>
void prefill_tile(
    const scalar_t* q, int64_t q_row_stride, int64_t q_head_stride,  // first row's first head of the group
    const cache_t* k_cache, const cache_t* v_cache,  // at this KV head
    int64_t block_stride, int64_t pos_stride, const int32_t* block_table, int64_t block_size,
    int64_t first_pos, int64_t rows, int64_t group, int64_t head_size, const Variant& variant,
    int64_t first_head,  // the group's first query head (its sinks)
    scalar_t* out, int64_t out_row_stride, int64_t out_head_stride) {
  if constexpr (kHeadSize > 0) head_size = kHeadSize;
  constexpr int kWidth = kHeadSize > 0 ? kHeadSize : kMaxHeadSize;
  TileState<kWidth> st;
  const int64_t vectors = rows * group;
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t g = 0; g < group; ++g) {
      const int64_t v = r * group + g;
      for (int64_t d = 0; d < head_size; ++d)
        st.query[v][d] = to_float(q[r * q_row_stride + g * q_head_stride + d]) * variant.q_scale;
      for (int64_t d = 0; d < head_size; ++d) st.acc[v][d] = 0.f;
      st.row_max[v] = -std::numeric_limits<float>::infinity();
      st.row_sum[v] = 0.f;
    }
  const int64_t last_pos = first_pos + rows - 1;
  const int64_t lowest = variant.first_visible(first_pos);  // no row of the tile sees a key before it
  alignas(64) float row[kWidth];
  for (int64_t t0 = lowest / kKeysPerChunk * kKeysPerChunk; t0 <= last_pos; t0 += kKeysPerChunk) {
    const int64_t keys = std::min(kKeysPerChunk, last_pos + 1 - t0);
    for (int64_t j = 0; j < kKeysPerChunk; ++j) {
      // outside [lowest, last_pos]: repeat a key that exists (never weighted)
      const int64_t t = std::max(lowest, t0 + std::min(j, keys - 1));
      const int64_t offset = block_table[t / block_size] * block_stride + (t % block_size) * pos_stride;
      load_row(k_cache + offset, row, head_size);
      for (int64_t d = 0; d < head_size; ++d) st.keys_t[d][j] = row[d];
      load_row(v_cache + offset, st.values[j], head_size);
    }
    // causal: vector v (row v / group, at position first_pos + v / group) sees keys t0 + [begin, end)
    int64_t begin[kTileVectors], end[kTileVectors];
    for (int64_t v = 0; v < vectors; ++v) {
      const int64_t pos = first_pos + v / group;
      end[v] = std::min(keys, pos - t0 + 1);
      begin[v] = std::max<int64_t>(0, variant.first_visible(pos) - t0);
    }
    int64_t v = 0;
#if defined(PAGODA_ISA_AVX512)
    if constexpr (kHeadSize > 0 && kHeadSize % 16 == 0) {
      for (; v + 4 <= vectors; v += 4) chunk_step_avx512<kHeadSize, 4>(st, v, begin + v, end + v, variant.softcap);
      for (; v < vectors; ++v) chunk_step_avx512<kHeadSize, 1>(st, v, begin + v, end + v, variant.softcap);
    }
#endif
    for (; v < vectors; ++v) {
      if (end[v] <= begin[v]) continue;
      float s[kKeysPerChunk] = {0.f};
      for (int64_t d = 0; d < head_size; ++d)
        for (int64_t j = 0; j < kKeysPerChunk; ++j) s[j] += st.query[v][d] * st.keys_t[d][j];
      online_softmax_update(st, v, s, begin[v], end[v], head_size, variant.softcap);
    }
  }
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t g = 0; g < group; ++g) {
      const int64_t v = r * group + g;
      const float inv = variant.out_scale / (st.row_sum[v] + variant.sink_weight(first_head + g, st.row_max[v]));
      for (int64_t d = 0; d < head_size; ++d)
        out[r * out_row_stride + g * out_head_stride + d] = from_float<scalar_t>(st.acc[v][d] * inv);
    }
}

#if defined(PAGODA_ISA_AVX512BF16)
// prefill_tile for a bfloat16 cache on CPUs with AVX512_BF16: `vdpbf16ps` multiplies bfloat16 pairs as they
// are, where the generic tile widens every key and value to float32 and spends one FMA per element.
// 32 keys a chunk (two score vectors: the softmax's reductions, where the max moves, are paid once per 32 keys).
// Scores: the chunk's keys transposed into [D/2][32] pairs of head-dim elements, one instruction per pair and 16
// keys, the query's pair broadcast. P @ V: the probabilities rounded to bfloat16 (as the decode kernel and SDPA's
// math path do), two keys at a time against their value rows interleaved, one instruction per 16 head-dim
// elements. The output accumulators hold the head dimension in unpack order (as accumulate_block's).
constexpr int64_t kKeysPerChunkBf16 = 32;

template <int kHeadSize>
struct TileStateBf16 {
  static constexpr int kPairs = kHeadSize / 2;  // head-dim pairs per row
  static constexpr int kAcc = kHeadSize / 16;   // float32 accumulator vectors per query vector
  alignas(64) uint32_t query[kTileVectors][kPairs];  // bfloat16 pairs
  alignas(64) float acc[kTileVectors][kHeadSize];
  float row_max[kTileVectors];
  alignas(64) float sum_lanes[kTileVectors][16];  // each vector's softmax sum by lane, added across once, at the end
};

// One KV head's chunk of 32 keys as the tiles read it (prefill_items_bf16 says who prepares it, and when)
template <int kHeadSize>
struct ChunkBf16 {
  alignas(64) uint32_t keys_t[kHeadSize / 2][kKeysPerChunkBf16];  // [pair][key]: keys 0-15, then 16-31
  alignas(64) __m512i values[kKeysPerChunkBf16 / 2][kHeadSize / 16];  // per key pair: both rows, unpacked into pairs
};

// Keys t0..t0+keys-1 of a context into chunk c; past the end a valid key repeats (never weighted)
template <int kHeadSize>
void prepare_chunk_bf16(ChunkBf16<kHeadSize>& c, const c10::BFloat16* k_cache, const c10::BFloat16* v_cache,
                        int64_t block_stride, int64_t pos_stride, const int32_t* block_table, int64_t block_size,
                        int64_t t0, int64_t keys) {
  constexpr int kPairs = kHeadSize / 2, kVecs = kHeadSize / 32;
  auto row_at = [&](const c10::BFloat16* cache, int64_t t) {
    return cache + block_table[t / block_size] * block_stride + (t % block_size) * pos_stride;
  };
  for (int64_t j = 0; j < kKeysPerChunkBf16; ++j) {
    uint32_t pairs[kPairs];
    std::memcpy(pairs, row_at(k_cache, t0 + std::min(j, keys - 1)), sizeof(pairs));
    for (int p = 0; p < kPairs; ++p) c.keys_t[p][j] = pairs[p];
  }
  for (int64_t j = 0; j < kKeysPerChunkBf16 / 2; ++j) {
    const c10::BFloat16* first = row_at(v_cache, t0 + std::min(2 * j, keys - 1));
    const c10::BFloat16* second = row_at(v_cache, t0 + std::min(2 * j + 1, keys - 1));
    for (int i = 0; i < kVecs; ++i) {
      const __m512i v0 = _mm512_loadu_si512(first + 32 * i), v1 = _mm512_loadu_si512(second + 32 * i);
      c.values[j][2 * i] = _mm512_unpacklo_epi16(v0, v1);
      c.values[j][2 * i + 1] = _mm512_unpackhi_epi16(v0, v1);
    }
  }
}

// Vector v's scores of a chunk, s0 (keys 0-15) and s1 (16-31), of which its first `seen` are visible, into its
// online softmax: its probabilities as bfloat16 pairs (p[2j], p[2j+1]) into weight_pairs (0 past `seen`), and
// the factor its output accumulators take before they add this chunk's values (returned; 1 while its max stays).
template <int kHeadSize>
inline float softmax_chunk(TileStateBf16<kHeadSize>& st, int64_t v, __m512 s0, __m512 s1, int64_t seen, float scale,
                           uint32_t* weight_pairs) {
  if (seen <= 0) {  // no key of this chunk is visible: the state stays as it is
    _mm512_store_si512(weight_pairs, _mm512_setzero_si512());
    return 1.f;
  }
  const __m512 lowest = _mm512_set1_ps(std::numeric_limits<float>::lowest());
  const __mmask16 mask0 = static_cast<__mmask16>(seen >= 16 ? 0xFFFF : (1u << seen) - 1);
  const __mmask16 mask1 = static_cast<__mmask16>(seen >= 32 ? 0xFFFF : seen > 16 ? (1u << (seen - 16)) - 1 : 0);
  const __m512 a0 = _mm512_mul_ps(s0, _mm512_set1_ps(scale)), a1 = _mm512_mul_ps(s1, _mm512_set1_ps(scale));
  const __m512 sum = _mm512_load_ps(st.sum_lanes[v]);
  // against the max as it is (once there is one), unless a visible score passes it by kLazyMaxNats
  const __m512 bound = _mm512_set1_ps(st.row_max[v] + kLazyMaxNats);
  if (st.row_max[v] != -std::numeric_limits<float>::infinity() &&
      !(_mm512_mask_cmp_ps_mask(mask0, a0, bound, _CMP_GT_OQ) |
        _mm512_mask_cmp_ps_mask(mask1, a1, bound, _CMP_GT_OQ))) {
    const __m512 m = _mm512_set1_ps(st.row_max[v]);
    const __m512 p0 = _mm512_maskz_mov_ps(mask0, exp_nonpositive16(_mm512_sub_ps(a0, m)));
    const __m512 p1 = _mm512_maskz_mov_ps(mask1, exp_nonpositive16(_mm512_sub_ps(a1, m)));
    _mm512_store_ps(st.sum_lanes[v], _mm512_add_ps(sum, _mm512_add_ps(p0, p1)));
    _mm512_store_si512(weight_pairs, (__m512i)_mm512_cvtne2ps_pbh(p1, p0));
    return 1.f;
  }
  const float chunk_max = _mm512_reduce_max_ps(
      _mm512_max_ps(_mm512_mask_mov_ps(lowest, mask0, a0), _mm512_mask_mov_ps(lowest, mask1, a1)));
  const float new_max = std::max(st.row_max[v], chunk_max);
  const float rescale = exp_nonpositive(st.row_max[v] - new_max);  // -inf - x: clamped to ~1e-38, times 0
  const __m512 m = _mm512_set1_ps(new_max);
  const __m512 p0 = _mm512_maskz_mov_ps(mask0, exp_nonpositive16(_mm512_sub_ps(a0, m)));
  const __m512 p1 = _mm512_maskz_mov_ps(mask1, exp_nonpositive16(_mm512_sub_ps(a1, m)));
  st.row_max[v] = new_max;
  _mm512_store_ps(st.sum_lanes[v], _mm512_fmadd_ps(sum, _mm512_set1_ps(rescale), _mm512_add_ps(p0, p1)));
  _mm512_store_si512(weight_pairs, (__m512i)_mm512_cvtne2ps_pbh(p1, p0));
  return rescale;
}

// Vectors v..v+kVectors-1 against the chunk, as chunk_step_avx512. P @ V runs kVectors vectors together: each
// value pair is loaded once for all of them, and their kVectors * kAcc accumulator chains keep vdpbf16ps's
// pipeline full (one vector's kAcc chains alone wait on its latency). A vector's sums keep their order.
template <int kHeadSize, int kVectors>
inline void chunk_step_bf16(TileStateBf16<kHeadSize>& st, const ChunkBf16<kHeadSize>& chunk, int64_t v,
                            const int64_t* visible, float scale) {
  constexpr int kPairs = TileStateBf16<kHeadSize>::kPairs, kAcc = TileStateBf16<kHeadSize>::kAcc;
  __m512 s0[kVectors], s1[kVectors];  // keys 0-15 and 16-31
  for (int q = 0; q < kVectors; ++q) s0[q] = s1[q] = _mm512_setzero_ps();
  for (int p = 0; p < kPairs; ++p) {
    const __m512bh k0 = (__m512bh)_mm512_load_si512(chunk.keys_t[p]);
    const __m512bh k1 = (__m512bh)_mm512_load_si512(chunk.keys_t[p] + 16);
    for (int q = 0; q < kVectors; ++q) {
      const __m512bh w = (__m512bh)_mm512_set1_epi32(static_cast<int>(st.query[v + q][p]));
      s0[q] = _mm512_dpbf16_ps(s0[q], w, k0);
      s1[q] = _mm512_dpbf16_ps(s1[q], w, k1);
    }
  }
  alignas(64) uint32_t weight_pairs[kVectors][kKeysPerChunkBf16 / 2];  // bfloat16 (p[2j], p[2j+1]); 0: unseen
  float rescale[kVectors];
  int64_t most_seen = 0;
  for (int q = 0; q < kVectors; ++q) {
    most_seen = std::max(most_seen, visible[q]);
    rescale[q] = softmax_chunk(st, v + q, s0[q], s1[q], visible[q], scale, weight_pairs[q]);
  }
  // vectors at once in P @ V: their accumulators and one value load per head-dim vector stay in registers
  constexpr int kTogether = std::min(kVectors, std::max(1, 16 / kAcc));
  for (int q0 = 0; q0 < kVectors; q0 += kTogether) {
    __m512 o[kTogether][kAcc];
    for (int q = 0; q < kTogether; ++q) {
      const __m512 r = _mm512_set1_ps(rescale[q0 + q]);
      for (int i = 0; i < kAcc; ++i) o[q][i] = _mm512_mul_ps(_mm512_load_ps(st.acc[v + q0 + q] + 16 * i), r);
    }
    for (int64_t j = 0; j < (most_seen + 1) / 2; ++j) {  // past a vector's `seen` its weights are zero
      for (int i = 0; i < kAcc; ++i) {
        const __m512bh values = (__m512bh)chunk.values[j][i];
        for (int q = 0; q < kTogether; ++q)
          o[q][i] = _mm512_dpbf16_ps(o[q][i], (__m512bh)_mm512_set1_epi32(static_cast<int>(weight_pairs[q0 + q][j])),
                                     values);
      }
    }
    for (int q = 0; q < kTogether; ++q)
      for (int i = 0; i < kAcc; ++i) _mm512_store_ps(st.acc[v + q0 + q] + 16 * i, o[q][i]);
  }
}

// A tile of rows x group query vectors against the chunks of its sequence's KV head: chunk_at(c) is chunk c
template <int kHeadSize, typename ChunkAt>
void prefill_tile_bf16(const c10::BFloat16* q, int64_t q_row_stride, int64_t q_head_stride, ChunkAt&& chunk_at,
                       int64_t first_pos, int64_t rows, int64_t group, float scale, c10::BFloat16* out,
                       int64_t out_row_stride, int64_t out_head_stride) {
  using State = TileStateBf16<kHeadSize>;
  constexpr int kVecs = kHeadSize / 32;
  State st;
  const int64_t vectors = rows * group;
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t g = 0; g < group; ++g) {
      const int64_t v = r * group + g;
      std::memcpy(st.query[v], q + r * q_row_stride + g * q_head_stride, kHeadSize * sizeof(c10::BFloat16));
      for (int64_t d = 0; d < kHeadSize; ++d) st.acc[v][d] = 0.f;
      st.row_max[v] = -std::numeric_limits<float>::infinity();
      _mm512_store_ps(st.sum_lanes[v], _mm512_setzero_ps());
    }
  const int64_t last_pos = first_pos + rows - 1;
  for (int64_t t0 = 0; t0 <= last_pos; t0 += kKeysPerChunkBf16) {
    const ChunkBf16<kHeadSize>& chunk = chunk_at(t0 / kKeysPerChunkBf16);
    const int64_t keys = std::min(kKeysPerChunkBf16, last_pos + 1 - t0);
    int64_t visible[kTileVectors];  // causal: vector v (row v / group) sees keys t <= its position
    for (int64_t v = 0; v < vectors; ++v) visible[v] = std::min(keys, first_pos + v / group - t0 + 1);
    int64_t v = 0;
    for (; v + 4 <= vectors; v += 4) chunk_step_bf16<kHeadSize, 4>(st, chunk, v, visible + v, scale);
    for (; v < vectors; ++v) chunk_step_bf16<kHeadSize, 1>(st, chunk, v, visible + v, scale);
  }
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t g = 0; g < group; ++g) {
      const int64_t v = r * group + g;
      const float inv = 1.f / _mm512_reduce_add_ps(_mm512_load_ps(st.sum_lanes[v]));
      c10::BFloat16* o = out + r * out_row_stride + g * out_head_stride;
      for (int i = 0; i < kVecs; ++i)  // accumulators 2i, 2i+1: per 128-bit lane L, outputs 32i + 8L + 0..3, 4..7
        for (int lane = 0; lane < 4; ++lane)
          for (int j = 0; j < 4; ++j) {
            o[32 * i + 8 * lane + j] = c10::BFloat16(st.acc[v][32 * i + 4 * lane + j] * inv);
            o[32 * i + 8 * lane + 4 + j] = c10::BFloat16(st.acc[v][32 * i + 16 + 4 * lane + j] * inv);
          }
    }
}
#endif

struct PrefillItem {
  int64_t seq, kv_head, first_row, rows, g0, heads;  // rows relative to the sequence's first query row
};

#if defined(PAGODA_ISA_AVX512BF16)
// The bfloat16 cache's tile kernels: the chunk each reads, how it is prepared, the tile
template <int kHeadSize>
struct Vdpbf16Tiles {
  using Chunk = ChunkBf16<kHeadSize>;
  static constexpr int64_t kChunkKeys = kKeysPerChunkBf16;
  static constexpr auto prepare = prepare_chunk_bf16<kHeadSize>;
  template <typename... Args>
  static void tile(Args&&... args) { prefill_tile_bf16<kHeadSize>(std::forward<Args>(args)...); }
};

#if defined(PAGODA_HAVE_AMX)
template <int kHeadSize>
struct AmxTiles {
  using Chunk = amx_prefill::Chunk<kHeadSize>;
  static constexpr int64_t kChunkKeys = amx_prefill::kChunkKeys;
  static constexpr auto prepare = amx_prefill::prepare_chunk<kHeadSize>;
  template <typename... Args>
  static void tile(Args&&... args) { amx_prefill::prefill_tile<kHeadSize>(std::forward<Args>(args)...); }
};
static_assert(amx_prefill::kTileVectors == kTileVectors);
#endif

// prefill_all's items on a bfloat16 cache, by Tiles (above). A sequence with several row tiles has each chunk
// they share prepared once, for all KV heads in parallel, before the items run (it takes as much memory as the
// context's K and V); a sequence with one tile (a verification, a short chunk) prepares its chunks as it reads
// them, where they stay in L1.
template <typename Tiles>
void prefill_items_bf16(const std::vector<PrefillItem>& items, int64_t rows_per_item, const at::Tensor& query,
                        const at::Tensor& key_cache, const at::Tensor& value_cache, const at::Tensor& block_tables,
                        const int32_t* starts, const int32_t* lens, float scale, at::Tensor& out) {
  using Chunk = typename Tiles::Chunk;
  constexpr int64_t kChunkKeys = Tiles::kChunkKeys;
  const int64_t num_seqs = block_tables.size(0), block_size = key_cache.size(1), num_kv_heads = key_cache.size(2);
  const int64_t group = query.size(1) / num_kv_heads;
  // sequence i's chunk c for KV head h: chunks[first_chunk[i * num_kv_heads + h] + c]; -1: not prepared
  std::vector<int64_t> first_chunk(num_seqs * num_kv_heads, -1);
  std::vector<std::array<int64_t, 3>> to_prepare;  // (sequence, KV head, chunk)
  int64_t total = 0;
  for (int64_t i = 0; i < num_seqs; ++i) {
    if (starts[i + 1] - starts[i] <= rows_per_item) continue;  // no items, or one tile per KV head
    const int64_t n = (lens[i] + kChunkKeys - 1) / kChunkKeys;
    for (int64_t h = 0; h < num_kv_heads; ++h, total += n) {
      first_chunk[i * num_kv_heads + h] = total;
      for (int64_t c = 0; c < n; ++c) to_prepare.push_back({i, h, c});
    }
  }
  const std::unique_ptr<Chunk[]> owned(new Chunk[total]);  // aligned new; left uninitialised
  Chunk* chunks = owned.get();
  const auto* q = query.data_ptr<c10::BFloat16>();
  const auto* k = key_cache.data_ptr<c10::BFloat16>();
  const auto* v = value_cache.data_ptr<c10::BFloat16>();
  const int32_t* tables = block_tables.data_ptr<int32_t>();
  auto* o = out.data_ptr<c10::BFloat16>();
  const int64_t block_stride = key_cache.stride(0), pos_stride = key_cache.stride(1), head_stride = key_cache.stride(2);
  auto prepare = [&](Chunk& chunk, int64_t i, int64_t h, int64_t c) {
    const int64_t t0 = c * kChunkKeys;
    Tiles::prepare(chunk, k + h * head_stride, v + h * head_stride, block_stride, pos_stride,
                   tables + i * block_tables.stride(0), block_size, t0, std::min<int64_t>(kChunkKeys, lens[i] - t0));
  };
  pagoda::parallel_tasks(static_cast<int64_t>(to_prepare.size()), [&](int64_t task) {
    const auto [i, h, c] = to_prepare[task];
    prepare(chunks[first_chunk[i * num_kv_heads + h] + c], i, h, c);
  });
  const int64_t num_items = static_cast<int64_t>(items.size());
  pagoda::parallel_tasks(num_items, [&](int64_t task) {  // last items first, as prefill_all's
    const PrefillItem& it = items[num_items - 1 - task];
    const int64_t row = starts[it.seq] + it.first_row;
    const int64_t q_len = starts[it.seq + 1] - starts[it.seq];
    const int64_t first_head = it.kv_head * group + it.g0;
    const int64_t base = first_chunk[it.seq * num_kv_heads + it.kv_head];
    Chunk scratch;
    auto chunk_at = [&](int64_t c) -> const Chunk& {
      if (base >= 0) return chunks[base + c];
      prepare(scratch, it.seq, it.kv_head, c);
      return scratch;
    };
    Tiles::tile(q + row * query.stride(0) + first_head * query.stride(1), query.stride(0), query.stride(1), chunk_at,
                lens[it.seq] - q_len + it.first_row, it.rows, it.heads, scale,
                o + row * out.stride(0) + first_head * out.stride(1), out.stride(0), out.stride(1));
  });
}
#endif

#if defined(PAGODA_ISA_AVX2) && !defined(PAGODA_ISA_AVX512)
// prefill_all's items on AVX2, head sizes 64 and 128 (csrc/paged_prefill_avx2.h). A sequence with several row tiles
// has each chunk they share widened once, every KV head's in parallel, before the items run, unless the sequences'
// chunks would take more than kMaxPreparedBytes (4x their bfloat16 K and V: a long context's chunk of a large
// model); a sequence with one tile a KV head, or past that bound, widens each chunk as its tile reads it, into the
// thread's scratch chunk, where it stays in L1.
constexpr int64_t kMaxPreparedBytes = int64_t{256} << 20;
static_assert(avx2::kTileVectors == kTileVectors);

template <int D, typename scalar_t, typename cache_t>
void prefill_items_avx2(const std::vector<PrefillItem>& items, int64_t rows_per_item, const at::Tensor& query,
                        const at::Tensor& key_cache, const at::Tensor& value_cache, const at::Tensor& block_tables,
                        const int32_t* starts, const int32_t* lens, const Variant& variant, at::Tensor& out) {
  using Chunk = avx2::Chunk<D>;
  constexpr int64_t kKeys = avx2::kChunkKeys;
  const int64_t num_seqs = block_tables.size(0), block_size = key_cache.size(1), num_kv_heads = key_cache.size(2);
  const int64_t group = query.size(1) / num_kv_heads;
  // sequence i's chunk c for KV head h: chunks[base[i * num_kv_heads + h] + c] where shared[i] (c from the
  // first chunk its first row sees)
  std::vector<int64_t> base(num_seqs * num_kv_heads, 0);
  std::vector<char> shared(num_seqs, 0);
  std::vector<std::array<int64_t, 3>> to_prepare;  // (sequence, KV head, chunk)
  int64_t total = 0;
  for (int64_t i = 0; i < num_seqs; ++i) {
    const int64_t q_len = starts[i + 1] - starts[i];
    if (q_len <= rows_per_item) continue;  // no items, or one tile a KV head
    const int64_t first = variant.first_visible(lens[i] - q_len) / kKeys, n = (lens[i] + kKeys - 1) / kKeys;
    shared[i] = 1;
    for (int64_t h = 0; h < num_kv_heads; ++h, total += n - first) {
      base[i * num_kv_heads + h] = total - first;
      for (int64_t c = first; c < n; ++c) to_prepare.push_back({i, h, c});
    }
  }
  if (total * static_cast<int64_t>(sizeof(Chunk)) > kMaxPreparedBytes) {
    std::fill(shared.begin(), shared.end(), 0);
    to_prepare.clear();
    total = 0;
  }
  const std::unique_ptr<Chunk[]> owned(total ? new Chunk[total] : nullptr);  // aligned new; left uninitialised
  Chunk* chunks = owned.get();
  const auto* q = query.data_ptr<scalar_t>();
  const auto* k = static_cast<const cache_t*>(key_cache.data_ptr());
  const auto* v = static_cast<const cache_t*>(value_cache.data_ptr());
  const int32_t* tables = block_tables.data_ptr<int32_t>();
  auto* o = out.data_ptr<scalar_t>();
  const int64_t block_stride = key_cache.stride(0), pos_stride = key_cache.stride(1), head_stride = key_cache.stride(2);
  auto prepare = [&](Chunk& chunk, int64_t i, int64_t h, int64_t c, int64_t lowest) {
    avx2::prepare_chunk<D>(chunk, k + h * head_stride, v + h * head_stride, block_stride, pos_stride,
                           tables + i * block_tables.stride(0), block_size, c * kKeys,
                           std::min<int64_t>(kKeys, lens[i] - c * kKeys), lowest);
  };
  pagoda::parallel_tasks(static_cast<int64_t>(to_prepare.size()), [&](int64_t task) {
    const auto [i, h, c] = to_prepare[task];
    const int64_t q_len = starts[i + 1] - starts[i];
    prepare(chunks[base[i * num_kv_heads + h] + c], i, h, c, variant.first_visible(lens[i] - q_len));
  });
  const int64_t num_items = static_cast<int64_t>(items.size());
  pagoda::parallel_tasks(num_items, [&](int64_t task) {  // last items first, as prefill_all's
    const PrefillItem& it = items[num_items - 1 - task];
    const int64_t row = starts[it.seq] + it.first_row;
    const int64_t q_len = starts[it.seq + 1] - starts[it.seq];
    const int64_t first_head = it.kv_head * group + it.g0;
    const int64_t first_pos = lens[it.seq] - q_len + it.first_row;
    Chunk scratch;
    auto chunk_at = [&](int64_t c) -> const Chunk& {
      if (shared[it.seq]) return chunks[base[it.seq * num_kv_heads + it.kv_head] + c];
      prepare(scratch, it.seq, it.kv_head, c, variant.first_visible(first_pos));
      return scratch;
    };
    avx2::prefill_tile<D>(q + row * query.stride(0) + first_head * query.stride(1), query.stride(0), query.stride(1),
                          chunk_at, first_pos, it.rows, it.heads, variant, first_head,
                          o + row * out.stride(0) + first_head * out.stride(1), out.stride(0), out.stride(1));
  });
}
#endif

template <typename scalar_t, typename cache_t>
void prefill_all(const at::Tensor& query, const at::Tensor& key_cache, const at::Tensor& value_cache,
                 const at::Tensor& block_tables, const at::Tensor& query_start_loc, const at::Tensor& seq_lens,
                 const Variant& variant, at::Tensor& out) {
  const int64_t num_seqs = seq_lens.size(0), num_heads = query.size(1), head_size = query.size(2);
  const int64_t block_size = key_cache.size(1), num_kv_heads = key_cache.size(2);
  const int64_t group = num_heads / num_kv_heads;
  const int32_t* starts = query_start_loc.data_ptr<int32_t>();
  const int32_t* lens = seq_lens.data_ptr<int32_t>();
  const int64_t heads_per_item = std::min(group, kTileVectors);
  const int64_t rows_per_item = std::max<int64_t>(1, kTileVectors / heads_per_item);
  std::vector<PrefillItem> items;
  for (int64_t i = 0; i < num_seqs; ++i) {
    const int64_t q_len = starts[i + 1] - starts[i];
    TORCH_CHECK(0 <= q_len && q_len <= lens[i], "paged_prefill_attention: sequence ", i, " has ", q_len,
                " query rows but a context of ", lens[i]);
    if (q_len < 2) continue;  // decode rows: paged_decode_attention
    for (int64_t r0 = 0; r0 < q_len; r0 += rows_per_item)
      for (int64_t h = 0; h < num_kv_heads; ++h)
        for (int64_t g0 = 0; g0 < group; g0 += heads_per_item)
          items.push_back({i, h, r0, std::min(rows_per_item, q_len - r0), g0, std::min(heads_per_item, group - g0)});
  }
#if defined(PAGODA_ISA_AVX512BF16)
  if constexpr (std::is_same_v<scalar_t, c10::BFloat16> && std::is_same_v<cache_t, c10::BFloat16>) {
    if (variant.plain() && (head_size == 64 || head_size == 128)) {
      auto run = head_size == 64 ? prefill_items_bf16<Vdpbf16Tiles<64>> : prefill_items_bf16<Vdpbf16Tiles<128>>;
#if defined(PAGODA_HAVE_AMX)
      if (amx::usable()) run = head_size == 64 ? prefill_items_bf16<AmxTiles<64>> : prefill_items_bf16<AmxTiles<128>>;
#endif
      run(items, rows_per_item, query, key_cache, value_cache, block_tables, starts, lens, variant.q_scale, out);
      return;
    }
  }
#endif
#if defined(PAGODA_ISA_AVX2) && !defined(PAGODA_ISA_AVX512)
  if (head_size == 64 || head_size == 128) {
    (head_size == 64 ? prefill_items_avx2<64, scalar_t, cache_t> : prefill_items_avx2<128, scalar_t, cache_t>)(
        items, rows_per_item, query, key_cache, value_cache, block_tables, starts, lens, variant, out);
    return;
  }
#endif
  const scalar_t* q = query.data_ptr<scalar_t>();
  const auto* k = static_cast<const cache_t*>(key_cache.data_ptr());
  const auto* v = static_cast<const cache_t*>(value_cache.data_ptr());
  const int32_t* tables = block_tables.data_ptr<int32_t>();
  scalar_t* o = out.data_ptr<scalar_t>();
  const int64_t block_stride = key_cache.stride(0), pos_stride = key_cache.stride(1), head_stride = key_cache.stride(2);
  auto tile = head_size == 64    ? prefill_tile<scalar_t, cache_t, 64>
              : head_size == 128 ? prefill_tile<scalar_t, cache_t, 128>
                                 : prefill_tile<scalar_t, cache_t, 0>;
  const int64_t num_items = static_cast<int64_t>(items.size());
  // last items first: a sequence's last tiles see the most keys (causal), and the cheap ones fill in at the end
  pagoda::parallel_tasks(num_items, [&](int64_t task) {
    const PrefillItem& it = items[num_items - 1 - task];
    const int64_t row = starts[it.seq] + it.first_row;  // row in the batch
    const int64_t q_len = starts[it.seq + 1] - starts[it.seq];
    const int64_t first_head = it.kv_head * group + it.g0;
    tile(q + row * query.stride(0) + first_head * query.stride(1), query.stride(0), query.stride(1),
         k + it.kv_head * head_stride, v + it.kv_head * head_stride, block_stride, pos_stride,
         tables + it.seq * block_tables.stride(0), block_size, lens[it.seq] - q_len + it.first_row, it.rows, it.heads,
         head_size, variant, first_head, o + row * out.stride(0) + first_head * out.stride(1), out.stride(0),
         out.stride(1));
  });
}

}  // namespace

// query/out [T, Hq, D], sequence i's rows query_start_loc[i]:query_start_loc[i+1], the last of its seq_lens[i]
// positions; only sequences with two or more rows are computed. Caches and the rest as paged_decode_attention's.
void paged_prefill_attention(const at::Tensor& query, const at::Tensor& key_cache, const at::Tensor& value_cache,
                             const at::Tensor& block_tables, const at::Tensor& query_start_loc,
                             const at::Tensor& seq_lens, double scale, at::Tensor out, double k_scale,
                             double v_scale, int64_t sliding_window, double logit_softcap,
                             const std::optional<at::Tensor>& sinks) {
  check_attention_args("paged_prefill_attention", query, key_cache, value_cache, out, k_scale, v_scale,
                       sliding_window, logit_softcap, sinks);
  TORCH_CHECK(block_tables.scalar_type() == at::kInt && seq_lens.scalar_type() == at::kInt &&
                  query_start_loc.scalar_type() == at::kInt && block_tables.stride(1) == 1 &&
                  seq_lens.is_contiguous() && query_start_loc.is_contiguous(),
              "paged_prefill_attention: block_tables, query_start_loc and seq_lens must be int32, contiguous rows");
  TORCH_CHECK(query_start_loc.size(0) == seq_lens.size(0) + 1 && block_tables.size(0) == seq_lens.size(0),
              "paged_prefill_attention: one block table row and one length per sequence, num_seqs + 1 starts");
  with_dtypes("paged_prefill_attention", query, key_cache, [&](auto scalar, auto cache) {
    using scalar_t = decltype(scalar);
    using cache_t = decltype(cache);
    const Variant variant = make_variant<cache_t>(scale, k_scale, v_scale, sliding_window, logit_softcap, sinks);
    prefill_all<scalar_t, cache_t>(query, key_cache, value_cache, block_tables, query_start_loc, seq_lens, variant,
                                   out);
  });
}

}  // namespace pagoda::attention
