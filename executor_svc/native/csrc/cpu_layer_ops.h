// The ops one decoder layer chains, declared once for the sources that call
// them from C++ (cpu_layers.cpp) and for those that define them, so the two
// cannot disagree: cpu_ops.cpp (norms, SiLU-and-multiply, rotary),
// cpu_gemm.cpp (panel GEMMs), cpu_kernel.cpp (the K/V store and decode
// attention), cpu_quant.cpp (int8 weights), cpu_qblocks.cpp (GGUF blocks).
// Their contracts are where they are defined; library.cpp has their schemas.
#pragma once
#include "cpu_common.h"

#include <optional>

at::Tensor add_rms_norm(at::Tensor x, at::Tensor residual, at::Tensor weight, double eps);
at::Tensor silu_and_mul(at::Tensor gate_up);
void rotary_(at::Tensor x, at::Tensor positions, at::Tensor cos_table, at::Tensor sin_table);
at::Tensor linear_f32(const at::Tensor& x, const at::Tensor& packed, int64_t n, const std::optional<at::Tensor>& bias);
at::Tensor linear_bf16(const at::Tensor& x, const at::Tensor& packed, int64_t n, const std::optional<at::Tensor>& bias);
void store_kv(at::Tensor k, at::Tensor v, at::Tensor k_cache, at::Tensor v_cache, at::Tensor slot_mapping,
              const std::optional<at::Tensor>& k_scale, const std::optional<at::Tensor>& v_scale);
at::Tensor paged_decode(at::Tensor q, at::Tensor k_cache, at::Tensor v_cache, at::Tensor block_tables,
                        at::Tensor context_lens, double scale, int64_t window, double softcap,
                        const std::optional<at::Tensor>& k_scale, const std::optional<at::Tensor>& v_scale,
                        bool split_kv);

namespace pagoda::quant {
at::Tensor linear_int8(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scales, int64_t n,
                       const std::optional<at::Tensor>& bias, bool vnni,
                       int64_t widen_above);
at::Tensor linear_int8_silu(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scales, int64_t n,
                            bool vnni, int64_t widen_above);
}  // namespace pagoda::quant

namespace pagoda::qblocks {
at::Tensor linear_qblocks(const at::Tensor& x, const at::Tensor& quants, const at::Tensor& scales, int64_t qtype,
                          int64_t n, const std::optional<at::Tensor>& bias, int64_t widen_above);
}  // namespace pagoda::qblocks
