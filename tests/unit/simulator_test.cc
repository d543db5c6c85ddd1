#include "workload/simulator.h"

#include <unistd.h>

#include <bit>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "core/half_float.h"
#include "refit/safetensors.h"
#include "test_util.h"

namespace refit {
namespace {

// Copies of every exported tensor's bytes: the state a receiver would hold.
using Snapshot = std::vector<std::vector<std::byte>>;

Snapshot TakeSnapshot(const TrainingSimulator& simulator) {
  Snapshot snapshot;
  for (const TensorView& view : simulator.Exported()) {
    snapshot.emplace_back(view.bytes.begin(), view.bytes.end());
  }
  return snapshot;
}

struct ChangeCount {
  uint64_t changed = 0;
  uint64_t elements = 0;
  double fraction() const { return static_cast<double>(changed) / static_cast<double>(elements); }
};

// Count elements whose bits differ between `before` and the simulator's current export, over
// the tensors whose name contains `name_filter` (all when empty).
ChangeCount CountChanges(const Snapshot& before, const TrainingSimulator& simulator,
                         const std::string& name_filter = "") {
  ChangeCount count;
  const std::vector<TensorView> views = simulator.Exported();
  for (size_t t = 0; t < views.size(); ++t) {
    if (views[t].name.find(name_filter) == std::string::npos) continue;
    const size_t width = DTypeSize(views[t].dtype);
    for (size_t offset = 0; offset < views[t].bytes.size(); offset += width) {
      count.changed += std::memcmp(&before[t][offset], &views[t].bytes[offset], width) != 0;
    }
    count.elements += views[t].numel();
  }
  return count;
}

uint16_t Element16(const TensorView& view, uint64_t index) {
  uint16_t bits;
  std::memcpy(&bits, view.bytes.data() + index * sizeof(bits), sizeof(bits));
  return bits;
}

float Element32(const TensorView& view, uint64_t index) {
  float value;
  std::memcpy(&value, view.bytes.data() + index * sizeof(value), sizeof(value));
  return value;
}

// A small model with several tensors, each spanning several parallel chunks (2^16 elements).
std::vector<SimulatedTensorSpec> SmallModel() {
  return {
      {"model.embed_tokens.weight", {512, 512}, 0.02f, 0.0f},
      {"model.layers.0.input_layernorm.weight", {512}, 1e-3f, 1.0f},
      {"model.layers.0.mlp.up_proj.weight", {1024, 512}, 0.02f, 0.0f},
      {"lm_head.weight", {300, 512}, 0.02f, 0.0f},
  };
}

SimulatorOptions SmallOptions() {
  SimulatorOptions options;
  options.tensors = SmallModel();
  return options;
}

TEST(MakeTransformerSpecTest, LandsNearTheTargetWithHuggingFaceNames) {
  for (uint64_t target_bytes : {uint64_t{8} << 20, uint64_t{256} << 20, uint64_t{16} << 30}) {
    const std::vector<SimulatedTensorSpec> spec =
        MakeTransformerSpec(target_bytes, DType::kBFloat16);
    uint64_t elements = 0;
    for (const SimulatedTensorSpec& tensor : spec) {
      ASSERT_OK_AND_ASSIGN(uint64_t numel, NumElements(tensor.shape));
      elements += numel;
    }
    const double bytes = static_cast<double>(elements * DTypeSize(DType::kBFloat16));
    EXPECT_NEAR(bytes / static_cast<double>(target_bytes), 1.0, 0.05) << target_bytes;

    ASSERT_GE(spec.size(), 12u);
    EXPECT_EQ(spec.front().name, "model.embed_tokens.weight");
    EXPECT_EQ(spec.back().name, "lm_head.weight");
    EXPECT_EQ(spec[spec.size() - 2].name, "model.norm.weight");
    EXPECT_EQ(spec[1].name, "model.layers.0.input_layernorm.weight");
    EXPECT_EQ(spec[2].name, "model.layers.0.self_attn.q_proj.weight");
    EXPECT_EQ(spec[9].name, "model.layers.0.mlp.down_proj.weight");
    EXPECT_EQ(spec[1].init_mean, 1.0f);
    EXPECT_LT(spec[1].init_std, 0.01f);
    EXPECT_EQ(spec[2].init_mean, 0.0f);
    EXPECT_EQ(spec[2].init_std, 0.02f);
  }
  // The same bytes at float32 hold half the elements.
  uint64_t bf16_elements = 0;
  uint64_t f32_elements = 0;
  for (const auto& tensor : MakeTransformerSpec(uint64_t{64} << 20, DType::kBFloat16)) {
    bf16_elements += *NumElements(tensor.shape);
  }
  for (const auto& tensor : MakeTransformerSpec(uint64_t{64} << 20, DType::kFloat32)) {
    f32_elements += *NumElements(tensor.shape);
  }
  EXPECT_NEAR(static_cast<double>(f32_elements) / static_cast<double>(bf16_elements), 0.5, 0.05);
}

TEST(TrainingSimulatorTest, ReportsShapeSizeStepAndRate) {
  SimulatorOptions options = SmallOptions();
  options.learning_rate = 3e-6;
  ASSERT_OK_AND_ASSIGN(auto simulator, TrainingSimulator::Make(options));
  const std::vector<TensorView> views = simulator->Exported();
  ASSERT_EQ(views.size(), options.tensors.size());
  uint64_t bytes = 0;
  for (size_t t = 0; t < views.size(); ++t) {
    EXPECT_EQ(views[t].name, options.tensors[t].name);
    EXPECT_EQ(views[t].shape, options.tensors[t].shape);
    EXPECT_EQ(views[t].dtype, DType::kBFloat16);
    EXPECT_OK(CheckTensorSize(views[t]));
    bytes += views[t].bytes.size();
  }
  EXPECT_EQ(simulator->exported_bytes(), bytes);
  EXPECT_EQ(simulator->step(), 0u);
  EXPECT_EQ(simulator->learning_rate(), 3e-6);
  ASSERT_OK(simulator->Step());
  ASSERT_OK(simulator->Step());
  EXPECT_EQ(simulator->step(), 2u);
  // Views point at the buffers Step rewrites in place.
  const std::vector<TensorView> after = simulator->Exported();
  for (size_t t = 0; t < views.size(); ++t) {
    EXPECT_EQ(after[t].bytes.data(), views[t].bytes.data());
  }
}

TEST(TrainingSimulatorTest, SameSeedGivesSameBitsAndOtherSeedsDiffer) {
  SimulatorOptions options = SmallOptions();
  ASSERT_OK_AND_ASSIGN(auto first, TrainingSimulator::Make(options));
  ASSERT_OK_AND_ASSIGN(auto second, TrainingSimulator::Make(options));
  options.seed = 43;
  ASSERT_OK_AND_ASSIGN(auto other_seed, TrainingSimulator::Make(options));
  for (int step = 0; step < 3; ++step) {
    ASSERT_OK(first->Step());
    ASSERT_OK(second->Step());
    ASSERT_OK(other_seed->Step());
    EXPECT_EQ(TakeSnapshot(*first), TakeSnapshot(*second)) << "step " << step;
    EXPECT_NE(TakeSnapshot(*first), TakeSnapshot(*other_seed)) << "step " << step;
  }
}

TEST(TrainingSimulatorTest, ThreadCountDoesNotChangeBits) {
  for (DType dtype : {DType::kBFloat16, DType::kFloat16, DType::kFloat32}) {
    SimulatorOptions options = SmallOptions();
    options.export_dtype = dtype;
    ASSERT_OK_AND_ASSIGN(auto serial, TrainingSimulator::Make(options));
    options.threads = 3;
    ASSERT_OK_AND_ASSIGN(auto parallel, TrainingSimulator::Make(options));
    EXPECT_EQ(TakeSnapshot(*serial), TakeSnapshot(*parallel)) << DTypeName(dtype);
    for (int step = 0; step < 3; ++step) {
      ASSERT_OK(serial->Step());
      ASSERT_OK(parallel->Step());
      EXPECT_EQ(TakeSnapshot(*serial), TakeSnapshot(*parallel))
          << DTypeName(dtype) << " step " << step;
    }
    ASSERT_OK_AND_ASSIGN(double serial_rate, serial->CalibrateLearningRate(0.02));
    ASSERT_OK_AND_ASSIGN(double parallel_rate, parallel->CalibrateLearningRate(0.02));
    EXPECT_EQ(serial_rate, parallel_rate) << DTypeName(dtype);
    ASSERT_OK(serial->Step());
    ASSERT_OK(parallel->Step());
    EXPECT_EQ(TakeSnapshot(*serial), TakeSnapshot(*parallel)) << DTypeName(dtype);
  }
}

// At lr 1e-6, weights of magnitude ≈ 0.02 (bf16 ulp 2^-13 ≈ 1.2e-4) cross a rounding boundary in
// roughly 1 % of elements per step, and the changes are single-ulp moves.
TEST(TrainingSimulatorTest, StepAtLearningRate1e6ChangesAboutOnePercentByOneUlp) {
  SimulatorOptions options;
  options.tensors = {{"model.layers.0.mlp.up_proj.weight", {1024, 1024}, 0.004f, 0.02f}};
  options.learning_rate = 1e-6;
  ASSERT_OK_AND_ASSIGN(auto simulator, TrainingSimulator::Make(options));
  // Let Adam's moments settle past the bias-corrected first steps.
  for (int step = 0; step < 3; ++step) ASSERT_OK(simulator->Step());
  const Snapshot before = TakeSnapshot(*simulator);
  ASSERT_OK(simulator->Step());
  const ChangeCount count = CountChanges(before, *simulator);
  EXPECT_GT(count.fraction(), 0.003);
  EXPECT_LT(count.fraction(), 0.03);

  const TensorView view = simulator->Exported()[0];
  uint64_t one_ulp = 0;
  for (uint64_t i = 0; i < view.numel(); ++i) {
    uint16_t old_bits;
    std::memcpy(&old_bits, &before[0][i * 2], 2);
    const uint16_t new_bits = Element16(view, i);
    if (old_bits == new_bits) continue;
    one_ulp += (old_bits > new_bits ? old_bits - new_bits : new_bits - old_bits) == 1;
  }
  EXPECT_GT(static_cast<double>(one_ulp), 0.99 * static_cast<double>(count.changed));
}

// Norm weights sit near 1.0 where the bf16 ulp is 2^-8..2^-7, so a small step almost never moves
// them while the projections around them change.
TEST(TrainingSimulatorTest, NormWeightsChangeFarLessThanProjections) {
  SimulatorOptions options;
  options.tensors = MakeTransformerSpec(uint64_t{8} << 20, DType::kBFloat16);
  options.threads = 2;
  ASSERT_OK_AND_ASSIGN(auto simulator, TrainingSimulator::Make(options));
  for (int step = 0; step < 3; ++step) ASSERT_OK(simulator->Step());
  const Snapshot before = TakeSnapshot(*simulator);
  ASSERT_OK(simulator->Step());
  const ChangeCount projections = CountChanges(before, *simulator, "_proj");
  const ChangeCount norms = CountChanges(before, *simulator, "norm");
  ASSERT_GT(norms.elements, 0u);
  EXPECT_GT(projections.fraction(), 0.003);
  EXPECT_LT(norms.fraction(), projections.fraction() / 10);
}

// With a noiseless constant gradient, bias-corrected Adam moves every weight by the learning rate
// per step (|m̂ / sqrt(v̂)| = 1), always in the same direction. Without the bias corrections the
// first step alone would move it by (1 − β1) / sqrt(1 − β2) ≈ 3.16 learning rates.
TEST(TrainingSimulatorTest, NoiselessAdamStepsByTheLearningRate) {
  SimulatorOptions options;
  options.tensors = {{"w", {4096}, 0.02f, 0.0f}};
  options.export_dtype = DType::kFloat32;
  options.gradient_noise = 0.0;
  // Far below any |gradient|, so that m̂ / (sqrt(v̂) + ε) is ±1 to float precision.
  options.epsilon = 1e-20;
  options.learning_rate = 1e-4;
  ASSERT_OK_AND_ASSIGN(auto simulator, TrainingSimulator::Make(options));
  const Snapshot initial = TakeSnapshot(*simulator);
  constexpr int kSteps = 5;
  for (int step = 0; step < kSteps; ++step) ASSERT_OK(simulator->Step());
  const TensorView view = simulator->Exported()[0];
  TensorView initial_view = view;
  initial_view.bytes = initial[0];
  uint64_t moved_by_steps_times_rate = 0;
  for (uint64_t i = 0; i < view.numel(); ++i) {
    const double moved = static_cast<double>(Element32(view, i)) - Element32(initial_view, i);
    moved_by_steps_times_rate += std::fabs(std::fabs(moved) - kSteps * 1e-4) < 1e-6;
  }
  // An element whose gradient signal is exactly 0 does not move; that is rarer than 1 in 10^4.
  EXPECT_GE(moved_by_steps_times_rate, view.numel() - 1);
}

// Master weights evolve independently of the export dtype, so a float32 export (the master bits)
// tells what the bf16 and fp16 exports must be.
TEST(TrainingSimulatorTest, ExportIsRoundToNearestEvenOfMaster) {
  SimulatorOptions options = SmallOptions();
  options.learning_rate = 1e-5;
  options.export_dtype = DType::kFloat32;
  ASSERT_OK_AND_ASSIGN(auto master, TrainingSimulator::Make(options));
  options.export_dtype = DType::kBFloat16;
  ASSERT_OK_AND_ASSIGN(auto bf16, TrainingSimulator::Make(options));
  options.export_dtype = DType::kFloat16;
  ASSERT_OK_AND_ASSIGN(auto fp16, TrainingSimulator::Make(options));
  constexpr uint64_t kSampleStride = 7;
  for (int step = 0; step <= 2; ++step) {
    if (step > 0) {
      ASSERT_OK(master->Step());
      ASSERT_OK(bf16->Step());
      ASSERT_OK(fp16->Step());
    }
    const std::vector<TensorView> masters = master->Exported();
    const std::vector<TensorView> bf16_views = bf16->Exported();
    const std::vector<TensorView> fp16_views = fp16->Exported();
    for (size_t t = 0; t < masters.size(); ++t) {
      ASSERT_EQ(bf16_views[t].dtype, DType::kBFloat16);
      ASSERT_EQ(fp16_views[t].dtype, DType::kFloat16);
      for (uint64_t i = 0; i < masters[t].numel(); i += kSampleStride) {
        const float weight = Element32(masters[t], i);
        ASSERT_EQ(Element16(bf16_views[t], i), FloatToBFloat16(weight))
            << masters[t].name << "[" << i << "] step " << step;
        ASSERT_EQ(Element16(fp16_views[t], i), FloatToHalf(weight))
            << masters[t].name << "[" << i << "] step " << step;
      }
    }
  }
}

// fp16 keeps 3 more mantissa bits than bf16, so the same step crosses far more rounding
// boundaries.
TEST(TrainingSimulatorTest, Float16ExportChangesMoreThanBFloat16) {
  SimulatorOptions options = SmallOptions();
  ASSERT_OK_AND_ASSIGN(auto bf16, TrainingSimulator::Make(options));
  options.export_dtype = DType::kFloat16;
  ASSERT_OK_AND_ASSIGN(auto fp16, TrainingSimulator::Make(options));
  ASSERT_OK(bf16->Step());
  ASSERT_OK(fp16->Step());
  const Snapshot bf16_before = TakeSnapshot(*bf16);
  const Snapshot fp16_before = TakeSnapshot(*fp16);
  ASSERT_OK(bf16->Step());
  ASSERT_OK(fp16->Step());
  const double bf16_fraction = CountChanges(bf16_before, *bf16).fraction();
  const double fp16_fraction = CountChanges(fp16_before, *fp16).fraction();
  EXPECT_GT(bf16_fraction, 0.0);
  EXPECT_GT(fp16_fraction, 4 * bf16_fraction);
  EXPECT_LT(fp16_fraction, 0.5);
}

class CalibrationTest : public ::testing::TestWithParam<double> {};

TEST_P(CalibrationTest, NextStepHitsTheTargetDensity) {
  const double target = GetParam();
  SimulatorOptions options;
  // About 4 M elements: larger than the 2^20-element calibration sample.
  options.tensors = MakeTransformerSpec(uint64_t{8} << 20, DType::kBFloat16);
  options.threads = 2;
  ASSERT_OK_AND_ASSIGN(auto simulator, TrainingSimulator::Make(options));
  for (int step = 0; step < 3; ++step) ASSERT_OK(simulator->Step());
  ASSERT_OK_AND_ASSIGN(double rate, simulator->CalibrateLearningRate(target));
  EXPECT_EQ(simulator->learning_rate(), rate);
  EXPECT_GT(rate, 1e-9);
  EXPECT_LT(rate, 1e-3);
  const Snapshot before = TakeSnapshot(*simulator);
  ASSERT_OK(simulator->Step());
  const ChangeCount count = CountChanges(before, *simulator);
  ASSERT_GT(count.elements, uint64_t{1} << 21);
  EXPECT_NEAR(count.fraction(), target, 0.3 * target);
}

INSTANTIATE_TEST_SUITE_P(Densities, CalibrationTest, ::testing::Values(0.01, 0.03, 0.05));

TEST(TrainingSimulatorTest, CalibrationIsExactOnSmallModels) {
  // Below 2^20 trained elements the sample is the whole model, so the prediction is exact.
  SimulatorOptions options = SmallOptions();
  ASSERT_OK_AND_ASSIGN(auto simulator, TrainingSimulator::Make(options));
  ASSERT_OK(simulator->Step());
  ASSERT_OK(simulator->CalibrateLearningRate(0.02));
  const Snapshot before = TakeSnapshot(*simulator);
  ASSERT_OK(simulator->Step());
  const ChangeCount count = CountChanges(before, *simulator);
  // Bisection stops at the smallest probed rate reaching the target: ≥ target, by at most the
  // elements that share the final rate bracket.
  EXPECT_GE(count.fraction(), 0.02);
  EXPECT_LT(count.fraction(), 0.0201);
}

class TemporaryFile {
 public:
  explicit TemporaryFile(const std::string& stem)
      : path_(::testing::TempDir() + stem + "_" + std::to_string(::getpid()) + ".safetensors") {}
  ~TemporaryFile() { std::filesystem::remove(path_); }
  const std::string& path() const { return path_; }

