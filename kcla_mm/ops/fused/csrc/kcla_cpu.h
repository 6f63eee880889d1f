// Pieces shared by the fused KCLA CPU kernels (float32, channels-last maps).
//
// A feature map [B, C, H, W] in channels-last order is, per sample, H rows of
// W pixels of C contiguous channels. The kernels stream over rows and keep the
// three rows the depthwise 3x3 value convolution reads in cache; within a row
// they work in tiles of up to 4 pixels by one vector of channels, with the
// vector's 9 weights in registers. Every tile function is written once for a
// lane type ``L`` (GCC vectors of one register for the full vectors of
// channels, plain floats for the channels past the last full vector).
#pragma once

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <initializer_list>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>
#if defined(__unix__) || defined(__APPLE__)
#include <unistd.h>
#endif

namespace kcla_cpu {

// Floats per vector: one register. A vector wider than the registers makes the
// 3x3 tiles (9 taps, 4 accumulators, 6 inputs) spill: with 16-float vectors on
// AVX2 the kernels ran slower than the eager ops.
#if defined(__AVX512F__)
constexpr int64_t VL = 16;
#else
constexpr int64_t VL = 8;  // AVX2; on narrower SIMD the compiler splits it
#endif
typedef float vf __attribute__((vector_size(VL * sizeof(float))));

// the same vector at float alignment: unaligned loads and stores through it.
// (std::memcpy would do too, but its stores may alias anything, so the compiler
// reloads every pointer after each; this measured 5-10% slower per kernel.)
typedef float vf_unaligned __attribute__((vector_size(VL * sizeof(float)), aligned(alignof(float))));

struct VecLanes {  // a full vector of VL channels
  using V = vf;
  static constexpr int64_t n = VL;
  static V load(const float* p) { return *reinterpret_cast<const vf_unaligned*>(p); }
  static void store(float* p, V v) { *reinterpret_cast<vf_unaligned*>(p) = v; }
  static V splat(float s) { return V{} + s; }  // one broadcast (a lane loop is not)
  // a b + c rounded once, on every build: the ReLU masks of the training
  // passes (relu_in) must be the forward's bit for bit, which a contraction
  // left to the compiler does not promise at every site. (Without FMA
  // instructions, x86-64 CPUs before 2013, fmaf runs in software: slow, but
  // the same numbers; tests build for -march=haswell and -march=x86-64.)
  static V fma(V a, V b, V c) {
#if defined(__AVX512F__)
    return (V)_mm512_fmadd_ps((__m512)a, (__m512)b, (__m512)c);
#elif defined(__AVX__) && defined(__FMA__)
    return (V)_mm256_fmadd_ps((__m256)a, (__m256)b, (__m256)c);
#else
    V r;
    for (int64_t i = 0; i < VL; ++i) r[i] = __builtin_fmaf(a[i], b[i], c[i]);
    return r;
#endif
  }
  // for maps no pass reads again soon: with AVX-512, a non-temporal store
  // where p is aligned to the vector (else a plain one), so that writing them
  // does not first read their lines into the cache; fence_stores() before the
  // map is read. With narrower vectors a plain store: there a vector is half a
  // cache line, and on an AMD EPYC (Zen 3, AVX2) VM train_backward, which
  // streams gx and gprev side by side, ran 2-3x slower with 32-byte
  // non-temporal stores than with plain ones (benchmark_cpu_ops.py, inputs
  // read from memory: 123-154 against 59 ms per ResNet-50 step; the other
  // kernels the same within noise).
  static void store_nt(float* p, V v) {
#if defined(__AVX512F__)
    if (reinterpret_cast<uintptr_t>(p) % 64 == 0) return _mm512_stream_ps(p, (__m512)v);
#endif
    store(p, v);
  }
};

struct OneLane {  // one channel
  using V = float;
  static constexpr int64_t n = 1;
  static V load(const float* p) { return *p; }
  static void store(float* p, V v) { *p = v; }
  static V splat(float s) { return s; }
  static V fma(V a, V b, V c) { return __builtin_fmaf(a, b, c); }
  static void store_nt(float* p, V v) { *p = v; }
};

// The value convolution and KCLA's output ReLU round the same way in every
// pass: the ReLU masks of the training passes must be the forward's bit for
// bit. Left to the compiler, a * b + c * d may become fma(a, b, c * d) at one
// site and fma(c, d, a * b) at another (GCC chose by the code around it), so
// the fused multiply-adds are written out (L::fma) in one fixed order.
//
// One tap row of the depthwise 3x3 convolution: k[0] a + k[1] b + k[2] c, as
// fma(k[2], c, fma(k[1], b, k[0] a)).
template <class L>
inline typename L::V tap_row(const typename L::V* k, typename L::V a, typename L::V b,
                             typename L::V c) {
  return L::fma(k[2], c, L::fma(k[1], b, k[0] * a));
}

// z = a v + shift, the input of KCLA's output ReLU, rounded once: every pass
// that computes it (train_apply, the gradient passes, eval_step) gets the same
// value, so the same mask
template <class L>
inline typename L::V relu_in(typename L::V a, typename L::V v, typename L::V shift) {
  return L::fma(a, v, shift);
}

// orders the non-temporal stores of store_nt before what follows
inline void fence_stores() {
#if defined(__SSE2__)
  _mm_sfence();
#endif
}

using Vec = VecLanes;
inline vf load(const float* p) { return Vec::load(p); }
inline void store(float* p, vf v) { Vec::store(p, v); }
inline vf splat(float s) { return Vec::splat(s); }

// Calls f(L{}, std::integral_constant<int, NW>{}, w0, c0) for every tile of
// the pixels [w_lo, w_hi) of a row and the channels [c_lo, c_hi): NW = MaxNW
// pixels from w0 (NW = 1 at the range's end), the channels c0 .. c0 + L::n - 1. Pixel tiles outermost, so that
// the accesses run along memory. MaxNW = 4 reuses each loaded tap over four
// pixels; MaxNW = 1 reads every map strictly in order, which measured faster
// for the passes that stream several maps and write some (train_backward's
// gradient rows, train_apply): the hardware prefetchers follow one stream per
// map instead of four interleaved ones. (eval_step measured slower with it.)
template <class L, int MaxNW = 4, class F>
inline void row_tiles_of(int64_t w_lo, int64_t w_hi, int64_t c_lo, int64_t c_hi, F& f) {
  for (int64_t w0 = w_lo; w0 < w_hi; w0 += MaxNW) {
    const int64_t nw = std::min<int64_t>(MaxNW, w_hi - w0);
    for (int64_t c0 = c_lo; c0 + L::n <= c_hi; c0 += L::n) {
      if (nw == MaxNW) {
        f(L{}, std::integral_constant<int, MaxNW>{}, w0, c0);
      } else {
        for (int64_t w = w0; w < w0 + nw; ++w) f(L{}, std::integral_constant<int, 1>{}, w, c0);
      }
    }
  }
}

template <int MaxNW = 4, class F>
inline void row_tiles_in(int64_t w_lo, int64_t w_hi, int64_t C, F&& f) {
  const int64_t cv = C - C % VL;
  row_tiles_of<VecLanes, MaxNW>(w_lo, w_hi, 0, cv, f);
  row_tiles_of<OneLane, MaxNW>(w_lo, w_hi, cv, C, f);
}

template <int MaxNW = 4, class F>
inline void row_tiles(int64_t W, int64_t C, F&& f) {
  row_tiles_in<MaxNW>(0, W, C, std::forward<F>(f));
}

// Where tap i of channel c lies in a table of taps() (see there).
inline int64_t tap_index(int64_t c, int64_t i) { return (c / VL) * 9 * VL + i * VL + c % VL; }

// The 9 taps of channels c0.. from a table of taps().
template <class L>
inline void load_taps(const float* wt, int64_t /*C*/, int64_t c0, typename L::V k[9]) {
  for (int i = 0; i < 9; ++i) k[i] = L::load(wt + tap_index(c0, i));
}

// in[j] = row r at pixel w0 - 1 + j, channels c0..: one row of the inputs
// of the depthwise 3x3 convolution at NW pixels from w0; zero past the row's
// ends (zero padding). C: the pixel stride of the row (StagedRows::stride()
// for staged rows).
template <class L, int NW>
inline void load_row_window(const float* r, int64_t w0, int64_t W, int64_t C, int64_t c0,
                            typename L::V in[NW + 2]) {
  const typename L::V zero = L::splat(0.f);
  for (int j = 0; j < NW + 2; ++j) {
    const int64_t w = w0 - 1 + j;
    in[j] = (w >= 0 && w < W) ? L::load(r + w * C + c0) : zero;
  }
}

// conv_acc with the three tap rows summed apart, then together: 3-deep
// multiply-add chains instead of one 9-deep chain per output vector. Measured
// with benchmark_cpu_ops.py on the AMD VM: eval_step 59 -> 42 ms per ResNet-50
// forward; in train_stats the same change was 25% slower, so the training
// kernels keep conv_acc (and the order of its sums: the ReLU masks of the
// training passes must be the forward's bit for bit). Only eval_step uses it,
// whose output no other pass recomputes, so its multiply-adds are left to the
// compiler: tap_row's order here measured 7% slower (Intel VM, 2026-12-06:
// 23.95 against 22.43 ms per ResNet-50 forward).
template <class L, int NW>
inline void conv_acc_split(const float* const rows[3], const typename L::V k[9], int64_t w0,
                           int64_t W, int64_t C, int64_t c0, typename L::V acc[NW]) {
  using V = typename L::V;
  const V zero = L::splat(0.f);
  V part[3][NW];
  for (int i = 0; i < 3; ++i) {
    const float* r = rows[i];
    if (r == nullptr) {
      for (int j = 0; j < NW; ++j) part[i][j] = zero;
      continue;
    }
    V in[NW + 2];
    load_row_window<L, NW>(r, w0, W, C, c0, in);
    for (int j = 0; j < NW; ++j)
      part[i][j] = k[3 * i] * in[j] + k[3 * i + 1] * in[j + 1] + k[3 * i + 2] * in[j + 2];
  }
  for (int j = 0; j < NW; ++j) acc[j] = part[0][j] + (part[1][j] + part[2][j]);
}

// acc[j] = (k * rows)(w0 + j) for channels c0..: the depthwise 3x3 convolution
// (cross-correlation, zero padding) at NW pixels; rows[i] is the row of the
// i-th tap row, null outside the map; C: the pixel stride of the rows. Each
// input vector is loaded once.
template <class L, int NW>
inline void conv_acc(const float* const rows[3], const typename L::V k[9], int64_t w0,
                     int64_t W, int64_t C, int64_t c0, typename L::V acc[NW]) {
  using V = typename L::V;
  const V zero = L::splat(0.f);
  for (int j = 0; j < NW; ++j) acc[j] = zero;
  for (int i = 0; i < 3; ++i) {
    const float* r = rows[i];
    if (r == nullptr) continue;
    V in[NW + 2];
    load_row_window<L, NW>(r, w0, W, C, c0, in);
    for (int j = 0; j < NW; ++j) acc[j] += tap_row<L>(k + 3 * i, in[j], in[j + 1], in[j + 2]);
  }
}

// The depthwise 3x3 convolution of rows (as conv_acc) at the n pixels from
// w0, channels c0 .. c0 + L::n - 1, into out + j * C + c0 for pixel w0 + j:
// one pixel after the other with the 9 taps in registers and a sliding window
// of the three input columns, so 3 loads per output vector instead of 9 taps
// and 9 inputs for a tile of one pixel. Each pixel's sum is conv_acc's
// expression in conv_acc's order: the ReLU masks of the training passes agree
// bit for bit whichever of the two computed them.
template <class L>
inline void conv_span(const float* const rows[3], const float* wt, int64_t w0, int64_t n,
                      int64_t W, int64_t C, int64_t P, int64_t c0, float* out) {
  using V = typename L::V;
  V k[9];
  load_taps<L>(wt, C, c0, k);
  const V zero = L::splat(0.f);
  auto col = [&](int i, int64_t w) {
    return (rows[i] != nullptr && w >= 0 && w < W) ? L::load(rows[i] + w * P + c0) : zero;
  };
  V a[3], b[3];
  for (int i = 0; i < 3; ++i) a[i] = col(i, w0 - 1), b[i] = col(i, w0);
  const bool r0 = rows[0] != nullptr, r2 = rows[2] != nullptr;
  for (int64_t j = 0; j < n; ++j) {
    V c[3];
    for (int i = 0; i < 3; ++i) c[i] = col(i, w0 + j + 1);
    V acc = zero;
    if (r0) acc += tap_row<L>(k, a[0], b[0], c[0]);
    acc += tap_row<L>(k + 3, a[1], b[1], c[1]);
    if (r2) acc += tap_row<L>(k + 6, a[2], b[2], c[2]);
    L::store(out + j * C + c0, acc);
    for (int i = 0; i < 3; ++i) a[i] = b[i], b[i] = c[i];
  }
}

// Pixels per span of conv_pixels: a span of all C channels in 16 KB (L1).
inline int64_t span_pixels(int64_t C) { return std::max<int64_t>(1, 4096 / C); }

// out[j * C + c] = the depthwise 3x3 convolution of rows at pixel w0 + j,
// channel c, for the n pixels from w0 (n <= span_pixels(C)); wt: a table of
// taps(), P: the pixel stride of rows, which are never null in the middle.
inline void conv_pixels(const float* const rows[3], const float* wt, int64_t w0, int64_t n,
                        int64_t W, int64_t C, int64_t P, float* out) {
  const int64_t cv = C - C % VL;
  for (int64_t c0 = 0; c0 < cv; c0 += VL) conv_span<VecLanes>(rows, wt, w0, n, W, C, P, c0, out);
  for (int64_t c0 = cv; c0 < C; ++c0) conv_span<OneLane>(rows, wt, w0, n, W, C, P, c0, out);
}

// lerp_row for the channels c0 .. c0 + L::n - 1 of one pixel
template <class L>
inline typename L::V lerp_value(const float* p, const float* x, const float* beta, int64_t c0) {
  using V = typename L::V;
  const V b = L::load(beta + c0), pv = L::load(p + c0), xv = L::load(x + c0);
  const V d = xv - pv;
  const V lo = pv + b * d, hi = xv - d * (L::splat(1.0f) - b);
  return b < L::splat(0.5f) ? lo : hi;
}

template <class L>
inline void lerp_lanes(const float* p, const float* x, const float* beta, float* o, int64_t c0) {
  L::store(o + c0, lerp_value<L>(p, x, beta, c0));
}

// mean_row[w, c] = prev_row[w, c] + beta[c] * (x_row[w, c] - prev_row[w, c])
// (torch.lerp's formula for weights below 0.5, the other branch above it).
// Written with the lane types: as a scalar loop with `omp simd` GCC did not
// vectorise the two branches, and the lerp was half of eval_step's time.
inline void lerp_row(const float* prev, const float* x, const float* beta, float* out,
                     int64_t W, int64_t C) {
  const int64_t cv = C - C % VL;
  for (int64_t w = 0; w < W; ++w) {
    const float* p = prev + w * C;
    const float* xx = x + w * C;
    float* o = out + w * C;
    for (int64_t c0 = 0; c0 < cv; c0 += VL) lerp_lanes<VecLanes>(p, xx, beta, o, c0);
    for (int64_t c0 = cv; c0 < C; ++c0) lerp_lanes<OneLane>(p, xx, beta, o, c0);
  }
}

// Software prefetch of rows a later row step reads first (null: none), spread
// over the tiles of the current row: tile (w0, c0) prefetches the same pixels
// and channels of each of them, one request per 64-byte line. The tiles visit
// 6 pixels 4 C bytes apart per channel vector, an order the hardware
// prefetchers follow poorly. In-process A/B on an AVX2 machine, ResNet-50
// shapes summed over the blocks: train_backward 94 -> 80 ms, train_grad_stats
// 25 -> 19, train_apply 27 -> 24; train_stats got slower (its new rows are
// read in order by the lerp) and does not prefetch.
struct RowPrefetch {
  const float* rows[3] = {nullptr, nullptr, nullptr};
  template <int NW>
  void tile(int64_t w0, int64_t C, int64_t c0) const {
    if (c0 % 16 != 0) return;  // 16 floats: one cache line
    for (const float* r : rows)
      if (r != nullptr)
        for (int j = 0; j < NW; ++j) __builtin_prefetch(r + (w0 + j) * C + c0);
  }
};

// out_row = x_row + relu(a * conv3x3(rows) + shift) at the pixels [w_lo, w_hi)
// of a row of W, rows[i] null for zero padding; wt: a table of taps(), a,
// shift: [C]. (P: the pixel stride of rows, e.g. StagedRows::stride(); x and
// out: C; Split: conv_acc_split instead of conv_acc)
template <bool Split = false, int MaxNW = 4>
inline void conv_row(const float* const rows[3], const float* x, float* out, const float* wt,
                     const float* a, const float* shift, int64_t w_lo, int64_t w_hi, int64_t W,
                     int64_t C, int64_t P, const RowPrefetch& pf = RowPrefetch{}) {
  row_tiles_in<MaxNW>(w_lo, w_hi, C, [&](auto lanes, auto nw, int64_t w0, int64_t c0) {
    using L = decltype(lanes);
    using V = typename L::V;
    constexpr int NW = decltype(nw)::value;
    pf.tile<NW>(w0, C, c0);
    V k[9], acc[NW];
    load_taps<L>(wt, C, c0, k);
    if (Split) {
      conv_acc_split<L, NW>(rows, k, w0, W, P, c0, acc);
    } else {
      conv_acc<L, NW>(rows, k, w0, W, P, c0, acc);
    }
    const V va = L::load(a + c0), vs = L::load(shift + c0), zero = L::splat(0.f);
    for (int j = 0; j < NW; ++j) {
      const int64_t o = (w0 + j) * C + c0;
      V v = relu_in<L>(va, acc[j], vs);
      v = v > zero ? v : zero;
      L::store(out + o, L::load(x + o) + v);
    }
  });
}

// wv [C, 1, 3, 3] as blocks of VL channels, each [9, VL] (tap_index): the 9
// taps of one vector of channels lie together. (Tap-major [9, C] put them C
// floats apart, in one L1 set when C is a multiple of 256: 9 lines in an
// 8-way set, reloaded at every tile.) Flipped: tap 8 - i (the transposed
// convolution of the backward pass).
inline std::vector<float> taps(const float* wv, int64_t C, bool flipped = false) {
  std::vector<float> wt(((C + VL - 1) / VL) * 9 * VL, 0.f);
  for (int64_t c = 0; c < C; ++c)
    for (int64_t i = 0; i < 9; ++i) wt[tap_index(c, i)] = wv[c * 9 + (flipped ? 8 - i : i)];
  return wt;
}

// Pixel stride of staged rows: C floats plus one cache line where C floats
// are a multiple of 512 bytes. In a channels-last map the pixels are C floats
// apart; for C = 128, 256, ... the 18 input vectors of a tile of the 3x3
// convolution then fall into one to four L1 sets (8 ways each), together with
// the other maps' vectors of the tile, so that every load misses L1 (the
// kernels ran 1.5-2.6x slower per element at C = 256 and 1024 than at 272 and
// 1040).
inline int64_t staged_stride(int64_t C) { return C % 128 == 0 ? C + 16 : C; }

// Whether eval_step stages its rows (StagedRows). The staging was measured on
// an 8-way L1 (AMD EPYC VM, training kernels 214 -> 193 ms per step); on a
// 12-way L1 (Intel Xeon VM) eval_step measured faster without it (in place
// at ResNet-50 shapes, 10.2 -> 9.1 ms per forward), the training kernels the
// same. So: stage where L1 has fewer than 12 ways or its ways are unknown.
// KCLA_MM_CPU_STAGE_ROWS=1 / 0 forces it (read at every call: the tests check
// that both ways compute the same).
inline bool stage_rows() {
  const char* env = std::getenv("KCLA_MM_CPU_STAGE_ROWS");
  if (env != nullptr && (env[0] == '0' || env[0] == '1') && env[1] == '\0') return env[0] == '1';
  static const bool few_ways = [] {
#if defined(_SC_LEVEL1_DCACHE_ASSOC)
    return sysconf(_SC_LEVEL1_DCACHE_ASSOC) < 12;
#else
    return true;
#endif
  }();
  return few_ways;
}

// A ring of 3 rows of a map (W pixels of C channels) with the pixel stride
// staged_stride(C), 64-byte aligned, each slot one cache line further into
// the sets than the last: the rows a 3x3 convolution reads, copied in once
// per row (a sequential copy) where the map's own stride aliases. Where it
// does not, stage() hands back the map's row itself.
class StagedRows {
 public:
  // stage = false: never copy (stride() == C), where L1 has ways enough
  StagedRows(int64_t W, int64_t C, bool stage = true)
      : W_(W), C_(C), P_(stage ? staged_stride(C) : C),
        slot_(((W * P_ + 15) / 16) * 16 + 16),
        buf_(P_ == C ? 0 : 3 * slot_ + 16) {
    const uintptr_t p = reinterpret_cast<uintptr_t>(buf_.data());
    base_ = buf_.data() + ((64 - p % 64) % 64) / sizeof(float);
  }
  int64_t stride() const { return P_; }
  // ring slot of row h (h >= -1); only where stride() != C
  float* slot(int64_t h) { return base_ + ((h + 3) % 3) * slot_; }
  // row h of the map (src: its W * C floats) in the ring; src itself if no copy is needed
  const float* stage(int64_t h, const float* src) {
    if (P_ == C_ || src == nullptr) return src;
    float* dst = slot(h);
    for (int64_t w = 0; w < W_; ++w) std::memcpy(dst + w * P_, src + w * C_, C_ * sizeof(float));
    return dst;
  }

