// A decode step through every decoder layer of a Llama-family model in one
// call: the same ops, in the same order, with the same roundings as the
// Python layer loop (executor_svc/models/llama.py) runs them one by one, so
// the outputs are the same bits. What it saves is the loop itself: about ten
// Python-dispatched ops and a dozen tensor views per layer, which at decode
// batch sizes cost as much as the small kernels they launch, and while the
// first thread runs them the second waits.
//
// A layer: qkv = linear(normed); rotate q and k in place; store k, v at the
// step's slots; attend (paged decode); normed = add_rms_norm(linear_o(attn),
// hidden, post_norm); mlp = down(silu_and_mul(gate_up(normed))); then
// normed = add_rms_norm(mlp, hidden, next layer's input norm), or for the
// last layer hidden += mlp. `hidden` (the residual stream) is updated in place.
#include "cpu_layer_ops.h"

#include <optional>
#include <vector>

namespace {

// How a linear weight is stored (executor_svc/models/fused_decode.py gives each weight's kind).
enum LinearKind : int64_t {
  kPanelBf16 = 0,  // pack_bf16 panels
  kPanelF32 = 1,   // pack_f32 panels
  kInt8 = 2,       // pack_int8 panels + per-channel scales, on AMX-INT8
  kInt8Vnni = 3,   // the same, on the vector path: AVX512-VNNI, or AVX2 (vpmaddubsw) in a build without VNNI
  kPanelWidened = 4,  // pack_f32 panels of a bf16 weight, for bf16 rows: widened, fp32 sums rounded once
  kBlocks = 16,    // GGUF blocks: kBlocks + the GGUF type, quants + scales from pack_qblocks
};

// Whether this build has linear_int8_silu for the AMX-INT8 and the VNNI int8 kinds.
constexpr bool kFusedSiluAmx =
#if defined(__AMX_TILE__) && defined(__AMX_INT8__) && defined(__AMX_BF16__) && defined(__AVX512BF16__)
    true;
#else
    false;
#endif
constexpr bool kFusedSiluVnni =
#if defined(__AVX512VNNI__) && defined(__AVX512BF16__)
    true;
#else
    false;
#endif

struct Linears {
  at::TensorList weights;
  const c10::List<std::optional<at::Tensor>>& scales;
  const c10::List<std::optional<at::Tensor>>& biases;
  at::IntArrayRef kinds, out_features;
  int64_t widen_above;

  at::Tensor operator()(const at::Tensor& x, int64_t j) const {
    const int64_t n = out_features[j], kind = kinds[j];
    const std::optional<at::Tensor> bias = biases.get(j);
    switch (kind) {
      case kPanelBf16: return linear_bf16(x, weights[j], n, bias);
      case kPanelF32: return linear_f32(x, weights[j], n, bias);
      case kPanelWidened: {
        const std::optional<at::Tensor> wide =
            bias.has_value() ? std::optional<at::Tensor>(bias->to(at::kFloat)) : std::nullopt;
        return linear_f32(x.to(at::kFloat), weights[j], n, wide).to(x.scalar_type());
      }
      case kInt8:
      case kInt8Vnni:
        return pagoda::quant::linear_int8(x, weights[j], *scales.get(j), n, bias, kind == kInt8Vnni, widen_above);
      default:
        return pagoda::qblocks::linear_qblocks(x, weights[j], *scales.get(j), kind - kBlocks, n, bias, widen_above);
    }
  }

  // silu_and_mul(linear(x, j)): int8 gate/up weights in one pass where this build has that kernel
  // (linear_int8_silu, the same bits), as Int8Linear.silu_and_mul runs them in the Python loop.
  at::Tensor gated(const at::Tensor& x, int64_t j) const {
    const int64_t kind = kinds[j];
    const bool fused = (kind == kInt8 && kFusedSiluAmx) || (kind == kInt8Vnni && kFusedSiluVnni);
    if (fused && x.scalar_type() == at::kBFloat16 && out_features[j] % 32 == 0)
      return pagoda::quant::linear_int8_silu(x, weights[j], *scales.get(j), out_features[j], kind == kInt8Vnni,
                                             widen_above);
    return silu_and_mul((*this)(x, j));
  }

