// The `pagoda` operator library: every op's schema in one place (the contract
// the Python side calls as torch.ops.pagoda.*), plus what this build can do.
// The CPU implementations are registered next to their code
// (TORCH_LIBRARY_IMPL in cpu_ops.cpp, cpu_gemm.cpp, cpu_kernel.cpp,
// cpu_prefill.cpp, cpu_quant.cpp, cpu_qblocks.cpp, cpu_layers.cpp, cpu_lora.cpp). `(a!)`
// marks a tensor the op writes in place.
#include "cpu_quant.h"

#include <string>
#include <vector>

bool bf16_kernels_ready();  // cpu_gemm.cpp

namespace {

// The vector code paths compiled into this library (each variant's flags pick them).
std::vector<std::string> cpu_features() {
  std::vector<std::string> features;
#if defined(__AVX512F__)
  features.push_back("avx512");  // decode attention, argmax
#endif
#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
  features.push_back("f32_panels");  // the fp32 panel GEMM (AVX-512, or AVX2 + FMA: the same bits)
#endif
#if defined(__AVX512F__) && defined(__AVX512BF16__)
  features.push_back("avx512_bf16");  // bf16 rotary and SiLU-and-multiply
#endif
#if defined(PAGODA_AMX)
  features.push_back("amx");  // the bf16 panel GEMM and the prefill kernel
#endif
#if defined(__AVX512VNNI__)
  features.push_back("avx512_vnni");  // the int8 GEMM without AMX
#endif
#if defined(PAGODA_AVX2_INT8)
  features.push_back("avx2_int8");  // int8 and GGUF block GEMMs on AVX2 (vpmaddubsw), where the build has no VNNI
#endif
#if defined(PAGODA_AMX_INT8)
  features.push_back("amx_int8");  // the int8 GEMM's tile path
#endif
  return features;
}

// Whether this build has the AMX kernels and Linux lets this process use AMX.
bool amx_ready() {
#if defined(PAGODA_AMX)
  return pagoda::request_amx();
#else
  return false;
#endif
}

}  // namespace

TORCH_LIBRARY(pagoda, m) {
  m.def("cpu_features() -> str[]", &cpu_features);
  m.def("amx_ready() -> bool", &amx_ready);
  m.def("amx_int8_ready() -> bool", &pagoda::quant::amx_int8_ready);
  // Layer ops (cpu_ops.cpp).
  m.def("rms_norm(Tensor x, Tensor weight, float eps) -> Tensor");
  m.def("add_rms_norm(Tensor x, Tensor(a!) residual, Tensor weight, float eps) -> Tensor");
  m.def("silu_and_mul(Tensor gate_up) -> Tensor");
  m.def("rotary_(Tensor(a!) x, Tensor positions, Tensor cos_table, Tensor sin_table) -> ()");
  m.def("argmax_rows(Tensor logits) -> Tensor");
  // Linear layers (cpu_gemm.cpp).
  m.def("pack_f32(Tensor weight) -> Tensor");
  m.def("linear_f32(Tensor x, Tensor packed, int out_features, Tensor? bias) -> Tensor");
  m.def("pack_bf16(Tensor weight) -> Tensor");
  m.def("linear_bf16(Tensor x, Tensor packed, int out_features, Tensor? bias) -> Tensor");
  m.def("bf16_kernels_ready() -> bool", &bf16_kernels_ready);
  // LoRA deltas of one fused linear layer for every adapter segment of a step (cpu_lora.cpp): 4 bounds per
  // segment (first row, end row, first column, end column), its A and B packed as the linear layers' panels.
  m.def("lora_add_(Tensor(a!) out, Tensor x, Tensor[] a, Tensor[] b, int[] bounds) -> ()");
  // Quantized linear layers (cpu_quant.cpp: int8 weights).
  m.def("quantize_rows_int8(Tensor x, int group) -> (Tensor, Tensor, Tensor)");
  m.def("pack_int8(Tensor weight) -> Tensor");
  m.def(
      "linear_int8(Tensor x, Tensor packed, Tensor scales, int out_features, Tensor? bias, bool vnni, "
      "int widen_above) -> Tensor");
  m.def(
      "linear_int8_silu(Tensor x, Tensor packed, Tensor scales, int out_features, bool vnni, int widen_above) -> "
      "Tensor");
  // GGUF blocks kept as stored (cpu_qblocks.cpp: Q8_0, Q4_0, Q4_1).
  m.def("pack_qblocks(Tensor data, int qtype, int in_features) -> (Tensor, Tensor)");
  m.def(
      "linear_qblocks(Tensor x, Tensor quants, Tensor scales, int qtype, int out_features, Tensor? bias, "
      "int widen_above) -> Tensor");
  m.def("qblocks_rows(Tensor quants, Tensor scales, int qtype, int out_features, Tensor? rows) -> Tensor");
  // Paged attention (cpu_kernel.cpp: decode and the K/V store; cpu_prefill.cpp: AMX prefill). An int8
  // cache comes with k_scale and v_scale, one fp32 scale per (kv head, slot) ([KVH, NB, BS]).
  m.def(
      "store_kv(Tensor k, Tensor v, Tensor(a!) k_cache, Tensor(b!) v_cache, Tensor slot_mapping, "
      "Tensor(c!)? k_scale=None, Tensor(d!)? v_scale=None) -> ()");
  m.def(
      "paged_decode(Tensor q, Tensor k_cache, Tensor v_cache, Tensor block_tables, Tensor context_lens, float scale, "
      "int window, float softcap=0., Tensor? k_scale=None, Tensor? v_scale=None, bool split_kv=True) -> Tensor");
  m.def(
      "paged_prefill(Tensor q, Tensor k_cache, Tensor v_cache, Tensor block_tables, Tensor spans, float scale, "
      "Tensor(a!) out, int window=0, float softcap=0., Tensor? k_scale=None, Tensor? v_scale=None) -> ()");
  // Every decoder layer of a decode-only step in one call (cpu_layers.cpp); hidden is updated in place.
  m.def(
      "decode_layers(Tensor(a!) hidden, Tensor normed, Tensor positions, Tensor cos_table, Tensor sin_table, "
      "Tensor[] weights, Tensor?[] scales, Tensor?[] biases, int[] kinds, int[] out_features, "
      "int widen_above, Tensor[] norms, Tensor[] k_caches, Tensor[] v_caches, Tensor?[] k_scales, Tensor?[] v_scales, "
      "Tensor slot_mapping, Tensor block_tables, Tensor context_lens, int num_heads, int num_kv_heads, "
      "float attn_scale, int window, float softcap, float eps, bool split_kv=True) -> ()");
}
