// Fused training step of KCLA's feature-map part on the CPU (float32, channels-last).
//
// The tail of a KCLA step (kcla_mm/ops/kcla.py, KCLA.tail) with a training-mode
// BatchNorm, batch statistics and all:
//   mean = lerp(prev, x, beta)           v = Wv * mean  (depthwise 3x3)
//   s = scale v   o = BN(s)   out = x + keep relu(o)
// The Python side (fused_tail_cpu.FusedStep) does the [B, C]-sized algebra in double
// precision; these four ops are the passes over the feature maps:
//   train_stats       mean, and per (sample, channel) sum v and sum v^2
//   train_apply       out = x + relu(a v + shift)   (a, shift per sample and
//                     channel: BatchNorm, gate and drop-path mask folded)
//   train_grad_stats  per (sample, channel) sum g and sum g v, g = dL/do
//   train_backward    gx, gprev, sum over pixels of gm (x - prev), dL/dWv,
//                     and the sums of train_grad_stats again
// v is never stored: every pass recomputes it from the rows of mean, which
// stay in cache. The maps the passes write (mean, out, gx, gprev) are written
// with non-temporal stores on AVX-512 builds (store_nt): no pass reads them
// back soon, and a plain store would first read every line of the map from
// memory (in-model A/B on ResNet-50: about 2% of a training step; on AVX2
// they are plain stores, see store_nt). Reductions sum in float
// over about 256 pixels (flush_after), then go through per-task partial sums
// in double, combined in a fixed order, so results do not depend on the
// thread count's scheduling.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <cmath>
#include <memory>
#include <vector>

#include "kcla_cpu.h"