 private:
  int64_t W_, C_, P_, slot_;
  std::vector<float> buf_;
  float* base_;
};

// -- ReLU masks: one bit per value of a channels-last map --
// Per pixel mask_bytes(C) bytes; bit c % 8 of byte c / 8 is set where a ReLU
// passes the gradient: where not x <= 0 (x > 0, or NaN), threshold_backward's
// test on the ReLU's output. 1/32 of the map: what a residual block's last
// ReLU needs for its backward pass instead of its output.
inline int64_t mask_bytes(int64_t C) { return (C + 7) / 8; }

// lane i of v -> bit i: set where not v <= 0
inline uint32_t relu_bits(vf v) {
#if defined(__AVX512F__)
  return _mm512_cmp_ps_mask((__m512)v, _mm512_setzero_ps(), _CMP_NLE_UQ);
#elif defined(__AVX__)
  return static_cast<uint32_t>(
      _mm256_movemask_ps(_mm256_cmp_ps((__m256)v, _mm256_setzero_ps(), _CMP_NLE_UQ)));
#else
  uint32_t bits = 0;
  for (int i = 0; i < VL; ++i) bits |= static_cast<uint32_t>(!(v[i] <= 0.f)) << i;
  return bits;
#endif
}

// the VL bits of a full vector at channel c0 (a multiple of VL, so of 8)
inline void store_bits(uint8_t* pixel, int64_t c0, uint32_t bits) {
  for (int64_t k = 0; k < VL / 8; ++k) pixel[c0 / 8 + k] = static_cast<uint8_t>(bits >> (8 * k));
}
inline uint32_t load_bits(const uint8_t* pixel, int64_t c0) {
  uint32_t bits = 0;
  for (int64_t k = 0; k < VL / 8; ++k) bits |= static_cast<uint32_t>(pixel[c0 / 8 + k]) << (8 * k);
  return bits;
}
inline bool mask_bit(const uint8_t* pixel, int64_t c) { return (pixel[c / 8] >> (c % 8)) & 1; }

// v in the lanes whose bit is set, +0 in the others
inline vf select_bits(uint32_t bits, vf v) {
#if defined(__AVX512F__)
  return (vf)_mm512_maskz_mov_ps(static_cast<__mmask16>(bits), (__m512)v);
#else
  typedef int32_t vi __attribute__((vector_size(VL * sizeof(int32_t))));
  vi lane{};
  for (int i = 0; i < VL; ++i) lane[i] = 1 << i;
  const vi set = ((vi{} + static_cast<int32_t>(bits)) & lane) != 0;
  return set ? v : vf{};
#endif
}

// -- grouped 1x1 convolutions of a row (an init layer's ``adjust``) --
// out[w, g dout + c] = bias[g dout + c] + sum_i wt[g][i][c] * src[w, g di + i]
// for the W pixels of a row: src pixel w at src + w * src_step (the stride of
// the convolution times the map's channels), out pixel w at out + w * out_step;
// G groups of di = Cin / G inputs and dout = Cout / G outputs; wt [G, di, dout]
// (the weights of a group transposed: its output channels contiguous); bias
// [Cout], or null for none. With wt the weights in their own layout
// [G, dout, di] (and di, dout swapped) the same function computes the
// transposed convolution (the backward pass's gradient of the input).

// NP pixels of group g: NV vectors of outputs each (a slice of the group's
// dout), accumulated in registers; wg the slice's first weights, ws the
// floats between one input's weights and the next's (dout).
template <int NP, int NV>
inline void grouped_tile(const float* const src[NP], const float* wg, int64_t ws,
                         const float* bg, float* const dst[NP], int64_t di) {
  vf acc[NP][NV];
  for (int v = 0; v < NV; ++v) {
    const vf b = bg != nullptr ? load(bg + v * VL) : splat(0.f);
    for (int p = 0; p < NP; ++p) acc[p][v] = b;
  }
  for (int64_t i = 0; i < di; ++i) {
    vf wv[NV];
    for (int v = 0; v < NV; ++v) wv[v] = load(wg + i * ws + v * VL);
    for (int p = 0; p < NP; ++p) {
      const vf s = splat(src[p][i]);
      for (int v = 0; v < NV; ++v) acc[p][v] += s * wv[v];
    }
  }
  for (int p = 0; p < NP; ++p)
    for (int v = 0; v < NV; ++v) store(dst[p] + v * VL, acc[p][v]);
}

// The tiles' shape: NP x NV accumulators, NV weight vectors and a broadcast
// must fit the vector registers (32 with AVX-512, 16 on AVX2: there 4 x 4
// spilled, and outputs wider than 4 vectors took the scalar loop below).
#if defined(__AVX512F__)
constexpr int kGroupedNP = 4, kGroupedNV = 4;
#else
constexpr int kGroupedNP = 4, kGroupedNV = 2;
#endif

// the NV-vector slice at vector v0 of each group's outputs, for the W pixels
template <int NV>
void grouped_slice(const float* src, int64_t src_step, const float* wt, const float* bias,
                   float* out, int64_t out_step, int64_t W, int64_t di, int64_t dout, int64_t G,
                   int64_t v0) {
  constexpr int NP = kGroupedNP;
  const int64_t c0 = v0 * VL;
  for (int64_t g = 0; g < G; ++g) {
    const float* wg = wt + g * di * dout + c0;
    const float* bg = bias != nullptr ? bias + g * dout + c0 : nullptr;
    int64_t w = 0;
    for (; w + NP <= W; w += NP) {
      const float* s[NP];
      float* d[NP];
      for (int p = 0; p < NP; ++p) {
        s[p] = src + (w + p) * src_step + g * di;
        d[p] = out + (w + p) * out_step + g * dout + c0;
      }
      grouped_tile<NP, NV>(s, wg, dout, bg, d, di);
    }
    for (; w < W; ++w) {
      const float* s[1] = {src + w * src_step + g * di};
      float* d[1] = {out + w * out_step + g * dout + c0};
      grouped_tile<1, NV>(s, wg, dout, bg, d, di);
    }
  }
}

inline void grouped_row(const float* src, int64_t src_step, const float* wt, const float* bias,
                        float* out, int64_t out_step, int64_t W, int64_t Cin, int64_t Cout,
                        int64_t G) {
  const int64_t di = Cin / G, dout = Cout / G;
  if (dout % VL == 0) {  // slices of kGroupedNV vectors, then the rest
    const int64_t nv = dout / VL;
    int64_t v0 = 0;
    for (; v0 + kGroupedNV <= nv; v0 += kGroupedNV)
      grouped_slice<kGroupedNV>(src, src_step, wt, bias, out, out_step, W, di, dout, G, v0);
    switch (nv - v0) {
      case 0: return;
      case 1: return grouped_slice<1>(src, src_step, wt, bias, out, out_step, W, di, dout, G, v0);
      case 2: return grouped_slice<2>(src, src_step, wt, bias, out, out_step, W, di, dout, G, v0);
      default: return grouped_slice<3>(src, src_step, wt, bias, out, out_step, W, di, dout, G, v0);
    }
  }
  for (int64_t w = 0; w < W; ++w) {
    const float* s = src + w * src_step;
    float* o = out + w * out_step;
    for (int64_t g = 0; g < G; ++g) {
      float* og = o + g * dout;
      const float* sg = s + g * di;
      const float* wg = wt + g * di * dout;  // [di, dout] of group g
      if (bias != nullptr) {
        std::memcpy(og, bias + g * dout, dout * sizeof(float));
      } else {
        std::fill(og, og + dout, 0.f);
      }
      for (int64_t i = 0; i < di; ++i) {
        const float v = sg[i];
        const float* wi = wg + i * dout;
#pragma omp simd
        for (int64_t c = 0; c < dout; ++c) og[c] += v * wi[c];
      }
    }
  }
}

// grouped 1x1 weights [Cout, di] (a Conv2d's [Cout, di, 1, 1]) as grouped_row's
// wt, [G, di, dout]
inline std::vector<float> grouped_weights_t(const float* w, int64_t Cout, int64_t di, int64_t G) {
  const int64_t dout = Cout / G;
  std::vector<float> wt(Cout * di);
  for (int64_t g = 0; g < G; ++g)
    for (int64_t c = 0; c < dout; ++c)
      for (int64_t i = 0; i < di; ++i) wt[(g * di + i) * dout + c] = w[(g * dout + c) * di + i];
  return wt;
}

// Pixels per task of the global pool, and per run summed in float before the
// runs are summed in double. (With runs of 2048 pixels a test's training
// step flipped a ReLU mask that float64 and ATen's mean, which the training
// kernels used before, did not: relative error 5e-2 instead of 1e-4 in a
// weight's gradient; with runs of 16, 1.2e-4.)
inline int64_t pool_chunk(int64_t HW) { return std::max<int64_t>(1, std::min<int64_t>(HW, 2048)); }
constexpr int64_t kPoolRun = 16;

// What global_pool does to the map as it pools it.
enum class PoolMode { kRead, kAddRelu, kAffineAddRelu };

// Per-channel affines [C] applied before a residual add: x -> ax x + bx, and
// res -> ar res + br unless ar is null (res added as it is). An eval-mode
// BatchNorm's, computed as ATen does (bn_eval_affine).
struct PreAffine {
  const float *ax = nullptr, *bx = nullptr, *ar = nullptr, *br = nullptr;
};

// one pixel of o <- relu(x + res) (the values of torch's x += res;
// x.relu_(): -0 and NaN kept; o may be x), or with Affine of o <- relu((ax x
// + bx) + (ar res + br)) (those of two eval-mode BatchNorms, each one fused
// multiply-add per value as ATen's, then the add and the ReLU); its values
// summed into acc and, given mk, its ReLU mask written there
template <bool Affine = false>
inline void add_relu_pixel(const float* r, float* o, const float* e, float* acc, uint8_t* mk,
                           int64_t C, const PreAffine& f = PreAffine{}) {
  const int64_t cv = C - C % VL;
  const vf zero = splat(0.f);
  for (int64_t c0 = 0; c0 < cv; c0 += VL) {
    vf x = load(r + c0), res = load(e + c0);
    if constexpr (Affine) {
      x = x * load(f.ax + c0) + load(f.bx + c0);
      if (f.ar != nullptr) res = res * load(f.ar + c0) + load(f.br + c0);
    }
    const vf u = x + res;
    const vf v = u < zero ? zero : u;
    store(o + c0, v);
    store(acc + c0, load(acc + c0) + v);
    if (mk != nullptr) store_bits(mk, c0, relu_bits(v));
  }
  if (cv == C) return;
  if (mk != nullptr)
    for (int64_t k = cv / 8; k < mask_bytes(C); ++k) mk[k] = 0;
  for (int64_t c = cv; c < C; ++c) {
    float x = r[c], res = e[c];
    if constexpr (Affine) {
      x = std::fma(x, f.ax[c], f.bx[c]);
      if (f.ar != nullptr) res = std::fma(res, f.ar[c], f.br[c]);
    }
    const float u = x + res;
    const float v = u < 0.f ? 0.f : u;
    o[c] = v;
    acc[c] += v;
    if (mk != nullptr) mk[c / 8] |= static_cast<uint8_t>(!(v <= 0.f)) << (c % 8);
  }
}

// The global average pool of x [B, H, W, C] (channels-last), [B, C] into
// pooled (float sums of up to pool_chunk pixels, added in double, the mean
// rounded to float; the kernels' one definition of the pool). kAddRelu: first
// x <- relu(x + res) in place, in the same pass (add_relu_pixel), and, given
// mask, its ReLU mask (mask_bytes(C) bytes per pixel). kAffineAddRelu: the
// same with the affines f first (add_relu_pixel<true>). Given out, the result
// goes there instead of into x.
template <PoolMode Mode>
inline void global_pool(std::conditional_t<Mode == PoolMode::kRead, const float*, float*> xp,
                        const float* res, int64_t B, int64_t HW, int64_t C, float* pooled,
                        uint8_t* mask = nullptr, const PreAffine& f = PreAffine{},
                        float* out = nullptr) {
  const int64_t plane = HW * C, chunk = pool_chunk(HW);
  const int64_t nchunks = (HW + chunk - 1) / chunk;
  std::vector<double> partial(B * nchunks * C, 0.0);
  at::parallel_for(0, B * nchunks, 1, [&](int64_t lo, int64_t hi) {
    std::vector<float> acc(C);
    for (int64_t t = lo; t < hi; ++t) {
      const int64_t b = t / nchunks, j = t % nchunks;
      const int64_t s0 = j * chunk, s1 = std::min(HW, s0 + chunk);
      double* dst = partial.data() + t * C;
      float* ap = acc.data();
      for (int64_t s = s0; s < s1; ++s) {
        if ((s - s0) % kPoolRun == 0) {  // a new run: the last one into the double sums
          if (s > s0)
            for (int64_t c = 0; c < C; ++c) dst[c] += ap[c];
          std::fill(acc.begin(), acc.end(), 0.f);
        }
        const auto r = xp + b * plane + s * C;
        if constexpr (Mode != PoolMode::kRead) {
          add_relu_pixel<Mode == PoolMode::kAffineAddRelu>(
              r, out == nullptr ? r : out + b * plane + s * C, res + b * plane + s * C, ap,
              mask == nullptr ? nullptr : mask + (b * HW + s) * mask_bytes(C), C, f);
        } else {
#pragma omp simd
          for (int64_t c = 0; c < C; ++c) ap[c] += r[c];
        }
      }
      for (int64_t c = 0; c < C; ++c) dst[c] += ap[c];
    }
  });
  std::vector<double> p(C);
  for (int64_t b = 0; b < B; ++b) {
    for (int64_t j = 0; j < nchunks; ++j) {
      const double* src = partial.data() + (b * nchunks + j) * C;
      if (j == 0) {
        for (int64_t c = 0; c < C; ++c) p[c] = src[c];
      } else {
        for (int64_t c = 0; c < C; ++c) p[c] += src[c];
      }
    }
    for (int64_t c = 0; c < C; ++c)
      pooled[b * C + c] = static_cast<float>(p[c] / static_cast<double>(HW));
  }
}

inline void check_map(const char* op, const at::Tensor& t, const char* name,
                      at::IntArrayRef shape) {
  TORCH_CHECK(t.device().is_cpu() && t.scalar_type() == at::kFloat, "kcla_mm ", op, ": ", name,
              " must be a CPU float32 tensor, got ", t.device(), " ", t.scalar_type());
  TORCH_CHECK(t.sizes() == shape, "kcla_mm ", op, ": ", name, " has shape ", t.sizes(),
              ", expected ", shape);
  TORCH_CHECK(t.is_contiguous(at::MemoryFormat::ChannelsLast), "kcla_mm ", op, ": ", name,
              " must be channels-last contiguous");
}

// the data of a small parameter tensor: CPU, contiguous, n elements of type T
template <typename T>
const T* param(const char* op, const at::Tensor& t, int64_t n, const char* name) {
  TORCH_CHECK(t.device().is_cpu() && t.scalar_type() == c10::CppTypeToScalarType<T>::value &&
                  t.is_contiguous() && t.numel() == n,
              "kcla_mm ", op, ": ", name, " must be a contiguous CPU ",
              c10::CppTypeToScalarType<T>::value, " tensor of ", n, " elements, got ",
              t.scalar_type(), " of shape ", t.sizes());
  return t.data_ptr<T>();
}

// An eval-mode BatchNorm's per-channel affine [2, C] (alpha, beta), as ATen
// computes it: in float, alpha = weight / sqrt(var + eps) (the reciprocal of
// the root, then the product), beta = bias - mean alpha in one fused
// multiply-add. x alpha + beta, one more, is then that BatchNorm's output bit
// for bit.
inline std::vector<float> bn_eval_affine(const char* op, const char* name, int64_t C,
                                  const at::Tensor& weight, const at::Tensor& bias,
                                  const at::Tensor& mean, const at::Tensor& var, double eps) {
  const std::string n(name);
  const float* w = param<float>(op, weight, C, (n + "weight").c_str());
  const float* b = param<float>(op, bias, C, (n + "bias").c_str());
  const float* m = param<float>(op, mean, C, (n + "running_mean").c_str());
  const float* v = param<float>(op, var, C, (n + "running_var").c_str());
  TORCH_CHECK(eps > 0, "kcla_mm ", op, ": ", n, "eps must be positive, got ", eps);
  std::vector<float> ab(2 * C);
  const float e = static_cast<float>(eps);
  for (int64_t c = 0; c < C; ++c) {
    const float invstd = 1.f / std::sqrt(v[c] + e);
    ab[c] = invstd * w[c];
    ab[C + c] = std::fma(-m[c], ab[c], b[c]);
  }
  return ab;
}

// checks that mask is the ReLU mask (mask_bytes(C) bytes per pixel) that
// producer wrote for a [B, C, H, W] map
inline void check_mask(const char* op, const at::Tensor& mask, int64_t B, int64_t C, int64_t H,
                       int64_t W, const char* producer) {
  const int64_t nb = mask_bytes(C);
  TORCH_CHECK(mask.device().is_cpu() && mask.scalar_type() == at::kByte && mask.is_contiguous() &&
                  mask.sizes() == at::IntArrayRef({B, H, W, nb}),
              "kcla_mm ", op, ": mask must be ", producer, "'s contiguous uint8 [", B, ", ", H,
              ", ", W, ", ", nb, "] mask of a map of shape [", B, ", ", C, ", ", H, ", ", W,
              "], got ", mask.scalar_type(), " of shape ", mask.sizes());
}

// Whether the optional tensors ts (named names, e.g. "res_weight, res_bias")
// are given, all of them (true) or none (false); a part of them is an error
// that names them.
inline bool all_or_none(const char* op, const char* names,
                        std::initializer_list<const c10::optional<at::Tensor>*> ts) {
  size_t n = 0;
  for (auto t : ts) n += t->has_value() && (*t)->defined();
  TORCH_CHECK(n == 0 || n == ts.size(), "kcla_mm ", op, ": ", names,
              " must be given together (res's BatchNorm) or not at all, got ", n, " of them");
  return n > 0;
}

// Bands of rows per sample, so that small batches use every thread: returns
// (rows per band, bands).
inline std::pair<int64_t, int64_t> bands_of(int64_t B, int64_t H) {
  const int64_t threads = at::get_num_threads();
  const int64_t bands =
      std::max<int64_t>(1, std::min<int64_t>(H / 4, (2 * threads + B - 1) / B));
  const int64_t band_h = (H + bands - 1) / bands;
  return {band_h, (H + band_h - 1) / band_h};
}

// -- the per-head math of a step ([B, C] vectors, double precision) --
//   q, k = ECA(p); |k|; logit = min(|k| tau, clamp)
//   log z' = logaddexp(log z, logit); beta = exp(logit - log z')  (with a state)
//   gate = sigmoid(Phi(<q, k> / max(|k|, 1e-12))); shrink = sigmoid(log z' - log eps)
// (docs/method.md section 4, steps 1, 2, 3 and 5, in the form of
// kcla_mm/ops/kcla.py: KCLA.keys, logits, _merge, gate). The eval step and the
// training step (head_forward, head_backward) both run it.
struct HeadMath {
  int64_t B, C, G, D, K, pad;
  const float *p, *lz0, *wq, *wk, *phi;  // p: the pooled map [B, C]; lz0: log z [B, G] or null
  const double* tau;
  double clamp, log_eps;
  // per sample: q, k [C]; per head: |k|, raw logit, log z', beta, shrink,
  // <q, k>, max(|k|, 1e-12), h, gate
  std::vector<double> q, k, kn, raw, lz, bt, shr, qk, knc, h, gate;

