// Fused inference step of KCLA on the CPU (float32, channels-last).
//
// One call does what the eager eval path does in about 50 ops per block:
//   p = GAP(x); q, k = ECA(p); logit = min(|k| / tau, clamp)
//   log z' = logaddexp(log z, logit); beta = exp(logit - log z')
//   mean' = lerp(mean, x, beta)                          (the new state)
//   a = sigmoid(Phi(<q, k> / |k|)) * sigmoid(log z' - log eps) * gamma / sigma
//   out = x + relu(a * Wv(mean') + (beta_bn - gamma mu / sigma))
// in two passes over the feature map: the pooling pass, then one streaming
// pass over rows that writes the state row h+1 and the output row h (the
// depthwise 3x3 value convolution reads the state rows h-1..h+1 while they
// are still in cache). The state may be written into the incoming state's
// map and the output into x, so a step allocates no feature map.
//
// The per-head math runs in double precision on [B, C] vectors. Numerics are
// those of kcla_mm/ops/kcla.py (KCLA.forward in eval mode); the Python side
// checks every precondition and falls back to the eager path where one fails.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <string>
#include <type_traits>
#include <vector>

#include "kcla_cpu.h"

namespace {

using namespace kcla_cpu;

// residual_relu_pool_(x, res): x <- relu(x + res) in place (a residual
// block's last add and ReLU), returns the global average pool of the result,
// [B, C] float32, as eval_step would compute it: one pass where the block's
// add, its ReLU and eval_step's pooling took three. With with_mask, also the
// ReLU's mask for its backward pass (relu_pool_backward): [B, H, W,
// ceil(C / 8)] uint8, one bit per value (see mask_bytes), else an empty
// tensor. A training step keeps the mask, 1/32 of the map, instead of x.
std::tuple<at::Tensor, at::Tensor> add_relu_pool(const char* op, at::Tensor& x,
                                                 const at::Tensor& res, bool with_mask) {
  TORCH_CHECK(x.dim() == 4, "kcla_mm ", op, ": x must be [B, C, H, W], got ", x.sizes());
  check_map(op, x, "x", x.sizes());
  check_map(op, res, "res", x.sizes());
  TORCH_CHECK(!res.is_same(x), "kcla_mm ", op, ": res must not be x");
  const int64_t B = x.size(0), C = x.size(1), H = x.size(2), W = x.size(3);
  at::Tensor pooled = at::empty({B, C}, x.options());
  const auto bytes = x.options().dtype(at::kByte);
  at::Tensor mask =
      with_mask ? at::empty({B, H, W, mask_bytes(C)}, bytes) : at::empty({0}, bytes);
  if (H * W > 0)
    global_pool<PoolMode::kAddRelu>(x.data_ptr<float>(), res.data_ptr<float>(), B, H * W, C,
                                    pooled.data_ptr<float>(),
                                    with_mask ? mask.data_ptr<uint8_t>() : nullptr);
  return std::make_tuple(pooled, mask);
}

at::Tensor residual_relu_pool_(at::Tensor x, const at::Tensor& res) {
  return std::get<0>(add_relu_pool("residual_relu_pool_", x, res, false));
}

std::tuple<at::Tensor, at::Tensor> residual_relu_pool_mask_(at::Tensor x, const at::Tensor& res) {
  return add_relu_pool("residual_relu_pool_mask_", x, res, true);
}

// residual_bn_relu_pool_(x, res, <x's BatchNorm>, <res's, optional>): the
// block's end with its last eval-mode BatchNorm, and the shortcut's where
// given, applied in the same pass: x <- relu(bn(x) + bn_res(res)) (or +
// res), the values of the three or four torch ops bit for bit (where the
// compiler fuses a * b + c, as -march=native builds on x86-64 do); returns
// the global average pool as residual_relu_pool_. Two transfers of the map
// fewer per BatchNorm than the host's ops.
at::Tensor residual_bn_relu_pool_(at::Tensor x, const at::Tensor& res, const at::Tensor& weight,
                                  const at::Tensor& bias, const at::Tensor& mean,
                                  const at::Tensor& var, double eps,
                                  const c10::optional<at::Tensor>& res_weight,
                                  const c10::optional<at::Tensor>& res_bias,
                                  const c10::optional<at::Tensor>& res_mean,
                                  const c10::optional<at::Tensor>& res_var, double res_eps) {
  const char* op = "residual_bn_relu_pool_";
  TORCH_CHECK(x.dim() == 4, "kcla_mm ", op, ": x must be [B, C, H, W], got ", x.sizes());
  check_map(op, x, "x", x.sizes());
  check_map(op, res, "res", x.sizes());
  TORCH_CHECK(!res.is_same(x), "kcla_mm ", op, ": res must not be x");
  const int64_t B = x.size(0), C = x.size(1), H = x.size(2), W = x.size(3);
  const std::vector<float> fx = bn_eval_affine(op, "", C, weight, bias, mean, var, eps);
  const bool given = all_or_none(op, "res_weight, res_bias, res_mean and res_var",
                                 {&res_weight, &res_bias, &res_mean, &res_var});
  const std::vector<float> fr =
      given ? bn_eval_affine(op, "res_", C, *res_weight, *res_bias, *res_mean, *res_var, res_eps)
            : std::vector<float>();
  PreAffine f;
  f.ax = fx.data();
  f.bx = fx.data() + C;
  if (given) {
    f.ar = fr.data();
    f.br = fr.data() + C;
  }
  at::Tensor pooled = at::empty({B, C}, x.options());
  if (H * W > 0)
    global_pool<PoolMode::kAffineAddRelu>(x.data_ptr<float>(), res.data_ptr<float>(), B, H * W,
                                          C, pooled.data_ptr<float>(), nullptr, f);
  return pooled;
}

// The backward of residual_relu_pool_mask_ (mask its ReLU mask): the gradient
// of the sum before the ReLU, 0 where the mask's bit is clear (x <= 0), else
// gx + gp / (H W) (torch's threshold_backward of gx plus the pool's gradient,
// in one pass; NaN in x passed the gradient, as there); gp [B, C] may be
// undefined (no gradient reached the pool).
at::Tensor relu_pool_backward(const at::Tensor& gx, const c10::optional<at::Tensor>& gp_opt,
                              const at::Tensor& mask) {
  const char* op = "relu_pool_backward";
  TORCH_CHECK(gx.dim() == 4, "kcla_mm ", op, ": gx must be [B, C, H, W], got ", gx.sizes());
  check_map(op, gx, "gx", gx.sizes());
  const int64_t B = gx.size(0), C = gx.size(1), H = gx.size(2), W = gx.size(3), HW = H * W;
  const int64_t nb = mask_bytes(C);
  check_mask(op, mask, B, C, H, W, "residual_relu_pool_mask_");
  const bool has_gp = gp_opt.has_value() && gp_opt->defined();
  std::vector<float> gpd(B * C, 0.f);
  if (has_gp) {
    const float* gp = param<float>(op, *gp_opt, B * C, "gp");
    for (int64_t i = 0; i < B * C; ++i) gpd[i] = gp[i] / static_cast<float>(HW);
  }
  at::Tensor g = at::empty_like(gx);
  const uint8_t* const mp = mask.data_ptr<uint8_t>();
  const float* const gxp = gx.data_ptr<float>();
  float* const gop = g.data_ptr<float>();
  const int64_t plane = HW * C, rows = std::max<int64_t>(1, 16384 / std::max<int64_t>(C, 1));
  const int64_t chunks = (HW + rows - 1) / rows, cv = C - C % VL;
  at::parallel_for(0, B * chunks, 1, [&](int64_t lo, int64_t hi) {
    for (int64_t t = lo; t < hi; ++t) {
      const int64_t b = t / chunks, s0 = (t % chunks) * rows, s1 = std::min(HW, s0 + rows);
      const float* d = gpd.data() + b * C;
      for (int64_t s = s0; s < s1; ++s) {
        const int64_t o = b * plane + s * C;
        const uint8_t* mk = mp + (b * HW + s) * nb;
        // (no + 0 without gp: keeps -0)
        for (int64_t c0 = 0; c0 < cv; c0 += VL) {
          const vf v = has_gp ? load(gxp + o + c0) + load(d + c0) : load(gxp + o + c0);
          store(gop + o + c0, select_bits(load_bits(mk, c0), v));
        }
        for (int64_t c = cv; c < C; ++c)
          gop[o + c] = mask_bit(mk, c) ? (has_gp ? gxp[o + c] + d[c] : gxp[o + c]) : 0.f;
      }
    }
  });
  return g;
}

// Returns (out, new mean, new log z [B, G] float32).
std::tuple<at::Tensor, at::Tensor, at::Tensor> eval_step(
    at::Tensor x, const c10::optional<at::Tensor>& prev_opt,
    const c10::optional<at::Tensor>& log_z_opt, const at::Tensor& wq, const at::Tensor& wk,
    const at::Tensor& inv_tau, const at::Tensor& phi, const at::Tensor& wv,
    const at::Tensor& norm_scale, const at::Tensor& norm_shift,
    const c10::optional<at::Tensor>& adj_w_opt, const c10::optional<at::Tensor>& adj_b_opt,
    const c10::optional<at::Tensor>& wk_u_opt, int64_t stride, double clamp, double eps,
    bool reuse_prev, bool inplace_out, const c10::optional<at::Tensor>& pooled_opt) {
  TORCH_CHECK(x.dim() == 4, "kcla_mm eval_step: x must be [B, C, H, W], got ", x.sizes());
  const int64_t B = x.size(0), C = x.size(1), H = x.size(2), W = x.size(3);
  check_map("eval_step", x, "x", x.sizes());
  const int64_t G = inv_tau.numel();
  TORCH_CHECK(G > 0 && C % G == 0, "kcla_mm eval_step: ", C, " channels, ", G, " heads");
  const int64_t D = C / G;
  const int64_t K = wq.numel(), pad = (K - 1) / 2;
  TORCH_CHECK(K % 2 == 1, "kcla_mm eval_step: the ECA kernel size must be odd, got ", K);
  const bool has_prev = prev_opt.has_value() && prev_opt->defined();
  at::Tensor prev;
  // an init layer adapting the incoming state: ubar = norm_u(adjust(prev)), re-keyed
  const bool adapt = adj_w_opt.has_value() && adj_w_opt->defined();
  int64_t Cp = C, Hp = H, Wp = W;
  if (has_prev) {
    prev = *prev_opt;
    if (adapt) {
      TORCH_CHECK(prev.dim() == 4 && prev.size(0) == B, "kcla_mm eval_step: prev must be [",
                  B, ", C', H', W'], got ", prev.sizes());
      Cp = prev.size(1), Hp = prev.size(2), Wp = prev.size(3);
      TORCH_CHECK(stride >= 1 && (Hp - 1) / stride + 1 == H && (Wp - 1) / stride + 1 == W &&
                      Cp % G == 0,
                  "kcla_mm eval_step: a state of shape ", prev.sizes(), " with stride ", stride,
                  " does not adapt to ", x.sizes());
      check_map("eval_step", prev, "prev", prev.sizes());
    } else {
      check_map("eval_step", prev, "prev", x.sizes());
      TORCH_CHECK(log_z_opt.has_value() && log_z_opt->numel() == B * G,
                  "kcla_mm eval_step: log_z must be [B, G] with the state");
    }
    TORCH_CHECK(!(reuse_prev && prev.data_ptr() == x.data_ptr()),
                "kcla_mm eval_step: the state cannot be written into x");
  }
  TORCH_CHECK(!(adapt && !has_prev), "kcla_mm eval_step: adjust weights without a state");
  reuse_prev = reuse_prev && !adapt;  // the adapted state has another shape
  TORCH_CHECK(!(inplace_out && !has_prev),
              "kcla_mm eval_step: without a state the new state is x; the output cannot "
              "be written into it");
  const float* wqp = param<float>("eval_step", wq, K, "wq");
  const float* wkp = param<float>("eval_step", wk, K, "wk");
  const double* taup = param<double>("eval_step", inv_tau, G, "inv_tau");
  const float* php = param<float>("eval_step", phi, G * G, "phi");
  const float* wvp = param<float>("eval_step", wv, C * 9, "wv");
  const float* nsp = param<float>("eval_step", norm_scale, C, "norm_scale");
  const float* nbp = param<float>("eval_step", norm_shift, C, "norm_shift");
  const float* lzp = nullptr;
  if (has_prev && !adapt) lzp = param<float>("eval_step", *log_z_opt, B * G, "log_z");
  std::vector<float> wa_t;  // adjust weights per head as [G, di, dout]
  const float *adj_b = nullptr, *wkup = nullptr;
  if (adapt) {
    const int64_t di = Cp / G;
    const float* wa = param<float>("eval_step", *adj_w_opt, C * di, "adj_w");
    TORCH_CHECK(adj_b_opt.has_value() && wk_u_opt.has_value(),
                "kcla_mm eval_step: adj_w needs adj_b and wk_u");
    adj_b = param<float>("eval_step", *adj_b_opt, C, "adj_b");
    wkup = param<float>("eval_step", *wk_u_opt, K, "wk_u");
    wa_t = grouped_weights_t(wa, C, di, G);
  }
  const std::vector<float> wt = taps(wvp, C);  // the layout of taps()
  const int64_t HW = H * W, plane = HW * C;
  const float* xp = x.data_ptr<float>();

  // -- pass 1: global average pool, [B, C] (unless residual_relu_pool_ gave it) --
  std::vector<float> pooled_own;
  const float* pooled = nullptr;
  if (pooled_opt.has_value() && pooled_opt->defined()) {
    pooled = param<float>("eval_step", *pooled_opt, B * C, "pooled");
  } else {
    pooled_own.resize(B * C);
    global_pool<PoolMode::kRead>(xp, nullptr, B, HW, C, pooled_own.data());
    pooled = pooled_own.data();
  }

  // pooled adapted state: GAP(ubar) = bias + wa . GAP(prev[::stride, ::stride]) (linear)
  std::vector<float> lz_adapt;
  if (adapt) {
    std::vector<double> psub(B * Cp, 0.0);
    const float* pvp = prev.data_ptr<float>();
    at::parallel_for(0, B, 1, [&](int64_t lo, int64_t hi) {
      std::vector<float> acc(Cp);
      for (int64_t b = lo; b < hi; ++b) {
        std::fill(acc.begin(), acc.end(), 0.f);
        for (int64_t h = 0; h < H; ++h)
          for (int64_t w = 0; w < W; ++w) {
            const float* r = pvp + ((b * Hp + h * stride) * Wp + w * stride) * Cp;
            for (int64_t c = 0; c < Cp; ++c) acc[c] += r[c];
          }
        for (int64_t c = 0; c < Cp; ++c) psub[b * Cp + c] = acc[c] / static_cast<double>(HW);
      }
    });
    const int64_t di = Cp / G, dout = C / G;
    lz_adapt.resize(B * G);
    std::vector<double> pu_(C + 2 * pad, 0.0), ku(C);
    double* pu = pu_.data() + pad;
    for (int64_t b = 0; b < B; ++b) {
      for (int64_t g = 0; g < G; ++g)
        for (int64_t c = 0; c < dout; ++c) {
          double sacc = adj_b[g * dout + c];
          for (int64_t i = 0; i < di; ++i)
            sacc += static_cast<double>(wa_t[(g * di + i) * dout + c]) * psub[b * Cp + g * di + i];
          pu[g * dout + c] = static_cast<float>(sacc);
        }
      std::fill(ku.begin(), ku.end(), 0.0);
      for (int64_t j = 0; j < K; ++j)
        for (int64_t c = 0; c < C; ++c) ku[c] += wkup[j] * pu[c + j - pad];
      for (int64_t g = 0; g < G; ++g) {
        double kk = 0;
        for (int64_t d = 0; d < D; ++d) kk += ku[g * D + d] * ku[g * D + d];
        double logit = std::sqrt(kk) * static_cast<float>(taup[g]);
        if (clamp > 0) logit = std::min(logit, clamp);
        lz_adapt[b * G + g] = static_cast<float>(logit);
      }
    }
    lzp = lz_adapt.data();
  }

  // -- the per-head math, double precision --
  at::Tensor log_z_new = at::empty({B, G}, x.options());
  std::vector<float> beta(B * C), a(B * C);
  float* lznp = log_z_new.data_ptr<float>();
  HeadMath hd(B, C, G, K, pooled, lzp, wqp, wkp, taup, php, clamp, eps);
  for (int64_t b = 0; b < B; ++b) {
    hd.run(b);
    for (int64_t g = 0; g < G; ++g) {
      lznp[b * G + g] = static_cast<float>(hd.lz[g]);
      const double sc = hd.gate[g] * hd.shr[g];
      for (int64_t d = 0; d < D; ++d) {
        beta[b * C + g * D + d] = static_cast<float>(hd.bt[g]);
        a[b * C + g * D + d] = static_cast<float>(sc * nsp[g * D + d]);
      }
    }
  }

  // -- pass 2: state rows and output rows, streamed --
  at::Tensor mean = has_prev ? (reuse_prev ? prev : at::empty_like(x)) : x;
  at::Tensor out = inplace_out ? x : at::empty_like(x);
  const float* pp = has_prev ? prev.data_ptr<float>() : nullptr;
  const int64_t pplane = Hp * Wp * Cp, prow = Wp * Cp;
  // state row h of sample b into dst (scratch: one row, for the adapted state)
  // the pixels [lo, hi) of state row h of sample b into the row dst (scratch:
  // a row, for the adapted state)
  auto make_state_pixels = [&](int64_t b, int64_t h, int64_t lo, int64_t hi, float* dst,
                               float* scratch) {
    const float* bt = beta.data() + b * C;
    const float* xr = xp + b * plane + h * W * C + lo * C;
    if (adapt) {
      grouped_row(pp + b * pplane + h * stride * prow + lo * stride * Cp, stride * Cp,
                  wa_t.data(), adj_b, scratch + lo * C, C, hi - lo, Cp, C, G);
      lerp_row(scratch + lo * C, xr, bt, dst + lo * C, hi - lo, C);
    } else {
      lerp_row(pp + b * plane + h * W * C + lo * C, xr, bt, dst + lo * C, hi - lo, C);
    }
  };
  auto make_state_row = [&](int64_t b, int64_t h, float* dst, float* scratch) {
    make_state_pixels(b, h, 0, W, dst, scratch);
  };
  float* mp = mean.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const float* wtp = wt.data();
  const int64_t row = W * C;
  const bool staged = stage_rows();
  constexpr int64_t kAhead = 4;  // pixels per step of the state row computed ahead
  // bands of rows per sample, so that small batches use every thread
  const std::pair<int64_t, int64_t> bands = bands_of(B, H);
  const int64_t band_h = bands.first, nb_tasks = bands.second;
  // state rows just outside each band, computed before any band writes in place
  std::vector<float> halo(has_prev ? B * nb_tasks * 2 * row : 0);
  if (has_prev && nb_tasks > 1) {
    at::parallel_for(0, B * nb_tasks, 1, [&](int64_t lo, int64_t hi) {
      std::vector<float> scratch(adapt ? row : 0);
      for (int64_t t = lo; t < hi; ++t) {
        const int64_t b = t / nb_tasks, j = t % nb_tasks;
        const int64_t h0 = j * band_h, h1 = std::min(H, h0 + band_h);
        if (h0 > 0) make_state_row(b, h0 - 1, halo.data() + (t * 2) * row, scratch.data());
        if (h1 < H) make_state_row(b, h1, halo.data() + (t * 2 + 1) * row, scratch.data());
      }
    });
  }
  at::parallel_for(0, B * nb_tasks, 1, [&](int64_t lo, int64_t hi) {
    std::vector<float> scratch(adapt ? row : 0);
    for (int64_t t = lo; t < hi; ++t) {
      const int64_t b = t / nb_tasks, j = t % nb_tasks;
      const int64_t h0 = j * band_h, h1 = std::min(H, h0 + band_h);
      const float* xb = xp + b * plane;
      float* mb = mp + b * plane;
      float* ob = op + b * plane;
      auto state_row = [&](int64_t h) {
        if (has_prev) make_state_row(b, h, mb + h * row, scratch.data());
      };
      auto mean_row = [&](int64_t h) -> const float* {
        if (h < 0 || h >= H) return nullptr;
        if (has_prev && nb_tasks > 1 && h < h0) return halo.data() + (t * 2) * row;
        if (has_prev && nb_tasks > 1 && h >= h1) return halo.data() + (t * 2 + 1) * row;
        return mb + h * row;
      };
      state_row(h0);
      StagedRows st(W, C, staged);
      const float* up = st.stage(h0 - 1, mean_row(h0 - 1));
      const float* mid = st.stage(h0, mean_row(h0));
      const float* ab = a.data() + b * C;
      for (int64_t h = h0; h < h1; ++h) {
        const float* xr = xb + h * row;
        float* orow = ob + h * row;
        // Unstaged, state row h+1 is computed a few pixels at a time just
        // ahead of the convolution that reads it, so that its loads from
        // memory overlap the convolution's arithmetic (whole rows one after
        // the other leave the memory idle while the convolution runs): 9.1 ->
        // 8.4 ms per ResNet-50 forward in place, Intel VM. (At an init layer,
        // whose state rows come from the adjust convolution, it measured 3-8%
        // slower per call, so those keep whole rows.)
        if (has_prev && !adapt && !staged && h + 1 < h1) {
          float* down = mb + (h + 1) * row;
          const float* rows[3] = {up, mid, down};
          // pixels [w0, w0 + 4) of row h read state row h+1 up to pixel w0 + 4
          int64_t done = std::min<int64_t>(W, kAhead + 1);
          make_state_pixels(b, h + 1, 0, done, down, scratch.data());
          for (int64_t w0 = 0; w0 < W; w0 += kAhead) {
            const int64_t need = std::min<int64_t>(W, w0 + 2 * kAhead + 1);
            if (need > done) {
              make_state_pixels(b, h + 1, done, need, down, scratch.data());
              done = need;
            }
            conv_row<true>(rows, xr, orow, wtp, ab, nbp, w0, std::min<int64_t>(W, w0 + kAhead),
                           W, C, C);
          }
          up = mid;
          mid = down;
          continue;
        }
        if (h + 1 < h1) state_row(h + 1);
        const float* down = st.stage(h + 1, mean_row(h + 1));
        const float* rows[3] = {up, mid, down};
        conv_row<true>(rows, xr, orow, wtp, ab, nbp, 0, W, W, C, st.stride());
        up = mid;
        mid = down;
      }
    }
  });
  return std::make_tuple(out, mean, log_z_new);
}

}  // namespace

