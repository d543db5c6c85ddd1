// An RL-like training simulator: the workload generator for tests, benchmarks and the demo.
//
// It keeps fp32 master weights and Adam state, applies one Adam step per call with gradients of
// configurable noise, and exports the weights to bf16/fp16 by round-to-nearest-even — so the
// fraction of exported elements that change per step emerges the way it does in real RL
// post-training (≈1 % per step at lr 1e-6 for |w| ≈ 0.02) instead of being sprinkled at random.
//
// Randomness is counter-based: every random number is a hash of (seed, purpose, step, tensor
// position, element index), so results are bit-identical for any thread count and chunking.
// Normal variates are approximated by Irwin–Hall(4) — the sum of four 16-bit uniforms of one
// 64-bit hash, standardised — which is cheap (no log/sqrt/cos), has the right mean and variance,
// an excess kurtosis of −0.3 and tails cut at ±2√3 ≈ ±3.46 σ.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "refit/dtype.h"
#include "refit/status.h"
#include "refit/tensor.h"

namespace refit {

/// One tensor of a synthetic model. Initial weights are `init_mean + init_std · N(0, 1)`.
struct SimulatedTensorSpec {
  std::string name;
  Shape shape;
  /// Standard deviation of the initial weights (realistic per-tensor scale).
  float init_std = 0.02f;
  /// Mean of the initial weights (1.0 for norm weights, 0 for projections).
  float init_mean = 0.0f;
};

/// Options of TrainingSimulator::Make.
struct SimulatorOptions {
  /// Export dtype of a synthetic model: bfloat16 or float16 (round-to-nearest-even of the
  /// master weights), or float32 (the master weights' bits). Other dtypes are InvalidArgument.
  /// Tensors of an `init_from` file keep their own dtype instead.
  DType export_dtype = DType::kBFloat16;
  /// Tensors of a synthetic model. Ignored when `init_from` is set.
  std::vector<SimulatedTensorSpec> tensors;
  /// Initialise from a safetensors file instead. Its float16/bfloat16/float32 tensors are
  /// trained and exported in their own dtype (the initial export is the file's bytes exactly;
  /// a NaN stays NaN but its payload becomes the canonical quiet NaN once stepped); every other
  /// tensor is exported unchanged.
  std::string init_from;
  /// Adam hyper-parameters (bias-corrected Adam as in torch.optim.Adam, computed in fp32).
  double learning_rate = 1e-6;
  double beta1 = 0.9;
  double beta2 = 0.999;
  double epsilon = 1e-8;
  /// Gradient model: g = signal_i + noise · N(0, 1), with a fixed per-element signal_i drawn
  /// once from N(0, gradient_signal²). noise / signal sets how consistent update directions are
  /// across steps.
  double gradient_signal = 1e-3;
  double gradient_noise = 1e-3;
  uint64_t seed = 42;
  /// Worker threads for Make, Step and CalibrateLearningRate (elements are independent).
  int threads = 1;
};

/// Return a synthetic Llama-shaped model of roughly `total_bytes` at `dtype` (within a few
/// percent above ~1 MB; never smaller than one layer of hidden size 64, about 120 K elements):
/// model.embed_tokens, per layer input_layernorm, self_attn.{q,k,v,o}_proj,
/// post_attention_layernorm, mlp.{gate,up,down}_proj, then model.norm and lm_head, named as in
/// Hugging Face checkpoints. Projections and embeddings start at N(0, 0.02²); norm weights at
/// 1.0 with a tiny spread (their bf16 ulp is 2^-7, so they rarely change — as in real runs).
std::vector<SimulatedTensorSpec> MakeTransformerSpec(uint64_t total_bytes, DType dtype);

/// The simulator.
///
/// Memory: 12 bytes per trained element (fp32 master weight, Adam m and v) plus the export
/// (2 bytes per element for bf16/fp16; none for float32, whose export is the master buffer;
/// untrained tensors of an `init_from` file are copied once).
///
/// Thread-safety: not thread-safe; one caller at a time. Step, Make and CalibrateLearningRate
/// use `threads` workers internally.
class TrainingSimulator {
 public:
  ~TrainingSimulator();

  /// Build the model: draw (or load) the initial weights, zero the Adam state and export.
  /// Errors: InvalidArgument (unsupported export dtype, empty model, duplicate or empty tensor
  /// name, bad shape, hyper-parameter out of range, threads < 1), ResourceExhausted (allocation
  /// failed), and the errors of SafetensorsFile::Open for `init_from`.
  static Result<std::unique_ptr<TrainingSimulator>> Make(const SimulatorOptions& options);

  /// Apply one Adam step to the master weights and refresh the exported tensors in place.
  /// Cost: O(trained elements) / threads; an fp16 export costs about twice a bf16 one per
  /// element (its round-to-nearest-even conversion dominates).
  Status Step();

  /// Choose the learning rate so that the next Step changes about `density` (0..1) of the
  /// exported elements of the trained tensors, and set it. Returns the rate.
  ///
  /// Evaluates the next step exactly (same gradients, current Adam state, nothing committed) on
  /// a fixed sample of up to 2^20 trained elements — all of them for smaller models — and
  /// bisects the rate in log space over [1e-12, 1]; a density beyond what a rate of 1 reaches
  /// yields 1. Errors: InvalidArgument for `density` outside (0, 1); FailedPrecondition when
  /// the model has no trained tensor.
  Result<double> CalibrateLearningRate(double density);

  /// The exported tensors at the current step, in model order. The views point at buffers that
  /// Step() rewrites in place; they stay valid for the simulator's lifetime.
  std::vector<TensorView> Exported() const;
  /// Number of Step() calls so far.
  uint64_t step() const;
  double learning_rate() const;
  /// Total bytes of the exported model.
  uint64_t exported_bytes() const;

 private:
  struct State;
  explicit TrainingSimulator(std::unique_ptr<State> state);
  std::unique_ptr<State> state_;
};

}  // namespace refit