namespace {

using namespace kcla_cpu;

struct Maps {
  int64_t B, C, H, W, row, plane;
};

Maps maps_of(const char* op, const at::Tensor& x) {
  TORCH_CHECK(x.dim() == 4, "kcla_mm ", op, ": x must be [B, C, H, W], got ", x.sizes());
  check_map(op, x, "x", x.sizes());
  const int64_t B = x.size(0), C = x.size(1), H = x.size(2), W = x.size(3);
  return {B, C, H, W, W * C, H * W * C};
}

// Bands of rows of every sample, run in parallel: body(b, h0, h1, task).
struct Bands {
  int64_t H, band_h, per_sample, tasks;
  Bands(int64_t B, int64_t H_) : H(H_) {
    const std::pair<int64_t, int64_t> bh = bands_of(B, H);
    band_h = bh.first;
    per_sample = bh.second;
    tasks = B * per_sample;
  }
  int64_t sample(int64_t task) const { return task / per_sample; }
  template <class F>
  void run(F&& body) const {
    at::parallel_for(0, tasks, 1, [&](int64_t lo, int64_t hi) {
      for (int64_t t = lo; t < hi; ++t) {
        const int64_t h0 = (t % per_sample) * band_h;
        body(t / per_sample, h0, std::min(H, h0 + band_h), t);
      }
    });
  }
  // per-task partial sums [tasks, n] -> per-sample sums [B, len] of the
  // columns lo .. lo + len - 1 into out (a new tensor's data), each the
  // sample's tasks in order (the same values whatever the thread count)
  void per_sample_sums(const double* partial, int64_t n, int64_t lo, int64_t len,
                       double* out) const {
    std::fill(out, out + (tasks / per_sample) * len, 0.0);
    for (int64_t t = 0; t < tasks; ++t) {
      const double* src = partial + t * n + lo;
      double* o = out + sample(t) * len;
      for (int64_t i = 0; i < len; ++i) o[i] += src[i];
    }
  }
  at::Tensor per_sample_sums(const std::vector<double>& partial, int64_t B, int64_t n) const {
    at::Tensor out = at::empty({B, n}, at::kDouble);
    per_sample_sums(partial.data(), n, 0, n, out.data_ptr<double>());
    return out;
  }
};

// A weight's gradient (grad: its values in the weight's memory order) as the
// weight's dtype, shape and strides, which the autograd functions return as
// they are: Python run right after a long kernel runs cold (the views and the
// copy this does took about 160 us per call there, Zen 3 VM). A channels-last
// [C, k, kh, kw] weight with size-1 dimensions has the memory order of a
// contiguous one but other strides on them, which DDP warns about in a gradient.
at::Tensor as_weight_grad(const at::Tensor& grad, const at::Tensor& weight) {
  at::Tensor g = grad.to(weight.scalar_type()).view(weight.sizes());
  return g.strides() == weight.strides() ? g : at::empty_like(weight).copy_(g);
}

// Whether a band's float partial sums go into the double partials after row h
// (rows h0 .. h1 - 1): every 256 pixels or so (at least every row), and at
// the band's end. A float sum of n values is off by up to about n ulps of its
// terms, which a flat map far from zero turns into a large error of its
// variance (KCLA's step on a 200x200 map: every 8 rows measured 30 times
// ATen's error of BatchNorm's running variance, every row a third of it).
// Flushing costs: 12 C sums per row of train_backward cost as much as a row's
// work at C = 2048, W = 7, and every 64 pixels measured it 5% slower at
// ResNet-50's shapes.
inline bool flush_after(int64_t h, int64_t h0, int64_t h1, int64_t W) {
  const int64_t rows = std::max<int64_t>(1, 256 / W);
  return (h - h0) % rows == rows - 1 || h + 1 == h1;
}

// float row sums s1, s2 [C] into the double partials acc [2 C]; zeroes them
inline void flush_sums(std::vector<float>& s1, std::vector<float>& s2, double* acc) {
  const size_t C = s1.size();
  for (size_t c = 0; c < C; ++c) {
    acc[c] += s1[c];
    acc[C + c] += s2[c];
  }
  std::fill(s1.begin(), s1.end(), 0.f);
  std::fill(s2.begin(), s2.end(), 0.f);
}

// the gradient at the ReLU's input: g = dL/do = gy keep [z > 0], z = a v +
// shift from relu_in (as the forward's, so the mask is the forward's bit for bit)
template <class L>
inline typename L::V relu_grad(typename L::V z, typename L::V gy, typename L::V keep) {
  const typename L::V zero = L::splat(0.f);
  return z > zero ? gy * keep : zero;
}

const float* opt_param(const char* op, const c10::optional<at::Tensor>& t, int64_t n,
                       const char* name) {
  return t.has_value() && t->defined() ? param<float>(op, *t, n, name) : nullptr;
}

// Returns (mean, or an empty tensor without prev: then mean is x; sums [B, 2, C]
// float64: sum over pixels of v, of v^2).
std::tuple<at::Tensor, at::Tensor> train_stats(const at::Tensor& x,
                                               const c10::optional<at::Tensor>& prev_opt,
                                               const c10::optional<at::Tensor>& beta_opt,
                                               const at::Tensor& wv) {
  const char* op = "train_stats";
  const Maps m = maps_of(op, x);
  const int64_t C = m.C, H = m.H, W = m.W, row = m.row;
  const bool has_prev = prev_opt.has_value() && prev_opt->defined();
  if (has_prev) check_map(op, *prev_opt, "prev", x.sizes());
  const float* betap = opt_param(op, beta_opt, m.B * C, "beta");
  TORCH_CHECK(has_prev == (betap != nullptr), "kcla_mm ", op, ": prev and beta go together");
  const std::vector<float> wt = taps(param<float>(op, wv, C * 9, "wv"), C);
  at::Tensor mean = has_prev ? at::empty_like(x) : at::empty({0}, x.options());
  const float* xp = x.data_ptr<float>();
  const float* pp = has_prev ? prev_opt->data_ptr<float>() : nullptr;
  float* mp = has_prev ? mean.data_ptr<float>() : nullptr;
  const Bands bands(m.B, H);
  std::vector<double> partial(bands.tasks * 2 * C, 0.0);
  bands.run([&](int64_t b, int64_t h0, int64_t h1, int64_t t) {
    std::vector<float> s1(C), s2(C);
    StagedRows st(W, C);
    const int64_t P = st.stride(), ring_row = ((W * P + 15) / 16) * 16 + 16;
    // with prev: the mean rows h-1..h+1 the convolution reads, in a ring with
    // the staged pixel stride P
    std::vector<float> ring_buf(has_prev ? 3 * ring_row + 16 : 0);
    float* ring = ring_buf.data() +
                  ((64 - reinterpret_cast<uintptr_t>(ring_buf.data()) % 64) % 64) / sizeof(float);
    const float* xb = xp + b * m.plane;
    float* mb = has_prev ? mp + b * m.plane : nullptr;
    // row h of mean into the ring and, if the band's (the rows just outside
    // it are computed here as well), into mean with non-temporal stores: this
    // pass does not read mean back, the next block's does
    auto state_row = [&](int64_t h, float* dst) {
      const float *pr = pp + b * m.plane + h * row, *xr = xb + h * row, *bt = betap + b * C;
      float* out = h >= h0 && h < h1 ? mb + h * row : nullptr;
      row_tiles<1>(W, C, [&](auto lanes, auto, int64_t w, int64_t c0) {
        using L = decltype(lanes);
        const typename L::V val = lerp_value<L>(pr + w * C, xr + w * C, bt, c0);
        L::store(dst + w * P + c0, val);
        if (out != nullptr) L::store_nt(out + w * C + c0, val);
      });
    };
    auto mean_row = [&](int64_t h) -> const float* {
      if (h < 0 || h >= H) return nullptr;
      if (!has_prev) return st.stage(h, xb + h * row);
      float* dst = ring + ((h + 3) % 3) * ring_row;
      state_row(h, dst);
      return dst;
    };
    double* acc = partial.data() + t * 2 * C;
    const float* up = mean_row(h0 - 1);
    const float* mid = mean_row(h0);
    for (int64_t h = h0; h < h1; ++h) {
      const float* down = mean_row(h + 1);
      const float* rows[3] = {up, mid, down};
      up = mid;
      mid = down;
      row_tiles(W, C, [&](auto lanes, auto nw, int64_t w0, int64_t c0) {
        using L = decltype(lanes);
        using V = typename L::V;
        constexpr int NW = decltype(nw)::value;
        V k[9], v[NW];  // (no prefetch: it measured slower here, the lerp reads rows in order)
        load_taps<L>(wt.data(), C, c0, k);
        conv_acc<L, NW>(rows, k, w0, W, P, c0, v);
        V a1 = L::load(s1.data() + c0), a2 = L::load(s2.data() + c0);
        for (int j = 0; j < NW; ++j) {
          a1 += v[j];
          a2 += v[j] * v[j];
        }
        L::store(s1.data() + c0, a1);
        L::store(s2.data() + c0, a2);
      });
      if (flush_after(h, h0, h1, W)) flush_sums(s1, s2, acc);
    }
    fence_stores();
  });
  return std::make_tuple(mean, bands.per_sample_sums(partial, m.B, 2 * C).view({m.B, 2, C}));
}

// out = x + relu(a * Wv(mean) + shift), a and shift [B, C].
at::Tensor train_apply(const at::Tensor& x, const at::Tensor& mean, const at::Tensor& wv,
                       const at::Tensor& a, const at::Tensor& shift) {
  const char* op = "train_apply";
  const Maps m = maps_of(op, x);
  check_map(op, mean, "mean", x.sizes());
  const int64_t C = m.C, H = m.H, row = m.row;
  const std::vector<float> wt = taps(param<float>(op, wv, C * 9, "wv"), C);
  const float* ap = param<float>(op, a, m.B * C, "a");
  const float* sp = param<float>(op, shift, m.B * C, "shift");
  at::Tensor out = at::empty_like(x);
  const float* xp = x.data_ptr<float>();
  const float* mp = mean.data_ptr<float>();
  float* op_ = out.data_ptr<float>();
  Bands(m.B, H).run([&](int64_t b, int64_t h0, int64_t h1, int64_t) {
    const float* mb = mp + b * m.plane;
    StagedRows st(m.W, C);
    auto mean_row = [&](int64_t h) { return h >= 0 && h < H ? mb + h * row : nullptr; };
    const float* up = st.stage(h0 - 1, mean_row(h0 - 1));
    const float* mid = st.stage(h0, mean_row(h0));
    const int64_t S = span_pixels(C), W = m.W, P = st.stride();
    std::vector<float> v(S * C);
    const float *ab = ap + b * C, *sb = sp + b * C;
    for (int64_t h = h0; h < h1; ++h) {
      const float* down = st.stage(h + 1, mean_row(h + 1));
      const float* rows[3] = {up, mid, down};
      const float* xr = xp + b * m.plane + h * row;
      float* orow = op_ + b * m.plane + h * row;
      // The mean row that the next row step reads, fetched while this row
      // computes: its copy into the ring (or the convolution, where rows are
      // not staged) then reads from cache instead of stalling on memory
      // between two rows of arithmetic. On the Intel VM train_apply ran 8-11%
      // faster out of cache (ResNet-50 shapes, 600 MB of rotating maps) and
      // 3% in benchmark_cpu_ops.py; the training step's change was within
      // the noise of an in-model A/B there. Fetching x a row ahead as well
      // added nothing. (Written out on purpose: GCC 12 compiled the same
      // prefetch to nothing when it went through a struct of map pointers
      // here; objdump -d shows whether a prefetcht0 is left.)
      const float* next_staged = h + 2 < H ? mb + (h + 2) * row : nullptr;
      for (int64_t w0 = 0; w0 < W; w0 += S) {
        const int64_t n = std::min(S, W - w0);
        conv_pixels(rows, wt.data(), w0, n, W, C, P, v.data());
        row_tiles<1>(n, C, [&](auto lanes, auto, int64_t j, int64_t c0) {
          using L = decltype(lanes);
          using V = typename L::V;
          const int64_t o = (w0 + j) * C + c0;
          if (next_staged != nullptr && c0 % 16 == 0) __builtin_prefetch(next_staged + o);
          const V zero = L::splat(0.f);
          V z = relu_in<L>(L::load(ab + c0), L::load(v.data() + j * C + c0), L::load(sb + c0));
          z = z > zero ? z : zero;
          L::store_nt(orow + o, L::load(xr + o) + z);
        });
      }
      up = mid;
      mid = down;
    }
    fence_stores();
  });
  return out;
}

// Returns [B, 2, C] float64: sum over pixels of g, of g v, g = dL/do.
at::Tensor train_grad_stats(const at::Tensor& gy, const at::Tensor& mean, const at::Tensor& wv,
                            const at::Tensor& a, const at::Tensor& shift,
                            const c10::optional<at::Tensor>& keep_opt) {
  const char* op = "train_grad_stats";
  const Maps m = maps_of(op, mean);
  check_map(op, gy, "gy", mean.sizes());
  const int64_t C = m.C, H = m.H, W = m.W, row = m.row;
  const std::vector<float> wt = taps(param<float>(op, wv, C * 9, "wv"), C);
  const float* ap = param<float>(op, a, m.B * C, "a");
  const float* sp = param<float>(op, shift, m.B * C, "shift");
  const float* kp = opt_param(op, keep_opt, m.B, "keep");
  const float* gp = gy.data_ptr<float>();
  const float* mp = mean.data_ptr<float>();
  const Bands bands(m.B, H);
  std::vector<double> partial(bands.tasks * 2 * C, 0.0);
  bands.run([&](int64_t b, int64_t h0, int64_t h1, int64_t t) {
    std::vector<float> r1(C), r2(C);
    const float* mb = mp + b * m.plane;
    const float keep = kp ? kp[b] : 1.f;
    double* acc = partial.data() + t * 2 * C;
    StagedRows st(W, C);
    const int64_t P = st.stride();
    auto mean_row = [&](int64_t h) { return h >= 0 && h < H ? mb + h * row : nullptr; };
    const float* up = st.stage(h0 - 1, mean_row(h0 - 1));
    const float* mid = st.stage(h0, mean_row(h0));
    for (int64_t h = h0; h < h1; ++h) {
      const float* down = st.stage(h + 1, mean_row(h + 1));
      const float* rows[3] = {up, mid, down};
      up = mid;
      mid = down;
      const float* gr = gp + b * m.plane + h * row;
      RowPrefetch pf;  // what row h + 1 reads first: mean at h + 2, gy at h + 1
      pf.rows[0] = h + 2 < H ? mb + (h + 2) * row : nullptr;
      pf.rows[1] = h + 1 < H ? gr + row : nullptr;
      row_tiles(W, C, [&](auto lanes, auto nw, int64_t w0, int64_t c0) {
        using L = decltype(lanes);
        using V = typename L::V;
        constexpr int NW = decltype(nw)::value;
        pf.tile<NW>(w0, C, c0);
        V k[9], v[NW];
        load_taps<L>(wt.data(), C, c0, k);
        conv_acc<L, NW>(rows, k, w0, W, P, c0, v);
        const V va = L::load(ap + b * C + c0), vs = L::load(sp + b * C + c0);
        const V vk = L::splat(keep);
        V a1 = L::load(r1.data() + c0), a2 = L::load(r2.data() + c0);
        for (int j = 0; j < NW; ++j) {
          const V z = relu_in<L>(va, v[j], vs);
          const V g = relu_grad<L>(z, L::load(gr + (w0 + j) * C + c0), vk);
          a1 += g;
          a2 += g * v[j];
        }
        L::store(r1.data() + c0, a1);
        L::store(r2.data() + c0, a2);
      });
      if (flush_after(h, h0, h1, W)) flush_sums(r1, r2, acc);
    }
  });
  return bands.per_sample_sums(partial, m.B, 2 * C).view({m.B, 2, C});
}

// The backward pass, given the gradient at v: gv = alpha g + kappa + lam v
// (alpha, kappa, lam [B, C]: BatchNorm's backward and the gate, folded).
// gm = Wv^T gv + gmean; gx = gy + beta gm (gy + gm without prev);
// gprev = (1 - beta) gm. Returns (gx, gprev or empty, gbeta [B, C] float64 =
// sum over pixels of gm (x - prev), gwv [C, 9] float64, [B, 2, C] float64 as
// train_grad_stats). x_is_out: x holds the step's output x + relu(a v + shift)
// instead (what the next block keeps anyway), and x is taken as out minus
// relu(a v + shift), the value the gradient rows compute for the mask, which is
// train_apply's addend bit for bit (float rounding: |error| <= ulp(out) per value).
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> train_backward(
    const at::Tensor& gy, const c10::optional<at::Tensor>& gmean_opt, const at::Tensor& x,
    const c10::optional<at::Tensor>& prev_opt, const at::Tensor& mean,
    const c10::optional<at::Tensor>& beta_opt, const at::Tensor& wv, const at::Tensor& a,
    const at::Tensor& shift, const c10::optional<at::Tensor>& keep_opt, const at::Tensor& alpha,
    const at::Tensor& kappa, const at::Tensor& lam, bool x_is_out) {
  const char* op = "train_backward";
  const Maps m = maps_of(op, x);
  const int64_t B = m.B, C = m.C, H = m.H, W = m.W, row = m.row;
  check_map(op, gy, "gy", x.sizes());
  check_map(op, mean, "mean", x.sizes());
  const bool has_gmean = gmean_opt.has_value() && gmean_opt->defined();
  if (has_gmean) check_map(op, *gmean_opt, "gmean", x.sizes());
  const bool has_prev = prev_opt.has_value() && prev_opt->defined();
  if (has_prev) check_map(op, *prev_opt, "prev", x.sizes());
  const float* betap = opt_param(op, beta_opt, B * C, "beta");
  TORCH_CHECK(has_prev == (betap != nullptr), "kcla_mm ", op, ": prev and beta go together");
  const float* wvp = param<float>(op, wv, C * 9, "wv");
  const std::vector<float> wt = taps(wvp, C), wt_flip = taps(wvp, C, true);
  const float* ap = param<float>(op, a, B * C, "a");
  const float* sp = param<float>(op, shift, B * C, "shift");
  const float* kp = opt_param(op, keep_opt, B, "keep");
  const float* alp = param<float>(op, alpha, B * C, "alpha");
  const float* kap = param<float>(op, kappa, B * C, "kappa");
  const float* lap = param<float>(op, lam, B * C, "lam");
  std::vector<float> one_minus_beta(has_prev ? B * C : 0);
  for (int64_t i = 0; i < (has_prev ? B * C : 0); ++i) one_minus_beta[i] = 1.0f - betap[i];

  at::Tensor gx = at::empty_like(x);
  at::Tensor gprev = has_prev ? at::empty_like(x) : at::empty({0}, x.options());
  const float* gyp = gy.data_ptr<float>();
  const float* gmp = has_gmean ? gmean_opt->data_ptr<float>() : nullptr;
  const float* xp = x.data_ptr<float>();
  const float* pp = has_prev ? prev_opt->data_ptr<float>() : nullptr;
  const float* mp = mean.data_ptr<float>();
  float* gxp = gx.data_ptr<float>();
  float* gpp = has_prev ? gprev.data_ptr<float>() : nullptr;
  const Bands bands(B, H);
  // per task: [2C] grad stats, [C] gbeta, [9C] gwv (tap-major)
  const int64_t n_red = 12 * C;  // (red, the float row sums, holds gw as taps() lays out)
  const int64_t n_red_f = 3 * C + ((C + VL - 1) / VL) * 9 * VL;
  // (not zeroed: a task's first flush assigns; at C = 2048 zeroing it and the
  // per-sample sums cost about as much as the work of a 7x7 map)
  std::unique_ptr<double[]> partial(new double[bands.tasks * n_red]);
  bands.run([&](int64_t b, int64_t h0, int64_t h1, int64_t t) {
    // gv rows h-1, h, h+1 (a ring with the staged pixel stride P); the mean
    // rows the convolution reads, staged; row sums (gw in the layout of taps())
    StagedRows st(W, C);
    const int64_t P = st.stride(), ring_row = ((W * P + 15) / 16) * 16 + 16;
    const bool out_given = x_is_out && has_prev;
    // x_is_out: relu(a v + shift) of rows h and h + 1 after the gv ring, in
    // the same layout: x = out - relu(a v + shift) of the gradient rows
    std::vector<float> ring_buf((out_given ? 5 : 3) * ring_row + 16), red(n_red_f);
    float* ring = ring_buf.data() +
                  ((64 - reinterpret_cast<uintptr_t>(ring_buf.data()) % 64) % 64) / sizeof(float);
    float* relu_ring = ring + 3 * ring_row;
    float *r1 = red.data(), *r2 = r1 + C, *gb = r2 + C, *gw = gb + C;
    const int64_t off = b * m.plane, bc = b * C;
    const float* mb = mp + off;
    const float keep = kp ? kp[b] : 1.f;
    auto slot = [&](int64_t r) { return ring + ((r + 3) % 3) * ring_row; };
    auto relu_slot = [&](int64_t r) { return relu_ring + ((r + 2) % 2) * ring_row; };
    auto mean_row = [&](int64_t h) -> const float* {
      return h >= 0 && h < H ? mb + h * row : nullptr;
    };
    // staged mean rows: the highest staged so far, and each row's pointer
    int64_t staged_hi = (h0 > 0 ? h0 - 1 : h0) - 2;  // the first gv row reads from row - 1
    const float* staged[3] = {nullptr, nullptr, nullptr};
    auto staged_row = [&](int64_t q) -> const float* {
      if (q < 0 || q >= H) return nullptr;
      for (; staged_hi < q; ) {
        ++staged_hi;
        staged[(staged_hi + 3) % 3] = st.stage(staged_hi, mean_row(staged_hi));
      }
      return staged[(q + 3) % 3];
    };
    // gv row r into the ring; own: the row is this band's, its sums count here
    auto gv_row = [&](int64_t r, bool own) {
      // What the tiles read, copied into locals first. The row functions are
      // not inlined into the band's body, so each captured variable is a
      // reference into the band's frame, and the vector stores (whose types
      // may alias anything) make the compiler reload it after every store,
      // through the reference. Locals whose address does not escape stay in
      // registers: train_backward in L2, Zen 3 VM, one thread, about 3.3 ->
      // 2.9 ns per element, the same values bit for bit.
      const int64_t Wr = W, Cr = C, Pr = P;
      const float *const wtr = wt.data(), *const a_s = ap + bc, *const shift_s = sp + bc,
                        *const alpha_s = alp + bc, *const kappa_s = kap + bc,
                        *const lam_s = lap + bc;
      const float keep_s = keep;
      const bool relu_out = out_given;
      float *const sum1 = r1, *const sum2 = r2, *const gws = gw;
      float* dst = slot(r);
      float* relu_dst = relu_slot(r);
      const float* rows[3];
      rows[2] = staged_row(r + 1);  // stages r - 1 .. r + 1 as needed, in order
      rows[0] = staged_row(r - 1);
      rows[1] = staged_row(r);
      const float* gr = gyp + off + r * row;
      RowPrefetch pf;  // what gv row r + 1 reads first: mean at r + 2, gy at r + 1
      pf.rows[0] = r + 2 < H ? mb + (r + 2) * row : nullptr;
      pf.rows[1] = r + 1 < H ? gr + row : nullptr;
      row_tiles(Wr, Cr, [&](auto lanes, auto nw, int64_t w0, int64_t c0) {
        using L = decltype(lanes);
        using V = typename L::V;
        constexpr int NW = decltype(nw)::value;
        pf.tile<NW>(w0, Cr, c0);
        V k[9], v[NW], gv[NW];
        load_taps<L>(wtr, Cr, c0, k);
        // v as train_apply and train_grad_stats compute it, bit for bit (their
        // ReLU masks, with relu_in's): conv_acc's roundings in all three. The
        // dL/dWv sums below load the inputs again instead of keeping the
        // tile's 3 x (NW + 2) of them: with them, the tile held about 40
        // vectors and spilled (AVX2 has 16 registers); per element in L2,
        // Zen 3 VM, 3566-3683 -> 3119 ps (from memory 4585-4692 -> 4433).
        conv_acc<L, NW>(rows, k, w0, Wr, Pr, c0, v);
        const V va = L::load(a_s + c0), vs = L::load(shift_s + c0), vk = L::splat(keep_s);
        const V al = L::load(alpha_s + c0), ka = L::load(kappa_s + c0),
                la = L::load(lam_s + c0);
        const V zero = L::splat(0.f);
        V a1 = zero, a2 = a1;
        for (int j = 0; j < NW; ++j) {
          const int64_t o = (w0 + j) * Cr + c0;
          const V z = relu_in<L>(va, v[j], vs);
          const V g = relu_grad<L>(z, L::load(gr + o), vk);
          gv[j] = al * g + ka + la * v[j];
          L::store(dst + (w0 + j) * Pr + c0, gv[j]);
          if (relu_out) L::store(relu_dst + (w0 + j) * Pr + c0, z > zero ? z : zero);
          a1 += g;
          a2 += g * v[j];
        }
        if (!own) return;
        L::store(sum1 + c0, L::load(sum1 + c0) + a1);
        L::store(sum2 + c0, L::load(sum2 + c0) + a2);
        // dL/dWv[c, i, j] = sum gv(h, w) mean(h + i - 1, w + j - 1) (zero padding)
        for (int i = 0; i < 3; ++i) {
          if (rows[i] == nullptr) continue;
          V in[NW + 2];  // reloaded (from L1): see above
          load_row_window<L, NW>(rows[i], w0, Wr, Pr, c0, in);
          for (int tap = 0; tap < 3; ++tap) {
            V s = gv[0] * in[tap];
            for (int j = 1; j < NW; ++j) s += gv[j] * in[j + tap];
            float* g = gws + tap_index(c0, 3 * i + tap);
            L::store(g, L::load(g) + s);
          }
        }
      });
    };
    // gx, gprev, gbeta of row h from the gv rows h-1..h+1 in the ring: the
    // transposed convolution span by span into gmv (conv_pixels), then the
    // maps streamed in order
    const int64_t S = span_pixels(C);
    std::vector<float> gmv(S * C);
    auto grad_row = [&](int64_t h) {
      // locals first, as in gv_row
      const int64_t Wr = W, Cr = C, Pr = P, Sr = S;
      const bool with_gmean = has_gmean, with_prev = has_prev, relu_out = out_given;
      const float *const wtr = wt_flip.data(),
                        *const beta_s = with_prev ? betap + bc : nullptr,
                        *const omb_s = with_prev ? one_minus_beta.data() + bc : nullptr,
                        *const gyr = gyp, *const gmr = gmp, *const xr = xp, *const pr = pp;
      float *const gxr = gxp, *const gpr = gpp, *const gbs = gb, *const gmvr = gmv.data();
      const float* rows[3] = {h > 0 ? slot(h - 1) : nullptr, slot(h),
                              h + 1 < H ? slot(h + 1) : nullptr};
      const int64_t ro = off + h * row;
      const float* relu_row = relu_slot(h);
      for (int64_t w0 = 0; w0 < Wr; w0 += Sr) {
        const int64_t n = std::min(Sr, Wr - w0);
        conv_pixels(rows, wtr, w0, n, Wr, Cr, Pr, gmvr);
        row_tiles<1>(n, Cr, [&](auto lanes, auto, int64_t j, int64_t c0) {
          using L = decltype(lanes);
          using V = typename L::V;
          const int64_t o = ro + (w0 + j) * Cr + c0;
          V g = L::load(gmvr + j * Cr + c0);
          if (with_gmean) g += L::load(gmr + o);
          if (!with_prev) {
            L::store_nt(gxr + o, g + L::load(gyr + o));
            return;
          }
          const V bt = L::load(beta_s + c0), omb = L::load(omb_s + c0);
          L::store_nt(gxr + o, L::load(gyr + o) + g * bt);
          L::store_nt(gpr + o, g * omb);
          V xv = L::load(xr + o);
          // x = out - relu(a v + shift), train_apply's addend bit for bit
          if (relu_out) xv -= L::load(relu_row + (w0 + j) * Pr + c0);
          L::store(gbs + c0, L::load(gbs + c0) + (xv - L::load(pr + o)) * g);
        });
      }
    };
    double* acc = partial.get() + t * n_red;
    bool first = true;
    auto flush = [&]() {
      auto move = [&](auto put) {  // the float sums into the partials
        for (int64_t i = 0; i < 3 * C; ++i) put(acc[i], red[i]);
        for (int64_t i = 0; i < 9; ++i)  // gw: from the layout of taps() to tap-major
          for (int64_t c = 0; c < C; ++c) put(acc[(3 + i) * C + c], gw[tap_index(c, i)]);
      };
      if (first) {
        move([](double& d, float v) { d = v; });
      } else {
        move([](double& d, float v) { d += v; });
      }
      first = false;
      std::fill(red.begin(), red.end(), 0.f);
    };
    if (h0 > 0) gv_row(h0 - 1, false);
    gv_row(h0, true);
    for (int64_t h = h0; h < h1; ++h) {
      if (h + 1 < H) gv_row(h + 1, h + 1 < h1);
      grad_row(h);
      if (flush_after(h, h0, h1, W)) flush();
    }
    fence_stores();
  });
  // the partials [tasks, 12 C] straight into the outputs (no [B, 12 C] tensor
  // and its slices): per sample its tasks in order, then over the batch
  const auto f64 = at::TensorOptions().dtype(at::kDouble);
  at::Tensor stats = at::empty({B, 2, C}, f64), gbeta = at::empty({B, C}, f64);
  bands.per_sample_sums(partial.get(), n_red, 0, 2 * C, stats.data_ptr<double>());
  bands.per_sample_sums(partial.get(), n_red, 2 * C, C, gbeta.data_ptr<double>());
  std::vector<double> gw_sum(9 * C, 0.0), gw_b(9 * C);  // tap-major [9, C]
  for (int64_t b = 0; b < B; ++b) {
    std::fill(gw_b.begin(), gw_b.end(), 0.0);
    for (int64_t j = 0; j < bands.per_sample; ++j) {
      const double* src = partial.get() + (b * bands.per_sample + j) * n_red + 3 * C;
      for (int64_t i = 0; i < 9 * C; ++i) gw_b[i] += src[i];
    }
    for (int64_t i = 0; i < 9 * C; ++i) gw_sum[i] += gw_b[i];
  }
  at::Tensor gwv = at::empty({C, 9}, f64);
  double* gwp = gwv.data_ptr<double>();
  for (int64_t c = 0; c < C; ++c)
    for (int64_t i = 0; i < 9; ++i) gwp[c * 9 + i] = gw_sum[i * C + c];
  return std::make_tuple(gx, gprev, gbeta, gwv, stats);
}

// -- the per-head math of a training step: HeadMath (kcla_cpu.h) and its backward --

HeadMath make_head(const char* op, const at::Tensor& p, const c10::optional<at::Tensor>& lz_opt,
                   const at::Tensor& wq, const at::Tensor& wk, const at::Tensor& inv_tau,
                   const at::Tensor& phi, double clamp, double eps) {
  TORCH_CHECK(p.dim() == 2, "kcla_mm ", op, ": p must be [B, C], got ", p.sizes());
  const int64_t B = p.size(0), C = p.size(1), G = inv_tau.numel(), K = wq.numel();
  TORCH_CHECK(G > 0 && C % G == 0, "kcla_mm ", op, ": ", C, " channels, ", G, " heads");
  TORCH_CHECK(K % 2 == 1, "kcla_mm ", op, ": the ECA kernel size must be odd, got ", K);
  TORCH_CHECK(eps > 0, "kcla_mm ", op, ": eps must be positive, got ", eps);
  return HeadMath(B, C, G, K, param<float>(op, p, B * C, "p"),
                  opt_param(op, lz_opt, B * G, "log_z"), param<float>(op, wq, K, "wq"),
                  param<float>(op, wk, K, "wk"), param<double>(op, inv_tau, G, "inv_tau"),
                  param<float>(op, phi, G * G, "phi"), clamp, eps);
}

// Returns (beta [B, C] or empty without log_z, scale [B, C], log z' [B, G]), float32.
std::tuple<at::Tensor, at::Tensor, at::Tensor> head_forward(
    const at::Tensor& p, const c10::optional<at::Tensor>& lz_opt, const at::Tensor& wq,
    const at::Tensor& wk, const at::Tensor& inv_tau, const at::Tensor& phi, double clamp,
    double eps) {
  HeadMath hd = make_head("head_forward", p, lz_opt, wq, wk, inv_tau, phi, clamp, eps);
  const int64_t B = hd.B, C = hd.C, G = hd.G, D = hd.D;
  at::Tensor beta = hd.lz0 ? at::empty({B, C}, p.options()) : at::empty({0}, p.options());
  at::Tensor scale = at::empty({B, C}, p.options()), lz = at::empty({B, G}, p.options());
  float *btp = hd.lz0 ? beta.data_ptr<float>() : nullptr, *scp = scale.data_ptr<float>(),
        *lzp = lz.data_ptr<float>();
  for (int64_t b = 0; b < B; ++b) {
    hd.run(b);
    for (int64_t g = 0; g < G; ++g) {
      lzp[b * G + g] = static_cast<float>(hd.lz[g]);
      const float sc = static_cast<float>(hd.gate[g] * hd.shr[g]);
      for (int64_t d = 0; d < D; ++d) {
        scp[b * C + g * D + d] = sc;
        if (btp) btp[b * C + g * D + d] = static_cast<float>(hd.bt[g]);
      }
    }
  }
  return std::make_tuple(beta, scale, lz);
}

// Gradients of head_forward: (gp [B, C], glog_z [B, G] or empty, gwq [K], gwk [K],
// gphi [G, G]), float32.
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> head_backward(
    const at::Tensor& p, const c10::optional<at::Tensor>& lz_opt, const at::Tensor& wq,
    const at::Tensor& wk, const at::Tensor& inv_tau, const at::Tensor& phi, double clamp,
    double eps, const c10::optional<at::Tensor>& gbeta_opt,
    const c10::optional<at::Tensor>& gscale_opt, const c10::optional<at::Tensor>& glz_opt) {
  const char* op = "head_backward";
  HeadMath hd = make_head(op, p, lz_opt, wq, wk, inv_tau, phi, clamp, eps);
  const int64_t B = hd.B, C = hd.C, G = hd.G, D = hd.D, K = hd.K, pad = hd.pad;
  const float* gbt = hd.lz0 ? opt_param(op, gbeta_opt, B * C, "gbeta") : nullptr;
  const float* gsc = opt_param(op, gscale_opt, B * C, "gscale");
  const float* glz = opt_param(op, glz_opt, B * G, "glog_z");
  at::Tensor gp = at::empty({B, C}, p.options());
  at::Tensor glz0 = hd.lz0 ? at::empty({B, G}, p.options()) : at::empty({0}, p.options());
  std::vector<double> gwq(K, 0.0), gwk(K, 0.0), gphi(G * G, 0.0), gq(C), gk(C), gs(G), gh(G);
  float* gpp = gp.data_ptr<float>();
  float* glz0p = hd.lz0 ? glz0.data_ptr<float>() : nullptr;
  for (int64_t b = 0; b < B; ++b) {
    hd.run(b);
    for (int64_t g = 0; g < G; ++g) {  // through the gate's sigmoid into Phi
      double s = 0;
      if (gsc)
        for (int64_t d = 0; d < D; ++d) s += gsc[b * C + g * D + d];
      gh[g] = s;  // d L / d scale_g, for now
      gs[g] = s * hd.shr[g] * hd.gate[g] * (1.0 - hd.gate[g]);
    }
    for (int64_t g = 0; g < G; ++g)
      for (int64_t j = 0; j < G; ++j) gphi[g * G + j] += gs[g] * hd.h[j];
    for (int64_t g = 0; g < G; ++g) {
      const double gscale_g = gh[g];
      double ghg = 0;
      for (int64_t j = 0; j < G; ++j) ghg += hd.phi[j * G + g] * gs[j];
      // log z': its own gradient, the shrink factor's, beta's
      double glzg = (glz ? glz[b * G + g] : 0.0) +
                    gscale_g * hd.gate[g] * hd.shr[g] * (1.0 - hd.shr[g]);
      double glogit = 0;
      if (hd.lz0) {
        double gb = 0;
        if (gbt)
          for (int64_t d = 0; d < D; ++d) gb += gbt[b * C + g * D + d];
        glogit += gb * hd.bt[g];  // beta = exp(logit - log z')
        glzg -= gb * hd.bt[g];
        glz0p[b * G + g] = static_cast<float>(glzg * std::exp(hd.lz0[b * G + g] - hd.lz[g]));
        glogit += glzg * hd.bt[g];  // d logaddexp / d logit
      } else {
        glogit += glzg;  // log z' = logit
      }
      // torch's clamp(max) passes the gradient where raw <= clamp
      const double graw = clamp > 0 && hd.raw[g] > clamp ? 0.0 : glogit;
      double gkn = graw * static_cast<float>(hd.tau[g]);
      // h = <q, k> / max(|k|, 1e-12)
      const double gqk = ghg / hd.knc[g];
      if (hd.kn[g] >= 1e-12) gkn -= ghg * hd.qk[g] / (hd.knc[g] * hd.knc[g]);
      const double kinv = hd.kn[g] > 0 ? gkn / hd.kn[g] : 0.0;  // d |k| / d k = k / |k|
      for (int64_t d = 0; d < D; ++d) {
        const int64_t c = g * D + d;
        gq[c] = gqk * hd.k[c];
        gk[c] = gqk * hd.q[c] + kinv * hd.k[c];
      }
    }
    // the ECA convolutions: q_c = sum_j wq_j p_{c + j - pad}
    const float* pb = hd.p + b * C;
    std::vector<double> gpb(C, 0.0);
    for (int64_t j = 0; j < K; ++j)
      for (int64_t c = std::max<int64_t>(0, pad - j); c < std::min<int64_t>(C, C + pad - j); ++c)
        gpb[c + j - pad] += hd.wq[j] * gq[c] + hd.wk[j] * gk[c];
    // the weights' gradients channel by channel, the taps innermost: 2 K
    // independent sums (each still over c in order, so the same values) where
    // the tap-outer loop ran one chain of dependent additions at a time (the
    // whole op 91 -> 85 us per call at C = 2048, batch 4)
    for (int64_t c = 0; c < C; ++c)
      for (int64_t j = std::max<int64_t>(0, pad - c); j < std::min<int64_t>(K, C + pad - c); ++j) {
        const double v = pb[c + j - pad];
        gwq[j] += gq[c] * v;
        gwk[j] += gk[c] * v;
      }
    for (int64_t c = 0; c < C; ++c) gpp[b * C + c] = static_cast<float>(gpb[c]);
  }
  auto to_float = [&](const std::vector<double>& v, at::IntArrayRef shape) {
    at::Tensor t = at::empty(shape, p.options());
    float* tp = t.data_ptr<float>();
    for (size_t i = 0; i < v.size(); ++i) tp[i] = static_cast<float>(v[i]);
    return t;
  };
  return std::make_tuple(gp, glz0, to_float(gwq, {K}), to_float(gwk, {K}),
                         to_float(gphi, {G, G}));
}

// -- BatchNorm and the gate folded: the [B, C] algebra of FusedStep (float64) --
// s = sc v (sc: the gate, per sample and channel); o = gamma (s - mu) invstd + b.
// Training: mu and var of s from the per-sample sums of v and v^2 of
// train_stats (count = B H W values per channel); else the running statistics.

struct Folded {
  int64_t B, C;
  const float *sc, *gamma;
  const double *mu, *invstd;
};

Folded folded_of(const char* op, const at::Tensor& scale, const at::Tensor& weight,
                 const at::Tensor& mu, const at::Tensor& invstd) {
  TORCH_CHECK(scale.dim() == 2, "kcla_mm ", op, ": scale must be [B, C], got ", scale.sizes());
  Folded f;
  f.B = scale.size(0), f.C = scale.size(1);
  f.sc = param<float>(op, scale, f.B * f.C, "scale");
  f.gamma = param<float>(op, weight, f.C, "weight");
  f.mu = param<double>(op, mu, f.C, "mu");
  f.invstd = param<double>(op, invstd, f.C, "invstd");
  return f;
}

// A BatchNorm's parameters as the kernels read them, checked: the affine
// weight and bias [C] and the running statistics [C] (updated in place in
// training, which needs more than one value per channel: count).
struct NormArgs {
  const float *weight, *bias;
  float *running_mean, *running_var;
};

NormArgs norm_args(const char* op, const at::Tensor& weight, const at::Tensor& bias,
                   const at::Tensor& running_mean, const at::Tensor& running_var, int64_t C,
                   bool training, int64_t count, double eps) {
  NormArgs n;
  n.weight = param<float>(op, weight, C, "weight");
  n.bias = param<float>(op, bias, C, "bias");
  param<float>(op, running_mean, C, "running_mean");  // checks
  param<float>(op, running_var, C, "running_var");
  n.running_mean = running_mean.data_ptr<float>();
  n.running_var = running_var.data_ptr<float>();
  TORCH_CHECK(!training || count > 1, "kcla_mm ", op, ": training needs more than one value per "
              "channel, got ", count);
  TORCH_CHECK(eps > 0, "kcla_mm ", op, ": eps must be positive, got ", eps);
  return n;
}

// BatchNorm's mean and 1 / sqrt(var + eps) of one channel: in training those
// of the batch, from the sums of its n values (s1) and of their squares (s2)
// (or of the values minus shift, which keeps the variance accurate where the
// mean is large against the spread),
// with the running statistics rm, rv updated as nn.BatchNorm2d does (in
// double, stored as float; factor its momentum or the cumulative average's
// 1 / batches; the variance unbiased); else the running statistics.
std::pair<double, double> channel_stats(bool training, double s1, double s2, double n,
                                        double factor, double eps, float& rm, float& rv,
                                        double shift = 0.0) {
  double m, var;
  if (training) {  // (s1, s2 may be sums of the values minus shift)
    m = s1 / n;
    var = std::max(s2 / n - m * m, 0.0);
    m += shift;
    rm = static_cast<float>((1 - factor) * rm + factor * m);
    rv = static_cast<float>((1 - factor) * rv + factor * var * n / (n - 1));
  } else {
    m = rm;
    var = rv;
  }
  return {m, 1.0 / std::sqrt(var + eps)};
}

// Returns (a, shift [B, C] float32: keep relu(o) = relu(a v + shift), keep >= 0;
// mu, invstd [C] float64). In training it also updates the running statistics
// as nn.BatchNorm2d does (in double, stored as float): factor is its momentum,
// or 1 / num_batches_tracked for a cumulative average; the variance unbiased.
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> tail_coeffs(
    const at::Tensor& sums, const at::Tensor& scale, const c10::optional<at::Tensor>& keep_opt,
    const at::Tensor& weight, const at::Tensor& bias, const at::Tensor& running_mean,
    const at::Tensor& running_var, bool training, double factor, double eps, int64_t count) {
  const char* op = "tail_coeffs";
  TORCH_CHECK(scale.dim() == 2, "kcla_mm ", op, ": scale must be [B, C], got ", scale.sizes());
  const int64_t B = scale.size(0), C = scale.size(1);
  const double* sp = param<double>(op, sums, B * 2 * C, "sums");
  const float* scp = param<float>(op, scale, B * C, "scale");
  const float* kp = opt_param(op, keep_opt, B, "keep");
  const NormArgs na = norm_args(op, weight, bias, running_mean, running_var, C, training, count,
                                eps);
  const float *gp = na.weight, *bp = na.bias;
  float *rm = na.running_mean, *rv = na.running_var;  // updated in place in training
  const at::TensorOptions f64 = sums.options().dtype(at::kDouble);
  at::Tensor mu = at::empty({C}, f64), invstd = at::empty({C}, f64);
  at::Tensor a = at::empty({B, C}, scale.options()), shift = at::empty({B, C}, scale.options());
  double *mup = mu.data_ptr<double>(), *isp = invstd.data_ptr<double>();
  float *ap = a.data_ptr<float>(), *shp = shift.data_ptr<float>();
  const double n = static_cast<double>(count);
  for (int64_t c = 0; c < C; ++c) {
    double s1 = 0, s2 = 0;  // the sums of s = sc v, in training
    for (int64_t b = 0; b < (training ? B : 0); ++b) {
      const double sc = scp[b * C + c];
      s1 += sc * sp[(b * 2) * C + c];
      s2 += sc * sc * sp[(b * 2 + 1) * C + c];
    }
    std::tie(mup[c], isp[c]) = channel_stats(training, s1, s2, n, factor, eps, rm[c], rv[c]);
    const double m = mup[c];
    const double p = gp[c] * isp[c];  // d o / d s
    for (int64_t b = 0; b < B; ++b) {
      const double kd = kp ? kp[b] : 1.0;
      ap[b * C + c] = static_cast<float>(kd * scp[b * C + c] * p);
      shp[b * C + c] = static_cast<float>(kd * (bp[c] - p * m));
    }
  }
  return std::make_tuple(a, shift, mu, invstd);
}

// The gradient at v: gv = alpha g + kappa + lam v, g = dL/do (BatchNorm's
// backward and the gate folded). stats: train_grad_stats's sums of g and g v,
// in training only (else kappa = lam = 0: the statistics are constants).
// Returns (alpha, kappa, lam [B, C] float32, qr [2, C] float64: BatchNorm's
// d L / d s = p g + q + r s, for tail_param_grads).
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> tail_grad_coeffs(
    const c10::optional<at::Tensor>& stats_opt, const at::Tensor& scale, const at::Tensor& weight,
    const at::Tensor& mu, const at::Tensor& invstd, int64_t count) {
  const char* op = "tail_grad_coeffs";
  const Folded f = folded_of(op, scale, weight, mu, invstd);
  const int64_t B = f.B, C = f.C;
  const bool training = stats_opt.has_value() && stats_opt->defined();
  const double* st = training ? param<double>(op, *stats_opt, B * 2 * C, "stats") : nullptr;
  TORCH_CHECK(!training || count > 0, "kcla_mm ", op, ": count must be positive, got ", count);
  at::Tensor alpha = at::empty({B, C}, scale.options()), kappa = at::empty({B, C}, scale.options()),
             lam = at::empty({B, C}, scale.options());
  at::Tensor qr = at::zeros({2, C}, scale.options().dtype(at::kDouble));
  float *alp = alpha.data_ptr<float>(), *kap = kappa.data_ptr<float>(), *lap = lam.data_ptr<float>();
  double* qrp = qr.data_ptr<double>();
  const double n = static_cast<double>(count);
  for (int64_t c = 0; c < C; ++c) {
    const double p = f.gamma[c] * f.invstd[c];
    double q = 0, r = 0;
    if (training) {  // gs = p (g - gb / n - s_hat gg / n), s_hat = (s - mu) invstd
      double gb = 0, gsv = 0;
      for (int64_t b = 0; b < B; ++b) {
        gb += st[(b * 2) * C + c];
        gsv += f.sc[b * C + c] * st[(b * 2 + 1) * C + c];
      }
      const double gg = f.invstd[c] * (gsv - f.mu[c] * gb);  // sum g s_hat
      q = p * (f.invstd[c] * f.mu[c] * gg - gb) / n;
      r = -p * f.invstd[c] * gg / n;
    }
    qrp[c] = q;
    qrp[C + c] = r;
    for (int64_t b = 0; b < B; ++b) {
      const double sc = f.sc[b * C + c];
      alp[b * C + c] = static_cast<float>(sc * p);
      kap[b * C + c] = static_cast<float>(sc * q);
      lap[b * C + c] = static_cast<float>(sc * sc * r);
    }
  }
  return std::make_tuple(alpha, kappa, lam, qr);
}

// Gradients of BatchNorm's affine parameters and of the gate scale, from r
// (train_backward's sums of g and g v), sums (train_stats's of v and v^2) and
// qr (tail_grad_coeffs). Returns (gweight, gbias [C], gscale [B, C]), float32.
std::tuple<at::Tensor, at::Tensor, at::Tensor> tail_param_grads(
    const at::Tensor& r, const at::Tensor& sums, const at::Tensor& scale, const at::Tensor& weight,
    const at::Tensor& mu, const at::Tensor& invstd, const at::Tensor& qr) {
  const char* op = "tail_param_grads";
  const Folded f = folded_of(op, scale, weight, mu, invstd);
  const int64_t B = f.B, C = f.C;
  const double* rp = param<double>(op, r, B * 2 * C, "r");
  const double* sp = param<double>(op, sums, B * 2 * C, "sums");
  const double* qrp = param<double>(op, qr, 2 * C, "qr");
  at::Tensor gw = at::empty({C}, scale.options()), gbias = at::empty({C}, scale.options()),
             gscale = at::empty({B, C}, scale.options());
  float *gwp = gw.data_ptr<float>(), *gbp = gbias.data_ptr<float>(),
        *gsp = gscale.data_ptr<float>();
  for (int64_t c = 0; c < C; ++c) {
    const double p = f.gamma[c] * f.invstd[c], q = qrp[c], rr = qrp[C + c];
    double gb = 0, gsv = 0;
    for (int64_t b = 0; b < B; ++b) {
      const double sc = f.sc[b * C + c], g0 = rp[(b * 2) * C + c], g1 = rp[(b * 2 + 1) * C + c];
      gb += g0;
      gsv += sc * g1;
      // d L / d scale = sum over pixels of gs v, gs = p g + q + r s
      gsp[b * C + c] = static_cast<float>(p * g1 + q * sp[(b * 2) * C + c] +
                                          rr * sc * sp[(b * 2 + 1) * C + c]);
    }
    gbp[c] = static_cast<float>(gb);
    gwp[c] = static_cast<float>(f.invstd[c] * (gsv - f.mu[c] * gb));  // sum g s_hat
  }
  return std::make_tuple(gw, gbias, gscale);
}

// -- an init layer adapting the incoming state, in training (docs/method.md, section 5) --
// y = adjust(m) (a grouped 1x1 convolution with the layer's stride, no bias),
// ubar = norm_u(y) (BatchNorm: batch statistics in training, which also
// updates the running ones as nn.BatchNorm2d does, else the running ones),
// and ubar's global pool, which the re-keying reads; FusedAdapt
// (kcla_mm/ops/fused_tail_cpu.py) is the autograd side. Forward is two passes
// over the adapted maps (y and its sums; ubar), backward two (sums of the
// gradient; the gradients of y, m and the weights), where the eager ops
// (oneDNN's strided grouped convolution and its backward, BatchNorm, the pool
// and the add of its gradient) took about a dozen calls.

struct Adapt {
  int64_t B, Cp, Hp, Wp, C, di, G, dout, stride, H, W;
};

Adapt adapt_of(const char* op, const at::Tensor& m, const at::Tensor& w, int64_t stride) {
  TORCH_CHECK(m.dim() == 4, "kcla_mm ", op, ": m must be [B, C_prev, H, W], got ", m.sizes());
  check_map(op, m, "m", m.sizes());
  TORCH_CHECK(w.dim() == 4 && w.size(2) == 1 && w.size(3) == 1,
              "kcla_mm ", op, ": w must be a 1x1 convolution's weight [C, C_prev / G, 1, 1], "
              "got ", w.sizes());
  TORCH_CHECK(w.device().is_cpu() && w.scalar_type() == at::kFloat && w.is_contiguous(),
              "kcla_mm ", op, ": w must be a contiguous CPU float32 tensor, got ",
              w.scalar_type());
  TORCH_CHECK(stride >= 1, "kcla_mm ", op, ": stride must be positive, got ", stride);
  Adapt a;
  a.B = m.size(0), a.Cp = m.size(1), a.Hp = m.size(2), a.Wp = m.size(3);
  a.C = w.size(0), a.di = w.size(1);
  TORCH_CHECK(a.di > 0 && a.Cp % a.di == 0 && a.C % (a.Cp / a.di) == 0, "kcla_mm ", op,
              ": w of shape ", w.sizes(), " is not a grouped 1x1 convolution of ", a.Cp,
              " channels");
  a.G = a.Cp / a.di, a.dout = a.C / a.G, a.stride = stride;
  a.H = (a.Hp - 1) / stride + 1, a.W = (a.Wp - 1) / stride + 1;
  return a;
}

// Returns (ubar, y, sums [B, 2, C] float64 (per sample and channel: sum over
// pixels of y, of y^2), pooled [B, C] (ubar's global average pool), mu and
// invstd [C] float64 (the statistics ubar was normalised with)); ubar and y
// float32 channels-last [B, C, H, W].
std::vector<at::Tensor> adapt_forward(const at::Tensor& m, const at::Tensor& w, int64_t stride,
                                      const at::Tensor& weight, const at::Tensor& bias,
                                      const at::Tensor& running_mean,
                                      const at::Tensor& running_var, bool training, double factor,
                                      double eps) {
  const char* op = "adapt_forward";
  const Adapt d = adapt_of(op, m, w, stride);
  const int64_t B = d.B, C = d.C, H = d.H, W = d.W, Cp = d.Cp, HW = H * W;
  const std::vector<float> wt = grouped_weights_t(w.data_ptr<float>(), C, d.di, d.G);
  const NormArgs na = norm_args(op, weight, bias, running_mean, running_var, C, training,
                                B * HW, eps);
  const float *gp = na.weight, *bp = na.bias;
  float *rm = na.running_mean, *rv = na.running_var;  // updated in place in training
  const auto cl = m.options().memory_format(at::MemoryFormat::ChannelsLast);
  at::Tensor y = at::empty({B, C, H, W}, cl), ubar = at::empty({B, C, H, W}, cl);
  const float* mp = m.data_ptr<float>();
  float *yp = y.data_ptr<float>(), *up = ubar.data_ptr<float>();
  const int64_t prow = d.Wp * Cp, pplane = d.Hp * prow, row = W * C, plane = HW * C;
  // k: y at the first pixel (m's first pixel through adjust), the shift of the
  // sums below: sums of y - k and (y - k)^2 do not cancel where y's mean is
  // large against its spread (a flat state far from zero), sums of y and y^2 do
  const float* wp = w.data_ptr<float>();
  std::vector<float> k(C);
  for (int64_t c = 0; c < C; ++c) {
    const float* mi = mp + (c / d.dout) * d.di;
    double acc = 0.0;
    for (int64_t i = 0; i < d.di; ++i) acc += static_cast<double>(wp[c * d.di + i]) * mi[i];
    k[c] = static_cast<float>(acc);
  }
  // pass 1: y, and per (sample, channel) sums of y - k and (y - k)^2
  const Bands bands(B, H);
  std::vector<double> partial(bands.tasks * 2 * C, 0.0);
  bands.run([&](int64_t b, int64_t h0, int64_t h1, int64_t t) {
    std::vector<float> s1(C), s2(C);
    double* acc = partial.data() + t * 2 * C;
    const float* kp = k.data();
    for (int64_t h = h0; h < h1; ++h) {
      float* yr = yp + b * plane + h * row;
      grouped_row(mp + b * pplane + h * stride * prow, stride * Cp, wt.data(), nullptr, yr, C,
                  W, Cp, C, d.G);
      float *a1 = s1.data(), *a2 = s2.data();
      for (int64_t x = 0; x < W; ++x) {
        const float* v = yr + x * C;
#pragma omp simd
        for (int64_t c = 0; c < C; ++c) {
          const float u = v[c] - kp[c];
          a1[c] += u;
          a2[c] += u * u;
        }
      }
      if (flush_after(h, h0, h1, W)) flush_sums(s1, s2, acc);
    }
  });
  at::Tensor sums = bands.per_sample_sums(partial, B, 2 * C);  // [B, 2 C], about k
  double* sp = sums.data_ptr<double>();
  // the statistics (channel_stats, as for the tail), then ubar = a y + sh
  const at::TensorOptions f64 = m.options().dtype(at::kDouble);
  at::Tensor mu = at::empty({C}, f64), invstd = at::empty({C}, f64);
  at::Tensor pooled = at::empty({B, C}, m.options());
  double *mup = mu.data_ptr<double>(), *isp = invstd.data_ptr<double>();
  float* pop = pooled.data_ptr<float>();
  std::vector<float> a(C), sh(C);
  const double n = static_cast<double>(B * HW);
  const double hw = static_cast<double>(HW);
  for (int64_t c = 0; c < C; ++c) {
    double t1 = 0, t2 = 0;  // the sums of y - k, in training
    for (int64_t b = 0; b < (training ? B : 0); ++b) {
      t1 += sp[b * 2 * C + c];
      t2 += sp[b * 2 * C + C + c];
    }
    std::tie(mup[c], isp[c]) =
        channel_stats(training, t1, t2, n, factor, eps, rm[c], rv[c], k[c]);
    const double mc = mup[c];
    const double ac = gp[c] * isp[c], shc = bp[c] - ac * mc;
    a[c] = static_cast<float>(ac);
    sh[c] = static_cast<float>(shc);
    // the pool of ubar = a y + sh is a (the pool of y) + sh = a (k + the pool
    // of y - k - mean) + a mean + sh: about the mean, so that it does not cancel
    for (int64_t b = 0; b < B; ++b) {
      const double dev = k[c] - mc + sp[b * 2 * C + c] / hw;  // sample b's mean of y - mean
      pop[b * C + c] = static_cast<float>(ac * dev + bp[c]);
    }
    // the sums returned: of y and y^2, from those about k (in double)
    for (int64_t b = 0; b < B; ++b) {
      double &s1 = sp[b * 2 * C + c], &s2 = sp[b * 2 * C + C + c];
      const double kc = k[c];
      s2 += 2.0 * kc * s1 + hw * kc * kc;
      s1 += hw * kc;
    }
  }
  // pass 2: ubar
  at::parallel_for(0, B * H, 1, [&](int64_t lo, int64_t hi) {
    const float *ap = a.data(), *shp = sh.data();
    for (int64_t r = lo; r < hi; ++r)
      for (int64_t x = 0; x < W; ++x) {
        const float* v = yp + r * row + x * C;
        float* u = up + r * row + x * C;
#pragma omp simd
        for (int64_t c = 0; c < C; ++c) u[c] = ap[c] * v[c] + shp[c];
      }
  });
  return {ubar, y, sums.view({B, 2, C}), pooled, mu, invstd};
}

// acc[c, i] += sum over n pixels p of g[p, c] src[p, i] (c < dout, i < NV VL):
// pixel p of g at g + p * g_step, of src at src + p * src_step; acc [dout, NV VL]
template <int NV>
void outer_sums(const float* g, int64_t g_step, const float* src, int64_t src_step, int64_t n,
                int64_t dout, float* acc) {
  constexpr int64_t di = NV * VL;
  // rows of acc held in registers over the pixels: CB x NV sums, NV inputs
  // and a broadcast in the vector registers (4 x 4 sums spilled on AVX2's 16)
  constexpr int kRegs = VL == 16 ? 32 : 16;
  constexpr int CB = 4 * NV + NV + 1 <= kRegs ? 4 : 2;
  int64_t c = 0;
  for (; c + CB <= dout; c += CB) {
    vf s[CB][NV];
    for (int r = 0; r < CB; ++r)
      for (int v = 0; v < NV; ++v) s[r][v] = load(acc + (c + r) * di + v * VL);
    for (int64_t p = 0; p < n; ++p) {
      vf in[NV];
      for (int v = 0; v < NV; ++v) in[v] = load(src + p * src_step + v * VL);
      for (int r = 0; r < CB; ++r) {
        const vf gv = splat(g[p * g_step + c + r]);
        for (int v = 0; v < NV; ++v) s[r][v] += gv * in[v];
      }
    }
    for (int r = 0; r < CB; ++r)
      for (int v = 0; v < NV; ++v) store(acc + (c + r) * di + v * VL, s[r][v]);
  }
  for (; c < dout; ++c)
    for (int64_t p = 0; p < n; ++p) {
      const float gv = g[p * g_step + c];
      for (int64_t i = 0; i < di; ++i) acc[c * di + i] += gv * src[p * src_step + i];
    }
}

// Gradients of adapt_forward: (gm [B, C_prev, H_prev, W_prev] (zero but at the
// pixels the convolution reads), gw as w (as_weight_grad; summed in float64),
// gweight, gbias [C] float32). gu: ubar's gradient; gpool [B, C] the pool's,
// or undefined; bn_training: whether forward used batch statistics.
std::vector<at::Tensor> adapt_backward(const at::Tensor& gu,
                                       const c10::optional<at::Tensor>& gpool_opt,
                                       const at::Tensor& m, const at::Tensor& y,
                                       const at::Tensor& w, int64_t stride,
                                       const at::Tensor& weight, const at::Tensor& mu,
                                       const at::Tensor& invstd, bool bn_training) {
  const char* op = "adapt_backward";
  const Adapt d = adapt_of(op, m, w, stride);
  const int64_t B = d.B, C = d.C, H = d.H, W = d.W, Cp = d.Cp, di = d.di, dout = d.dout;
  const int64_t HW = H * W, row = W * C, plane = HW * C, prow = d.Wp * Cp,
                pplane = d.Hp * prow;
  const std::vector<int64_t> shape = {B, C, H, W};
  check_map(op, gu, "gu", shape);
  check_map(op, y, "y", shape);
  const float* gpp = opt_param(op, gpool_opt, B * C, "gpool");
  const float* gam = param<float>(op, weight, C, "weight");
  const double* mup = param<double>(op, mu, C, "mu");
  const double* isp = param<double>(op, invstd, C, "invstd");
  const float *gup = gu.data_ptr<float>(), *yp = y.data_ptr<float>(),
              *mp = m.data_ptr<float>(), *wp = w.data_ptr<float>();
  // pass A: per (sample, channel) sums of gu, gu (y - mf) and y - mf, mf the
  // mean in float: about the mean, so that they do not cancel where y's mean
  // is large against its spread
  std::vector<float> mf(C);
  for (int64_t c = 0; c < C; ++c) mf[c] = static_cast<float>(mup[c]);
  const Bands bands(B, H);
  std::vector<double> partial(bands.tasks * 3 * C, 0.0);
  bands.run([&](int64_t b, int64_t h0, int64_t h1, int64_t t) {
    std::vector<float> s(3 * C, 0.f);
    double* acc = partial.data() + t * 3 * C;
    float *sg = s.data(), *sgy = sg + C, *sy = sgy + C;
    const float* mfp = mf.data();
    for (int64_t h = h0; h < h1; ++h) {
      for (int64_t x = 0; x < W; ++x) {
        const int64_t o = b * plane + h * row + x * C;
        const float *gr = gup + o, *yr = yp + o;
#pragma omp simd
        for (int64_t c = 0; c < C; ++c) {
          const float u = yr[c] - mfp[c];
          sg[c] += gr[c];
          sgy[c] += gr[c] * u;
          sy[c] += u;
        }
      }
      if (flush_after(h, h0, h1, W)) {  // into double
        for (int64_t i = 0; i < 3 * C; ++i) acc[i] += s[i];
        std::fill(s.begin(), s.end(), 0.f);
      }
    }
  });
  at::Tensor sums = bands.per_sample_sums(partial, B, 3 * C);  // [B, 3 C]
  const double* sp = sums.data_ptr<double>();
  // g_y = k1 gu + k0[b] + k2 (y - mf) (BatchNorm's backward with the pool's
  // gradient folded)
  const auto f32 = m.options();
  at::Tensor gweight = at::empty({C}, f32), gbias = at::empty({C}, f32);
  float *gwt = gweight.data_ptr<float>(), *gbs = gbias.data_ptr<float>();
  std::vector<float> k1(C), k2(C), k0(B * C);
  const double n = static_cast<double>(B * HW);
  for (int64_t c = 0; c < C; ++c) {
    double sg = 0, sgy = 0;  // sums of G and G (y - mf), G the gradient with the pool's
    for (int64_t b = 0; b < B; ++b) {
      const double gpb = gpp != nullptr ? gpp[b * C + c] : 0.0;
      sg += sp[b * 3 * C + c] + gpb;
      sgy += sp[b * 3 * C + C + c] + gpb * sp[b * 3 * C + 2 * C + c] / static_cast<double>(HW);
    }
    const double dm = mup[c] - mf[c];  // the mean's rounding to float
    const double sgh = isp[c] * (sgy - dm * sg);  // sum of G y_hat
    gbs[c] = static_cast<float>(sg);
    gwt[c] = static_cast<float>(sgh);
    const double a = gam[c] * isp[c];
    const double q2 = bn_training ? -a * isp[c] * sgh / n : 0.0;
    const double q0 = bn_training ? -a * sg / n - q2 * dm : 0.0;
    k1[c] = static_cast<float>(a);
    k2[c] = static_cast<float>(q2);
    for (int64_t b = 0; b < B; ++b) {
      const double gpb = gpp != nullptr ? gpp[b * C + c] : 0.0;
      k0[b * C + c] = static_cast<float>(a * gpb / static_cast<double>(HW) + q0);
    }
  }
  // pass B: g_y row by row; gm = adjust^T g_y at the pixels read (zero elsewhere); gw
  at::Tensor gm = at::empty_like(m);
  float* gmp = gm.data_ptr<float>();
  const int64_t n_gw = C * di;
  std::vector<double> gw_partial(bands.tasks * n_gw, 0.0);
  bands.run([&](int64_t b, int64_t h0, int64_t h1, int64_t t) {
    std::vector<float> gyr(row), acc(n_gw, 0.f);
    double* dst = gw_partial.data() + t * n_gw;
    const float *k1p = k1.data(), *k2p = k2.data(), *k0p = k0.data() + b * C, *mfp = mf.data();
    for (int64_t h = h0; h < h1; ++h) {
      for (int64_t x = 0; x < W; ++x) {
        const int64_t o = b * plane + h * row + x * C;
        const float *gr = gup + o, *yr = yp + o;
        float* out = gyr.data() + x * C;
#pragma omp simd
        for (int64_t c = 0; c < C; ++c)
          out[c] = k1p[c] * gr[c] + k0p[c] + k2p[c] * (yr[c] - mfp[c]);
      }
      const int64_t r0 = h * stride, r1 = std::min(d.Hp, r0 + stride);
      float* gm_row = gmp + b * pplane + r0 * prow;
      std::memset(gm_row, 0, (r1 - r0) * prow * sizeof(float));
      // the transposed convolution: w in its own layout [G, dout, di]
      grouped_row(gyr.data(), C, wp, nullptr, gm_row, stride * Cp, W, C, Cp, d.G);
      const float* m_row = mp + b * pplane + r0 * prow;
      for (int64_t g = 0; g < d.G; ++g) {
        const float* gg = gyr.data() + g * dout;
        const float* sg = m_row + g * di;
        float* ag = acc.data() + g * dout * di;
        if (di == VL) {
          outer_sums<1>(gg, C, sg, stride * Cp, W, dout, ag);
        } else if (di == 2 * VL) {
          outer_sums<2>(gg, C, sg, stride * Cp, W, dout, ag);
        } else if (di == 4 * VL) {  // ResNet's 32 inputs per group on AVX2
          outer_sums<4>(gg, C, sg, stride * Cp, W, dout, ag);
        } else {
          for (int64_t x = 0; x < W; ++x)
            for (int64_t c = 0; c < dout; ++c) {
              const float gv = gg[x * C + c];
              const float* s = sg + x * stride * Cp;
              float* a = ag + c * di;
#pragma omp simd
              for (int64_t i = 0; i < di; ++i) a[i] += gv * s[i];
            }
        }
      }
      if (flush_after(h, h0, h1, W)) {  // into double
        for (int64_t i = 0; i < n_gw; ++i) dst[i] += acc[i];
        std::fill(acc.begin(), acc.end(), 0.f);
      }
    }
  });
  at::Tensor gw = at::zeros({C, di}, m.options().dtype(at::kDouble));
  double* gwp = gw.data_ptr<double>();
  for (int64_t t = 0; t < bands.tasks; ++t)  // in task order: the same sums for any thread count
    for (int64_t i = 0; i < n_gw; ++i) gwp[i] += gw_partial[t * n_gw + i];
  return {gm, as_weight_grad(gw, w), gweight, gbias};
}

// -- a whole training step in one call each way (fused_tail_cpu.FusedStep) --
// The ops above in FusedStep's order, called directly: one dispatch from
// Python per block and direction instead of five or six, and none of the
// small ATen ops between them. Same ops, same order, so the same numbers.

// Returns (out, mean or empty without prev (then mean is x), log z', p [B, C]
// (the pooled x), beta or empty, scale, sums, a, shift, mu, invstd).
std::vector<at::Tensor> step_forward(
    const at::Tensor& x, const c10::optional<at::Tensor>& prev, const c10::optional<at::Tensor>& log_z,
    const at::Tensor& wq, const at::Tensor& wk, const at::Tensor& inv_tau, const at::Tensor& phi,
    double clamp, double eps, const at::Tensor& wv, const c10::optional<at::Tensor>& keep,
    const at::Tensor& weight, const at::Tensor& bias, const at::Tensor& running_mean,
    const at::Tensor& running_var, bool training, double factor, double bn_eps,
    const c10::optional<at::Tensor>& pooled) {
  const Maps m = maps_of("step_forward", x);
  // the global pool (global_pool's, as eval_step's), unless residual_relu_pool_ gave it
  at::Tensor p;
  if (pooled.has_value() && pooled->defined()) {
    TORCH_CHECK(pooled->scalar_type() == at::kFloat && pooled->is_contiguous() &&
                    pooled->sizes() == at::IntArrayRef({m.B, m.C}),
                "kcla_mm step_forward: pooled must be a contiguous float32 [", m.B, ", ", m.C,
                "] tensor, got ", pooled->scalar_type(), " ", pooled->sizes());
    p = *pooled;
  } else {
    p = at::empty({m.B, m.C}, x.options());
    global_pool<PoolMode::kRead>(x.data_ptr<float>(), nullptr, m.B, m.H * m.W, m.C,
                                 p.data_ptr<float>());
  }
  at::Tensor beta, scale, lz;
  std::tie(beta, scale, lz) = head_forward(p, log_z, wq, wk, inv_tau, phi, clamp, eps);
  const bool has_state = log_z.has_value() && log_z->defined();
  const c10::optional<at::Tensor> flat =
      has_state ? c10::optional<at::Tensor>(beta) : c10::nullopt;
  at::Tensor mean, sums;
  std::tie(mean, sums) = train_stats(x, prev, flat, wv);
  const bool has_prev = prev.has_value() && prev->defined();
  at::Tensor a, shift, mu, invstd;
  std::tie(a, shift, mu, invstd) = tail_coeffs(sums, scale, keep, weight, bias, running_mean,
                                               running_var, training, factor, bn_eps,
                                               m.B * m.H * m.W);
  at::Tensor out = train_apply(x, has_prev ? mean : x, wv, a, shift);
  return {out, mean, lz, p, beta, scale, sums, a, shift, mu, invstd};
}

// Returns (gx, gprev or empty, glog_z or empty, gwq, gwk, gphi, gwv, gweight,
// gbias), float32, the weights' gradients as their weights (as_weight_grad).
// gy: the output's gradient (a zero map where it has none); bn_training:
// whether forward used batch statistics.
std::vector<at::Tensor> step_backward(
    const at::Tensor& gy, const c10::optional<at::Tensor>& gmean,
    const c10::optional<at::Tensor>& glog_z, const at::Tensor& x,
    const c10::optional<at::Tensor>& prev, const at::Tensor& mean, const at::Tensor& p,
    const c10::optional<at::Tensor>& log_z, const at::Tensor& wq, const at::Tensor& wk,
    const at::Tensor& inv_tau, const at::Tensor& phi, double clamp, double eps,
    const at::Tensor& wv, const c10::optional<at::Tensor>& keep,
    const c10::optional<at::Tensor>& beta, const at::Tensor& scale, const at::Tensor& sums,
    const at::Tensor& weight, const at::Tensor& mu, const at::Tensor& invstd, const at::Tensor& a,
    const at::Tensor& shift, bool bn_training, bool pool_grad_into_gx, bool x_is_out) {
  const Maps m = maps_of("step_backward", x);
  const int64_t count = m.B * m.H * m.W;
  const c10::optional<at::Tensor> stats =
      bn_training ? c10::optional<at::Tensor>(train_grad_stats(gy, mean, wv, a, shift, keep))
                  : c10::nullopt;
  at::Tensor alpha, kappa, lam, qr;
  std::tie(alpha, kappa, lam, qr) = tail_grad_coeffs(stats, scale, weight, mu, invstd, count);
  at::Tensor gx, gprev, gbeta, gwv, r;
  std::tie(gx, gprev, gbeta, gwv, r) =
      train_backward(gy, gmean, x, prev, mean, beta, wv, a, shift, keep, alpha, kappa, lam,
                     x_is_out);
  at::Tensor gweight, gbias, gscale;
  std::tie(gweight, gbias, gscale) = tail_param_grads(r, sums, scale, weight, mu, invstd, qr);
  const bool has_prev = prev.has_value() && prev->defined();
  const c10::optional<at::Tensor> gbeta_f =
      has_prev ? c10::optional<at::Tensor>(gbeta.to(x.scalar_type())) : c10::nullopt;
  at::Tensor gp, glz, gwq, gwk, gphi;
  std::tie(gp, glz, gwq, gwk, gphi) =
      head_backward(p, log_z, wq, wk, inv_tau, phi, clamp, eps, gbeta_f, gscale,
                    glog_z);
  std::vector<at::Tensor> grads = {gx, gprev, glz, as_weight_grad(gwq, wq),
                                   as_weight_grad(gwk, wk), as_weight_grad(gphi, phi),
                                   as_weight_grad(gwv, wv), gweight, gbias};
  // the pool's backward: gp / (H W) at every pixel (unless the pool came from
  // residual_relu_pool_, whose backward adds it: then gp is returned, last)
  if (pool_grad_into_gx) {
    gx.add_(gp.div_(m.H * m.W).view({m.B, m.C, 1, 1}));
  } else {
    grads.push_back(gp);
  }
  return grads;
}

}  // namespace