  HeadMath(int64_t B_, int64_t C_, int64_t G_, int64_t K_, const float* p_, const float* lz0_,
           const float* wq_, const float* wk_, const double* tau_, const float* phi_,
           double clamp_, double eps)
      : B(B_), C(C_), G(G_), D(C_ / G_), K(K_), pad((K_ - 1) / 2), p(p_), lz0(lz0_), wq(wq_),
        wk(wk_), phi(phi_), tau(tau_), clamp(clamp_), log_eps(std::log(eps)), q(C_), k(C_),
        kn(G_), raw(G_), lz(G_), bt(G_), shr(G_), qk(G_), knc(G_), h(G_), gate(G_),
        padded_(C_ + 2 * ((K_ - 1) / 2), 0.0) {}

  static double logaddexp(double a, double b) {
    const double m = std::max(a, b);
    if (std::isinf(m) && m < 0) return m;
    return m + std::log1p(std::exp(-std::abs(a - b)));
  }

  void run(int64_t b) {
    // the ECA cross-correlations over p zero-padded by the half-width, taps
    // outermost (vectorises; for each channel the sum runs over the taps in order)
    double* pp = padded_.data() + pad;
    for (int64_t c = 0; c < C; ++c) pp[c] = p[b * C + c];  // the float32 pool, like torch
    double* __restrict__ qp = q.data();
    double* __restrict__ kp = k.data();
    std::fill(qp, qp + C, 0.0);
    std::fill(kp, kp + C, 0.0);
    for (int64_t j = 0; j < K; ++j) {
      const double cq = wq[j], ck = wk[j];
      const double* __restrict__ src = pp + j - pad;
#pragma omp simd
      for (int64_t c = 0; c < C; ++c) {
        qp[c] += cq * src[c];
        kp[c] += ck * src[c];
      }
    }
    for (int64_t g = 0; g < G; ++g) {
      double kk = 0, s = 0;
      for (int64_t d = 0; d < D; ++d) {
        kk += k[g * D + d] * k[g * D + d];
        s += q[g * D + d] * k[g * D + d];
      }
      kn[g] = std::sqrt(kk);
      qk[g] = s;
      knc[g] = std::max(kn[g], 1e-12);
      h[g] = s / knc[g];
      raw[g] = kn[g] * static_cast<float>(tau[g]);  // the float32 temperatures, like torch
      const double logit = clamp > 0 ? std::min(raw[g], clamp) : raw[g];
      if (lz0) {
        lz[g] = logaddexp(lz0[b * G + g], logit);
        bt[g] = std::exp(logit - lz[g]);
      } else {
        lz[g] = logit;
        bt[g] = 1.0;
      }
      shr[g] = 1.0 / (1.0 + std::exp(-(lz[g] - log_eps)));  // z / (z + eps)
    }
    for (int64_t g = 0; g < G; ++g) {
      double s = 0;
      for (int64_t j = 0; j < G; ++j) s += phi[g * G + j] * h[j];
      gate[g] = 1.0 / (1.0 + std::exp(-s));
    }
  }

 private:
  std::vector<double> padded_;
};

}  // namespace kcla_cpu
