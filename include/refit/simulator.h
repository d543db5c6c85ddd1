// An RL-like training simulator: the workload generator for tests, benchmarks and the demo.
//
// It keeps fp32 master weights and Adam state, applies one Adam step per call with gradients of
// configurable noise, and exports the weights to bf16/fp16 by round-to-nearest-even — so the
// fraction of exported elements that change per step emerges the way it does in real RL
// post-training (≈1 % per step at lr 1e-6 for |w| ≈ 0.02) instead of being sprinkled at random.
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "refit/dtype.h"
#include "refit/status.h"
#include "refit/tensor.h"

namespace refit {

/// One tensor of a synthetic model.
struct SimulatedTensorSpec {
  std::string name;
  Shape shape;
  /// Standard deviation of the initial weights (realistic per-tensor scale).
  float init_std = 0.02f;
};

/// Options of TrainingSimulator::Make.
struct SimulatorOptions {
  /// Export dtype: bfloat16 or float16 (float32 exports the master weights unchanged).
  DType export_dtype = DType::kBFloat16;
  /// Tensors of a synthetic model. Ignored when `init_from` is set.
  std::vector<SimulatedTensorSpec> tensors;
  /// Initialise from a safetensors file instead (floating tensors are trained; others are
  /// exported unchanged).
  std::string init_from;
  /// Adam hyper-parameters.
  double learning_rate = 1e-6;
  double beta1 = 0.9;
  double beta2 = 0.999;
  double epsilon = 1e-8;
  /// Gradient model: g = signal_i + noise · N(0, 1), with a fixed per-element signal drawn once.
  /// noise / signal sets how consistent update directions are across steps.
  double gradient_signal = 1e-3;
  double gradient_noise = 1e-3;
  uint64_t seed = 42;
  /// Worker threads for the step (elements are independent).
  int threads = 1;
};

/// Return a synthetic transformer-shaped model of roughly `total_bytes` at `dtype`: embeddings,
/// per-layer attention and MLP projections and norms (norm weights ≈ 1, projections ≈ 0.02).
std::vector<SimulatedTensorSpec> MakeTransformerSpec(uint64_t total_bytes, DType dtype);

/// The simulator. Not thread-safe: one caller at a time (Step uses its own workers internally).
class TrainingSimulator {
 public:
  ~TrainingSimulator();
  static Result<std::unique_ptr<TrainingSimulator>> Make(const SimulatorOptions& options);

  /// Apply one Adam step to the master weights and refresh the exported tensors.
  Status Step();

  /// Choose the learning rate so that the next step changes about `density` (0..1) of the
  /// exported elements, by bisection on a sample of elements, and set it. Returns the rate.
  Result<double> CalibrateLearningRate(double density);

  /// The exported tensors at the current step. Views stay valid until the next Step().
  std::vector<TensorView> Exported() const;
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