  void check(int64_t count) const {
    TORCH_CHECK(int64_t(weights.size()) == count && int64_t(kinds.size()) == count &&
                    int64_t(out_features.size()) == count && int64_t(scales.size()) == count &&
                    int64_t(biases.size()) == count,
                "decode_layers: ", count, " linear weights expected (4 per layer), with a kind, size, scales "
                "and bias entry each");
    for (int64_t j = 0; j < count; ++j) {
      const int64_t kind = kinds[j];
      TORCH_CHECK(kind == kPanelBf16 || kind == kPanelF32 || kind == kInt8 || kind == kInt8Vnni ||
                      kind == kPanelWidened || kind > kBlocks,
                  "decode_layers: unknown linear kind ", kind);
      TORCH_CHECK(kind < kInt8 || kind == kPanelWidened || scales.get(j).has_value(), "decode_layers: weight ", j,
                  " needs its scales");
    }
  }
};

}  // namespace

void decode_layers(at::Tensor hidden, at::Tensor normed, at::Tensor positions, at::Tensor cos_table,
                   at::Tensor sin_table, at::TensorList weights, const c10::List<std::optional<at::Tensor>>& scales,
                   const c10::List<std::optional<at::Tensor>>& biases, at::IntArrayRef kinds,
                   at::IntArrayRef out_features, int64_t widen_above, at::TensorList norms, at::TensorList k_caches,
                   at::TensorList v_caches, const c10::List<std::optional<at::Tensor>>& k_scales,
                   const c10::List<std::optional<at::Tensor>>& v_scales, at::Tensor slot_mapping,
                   at::Tensor block_tables, at::Tensor context_lens, int64_t num_heads, int64_t num_kv_heads,
                   double attn_scale, int64_t window, double softcap, double eps, bool split_kv) {
  const int64_t layers = int64_t(k_caches.size());
  TORCH_CHECK(layers > 0 && int64_t(v_caches.size()) == layers && int64_t(k_scales.size()) == layers &&
                  int64_t(v_scales.size()) == layers && int64_t(norms.size()) == 2 * layers,
              "decode_layers: per layer one K and one V cache, their scales (or None) and two norms");
  const Linears linear{weights, scales, biases, kinds, out_features, widen_above};
  linear.check(4 * layers);
  TORCH_CHECK(hidden.dim() == 2 && hidden.is_contiguous() && normed.sizes() == hidden.sizes(),
              "decode_layers: hidden and normed must be [T, hidden], hidden contiguous");
  const int64_t tokens = hidden.size(0), head_dim = k_caches[0].size(3);
  TORCH_CHECK(block_tables.size(0) == tokens, "decode_layers: one decode row per sequence (a decode-only step)");
  at::Tensor x = normed;
  for (int64_t i = 0; i < layers; ++i) {
    const at::Tensor heads = linear(x, 4 * i).view({tokens, num_heads + 2 * num_kv_heads, head_dim});
    rotary_(heads.narrow(1, 0, num_heads + num_kv_heads), positions, cos_table, sin_table);
    const at::Tensor k = heads.narrow(1, num_heads, num_kv_heads);
    const at::Tensor v = heads.narrow(1, num_heads + num_kv_heads, num_kv_heads);
    const std::optional<at::Tensor> k_scale = k_scales.get(i), v_scale = v_scales.get(i);
    store_kv(k, v, k_caches[i], v_caches[i], slot_mapping, k_scale, v_scale);
    const at::Tensor attn = paged_decode(heads.narrow(1, 0, num_heads), k_caches[i], v_caches[i], block_tables,
                                         context_lens, attn_scale, window, softcap, k_scale, v_scale, split_kv);
    x = add_rms_norm(linear(attn.view({tokens, num_heads * head_dim}), 4 * i + 1), hidden, norms[2 * i + 1], eps);
    const at::Tensor mlp = linear(linear.gated(x, 4 * i + 2), 4 * i + 3);
    if (i + 1 < layers) {
      x = add_rms_norm(mlp, hidden, norms[2 * i + 2], eps);
    } else {
      hidden.add_(mlp);
    }
  }
}

TORCH_LIBRARY_IMPL(pagoda, CPU, m) { m.impl("decode_layers", &decode_layers); }