 private:
  std::string path_;
};

TEST(TrainingSimulatorTest, InitFromSafetensorsRoundTripsAndTrainsFloatingTensors) {
  // Deterministic, varied element bits: bf16 and fp16 weights ≈ ±0.02 (some subnormal fp16
  // and negative zero), fp32 weights, and an int32 tensor that must never change.
  std::vector<OwnedTensor> tensors(4);
  tensors[0] = {"model.embed_tokens.weight", DType::kBFloat16, {256, 300}, {}};
  tensors[1] = {"model.norm.weight", DType::kFloat16, {300}, {}};
  tensors[2] = {"lm_head.bias", DType::kFloat32, {7, 5}, {}};
  tensors[3] = {"position_ids", DType::kInt32, {10}, {}};
  uint32_t state = 12345;
  auto next_random = [&state] {
    state = state * 1664525u + 1013904223u;  // Numerical Recipes LCG: enough for test data.
    return state >> 8;
  };
  for (uint64_t i = 0; i < 256 * 300; ++i) {
    const float value = (static_cast<float>(next_random() % 2001) - 1000.0f) * 4e-5f;
    const uint16_t bits = FloatToBFloat16(value);
    tensors[0].bytes.resize(tensors[0].bytes.size() + 2);
    std::memcpy(tensors[0].bytes.data() + 2 * i, &bits, 2);
  }
  for (uint64_t i = 0; i < 300; ++i) {
    const uint16_t bits = i % 50 == 0 ? static_cast<uint16_t>(0x8000u | i)  // −0, subnormals
                                      : FloatToHalf(1.0f + (next_random() % 64) / 512.0f);
    tensors[1].bytes.resize(tensors[1].bytes.size() + 2);
    std::memcpy(tensors[1].bytes.data() + 2 * i, &bits, 2);
  }
  for (uint64_t i = 0; i < 35; ++i) {
    const float value = (static_cast<float>(next_random() % 1000) - 500.0f) * 1e-4f;
    tensors[2].bytes.resize(tensors[2].bytes.size() + 4);
    std::memcpy(tensors[2].bytes.data() + 4 * i, &value, 4);
  }
  for (int32_t i = 0; i < 10; ++i) {
    tensors[3].bytes.resize(tensors[3].bytes.size() + 4);
    std::memcpy(tensors[3].bytes.data() + 4 * i, &i, 4);
  }
  std::vector<TensorView> views;
  for (const OwnedTensor& tensor : tensors) views.push_back(tensor.view());
  TemporaryFile file("simulator_init_from");
  ASSERT_OK(WriteSafetensors(file.path(), views));

  SimulatorOptions options;
  options.init_from = file.path();
  options.tensors = SmallModel();          // Ignored with init_from.
  options.export_dtype = DType::kFloat16;  // Ignored too: each tensor keeps its dtype.
  options.learning_rate = 1e-4;
  options.threads = 2;
  ASSERT_OK_AND_ASSIGN(auto simulator, TrainingSimulator::Make(options));
  std::vector<TensorView> exported = simulator->Exported();
  ASSERT_EQ(exported.size(), tensors.size());
  uint64_t bytes = 0;
  for (size_t t = 0; t < tensors.size(); ++t) {
    EXPECT_EQ(exported[t].name, tensors[t].name);
    EXPECT_EQ(exported[t].dtype, tensors[t].dtype);
    EXPECT_EQ(exported[t].shape, tensors[t].shape);
    EXPECT_EQ(std::vector<std::byte>(exported[t].bytes.begin(), exported[t].bytes.end()),
              tensors[t].bytes)
        << tensors[t].name;
    bytes += tensors[t].bytes.size();
  }
  EXPECT_EQ(simulator->exported_bytes(), bytes);

  const Snapshot before = TakeSnapshot(*simulator);
  ASSERT_OK(simulator->Step());
  EXPECT_GT(CountChanges(before, *simulator, "embed_tokens").changed, 0u);
  EXPECT_GT(CountChanges(before, *simulator, "lm_head.bias").changed, 0u);
  EXPECT_EQ(CountChanges(before, *simulator, "position_ids").changed, 0u);
  exported = simulator->Exported();
  for (size_t t = 0; t < tensors.size(); ++t) EXPECT_EQ(exported[t].dtype, tensors[t].dtype);
  ASSERT_OK_AND_ASSIGN(double rate, simulator->CalibrateLearningRate(0.05));
  EXPECT_GT(rate, 0.0);
}

TEST(TrainingSimulatorTest, FileWithoutFloatingTensorsCannotCalibrate) {
  OwnedTensor ids{"ids", DType::kInt64, {4}, std::vector<std::byte>(32, std::byte{7})};
  TemporaryFile file("simulator_untrained");
  ASSERT_OK(WriteSafetensors(file.path(), {ids.view()}));
  SimulatorOptions options;
  options.init_from = file.path();
  ASSERT_OK_AND_ASSIGN(auto simulator, TrainingSimulator::Make(options));
  ASSERT_OK(simulator->Step());
  EXPECT_EQ(TakeSnapshot(*simulator), Snapshot{ids.bytes});
  EXPECT_STATUS(FailedPrecondition, simulator->CalibrateLearningRate(0.01));
}

TEST(TrainingSimulatorTest, RejectsBadOptions) {
  for (DType dtype : {DType::kInt8, DType::kFloat64, DType::kFloat8E4M3FN}) {
    SimulatorOptions options = SmallOptions();
    options.export_dtype = dtype;
    EXPECT_STATUS_MSG(InvalidArgument, DTypeName(dtype), TrainingSimulator::Make(options));
  }
  SimulatorOptions options = SmallOptions();
  options.tensors.clear();
  EXPECT_STATUS(InvalidArgument, TrainingSimulator::Make(options));
  options.tensors = {{"empty", {0, 16}, 0.02f, 0.0f}};
  EXPECT_STATUS(InvalidArgument, TrainingSimulator::Make(options));
  options.tensors = {{"w", {4}, 0.02f, 0.0f}, {"w", {4}, 0.02f, 0.0f}};
  EXPECT_STATUS_MSG(InvalidArgument, "duplicate", TrainingSimulator::Make(options));
  options.tensors = {{"", {4}, 0.02f, 0.0f}};
  EXPECT_STATUS(InvalidArgument, TrainingSimulator::Make(options));
  options.tensors = {{"w", {4, -1}, 0.02f, 0.0f}};
  EXPECT_STATUS(InvalidArgument, TrainingSimulator::Make(options));
  options.tensors = {{"w", {4}, -0.02f, 0.0f}};
  EXPECT_STATUS(InvalidArgument, TrainingSimulator::Make(options));

  auto with = [](auto mutate) {
    SimulatorOptions mutated = SmallOptions();
    mutate(mutated);
    return TrainingSimulator::Make(mutated).status();
  };
  EXPECT_STATUS(InvalidArgument, with([](SimulatorOptions& o) { o.threads = 0; }));
  EXPECT_STATUS(InvalidArgument, with([](SimulatorOptions& o) { o.beta1 = 1.0; }));
  EXPECT_STATUS(InvalidArgument, with([](SimulatorOptions& o) { o.beta2 = -0.5; }));
  EXPECT_STATUS(InvalidArgument, with([](SimulatorOptions& o) { o.epsilon = 0.0; }));
  EXPECT_STATUS(InvalidArgument, with([](SimulatorOptions& o) { o.learning_rate = NAN; }));
  EXPECT_STATUS(InvalidArgument, with([](SimulatorOptions& o) { o.gradient_noise = -1.0; }));
  EXPECT_STATUS(InvalidArgument, with([](SimulatorOptions& o) { o.gradient_signal = INFINITY; }));
  EXPECT_FALSE(
      with([](SimulatorOptions& o) { o.init_from = "/nonexistent/model.safetensors"; }).ok());

  ASSERT_OK_AND_ASSIGN(auto simulator, TrainingSimulator::Make(SmallOptions()));
  for (double density : {0.0, 1.0, 1.5, -0.1, static_cast<double>(NAN)}) {
    EXPECT_STATUS_MSG(InvalidArgument, "density", simulator->CalibrateLearningRate(density));
  }
  EXPECT_EQ(simulator->learning_rate(), SimulatorOptions{}.learning_rate);
}

}  // namespace
}  // namespace refit