// -- a residual block's end in training: relu(bn(x) + bn_res(res)) --
//
// The block's last BatchNorm (and its shortcut's, where given) applied in the
// pass of the add, the ReLU and KCLA's pooling (global_pool's kAffineAddRelu),
// after one pass for each norm's batch statistics; the backward pass is two
// passes (the gradient sums of both norms, then both input gradients), where
// the host's ops took two passes for the statistics and two for the norm's
// output per norm, one for the add and the ReLU, and three per norm backward.

// One norm of the block's end: its parameters, and in training its batch
// statistics (mu, invstd, [C] float64) and running statistics' update.
struct EndNorm {
  std::vector<float> alpha, beta;  // x -> alpha x + beta
  at::Tensor mu, invstd;
};

EndNorm end_norm(const char* op, const char* name, const at::Tensor& x, const at::Tensor& weight,
                 const at::Tensor& bias, const at::Tensor& running_mean,
                 const at::Tensor& running_var, bool training, double factor, double eps) {
  const int64_t B = x.size(0), C = x.size(1), H = x.size(2), W = x.size(3), HW = H * W;
  EndNorm e;
  const at::TensorOptions f64 = x.options().dtype(at::kDouble);
  e.mu = at::empty({C}, f64);
  e.invstd = at::empty({C}, f64);
  double *mup = e.mu.data_ptr<double>(), *isp = e.invstd.data_ptr<double>();
  if (!training) {  // ATen's affine (bit for bit its output); its invstd for the backward pass
    e.alpha = bn_eval_affine(op, name, C, weight, bias, running_mean, running_var, eps);
    e.beta.assign(e.alpha.begin() + C, e.alpha.end());
    e.alpha.resize(C);
    const float *rm = running_mean.data_ptr<float>(), *rv = running_var.data_ptr<float>();
    for (int64_t c = 0; c < C; ++c) {
      mup[c] = rm[c];
      isp[c] = 1.0 / std::sqrt(static_cast<double>(rv[c]) + eps);
    }
    return e;
  }
  const NormArgs na = norm_args(op, weight, bias, running_mean, running_var, C, true, B * HW, eps);
  // the statistics pass: per-channel sums of x - k and (x - k)^2 (float over
  // about 256 pixels, then double, in a fixed order), k the first pixel's value:
  // shifted, E[(x-k)^2] - E[x-k]^2 does not cancel where the mean is large
  const float* xp = x.data_ptr<float>();
  const std::vector<float> k(xp, xp + C);
  const Bands bands(B, H);
  std::vector<double> partial(bands.tasks * 2 * C, 0.0);
  bands.run([&](int64_t b, int64_t h0, int64_t h1, int64_t t) {
    std::vector<float> s1(C), s2(C);
    double* acc = partial.data() + t * 2 * C;
    for (int64_t h = h0; h < h1; ++h) {
      float *a1 = s1.data(), *a2 = s2.data();
      for (int64_t w = 0; w < W; ++w) {
        const float* v = xp + ((b * H + h) * W + w) * C;
        const float* kp = k.data();
#pragma omp simd
        for (int64_t c = 0; c < C; ++c) {
          const float u = v[c] - kp[c];
          a1[c] += u;
          a2[c] += u * u;
        }
      }
      if (flush_after(h, h0, h1, W)) flush_sums(s1, s2, acc);
    }
  });
  std::vector<double> sums(2 * C, 0.0);
  for (int64_t t = 0; t < bands.tasks; ++t)
    for (int64_t i = 0; i < 2 * C; ++i) sums[i] += partial[t * 2 * C + i];
  e.alpha.resize(C);
  e.beta.resize(C);
  const double n = static_cast<double>(B * HW);
  for (int64_t c = 0; c < C; ++c) {
    std::tie(mup[c], isp[c]) = channel_stats(true, sums[c], sums[C + c], n, factor, eps,
                                             na.running_mean[c], na.running_var[c], k[c]);
    const double a = na.weight[c] * isp[c];
    e.alpha[c] = static_cast<float>(a);
    e.beta[c] = static_cast<float>(na.bias[c] - a * mup[c]);
  }
  return e;
}

