#pragma once
// The GPU engine of `cpgold gen --engine gpu` (reference/attention_engine.hpp): the oracle (float64) and the peer
// (float32 accumulation, rounding to the dtype at the reference's points) of reference/attention.hpp on one CUDA
// device. Per (sequence, block of query rows): the score tile S = scale Q K^T over every key the block sees (cuBLAS
// in float64, or in float32 without TF32: the default math mode with reduced-precision reductions disallowed), the
// exact two-pass softmax of each row over its visible keys (max, then exp and sum; P rounded to the dtype after the
// sum, as the reference), O = P V / sum; the backward
// recomputes S, dP = dO V^T, dS = P (dP - D) with D = rowsum(dO O) in the reference's order, dS (and P) rounded, then
// dQ = scale dS K per block and dK += dS^T Q, dV += P^T dO summed over the blocks in a fixed order (no atomics), the
// sums rounded once at the end. One stream, one cuBLAS handle with a fixed workspace and atomics not allowed: the same
// bits on every rerun on the same device, driver and libraries. What differs from the CPU reference is the order of
// the sums inside the products and the exp/log of the device (docs/scale.md states the bounds and how they are tested).
// This header is CUDA-free; the implementation links the CUDA runtime and cuBLAS, never libcuda.
#include <memory>
#include <string>

#include "reference/attention_engine.hpp"

namespace cpgold::gpu_engine {

// The engine on the current CUDA device (device 0 of CUDA_VISIBLE_DEVICES). InputError (field "--engine") when
// no CUDA device can be used, naming the cause (no device, no driver, the runtime's error).
std::unique_ptr<AttentionEngine> make_gpu_engine();

// Devices the CUDA runtime sees (0 without a driver or a device; never throws).
int device_count();

}  // namespace cpgold::gpu_engine