TORCH_LIBRARY(kcla_mm, m) {
  m.def(
      "eval_step(Tensor x, Tensor? prev, Tensor? log_z, Tensor wq, Tensor wk, Tensor inv_tau, "
      "Tensor phi, Tensor wv, Tensor norm_scale, Tensor norm_shift, Tensor? adj_w, Tensor? adj_b, "
      "Tensor? wk_u, int stride, float clamp, float eps, "
      "bool reuse_prev, bool inplace_out, Tensor? pooled=None) -> (Tensor, Tensor, Tensor)");
  m.def("residual_relu_pool_(Tensor(a!) x, Tensor res) -> Tensor");
  m.def("residual_relu_pool_mask_(Tensor(a!) x, Tensor res) -> (Tensor, Tensor)");
  m.def("relu_pool_backward(Tensor gx, Tensor? gp, Tensor mask) -> Tensor");
  m.def(
      "residual_bn_relu_pool_(Tensor(a!) x, Tensor res, Tensor weight, Tensor bias, "
      "Tensor running_mean, Tensor running_var, float eps, Tensor? res_weight, "
      "Tensor? res_bias, Tensor? res_mean, Tensor? res_var, float res_eps) -> Tensor");
}

TORCH_LIBRARY_IMPL(kcla_mm, CPU, m) {
  m.impl("eval_step", &eval_step);
  m.impl("residual_relu_pool_", &residual_relu_pool_);
  m.impl("residual_relu_pool_mask_", &residual_relu_pool_mask_);
  m.impl("relu_pool_backward", &relu_pool_backward);
  m.impl("residual_bn_relu_pool_", &residual_bn_relu_pool_);
}