// Returns (out = relu(bn(x) + bn_res(res)) (+ res without res's norm), its
// pool [B, C], the ReLU's mask (residual_relu_pool_mask_'s), mu, invstd of
// x's norm, of res's ([C] float64; empty without)). Each norm: batch
// statistics in training (the running ones updated as nn.BatchNorm2d does:
// factor its momentum, or 1 / batches for a cumulative average), else the
// running ones (ATen's output bit for bit). x and res are kept as they are.
std::vector<at::Tensor> block_end_forward(
    const at::Tensor& x, const at::Tensor& res, const at::Tensor& weight, const at::Tensor& bias,
    const at::Tensor& running_mean, const at::Tensor& running_var, bool training, double factor,
    double eps, const c10::optional<at::Tensor>& res_weight,
    const c10::optional<at::Tensor>& res_bias, const c10::optional<at::Tensor>& res_mean,
    const c10::optional<at::Tensor>& res_var, bool res_training, double res_factor,
    double res_eps) {
  const char* op = "block_end_forward";
  TORCH_CHECK(x.dim() == 4, "kcla_mm ", op, ": x must be [B, C, H, W], got ", x.sizes());
  check_map(op, x, "x", x.sizes());
  check_map(op, res, "res", x.sizes());
  const bool given = all_or_none(op, "res_weight, res_bias, res_mean and res_var",
                                 {&res_weight, &res_bias, &res_mean, &res_var});
  const int64_t B = x.size(0), C = x.size(1), H = x.size(2), W = x.size(3);
  const EndNorm nx = end_norm(op, "", x, weight, bias, running_mean, running_var, training,
                              factor, eps);
  EndNorm nr;
  PreAffine f;
  f.ax = nx.alpha.data();
  f.bx = nx.beta.data();
  if (given) {
    nr = end_norm(op, "res_", res, *res_weight, *res_bias, *res_mean, *res_var, res_training,
                  res_factor, res_eps);
    f.ar = nr.alpha.data();
    f.br = nr.beta.data();
  }
  at::Tensor out = at::empty_like(x);
  at::Tensor pooled = at::empty({B, C}, x.options());
  at::Tensor mask = at::empty({B, H, W, mask_bytes(C)}, x.options().dtype(at::kByte));
  if (H * W > 0)
    global_pool<PoolMode::kAffineAddRelu>(const_cast<float*>(x.data_ptr<float>()),
                                          res.data_ptr<float>(), B, H * W, C,
                                          pooled.data_ptr<float>(), mask.data_ptr<uint8_t>(), f,
                                          out.data_ptr<float>());
  const at::Tensor none = at::empty({0}, x.options().dtype(at::kDouble));
  return {out, pooled, mask, nx.mu, nx.invstd, given ? nr.mu : none, given ? nr.invstd : none};
}

