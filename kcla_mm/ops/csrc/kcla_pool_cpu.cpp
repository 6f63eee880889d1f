// A residual block's last ReLU with KCLA's global average pool folded in
// (float32, channels-last).
//
// KCLA pools every block output x = relu(residual sum) for its queries and
// keys: a pass that reads the whole map again, and in training a second map,
// the pool's gradient, added to x's gradient. Here the ReLU pools as it goes:
//   relu_pool_           x = relu(x) in place, returns mean over pixels [B, C]
//   relu_pool_backward   gx = (gy + gp) [y > 0], gp = dL/dpool / (H W) per
//                        (sample, channel): the ReLU's backward with the
//                        pool's gradient added in the same pass
// Each moves the bytes of the ReLU alone (in place: read and write x; backward:
// read gy and y, write gx), as torch's relu_ and threshold_backward do. The
// means are eval_step's bit for bit (pool_means in kcla_cpu.h), and the
// gradient is autograd's for relu then mean: (gy + gp) where y > 0, else 0.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include "kcla_cpu.h"

namespace {

using namespace kcla_cpu;

at::Tensor relu_pool_(at::Tensor x) {
  TORCH_CHECK(x.dim() == 4, "kcla_mm relu_pool_: x must be [B, C, H, W], got ", x.sizes());
  check_map("relu_pool_", x, "x", x.sizes());
  const int64_t B = x.size(0), C = x.size(1), HW = x.size(2) * x.size(3);
  at::Tensor means = at::empty({B, C}, x.options().memory_format(at::MemoryFormat::Contiguous));
  pool_means<true>(x.data_ptr<float>(), B, HW, C, means.data_ptr<float>());
  return means;
}

at::Tensor relu_pool_backward(const at::Tensor& gy, const at::Tensor& y,
                              const c10::optional<at::Tensor>& gp_opt) {
  const char* op = "relu_pool_backward";
  TORCH_CHECK(y.dim() == 4, "kcla_mm ", op, ": y must be [B, C, H, W], got ", y.sizes());
  check_map(op, y, "y", y.sizes());
  check_map(op, gy, "gy", y.sizes());
  const int64_t B = y.size(0), C = y.size(1), HW = y.size(2) * y.size(3);
  const bool has_gp = gp_opt.has_value() && gp_opt->defined();
  const float* gpp = has_gp ? param<float>(op, *gp_opt, B * C, "gp") : nullptr;
  at::Tensor gx = at::empty_like(y);
  const float* gyp = gy.data_ptr<float>();
  const float* yp = y.data_ptr<float>();
  float* gxp = gx.data_ptr<float>();
  const int64_t cv = C - C % VL;
  // pixels in grains of 64 (whole pixels: every grain knows its sample)
  at::parallel_for(0, B * HW, 64, [&](int64_t lo, int64_t hi) {
    for (int64_t s = lo; s < hi; ++s) {
      const int64_t o = s * C;
      const float* gb = gpp != nullptr ? gpp + (s / HW) * C : nullptr;
      auto lanes = [&](auto l, int64_t c0) {
        using L = decltype(l);
        using V = typename L::V;
        const V zero = L::splat(0.f);
        V g = L::load(gyp + o + c0);
        if (gb != nullptr) g = g + L::load(gb + c0);
        L::store(gxp + o + c0, L::load(yp + o + c0) > zero ? g : zero);
      };
      for (int64_t c0 = 0; c0 < cv; c0 += VL) lanes(VecLanes{}, c0);
      for (int64_t c0 = cv; c0 < C; ++c0) lanes(OneLane{}, c0);
    }
  });
  return gx;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(kcla_mm, m) {
  m.def("relu_pool_(Tensor(a!) x) -> Tensor");
  m.def("relu_pool_backward(Tensor gy, Tensor y, Tensor? gp) -> Tensor");
}

TORCH_LIBRARY_IMPL(kcla_mm, CPU, m) {
  m.impl("relu_pool_", &relu_pool_);
  m.impl("relu_pool_backward", &relu_pool_backward);
}
