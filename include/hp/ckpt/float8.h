// FP8 weights with block scales, as published checkpoints hold them (DeepSeek-V3's; issue
// 47). config.json says
//   "quantization_config": {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme":
//                           "dynamic", "weight_block_size": [128, 128]}
// and each quantized weight W [R, C] is stored as F8_E4M3 bytes beside an fp32 tensor
// `W_scale_inv` [ceil(R / 128), ceil(C / 128)] (the last blocks of a dim that 128 does not
// divide are partial): the value of W[i, j] is the byte's value times the scale of its block,
// scale_inv[i / 128, j / 128]. Every other tensor of the folder is stored plainly.
//
// float8_e4m3fn: 1 sign bit, 4 exponent bits (bias 7), 3 mantissa bits; exponent 0 holds the
// subnormals (m / 8 x 2^-6); no infinities; 0x7f and 0xff are NaN; the largest value is 448.
// libtorch 1.13 has no such dtype: the bytes are held as uint8 and decoded here, exactly.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/Optional.h>

#include <cstdint>
#include <string>
#include <utility>

namespace hp::ckpt {

// The value of one float8_e4m3fn byte (NaN for 0x7f and 0xff).
float e4m3fn_value(uint8_t bits);
// The float8_e4m3fn byte nearest `x` (ties to the even mantissa); beyond +-448, +-448 (a
// block scaled by its amax / 448 never gets there); NaN to 0x7f.
uint8_t e4m3fn_bits(float x);

// uint8 bytes (any shape) as float32 values, exactly.
at::Tensor decode_e4m3fn(const at::Tensor& bytes);
// float32 values as float8_e4m3fn bytes (e4m3fn_bits elementwise).
at::Tensor encode_e4m3fn(const at::Tensor& values);

// The block a scale covers: rows x cols of the weight.
struct Float8Blocks {
  int64_t rows = 128, cols = 128;
};

// The fp32 values of the box of a quantized weight whose float8_e4m3fn `bytes` [rows, cols]
// start at (row0, col0) of the weight: each byte's value times the scale of its block,
// `scales` [.., ..] holding the blocks from (row0 / blocks.rows, col0 / blocks.cols) on. One
// pass (no tensor of the scales per element); the product in fp32, as a reader in PyTorch
// forms it. `nan_bytes`, when given, receives the count of NaN bytes (0x7f, 0xff) met.
at::Tensor dequantize_e4m3fn_blocks(const at::Tensor& bytes, const at::Tensor& scales, int64_t row0, int64_t col0,
                                    const Float8Blocks& blocks = {}, int64_t* nan_bytes = nullptr);
// The same written into `out` (the box's shape; any floating dtype, each fp32 product
// rounded to it as a cast would), without a tensor of fp32 values in between where `out` is
// contiguous.
void dequantize_e4m3fn_blocks_into(const at::Tensor& bytes, const at::Tensor& scales, int64_t row0, int64_t col0,
                                   const Float8Blocks& blocks, const at::Tensor& out, int64_t* nan_bytes = nullptr);

// A 2-D float tensor quantized in that format: its float8_e4m3fn bytes and its fp32 scales,
// one a block: the block's largest magnitude / 448 (1 for a block of zeros), each element
// divided by its block's scale (fp32) and rounded to the nearest code.
std::pair<at::Tensor, at::Tensor> quantize_e4m3fn_blocks(const at::Tensor& weight, const Float8Blocks& blocks = {});

// The quantization_config of a model folder's config.json (`text`, read from `path`):
// nothing where it has none (or null); the blocks of the fp8 format above; otherwise raises
// "not supported yet" naming the key and its value (another quant_method or fmt, static
// activation scales, a block other than 128 x 128).
c10::optional<Float8Blocks> hf_float8_blocks(const std::string& text, const std::string& path);

// The name of the scale tensor of the quantized weight `weight` ("...weight" ->
// "...weight_scale_inv").
std::string float8_scale_name(const std::string& weight);

}  // namespace hp::ckpt