// Gradients of block_end_forward: (gx, gweight, gbias, gres, and with res's
// norm gres_weight, gres_bias; else empty). gout: out's gradient (undefined:
// zero), gpool: the pool's [B, C] (undefined: none); mu, invstd what forward
// returned; *_training whether forward used batch statistics. res (the
// shortcut's input to its norm) only with its norm.
std::vector<at::Tensor> block_end_backward(
    const c10::optional<at::Tensor>& gout_opt, const c10::optional<at::Tensor>& gpool_opt,
    const at::Tensor& mask, const at::Tensor& x, const at::Tensor& weight, const at::Tensor& mu,
    const at::Tensor& invstd, bool training, const c10::optional<at::Tensor>& res_opt,
    const c10::optional<at::Tensor>& res_weight, const c10::optional<at::Tensor>& res_mu,
    const c10::optional<at::Tensor>& res_invstd, bool res_training) {
  const char* op = "block_end_backward";
  TORCH_CHECK(x.dim() == 4, "kcla_mm ", op, ": x must be [B, C, H, W], got ", x.sizes());
  check_map(op, x, "x", x.sizes());
  const int64_t B = x.size(0), C = x.size(1), H = x.size(2), W = x.size(3), HW = H * W;
  const int64_t nb = mask_bytes(C);
  check_mask(op, mask, B, C, H, W, "block_end_forward");
  const bool has_gout = gout_opt.has_value() && gout_opt->defined();
  if (has_gout) check_map(op, *gout_opt, "gout", x.sizes());
  const bool rn = all_or_none(op, "res, res_weight, res_mu and res_invstd",
                              {&res_opt, &res_weight, &res_mu, &res_invstd});
  if (rn) check_map(op, *res_opt, "res", x.sizes());
  const float* gam = param<float>(op, weight, C, "weight");
  const double* mup = param<double>(op, mu, C, "mu");
  const double* isp = param<double>(op, invstd, C, "invstd");
  const float* rgam = rn ? param<float>(op, *res_weight, C, "res_weight") : nullptr;
  const double* rmup = rn ? param<double>(op, *res_mu, C, "res_mu") : nullptr;
  const double* risp = rn ? param<double>(op, *res_invstd, C, "res_invstd") : nullptr;
  const float* gpp = opt_param(op, gpool_opt, B * C, "gpool");
  std::vector<float> d(B * C, 0.f);  // the pool's gradient per value
  if (gpp != nullptr)
    for (int64_t i = 0; i < B * C; ++i) d[i] = gpp[i] / static_cast<float>(HW);
  const float* gop = has_gout ? gout_opt->data_ptr<float>() : nullptr;
  const float* xp = x.data_ptr<float>();
  const float* rp = rn ? res_opt->data_ptr<float>() : nullptr;
  const uint8_t* mp = mask.data_ptr<uint8_t>();
  // g, the gradient of the sum: (gout + d) where the ReLU passed, else +0
  // (relu_pool_backward's values)
  auto g_of = [&](int64_t o, int64_t px, const float* db, int64_t c0) -> vf {
    const vf v = gop != nullptr ? (gpp != nullptr ? load(gop + o + c0) + load(db + c0)
                                                  : load(gop + o + c0))
                                : (gpp != nullptr ? load(db + c0) : splat(0.f));
    return select_bits(load_bits(mp + px * nb, c0), v);
  };
  auto g_at = [&](int64_t o, int64_t px, const float* db, int64_t c) -> float {
    const float v = gop != nullptr ? (gpp != nullptr ? gop[o + c] + db[c] : gop[o + c])
                                   : (gpp != nullptr ? db[c] : 0.f);
    return mask_bit(mp + px * nb, c) ? v : 0.f;
  };
  at::Tensor gres = at::empty_like(x);
  float* grp = gres.data_ptr<float>();
  const int64_t cv = C - C % VL, ns = rn ? 3 : 2;
  // pass 1: per-channel sums of g, g x (and g res); g itself is res's
  // gradient without res's norm
  const Bands bands(B, H);
  std::vector<double> partial(bands.tasks * ns * C, 0.0);
  bands.run([&](int64_t b, int64_t h0, int64_t h1, int64_t t) {
    std::vector<float> s(ns * C, 0.f);
    double* acc = partial.data() + t * ns * C;
    float *sg = s.data(), *sgx = sg + C, *sgr = sgx + C;
    const float* db = d.data() + b * C;
    for (int64_t h = h0; h < h1; ++h) {
      for (int64_t w = 0; w < W; ++w) {
        const int64_t px = (b * H + h) * W + w, o = px * C;
        for (int64_t c0 = 0; c0 < cv; c0 += VL) {
          const vf g = g_of(o, px, db, c0);
          store(sg + c0, load(sg + c0) + g);
          store(sgx + c0, load(sgx + c0) + g * load(xp + o + c0));
          if (rn) {
            store(sgr + c0, load(sgr + c0) + g * load(rp + o + c0));
          } else {
            store(grp + o + c0, g);
          }
        }
        for (int64_t c = cv; c < C; ++c) {
          const float g = g_at(o, px, db, c);
          sg[c] += g;
          sgx[c] += g * xp[o + c];
          if (rn) {
            sgr[c] += g * rp[o + c];
          } else {
            grp[o + c] = g;
          }
        }
      }
      if (flush_after(h, h0, h1, W)) {  // into double
        for (int64_t i = 0; i < ns * C; ++i) acc[i] += s[i];
        std::fill(s.begin(), s.end(), 0.f);
      }
    }
  });
  std::vector<double> sums(ns * C, 0.0);
  for (int64_t t = 0; t < bands.tasks; ++t)
    for (int64_t i = 0; i < ns * C; ++i) sums[i] += partial[t * ns * C + i];
  // per norm: grad = k1 g + k2 (v - k3) + k0 (BatchNorm's backward; k3 the
  // mean in float, so that v - k3 does not cancel), its parameters' gradients
  const auto f32 = x.options();
  const double n = static_cast<double>(B * HW);
  auto coeffs = [&](const float* gm, const double* mm, const double* is, bool tr,
                    const double* sgv, std::vector<float>& k, float* gw, float* gb) {
    k.assign(4 * C, 0.f);
    for (int64_t c = 0; c < C; ++c) {
      const double sg = sums[c], sgh = is[c] * (sgv[c] - mm[c] * sg);  // sum of g v_hat
      gb[c] = static_cast<float>(sg);
      gw[c] = static_cast<float>(sgh);
      const double a = gm[c] * is[c];
      const double q2 = tr ? -a * is[c] * sgh / n : 0.0;
      const float mf = static_cast<float>(mm[c]);
      k[c] = static_cast<float>(a);
      k[C + c] = static_cast<float>(q2);
      k[2 * C + c] = static_cast<float>(tr ? -a * sg / n + q2 * (mf - mm[c]) : 0.0);
      k[3 * C + c] = mf;
    }
  };
  at::Tensor gweight = at::empty({C}, f32), gbias = at::empty({C}, f32);
  std::vector<float> kx, kr;
  coeffs(gam, mup, isp, training, sums.data() + C, kx, gweight.data_ptr<float>(),
         gbias.data_ptr<float>());
  at::Tensor grw = at::empty({rn ? C : 0}, f32), grb = at::empty({rn ? C : 0}, f32);
  if (rn)
    coeffs(rgam, rmup, risp, res_training, sums.data() + 2 * C, kr, grw.data_ptr<float>(),
           grb.data_ptr<float>());
  // pass 2: gx (and gres) from g, recomputed
  at::Tensor gx = at::empty_like(x);
  float* gxp = gx.data_ptr<float>();
  bands.run([&](int64_t b, int64_t h0, int64_t h1, int64_t) {
    const float* db = d.data() + b * C;
    const float *k1 = kx.data(), *k2 = k1 + C, *k0 = k2 + C, *k3 = k0 + C;
    const float *r1 = rn ? kr.data() : nullptr, *r2 = r1 + C, *r0 = r2 + C, *r3 = r0 + C;
    for (int64_t h = h0; h < h1; ++h) {
      for (int64_t w = 0; w < W; ++w) {
        const int64_t px = (b * H + h) * W + w, o = px * C;
        for (int64_t c0 = 0; c0 < cv; c0 += VL) {
          const vf g = g_of(o, px, db, c0);
          store(gxp + o + c0,
                load(k1 + c0) * g + load(k2 + c0) * (load(xp + o + c0) - load(k3 + c0)) +
                    load(k0 + c0));
          if (rn)
            store(grp + o + c0,
                  load(r1 + c0) * g + load(r2 + c0) * (load(rp + o + c0) - load(r3 + c0)) +
                      load(r0 + c0));
        }
        for (int64_t c = cv; c < C; ++c) {
          const float g = g_at(o, px, db, c);
          gxp[o + c] = k1[c] * g + k2[c] * (xp[o + c] - k3[c]) + k0[c];
          if (rn) grp[o + c] = r1[c] * g + r2[c] * (rp[o + c] - r3[c]) + r0[c];
        }
      }
    }
  });
  return {gx, gweight, gbias, gres, grw, grb};
}

TORCH_LIBRARY_FRAGMENT(kcla_mm, m) {
  m.def("train_stats(Tensor x, Tensor? prev, Tensor? beta, Tensor wv) -> (Tensor, Tensor)");
  m.def("train_apply(Tensor x, Tensor mean, Tensor wv, Tensor a, Tensor shift) -> Tensor");
  m.def(
      "train_grad_stats(Tensor gy, Tensor mean, Tensor wv, Tensor a, Tensor shift, "
      "Tensor? keep) -> Tensor");
  m.def(
      "train_backward(Tensor gy, Tensor? gmean, Tensor x, Tensor? prev, Tensor mean, "
      "Tensor? beta, Tensor wv, Tensor a, Tensor shift, Tensor? keep, Tensor alpha, "
      "Tensor kappa, Tensor lam, bool x_is_out=False) -> (Tensor, Tensor, Tensor, Tensor, "
      "Tensor)");
  m.def(
      "tail_coeffs(Tensor sums, Tensor scale, Tensor? keep, Tensor weight, Tensor bias, "
      "Tensor(a!) running_mean, Tensor(b!) running_var, bool training, float factor, float eps, "
      "int count) -> (Tensor, Tensor, Tensor, Tensor)");
  m.def(
      "tail_grad_coeffs(Tensor? stats, Tensor scale, Tensor weight, Tensor mu, Tensor invstd, "
      "int count) -> (Tensor, Tensor, Tensor, Tensor)");
  m.def(
      "tail_param_grads(Tensor r, Tensor sums, Tensor scale, Tensor weight, Tensor mu, "
      "Tensor invstd, Tensor qr) -> (Tensor, Tensor, Tensor)");
  m.def(
      "head_forward(Tensor p, Tensor? log_z, Tensor wq, Tensor wk, Tensor inv_tau, Tensor phi, "
      "float clamp, float eps) -> (Tensor, Tensor, Tensor)");
  m.def(
      "head_backward(Tensor p, Tensor? log_z, Tensor wq, Tensor wk, Tensor inv_tau, "
      "Tensor phi, float clamp, float eps, Tensor? gbeta, Tensor? gscale, Tensor? glog_z) "
      "-> (Tensor, Tensor, Tensor, Tensor, Tensor)");
  m.def(
      "adapt_forward(Tensor m, Tensor w, int stride, Tensor weight, Tensor bias, "
      "Tensor(a!) running_mean, Tensor(b!) running_var, bool training, float factor, float eps) "
      "-> Tensor[]");
  m.def(
      "block_end_forward(Tensor x, Tensor res, Tensor weight, Tensor bias, "
      "Tensor(a!) running_mean, Tensor(b!) running_var, bool training, float factor, float eps, "
      "Tensor? res_weight, Tensor? res_bias, Tensor(c!)? res_mean, Tensor(d!)? res_var, "
      "bool res_training, float res_factor, float res_eps) -> Tensor[]");
  m.def(
      "block_end_backward(Tensor? gout, Tensor? gpool, Tensor mask, Tensor x, Tensor weight, "
      "Tensor mu, Tensor invstd, bool training, Tensor? res, Tensor? res_weight, Tensor? res_mu, "
      "Tensor? res_invstd, bool res_training) -> Tensor[]");
  m.def(
      "adapt_backward(Tensor gu, Tensor? gpool, Tensor m, Tensor y, Tensor w, int stride, "
      "Tensor weight, Tensor mu, Tensor invstd, bool bn_training) -> Tensor[]");
  m.def(
      "step_forward(Tensor x, Tensor? prev, Tensor? log_z, Tensor wq, Tensor wk, "
      "Tensor inv_tau, Tensor phi, float clamp, float eps, Tensor wv, Tensor? keep, "
      "Tensor weight, Tensor bias, Tensor(a!) running_mean, Tensor(b!) running_var, "
      "bool training, float factor, float bn_eps, Tensor? pooled=None) -> Tensor[]");
  m.def(
      "step_backward(Tensor gy, Tensor? gmean, Tensor? glog_z, Tensor x, Tensor? prev, "
      "Tensor mean, Tensor p, Tensor? log_z, Tensor wq, Tensor wk, Tensor inv_tau, Tensor phi, "
      "float clamp, float eps, Tensor wv, Tensor? keep, Tensor? beta, Tensor scale, "
      "Tensor sums, Tensor weight, Tensor mu, Tensor invstd, Tensor a, Tensor shift, "
      "bool bn_training, bool pool_grad_into_gx=True, bool x_is_out=False) -> Tensor[]");
}

TORCH_LIBRARY_IMPL(kcla_mm, CPU, m) {
  m.impl("train_stats", &train_stats);
  m.impl("block_end_forward", &block_end_forward);
  m.impl("block_end_backward", &block_end_backward);
  m.impl("train_apply", &train_apply);
  m.impl("train_grad_stats", &train_grad_stats);
  m.impl("train_backward", &train_backward);
  m.impl("tail_coeffs", &tail_coeffs);
  m.impl("tail_grad_coeffs", &tail_grad_coeffs);
  m.impl("tail_param_grads", &tail_param_grads);
  m.impl("head_forward", &head_forward);
  m.impl("head_backward", &head_backward);
  m.impl("adapt_forward", &adapt_forward);
  m.impl("adapt_backward", &adapt_backward);
  m.impl("step_forward", &step_forward);
  m.impl("step_backward", &step_backward);
}
