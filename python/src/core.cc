// refit._core: the pybind11 binding of refit's public API — ReceiverNode, Publisher, producer
// groups, loader specs and the configuration file. A thin layer: it converts arguments and
// results, releases the GIL around every call that can block, and turns a Status into the
// exception class refit.errors maps its code to. Everything a user sees as Python (defaults,
// torch tensors, dataclasses) lives in the pure-Python modules above it (python/refit/).
//
// GIL rules. Every blocking call runs with the GIL released. C++ threads call back into Python
// (receiver hooks, a Python-implemented producer group) only after taking the GIL, and every
// Python object a C++ object keeps is released under the GIL (HeldObject), so that objects may be
// destroyed on any thread. A long call that Ctrl-C should stop (Publisher.sync) runs on a worker
// thread while the calling thread waits in short slices and checks for signals.
#include <pybind11/functional.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <chrono>
#include <cstdint>
#include <future>
#include <memory>
#include <optional>
#include <string>
#include <thread>
#include <tuple>
#include <utility>
#include <vector>

#include <fmt/format.h>

#include "config_file.h"
#include "refit/compare_options.h"
#include "refit/dtype.h"
#include "refit/loader.h"
#include "refit/loader_layout.h"
#include "refit/logging.h"
#include "refit/producer_group.h"
#include "refit/producer_layout.h"
#include "refit/publisher.h"
#include "refit/receiver_node.h"
#include "refit/status.h"
#include "refit/status_format.h"
#include "refit/tensor.h"
#include "refit/tensor_memory.h"
#include "refit/version.h"
#include "role_options.h"

namespace py = pybind11;
using namespace std::chrono_literals;

namespace refit::python {
namespace {

// ---- Errors -------------------------------------------------------------------------------------

// A failed Status on its way to Python; the translator raises refit.errors' class for its code.
struct StatusError {
  Status status;
};

[[noreturn]] void Throw(Status status) { throw StatusError{std::move(status)}; }

void Check(const Status& status) {
  if (!status.ok()) Throw(status);
}

template <typename T>
T Unwrap(Result<T> result) {
  if (!result.ok()) Throw(result.status());
  return std::move(result).ValueOrDie();
}

void RaiseStatus(const Status& status) {
  py::object errors = py::module_::import("refit.errors");
  py::object cls = errors.attr("error_class")(std::string(StatusCodeName(status.code())));
  PyErr_SetString(cls.ptr(), status.message().c_str());
}

// ---- Python objects held by C++
// -------------------------------------------------------------------

// A Python object owned by C++ code that may drop it on any thread, with or without the GIL.
using HeldObject = std::shared_ptr<py::object>;

HeldObject Hold(py::object object) {
  return HeldObject(new py::object(std::move(object)), [](py::object* held) {
    py::gil_scoped_acquire gil;
    delete held;
  });
}

// Call a Python hook from a C++ thread. A hook that raises is logged through Python's
// unraisable-exception machinery (it must not unwind into the session's threads).
template <typename... Args>
void CallHook(const HeldObject& hook, Args&&... args) {
  py::gil_scoped_acquire gil;
  try {
    (*hook)(std::forward<Args>(args)...);
  } catch (py::error_already_set& error) {
    error.discard_as_unraisable("refit receiver hook");
  }
}

// ---- Blocking calls ----------------------------------------------------------------------------

// Run `work` on a worker thread, the GIL released, while this thread checks for signals every
// 50 ms. On a signal whose handler raised (Ctrl-C: KeyboardInterrupt), call `cancel`, wait for
// `work` to return, and re-raise the handler's exception. Signals are only delivered to the main
// thread; elsewhere this is a plain wait.
template <typename T>
T RunInterruptible(std::function<T()> work, const std::function<void()>& cancel) {
  std::packaged_task<T()> task(std::move(work));
  std::future<T> done = task.get_future();
  std::thread worker(std::move(task));
  while (true) {
    std::future_status state;
    {
      py::gil_scoped_release release;
      state = done.wait_for(50ms);
    }
    if (state == std::future_status::ready) break;
    if (PyErr_CheckSignals() != 0) {
      // Keep the handler's exception pending while waiting for the cancelled call.
      py::error_already_set interrupted;
      cancel();
      {
        py::gil_scoped_release release;
        worker.join();
      }
      throw interrupted;
    }
  }
  {
    py::gil_scoped_release release;
    worker.join();
  }
  return done.get();
}

// ---- Tensors
// -------------------------------------------------------------------------------------

// One tensor as Python passes it: (name, dtype name, shape, buffer). The buffer must be
// C-contiguous and hold exactly numel × dtype size bytes; it is never copied.
struct BufferTensor {
  std::string name;
  DType dtype = DType::kUInt8;
  Shape shape;
  py::buffer_info info;
};

BufferTensor ToBufferTensor(const py::handle& item, bool writable) {
  const py::tuple entry = py::reinterpret_borrow<py::tuple>(item);
  if (entry.size() != 4) {
    Throw(InvalidArgument("a tensor is (name, dtype, shape, buffer), got a tuple of {}",
                          entry.size()));
  }
  BufferTensor tensor;
  tensor.name = entry[0].cast<std::string>();
  tensor.dtype = Unwrap(ParseDType(entry[1].cast<std::string>()));
  tensor.shape = entry[2].cast<Shape>();
  tensor.info = entry[3].cast<py::buffer>().request(writable);
  // C-contiguity: strides must be the row-major ones for the buffer's own item size.
  int64_t stride = tensor.info.itemsize;
  for (int64_t d = tensor.info.ndim - 1; d >= 0; --d) {
    if (tensor.info.shape[d] > 1 && tensor.info.strides[d] != stride) {
      Throw(InvalidArgument("tensor '{}': its buffer is not contiguous", tensor.name));
    }
    stride *= tensor.info.shape[d];
  }
  return tensor;
}

std::span<std::byte> BytesOf(const BufferTensor& tensor) {
  return {static_cast<std::byte*>(tensor.info.ptr),
          static_cast<size_t>(tensor.info.size * tensor.info.itemsize)};
}

TensorView ViewOf(const BufferTensor& tensor) {
  TensorView view{tensor.name, tensor.dtype, tensor.shape, BytesOf(tensor)};
  Check(CheckTensorSize(view));
  return view;
}

// A trainer's export as Python passes it: each tensor (name, dtype, shape, buffer) in host memory
// or (name, dtype, shape, TensorMemory) in device memory, staged by the publisher. Holds the
// buffers and the backends alive while the core reads them.
struct ExportTensors {
  std::vector<BufferTensor> buffers;
  std::vector<py::object> memories;
  std::vector<ExportTensor> tensors;
};

ExportTensors ToExportTensors(const py::list& items) {
  ExportTensors out;
  // Two passes: the views point into `buffers`, which must not move after.
  std::vector<bool> device(items.size(), false);
  for (size_t i = 0; i < items.size(); ++i) {
    const py::tuple entry = py::reinterpret_borrow<py::tuple>(items[i]);
    if (entry.size() == 4 && py::isinstance<TensorMemory>(entry[3])) {
      device[i] = true;
      out.memories.push_back(entry[3]);
    } else {
      out.buffers.push_back(ToBufferTensor(entry, false));
    }
  }
  size_t next_buffer = 0;
  size_t next_memory = 0;
  for (size_t i = 0; i < items.size(); ++i) {
    if (!device[i]) {
      out.tensors.push_back(ExportTensor::Host(ViewOf(out.buffers[next_buffer++])));
      continue;
    }
    const py::tuple entry = py::reinterpret_borrow<py::tuple>(items[i]);
    ExportTensor tensor;
    tensor.name = entry[0].cast<std::string>();
    tensor.dtype = Unwrap(ParseDType(entry[1].cast<std::string>()));
    tensor.shape = entry[2].cast<Shape>();
    tensor.device = out.memories[next_memory++].cast<TensorMemory*>();
    Check(CheckExportTensorSize(tensor));
    out.tensors.push_back(std::move(tensor));
  }
  return out;
}

// ---- Loader specs (dicts)
// ------------------------------------------------------------------------

// The rule fields a loader dict may set, by kind of value (LoaderRule's members).
constexpr std::pair<std::string_view, std::string LoaderRule::*> kRuleTexts[] = {
    {"match", &LoaderRule::match}, {"to", &LoaderRule::to}, {"q", &LoaderRule::q},
    {"k", &LoaderRule::k},         {"v", &LoaderRule::v},   {"gate", &LoaderRule::gate},
    {"up", &LoaderRule::up}};
constexpr std::pair<std::string_view, uint32_t LoaderRule::*> kRuleCounts[] = {
    {"num_heads", &LoaderRule::num_heads},
    {"num_kv_heads", &LoaderRule::num_kv_heads},
    {"expert_group", &LoaderRule::expert_group},
    {"num_experts", &LoaderRule::num_experts},
    {"expert_tp_rank", &LoaderRule::expert_tp_rank},
    {"expert_tp_size", &LoaderRule::expert_tp_size}};
constexpr std::pair<std::string_view, uint64_t LoaderRule::*> kRuleSizes[] = {
    {"vocab_size", &LoaderRule::vocab_size}, {"pad_to", &LoaderRule::pad_to}};

// Set the member of `rule` named `field` from `value`; false for an unknown field.
template <typename T, size_t N>
bool SetRuleField(const std::pair<std::string_view, T LoaderRule::*> (&fields)[N],
                  std::string_view field, const py::handle& value, LoaderRule& rule) {
  for (const auto& [name, member] : fields) {
    if (name == field) {
      rule.*member = value.cast<T>();
      return true;
    }
  }
  return false;
}

LoaderRule LoaderRuleFromDict(const py::dict& dict, size_t index) {
  LoaderRule rule;
  for (const auto& [key, value] : dict) {
    const std::string field = key.cast<std::string>();
    if (field == "kind") {
      rule.kind = Unwrap(ParseLoaderKind(value.cast<std::string>()));
    } else if (field == "experts") {
      rule.experts = value.cast<std::vector<uint32_t>>();
    } else if (!SetRuleField(kRuleTexts, field, value, rule) &&
               !SetRuleField(kRuleCounts, field, value, rule) &&
               !SetRuleField(kRuleSizes, field, value, rule)) {
      Throw(InvalidArgument(
          "loader rule {}: unknown key '{}'; known keys: kind, match, to, q, k, v, gate, up, "
          "num_heads, num_kv_heads, vocab_size, pad_to, expert_group, num_experts, experts, "
          "expert_tp_rank, expert_tp_size",
          index, field));
    }
  }
  return rule;
}

LoaderSpec LoaderSpecFromDict(const py::dict& spec) {
  LoaderSpec out;
  for (const auto& [key, value] : spec) {
    const std::string name = key.cast<std::string>();
    if (name == "tp_rank") {
      out.tp_rank = value.cast<uint32_t>();
    } else if (name == "tp_size") {
      out.tp_size = value.cast<uint32_t>();
    } else if (name == "rules") {
      for (const py::handle& item : value) {
        out.rules.push_back(LoaderRuleFromDict(item.cast<py::dict>(), out.rules.size()));
      }
    } else {
      Throw(InvalidArgument("loader: unknown key '{}'; known keys: tp_rank, tp_size, rules", name));
    }
  }
  return out;
}

py::dict LoaderSpecToDict(const LoaderSpec& spec) {
  py::list rules;
  for (const LoaderRule& rule : spec.rules) {
    py::dict out;
    out["kind"] = std::string(LoaderKindName(rule.kind));
    for (const auto& [key, member] : kRuleTexts) {
      if (!(rule.*member).empty()) out[py::str(std::string(key))] = rule.*member;
    }
    if (rule.kind == LoaderKind::kQkv || rule.kind == LoaderKind::kQkvInterleaved) {
      out["num_heads"] = rule.num_heads;
      out["num_kv_heads"] = rule.num_kv_heads;
    }
    if (rule.kind == LoaderKind::kVocab) {
      out["vocab_size"] = rule.vocab_size;
      out["pad_to"] = rule.pad_to;
    }
    if (rule.expert_group != 0) out["expert_group"] = rule.expert_group;
    if (rule.num_experts != 0) out["num_experts"] = rule.num_experts;
    if (!rule.experts.empty()) out["experts"] = rule.experts;
    if (rule.expert_tp_size != 0) {
      out["expert_tp_rank"] = rule.expert_tp_rank;
      out["expert_tp_size"] = rule.expert_tp_size;
    }
    rules.append(out);
  }
  py::dict out;
  out["tp_rank"] = spec.tp_rank;
  out["tp_size"] = spec.tp_size;
  out["rules"] = rules;
  return out;
}

// ---- Producer layouts (dicts) -------------------------------------------------------------------

// A piece dict: tensor, dtype, shape, offset, extent; local (default: the tensor's name),
// local_offset (default: zeros) and local_shape (default: the extent), as refit.layout writes it.
LayoutPiece LayoutPieceFromDict(const py::dict& dict, size_t rank, size_t index) {
  LayoutPiece piece;
  bool has_local = false;
  bool has_local_shape = false;
  bool has_local_offset = false;
  for (const auto& [key, value] : dict) {
    const std::string field = key.cast<std::string>();
    if (field == "tensor") {
      piece.tensor = value.cast<std::string>();
    } else if (field == "dtype") {
      piece.dtype = Unwrap(ParseDType(value.cast<std::string>()));
    } else if (field == "shape") {
      piece.shape = value.cast<std::vector<int64_t>>();
    } else if (field == "offset") {
      piece.offset = value.cast<std::vector<int64_t>>();
    } else if (field == "extent") {
      piece.extent = value.cast<std::vector<int64_t>>();
    } else if (field == "local") {
      piece.local = value.cast<std::string>();
      has_local = true;
    } else if (field == "local_shape") {
      piece.local_shape = value.cast<std::vector<int64_t>>();
      has_local_shape = true;
    } else if (field == "local_offset") {
      piece.local_offset = value.cast<std::vector<int64_t>>();
      has_local_offset = true;
    } else {
      Throw(InvalidArgument(
          "rank {} piece {}: unknown key '{}'; known keys: tensor, dtype, shape, offset, extent, "
          "local, local_shape, local_offset",
          rank, index, field));
    }
  }
  if (!has_local) piece.local = piece.tensor;
  if (!has_local_shape) piece.local_shape = Shape(piece.extent.begin(), piece.extent.end());
  if (!has_local_offset) piece.local_offset.assign(piece.extent.size(), 0);
  return piece;
}

py::dict LayoutPieceToDict(const LayoutPiece& piece) {
  py::dict out;
  out["tensor"] = piece.tensor;
  out["dtype"] = std::string(DTypeName(piece.dtype));
  out["shape"] = std::vector<int64_t>(piece.shape.begin(), piece.shape.end());
  out["offset"] = piece.offset;
  out["extent"] = piece.extent;
  out["local"] = piece.local;
  out["local_shape"] = std::vector<int64_t>(piece.local_shape.begin(), piece.local_shape.end());
  out["local_offset"] = piece.local_offset;
  return out;
}

py::dict LayoutPlanToDict(const LayoutPlan& plan) {
  py::list tensors;
  for (const PlannedTensor& tensor : plan.tensors) {
    py::list boxes;
    for (const PlannedBox& box : tensor.boxes) {
      py::dict out;
      out["offset"] = box.offset;
      out["extent"] = box.extent;
      out["sender"] = box.sender;
      out["copies"] = box.copies;
      boxes.append(out);
    }
    py::dict out;
    out["name"] = tensor.name;
    out["dtype"] = std::string(DTypeName(tensor.dtype));
    out["shape"] = std::vector<int64_t>(tensor.shape.begin(), tensor.shape.end());
    out["boxes"] = boxes;
    tensors.append(out);
  }
  py::list roles;
  for (const std::vector<PieceRole>& rank : plan.roles) {
    py::list out;
    for (PieceRole role : rank) {
      out.append(role == PieceRole::kSend ? "send" : role == PieceRole::kCopy ? "copy" : "empty");
    }
    roles.append(out);
  }
  py::dict out;
  out["tensors"] = tensors;
  out["roles"] = roles;
  return out;
}

// ---- Reports ------------------------------------------------------------------------------------

py::dict StatusToDict(const ReceiverStatus& status) {
  py::dict out;
  out["state"] = std::string(ReceiverStateName(status.state));
  out["version"] = status.version;
  out["transfer_id"] = status.transfer_id.has_value()
                           ? py::object(py::str(status.transfer_id->ToHex()))
                           : py::object(py::none());
  out["base_version"] = status.base_version;
  out["target_version"] = status.target_version;
  out["staged_payloads"] = status.staged_payloads;
  out["applied_payloads"] = status.applied_payloads;
  out["queued_payloads"] = status.queued_payloads;
  out["undo_bytes"] = status.undo_bytes;
  out["received_payloads"] = status.received_payloads;
  out["received_bytes"] = status.received_bytes;
  out["device_to_bytes"] = status.device_to_bytes;
  out["device_from_bytes"] = status.device_from_bytes;
  out["needs_anchor"] = status.needs_anchor;
  out["run_id"] = status.lineage.run_id.empty() ? py::object(py::none())
                                                : py::object(py::str(status.lineage.run_id));
  out["epoch"] = status.lineage.epoch;
  out["fingerprint"] =
      status.lineage.fingerprint == 0
          ? py::object(py::none())
          : py::object(py::str(fmt::format("{:016x}", status.lineage.fingerprint)));
  out["last_error"] = status.last_error.ok() ? py::object(py::none())
                                             : py::object(py::str(status.last_error.ToString()));
  return out;
}

// Readiness (refit/readiness.h) as ReceiverStatus's fields in Python.
void PutReadiness(const Readiness& readiness, py::dict& out) {
  out["ready"] = readiness.ready;
  out["ready_reason"] = std::string(ReadinessReasonName(readiness.reason));
  out["ready_detail"] = readiness.detail;
  out["fleet_version"] = readiness.fleet_version.has_value()
                             ? py::object(py::int_(*readiness.fleet_version))
                             : py::object(py::none());
  out["last_catch_up"] =
      readiness.last_catch_up.has_value()
          ? py::object(py::str(std::string(CatchUpName(*readiness.last_catch_up))))
          : py::object(py::none());
  out["publisher_url"] = readiness.publisher_url;
}

py::dict MembershipToDict(const FleetMembership& membership) {
  py::dict out;
  out["fleet_version"] = membership.fleet_version.has_value()
                             ? py::object(py::int_(*membership.fleet_version))
                             : py::object(py::none());
  py::list members;
  for (const MemberStanding& member : membership.members) {
    py::dict one;
    one["control_url"] = member.endpoint.control_url;
    one["data_endpoint"] = member.endpoint.data_endpoint;
    one["joined"] = member.joined;
    one["missed_syncs"] = member.missed_syncs;
    one["version"] =
        member.version.has_value() ? py::object(py::int_(*member.version)) : py::object(py::none());
    one["held_version"] = member.held_version;
    one["lag"] = member.lag;
    one["caught_up_by"] = member.caught_up_by.has_value()
                              ? py::object(py::str(std::string(CatchUpName(*member.caught_up_by))))
                              : py::object(py::none());
    one["wire_bytes"] = member.wire_bytes;
    one["fenced"] = member.fenced;
    members.append(std::move(one));
  }
  out["members"] = members;
  return out;
}

py::dict SyncReportToDict(const SyncReport& sync) {
  const RefitReport& report = sync.transfer;
  py::dict out;
  out["transfer_id"] = report.plan.transfer_id.ToHex();
  out["anchor"] = report.plan.anchor;
  out["base_version"] = report.plan.base_version;
  out["version"] = report.plan.target_version;
  out["payloads"] = report.payloads;
  out["wire_bytes"] = report.wire_bytes;
  out["changed_elements"] = report.changed_elements;
  out["total_elements"] = report.total_elements;
  out["prepare_s"] = report.prepare_s;
  out["stream_s"] = report.stream_s;
  out["flush_s"] = report.flush_s;
  out["commit_s"] = report.commit_s;
  out["seconds"] = report.total_s;
  out["rank"] = sync.rank;
  out["world_size"] = sync.world_size;
  py::list receivers;
  for (const ReceiverOutcome& receiver : report.receivers) receivers.append(receiver.name);
  out["receivers"] = receivers;
  // How each receiver reached the version (docs/protocol.md "Per-receiver plans").
  py::list catch_ups;
  for (const ReceiverOutcome& receiver : report.receivers) {
    py::dict one;
    one["name"] = receiver.name;
    one["held_version"] = receiver.held_version;
    one["lag"] = receiver.lag;
    one["caught_up_by"] = std::string(CatchUpName(receiver.caught_up_by));
    one["wire_bytes"] = receiver.wire_bytes;
    // Fenced under a quorum commit policy: it did not commit, and why (docs/protocol.md
    // "Stragglers and quorum").
    one["fenced"] = receiver.fenced;
    one["fenced_because"] =
        receiver.fenced ? py::object(py::str(receiver.fenced_because.ToString())) : py::none();
    catch_ups.append(std::move(one));
  }
  out["catch_ups"] = catch_ups;
  py::list fenced;
  for (const std::string& name : report.fenced) fenced.append(name);
  out["fenced"] = fenced;
  out["staged_bytes"] = sync.staging.staged_bytes;
  out["staging_budget_bytes"] = sync.staging.budget_bytes;
  out["staging_peak_bytes"] = sync.staging.peak_held_bytes;
  out["unreachable"] = py::tuple(py::cast(sync.unreachable));
  out["dropped"] = py::tuple(py::cast(sync.dropped));
  return out;
}

// ---- Producer groups
// ------------------------------------------------------------------------------

// A producer group as Python holds it before a Publisher takes it over.
struct GroupHandle {
  std::unique_ptr<ProducerGroup> group;

  ProducerGroup& get() const {
    if (group == nullptr) {
      Throw(FailedPrecondition("this producer group belongs to a Publisher already"));
    }
    return *group;
  }
};

// A ProducerGroup whose two collectives are Python callables (refit.torch.TorchGroup wraps
// torch.distributed this way): broadcast(message: bytes | None, timeout_s: float) -> bytes and
// gather(message: bytes, timeout_s: float) -> list[bytes] | None. A callable that raises fails
// the collective: TimeoutError as DeadlineExceeded, a refit.Error as its code, anything else as
// Unavailable, each naming the rank and the collective.
class CallbackGroup final : public ProducerGroup {
 public:
  CallbackGroup(uint32_t rank, uint32_t world_size, py::function broadcast, py::function gather)
      : rank_(rank),
        world_size_(world_size),
        broadcast_(Hold(std::move(broadcast))),
        gather_(Hold(std::move(gather))) {}

  uint32_t rank() const override { return rank_; }
  uint32_t world_size() const override { return world_size_; }

  Result<std::string> Broadcast(std::string message, GroupClock::time_point deadline) override {
    py::gil_scoped_acquire gil;
    Result<py::object> reply =
        Call(*broadcast_, "broadcast",
             rank_ == 0 ? py::object(py::bytes(message)) : py::object(py::none()), deadline);
    if (!reply.ok()) return reply.status();
    try {
      return reply->cast<std::string>();
    } catch (const py::cast_error&) {
      return InvalidArgument("rank {}: broadcast returned {}, not bytes", rank_,
                             py::repr(*reply).cast<std::string>());
    }
  }

  Result<std::vector<std::string>> Gather(std::string message,
                                          GroupClock::time_point deadline) override {
    py::gil_scoped_acquire gil;
    Result<py::object> reply = Call(*gather_, "gather", py::bytes(message), deadline);
    if (!reply.ok()) return reply.status();
    if (rank_ != 0 || reply->is_none()) return std::vector<std::string>();
    try {
      auto messages = reply->cast<std::vector<std::string>>();
      if (messages.size() != world_size_) {
        return InvalidArgument("rank 0: gather returned {} messages for {} ranks", messages.size(),
                               world_size_);
      }
      return messages;
    } catch (const py::cast_error&) {
      return InvalidArgument("rank 0: gather returned {}, not a list of bytes",
                             py::repr(*reply).cast<std::string>());
    }
  }

 private:
  Result<py::object> Call(const py::object& fn, std::string_view what, py::object message,
                          GroupClock::time_point deadline) {
    const double timeout_s =
        std::max(0.0, std::chrono::duration<double>(deadline - GroupClock::now()).count());
    try {
      return fn(message, timeout_s);
    } catch (py::error_already_set& error) {
      const std::string text =
          fmt::format("rank {} of {}: {} failed: {}", rank_, world_size_, what, error.what());
      if (error.matches(PyExc_TimeoutError)) return DeadlineExceeded("{}", text);
      py::object code = py::module_::import("refit.errors").attr("code_of")(error.value());
      if (!code.is_none()) {
        if (std::optional<StatusCode> parsed = StatusCodeFromName(code.cast<std::string>())) {
          return Status(*parsed, text);
        }
      }
      return Unavailable("{}", text);
    }
  }

  uint32_t rank_;
  uint32_t world_size_;
  HeldObject broadcast_;
  HeldObject gather_;
};

// ---- Device boundary ----------------------------------------------------------------------------

// A TensorMemory implemented in Python (refit.torch's torch backend): each operation calls the
// subclass's method of the same name with memoryviews of the core's buffers, under the GIL (the
// applier calls from its own threads). Positions go as packed little-endian integers: int32 when
// the tensor has fewer than 2^31 elements, int64 otherwise (the boundary's contract), so that the
// backend sends the device exactly what the traffic counts. A Python exception becomes an
// IoError naming the tensor's memory and the operation.
class PyTensorMemory : public TensorMemory {
 public:
  PyTensorMemory(uint64_t size_bytes, std::string description)
      : TensorMemory(size_bytes, std::move(description)) {}

 protected:
  Status DoGather(std::span<const uint64_t> positions, uint32_t width,
                  std::span<std::byte> out) override {
    py::gil_scoped_acquire gil;
    return Call("gather", [&](const py::function& method) {
      method(Positions(positions, width), width, Writable(out));
    });
  }
  Status DoScatter(std::span<const uint64_t> positions, uint32_t width,
                   std::span<const std::byte> bits, bool same_positions) override {
    py::gil_scoped_acquire gil;
    return Call("scatter", [&](const py::function& method) {
      method(same_positions ? py::object(py::none()) : Positions(positions, width), width,
             Readable(bits));
    });
  }
  Status DoRead(uint64_t offset, std::span<std::byte> out) override {
    py::gil_scoped_acquire gil;
    return Call("read", [&](const py::function& method) { method(offset, Writable(out)); });
  }
  Status DoWrite(uint64_t offset, std::span<const std::byte> bytes) override {
    py::gil_scoped_acquire gil;
    return Call("write", [&](const py::function& method) { method(offset, Readable(bytes)); });
  }
  Status DoSynchronize() override {
    py::gil_scoped_acquire gil;
    return Call("synchronize", [](const py::function& method) { method(); });
  }

 private:
  template <typename Invoke>
  Status Call(const char* name, Invoke&& invoke) {
    try {
      py::function method = py::get_override(static_cast<const TensorMemory*>(this), name);
      if (!method) return Internal("{}: the backend has no method '{}'", description(), name);
      invoke(method);
      return Status::OK();
    } catch (py::error_already_set& error) {
      return IoError("{}: {} failed: {}", description(), name, error.what());
    }
  }
  // Views the backend only reads are passed writable too: torch.frombuffer warns on read-only
  // buffers, and the backend copies out of them before returning.
  static py::memoryview Readable(std::span<const std::byte> bytes) {
    return py::memoryview::from_memory(const_cast<std::byte*>(bytes.data()),
                                       static_cast<py::ssize_t>(bytes.size()), false);
  }
  static py::memoryview Writable(std::span<std::byte> bytes) {
    return py::memoryview::from_memory(bytes.data(), static_cast<py::ssize_t>(bytes.size()), false);
  }
  py::memoryview Positions(std::span<const uint64_t> positions, uint32_t width) {
    if (size_bytes() / width <= static_cast<uint64_t>(INT32_MAX)) {
      narrow_.assign(positions.begin(), positions.end());
      return Readable(std::as_bytes(std::span<const int32_t>(narrow_)));
    }
    return Readable(std::as_bytes(positions));
  }

  std::vector<int32_t> narrow_;
};

py::dict TrafficToDict(const BoundaryTraffic& traffic) {
  py::dict out;
  out["to_device_bytes"] = traffic.to_device_bytes;
  out["from_device_bytes"] = traffic.from_device_bytes;
  out["calls"] = traffic.calls;
  return out;
}

// ---- Receiver
// -------------------------------------------------------------------------------------

// A ReceiverNode and the Python buffers it applies into (kept alive as long as the node).
class PyReceiver {
 public:
  PyReceiver(ReceiverNodeOptions options, const py::object& before_first_apply,
             const py::object& after_commit, const py::object& after_abort) {
    if (!before_first_apply.is_none()) {
      HeldObject hook = Hold(before_first_apply);
      options.session.before_first_apply = [hook](const TransferId& id) {
        CallHook(hook, id.ToHex());
      };
    }
    if (!after_commit.is_none()) {
      HeldObject hook = Hold(after_commit);
      options.session.after_commit = [hook](const TransferId& id, uint64_t version) {
        CallHook(hook, id.ToHex(), version);
      };
    }
    if (!after_abort.is_none()) {
      HeldObject hook = Hold(after_abort);
      options.session.after_abort = [hook](const TransferId& id, uint64_t version) {
        CallHook(hook, id.ToHex(), version);
      };
    }
    py::gil_scoped_release release;
    node_ = Unwrap(ReceiverNode::Make(options));
  }

  ~PyReceiver() {
    // Stopping joins threads that may be waiting for the GIL in a hook.
    py::gil_scoped_release release;
    node_.reset();
  }

  void Register(const py::tuple& tensor) {
    BufferTensor buffer = ToBufferTensor(tensor, /*writable=*/true);
    const TensorView view = ViewOf(buffer);
    MutableTensorView target{view.name, view.dtype, view.shape, BytesOf(buffer)};
    {
      py::gil_scoped_release release;
      Check(node_->RegisterTensor(target));
    }
    buffers_.push_back(std::move(buffer));
  }

  // The tensor's Python backend object is kept alive as long as the node (which holds its C++
  // part).
  void RegisterDevice(const std::string& name, const std::string& dtype,
                      const std::vector<int64_t>& shape, const py::object& memory) {
    auto held = memory.cast<std::shared_ptr<TensorMemory>>();
    Check(node_->RegisterDeviceTensor(name, Unwrap(ParseDType(dtype)),
                                      Shape(shape.begin(), shape.end()), std::move(held)));
    device_memories_.push_back(memory);
  }

  void Start() {
    py::gil_scoped_release release;
    Check(node_->Start());
  }

  void Stop() {
    py::gil_scoped_release release;
    node_->Stop();
  }

  // Wait until the committed version is at least `version`: in 5 ms slices without the GIL,
  // checking for Ctrl-C between them. Returns the version held; DeadlineExceeded after
  // `timeout_s` (negative: no limit).
  uint64_t WaitForVersion(uint64_t version, double timeout_s) {
    const auto start = std::chrono::steady_clock::now();
    while (true) {
      uint64_t held = 0;
      {
        py::gil_scoped_release release;
        for (int slice = 0; slice < 10; ++slice) {
          held = node_->status().version;
          if (held >= version) break;
          std::this_thread::sleep_for(5ms);
        }
      }
      if (held >= version) return held;
      if (PyErr_CheckSignals() != 0) throw py::error_already_set();
      const double waited =
          std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
      if (timeout_s >= 0 && waited > timeout_s) {
        Throw(DeadlineExceeded(
            "receiver {}: still at version {} after {:.1f} s of waiting for version {}",
            node_->control_url(), held, waited, version));
      }
    }
  }

  ReceiverNode& node() { return *node_; }

 private:
  std::unique_ptr<ReceiverNode> node_;
  std::vector<BufferTensor> buffers_;
  // The Python backends of device tensors (released after the node, under the GIL).
  std::vector<py::object> device_memories_;
};

// ---- Configuration ------------------------------------------------------------------------------

// A configuration file as Python holds it: its text, read again with each object's keywords on
// top (config::ParseConfig's one merge rule), and what it parses to alone (Config's properties).
struct LoadedConfig {
  std::string text;
  std::string source;
  config::RefitConfig parsed;
};

// One keyword's value as the configuration layer takes it: text, a list of strings, or the
// receivers as (control, data) pairs.
config::ConfigValue ConfigValueFrom(const py::handle& value) {
  if (py::isinstance<py::str>(value)) return value.cast<std::string>();
  std::vector<std::string> strings;
  std::vector<config::ReceiverConfig> receivers;
  for (const py::handle& element : value.cast<py::list>()) {
    if (py::isinstance<py::str>(element)) {
      strings.push_back(element.cast<std::string>());
    } else {
      const auto [control, data] = element.cast<std::pair<std::string, std::string>>();
      receivers.push_back({control, data});
    }
  }
  if (!strings.empty() && !receivers.empty()) {
    Throw(InvalidArgument("a configuration value mixes strings and (control, data) pairs"));
  }
  if (!receivers.empty()) return receivers;
  return strings;
}

// The configuration (the file's, or the defaults) with `overrides`, a list of (key path, value,
// origin) from the Python keywords, on top.
config::RefitConfig ResolveConfig(const std::optional<LoadedConfig>& file,
                                  const py::list& overrides) {
  std::vector<config::ConfigOverride> entries;
  for (const py::handle& entry : overrides) {
    const auto tuple = entry.cast<py::tuple>();
    entries.push_back(
        {tuple[0].cast<std::string>(), ConfigValueFrom(tuple[1]), tuple[2].cast<std::string>()});
  }
  if (!file.has_value()) return Unwrap(config::LoadConfigFile("", entries));
  return Unwrap(config::ParseConfig(file->text, file->source, entries));
}

ReceiverNodeOptions ReceiverOptionsFrom(
    const std::optional<LoadedConfig>& file, const py::list& overrides,
    std::optional<uint64_t> version, const std::optional<py::dict>& loader,
    std::optional<uint32_t> shard, const std::string& data_endpoint, const std::string& data_bind,
    const std::vector<std::string>& peers, const std::optional<std::string>& api_key) {
  ReceiverNodeOptions options =
      Unwrap(config::ToReceiverNodeOptions(ResolveConfig(file, overrides)));
  options.version = version;
  if (loader.has_value()) options.loader = LoaderSpecFromDict(*loader);
  if (shard.has_value()) options.place.shard = *shard;
  if (options.loader.has_value() && options.loader->tp_size > 1) {
    options.place.shards = options.loader->tp_size;
    if (!shard.has_value()) options.place.shard = options.loader->tp_rank;
  }
  options.data_endpoint = data_endpoint;
  options.data_bind_address = data_bind;
  options.peers = peers;
  if (api_key.has_value()) options.control.api_key = *api_key;
  return options;
}

// ---- Publisher
// ------------------------------------------------------------------------------------

class PyPublisher {
 public:
  PyPublisher(PublisherOptions options, GroupHandle& group) {
    std::unique_ptr<ProducerGroup> owned = std::move(group.group);
    if (owned == nullptr)
      Throw(FailedPrecondition("this producer group belongs to a Publisher already"));
    py::gil_scoped_release release;
    publisher_ = Unwrap(Publisher::Make(options, std::move(owned)));
  }

  ~PyPublisher() {
    py::gil_scoped_release release;
    publisher_.reset();
  }

  void AdoptBaseline(const py::list& tensors, std::optional<uint64_t> version) {
    ExportTensors exported = ToExportTensors(tensors);
    py::gil_scoped_release release;
    Check(publisher_->AdoptBaseline(std::span<const ExportTensor>(exported.tensors), version));
  }

  // A sharded rank's adoption: its pieces and local tensors, as SyncSharded takes them.
  void AdoptBaselineSharded(const py::list& pieces, const py::list& locals,
                            std::optional<uint64_t> version) {
    ShardedModel model;
    for (const py::handle& piece : pieces) {
      model.layout.pieces.push_back(LayoutPieceFromDict(piece.cast<py::dict>(), publisher_->rank(),
                                                        model.layout.pieces.size()));
    }
    ExportTensors exported = ToExportTensors(locals);
    model.locals = exported.tensors;
    py::gil_scoped_release release;
    Check(publisher_->AdoptBaseline(model, version));
  }

  py::dict Sync(const py::list& tensors, bool force_anchor) {
    ExportTensors exported = ToExportTensors(tensors);
    Publisher* publisher = publisher_.get();
    Result<SyncReport> synced = RunInterruptible<Result<SyncReport>>(
        [publisher, &exported, force_anchor] {
          return publisher->Sync(exported.tensors, force_anchor);
        },
        [publisher] { publisher->Cancel(); });
    return SyncReportToDict(Unwrap(std::move(synced)));
  }

  // A sharded rank's sync: its pieces (dicts, as plan_layouts takes them) and the local tensors
  // they name.
  py::dict SyncSharded(const py::list& pieces, const py::list& locals, bool force_anchor) {
    ShardedModel model;
    for (const py::handle& piece : pieces) {
      model.layout.pieces.push_back(LayoutPieceFromDict(piece.cast<py::dict>(), publisher_->rank(),
                                                        model.layout.pieces.size()));
    }
    ExportTensors exported = ToExportTensors(locals);
    model.locals = exported.tensors;
    Publisher* publisher = publisher_.get();
    Result<SyncReport> synced = RunInterruptible<Result<SyncReport>>(
        [publisher, &model, force_anchor] { return publisher->Sync(model, force_anchor); },
        [publisher] { publisher->Cancel(); });
    return SyncReportToDict(Unwrap(std::move(synced)));
  }

  Publisher& get() { return *publisher_; }

 private:
  std::unique_ptr<Publisher> publisher_;
};

std::vector<PublisherReceiver> ReceiversFrom(
    const std::vector<std::pair<std::string, std::string>>& receivers) {
  std::vector<PublisherReceiver> out;
  for (const auto& [control, data] : receivers) out.push_back({control, data});
  return out;
}

PublisherOptions PublisherOptionsFrom(const std::optional<LoadedConfig>& file,
                                      const py::list& overrides,
                                      const std::optional<std::string>& api_key,
                                      double transfer_timeout_s,
                                      std::optional<uint64_t> staging_bytes,
                                      const std::optional<std::string>& run_id, bool resume) {
  PublisherOptions options = Unwrap(config::ToPublisherOptions(ResolveConfig(file, overrides)));
  if (api_key.has_value()) options.control.api_key = *api_key;
  if (!(transfer_timeout_s > 0)) {
    Throw(InvalidArgument("transfer_timeout must be positive, got {} s", transfer_timeout_s));
  }
  options.transfer_timeout =
      std::chrono::milliseconds(static_cast<int64_t>(transfer_timeout_s * 1000.0 + 0.5));
  if (staging_bytes.has_value()) options.staging_bytes = *staging_bytes;
  if (run_id.has_value()) options.run_id = *run_id;
  options.resume = resume;
  return options;
}

}  // namespace
}  // namespace refit::python

PYBIND11_MODULE(_core, m) {
  using namespace refit;
  using namespace refit::python;
  m.doc() =
      "refit's C++ core: ReceiverNode, Publisher, producer groups, loader specs and the "
      "configuration file. Use the refit package, not this module.";
  m.attr("__version__") = std::string(refit::VersionString());

  py::register_exception_translator([](std::exception_ptr pointer) {
    try {
      if (pointer) std::rethrow_exception(pointer);
    } catch (const StatusError& error) {
      RaiseStatus(error.status);
    }
  });

  m.def(
      "set_log_level", [](const std::string& level) { Check(SetLogLevel(level)); },
      py::arg("level"),
      "Set refit's log level (trace, debug, info, warn, error, critical, off); the default comes "
      "from the environment variable REFIT_LOG_LEVEL, else info.");
  m.def(
      "log_level", [] { return std::string(CurrentLogLevel()); }, "refit's current log level.");
  m.def(
      "parse_dtype",
      [](const std::string& text) { return std::string(DTypeName(Unwrap(ParseDType(text)))); },
      py::arg("text"), "The canonical name of a dtype name or alias; InvalidArgument otherwise.");

  m.def(
      "loader_from_yaml",
      [](const std::string& text, const std::string& source) {
        return LoaderSpecToDict(Unwrap(LoaderSpecFromYaml(text, source)));
      },
      py::arg("text"), py::arg("source") = "<string>",
      "Parse a loader spec from YAML text into {tp_rank, tp_size, rules}.");
  m.def(
      "loader_from_file",
      [](const std::string& path) {
        return LoaderSpecToDict(Unwrap(LoaderSpecFromYamlFile(path)));
      },
      py::arg("path"), "Read a loader spec YAML file into {tp_rank, tp_size, rules}.");
  m.def(
      "compare_target", [] { return std::string(BestCompareTarget()); },
      "The SIMD target the bitwise compare dispatches to on this CPU (e.g. AVX3, AVX2).");
  m.def(
      "plan_layouts",
      [](const py::list& ranks) {
        std::vector<ProducerLayout> layouts;
        for (const py::handle& rank : ranks) {
          ProducerLayout layout;
          for (const py::handle& piece : rank) {
            layout.pieces.push_back(
                LayoutPieceFromDict(piece.cast<py::dict>(), layouts.size(), layout.pieces.size()));
          }
          layouts.push_back(std::move(layout));
        }
        return LayoutPlanToDict(Unwrap(PlanLayouts(layouts)));
      },
      py::arg("layouts"),
      "Plan a sharded transfer from every rank's pieces (layouts[r]: rank r's list of piece "
      "dicts): {tensors: [{name, dtype, shape, boxes: [{offset, extent, sender, copies}]}], "
      "roles: [[send|copy|empty per piece] per rank]}. InvalidArgument names the tensor, box and "
      "ranks of a gap, an overlap or a disagreement.");
  m.def(
      "layout_from_loader",
      [](const py::dict& spec, const py::list& locals, const std::vector<std::string>& names) {
        // Only names, dtypes and shapes cross: the tensors may live on any device.
        std::vector<TensorView> views;
        for (const py::handle& local : locals) {
          const auto [name, dtype, shape] =
              local.cast<std::tuple<std::string, std::string, std::vector<int64_t>>>();
          views.push_back(
              TensorView{name, Unwrap(ParseDType(dtype)), Shape(shape.begin(), shape.end()), {}});
        }
        const ProducerLayout layout =
            Unwrap(ProducerLayoutFromLoader(LoaderSpecFromDict(spec), views, names));
        py::list out;
        for (const LayoutPiece& piece : layout.pieces) out.append(LayoutPieceToDict(piece));
        return out;
      },
      py::arg("spec"), py::arg("locals"), py::arg("canonical_names"),
      "A rank's pieces from a loader dict, its local tensors as (name, dtype, shape) and the "
      "canonical tensors it holds.");
  m.def(
      "check_loader",
      [](const py::dict& dict) {
        const LoaderSpec spec = LoaderSpecFromDict(dict);
        // The rules' own checks (patterns, parameters, TP coordinates) need no tensors: refuse a
        // spec here, where the user wrote it, not when a receiver attaches it.
        const std::unique_ptr<WeightStore> empty = WeightStore::Make();
        Unwrap(Loader::Make(spec, *empty));
        return LoaderSpecToDict(spec);
      },
      py::arg("spec"), "Validate a loader dict and return it normalised.");

  py::class_<LoadedConfig>(m, "Config",
                           "A refit configuration file (the YAML `refit push` and `refit serve` "
                           "read; docs/configuration.md lists every key).")
      .def_static(
          "load",
          [](const std::string& path) {
            std::string text = Unwrap(config::ReadConfigFile(path));
            config::RefitConfig parsed = Unwrap(config::ParseConfig(text, path));
            return LoadedConfig{std::move(text), path, std::move(parsed)};
          },
          py::arg("path"), "Read and validate the configuration file at `path`.")
      .def_static(
          "parse",
          [](const std::string& text, const std::string& source) {
            return LoadedConfig{text, source, Unwrap(config::ParseConfig(text, source))};
          },
          py::arg("text"), py::arg("source") = "<string>",
          "Parse configuration YAML text; `source` prefixes error messages.")
      .def_property_readonly(
          "transport", [](const LoadedConfig& c) { return c.parsed.transport; },
          "The transport URI.")
      .def_property_readonly(
          "receivers",
          [](const LoadedConfig& c) {
            std::vector<std::pair<std::string, std::string>> out;
            for (const config::ReceiverConfig& r : c.parsed.receivers) {
              out.emplace_back(r.control, r.data);
            }
            return out;
          },
          "The fleet: (control URL, data endpoint) per receiver, in tree order.")
      .def_property_readonly(
          "api_key_env", [](const LoadedConfig& c) { return c.parsed.http_refit_api_key_env_var; },
          "The environment variable holding the shared API key ('' = none).")
      .def_property_readonly(
          "control_port", [](const LoadedConfig& c) { return c.parsed.http_refit_server_port; },
          "The control plane's port (0 = any free one).")
      .def_property_readonly(
          "data_port", [](const LoadedConfig& c) { return c.parsed.zmq_refit_server_port; },
          "The ZeroMQ data port of `refit serve`.")
      .def_property_readonly(
          "model", [](const LoadedConfig& c) { return c.parsed.server.model; },
          "server.model: the safetensors file a receiver serves ('' = none).")
      .def_property_readonly(
          "bind", [](const LoadedConfig& c) { return c.parsed.server.bind; },
          "server.bind: the address a receiver listens on.")
      .def_property_readonly(
          "export_chunk_bytes",
          [](const LoadedConfig& c) { return c.parsed.delta_compression.export_chunk_bytes; },
          "delta_compression.export_chunk_bytes.")
      .def_property_readonly(
          "full_sync_interval",
          [](const LoadedConfig& c) { return c.parsed.delta_compression.full_sync_interval; },
          "delta_compression.full_sync_interval.");

  py::class_<GroupHandle>(m, "Group",
                          "One rank's endpoint of a producer group, until a Publisher takes it.")
      .def_property_readonly("rank", [](const GroupHandle& g) { return g.get().rank(); })
      .def_property_readonly("world_size",
                             [](const GroupHandle& g) { return g.get().world_size(); })
      .def_property_readonly(
          "port", [](const GroupHandle& g) { return TcpGroupPort(g.get()); },
          "A TCP group's rank 0: the port it listens on; 0 otherwise.");

  m.def(
      "tcp_group",
      [](const std::string& address, uint32_t rank, uint32_t world_size, const std::string& api_key,
         double connect_timeout_s) {
        TcpGroupOptions options;
        options.address = address;
        options.rank = rank;
        options.world_size = world_size;
        options.api_key = api_key;
        options.connect_timeout =
            std::chrono::milliseconds(static_cast<int64_t>(connect_timeout_s * 1000.0));
        py::gil_scoped_release release;
        return GroupHandle{Unwrap(MakeTcpGroup(options))};
      },
      py::arg("address"), py::arg("rank"), py::arg("world_size"), py::arg("api_key") = "",
      py::arg("connect_timeout") = 60.0,
      "This rank's endpoint of a TCP producer group (rank 0 listens on `address`).");
  m.def(
      "callback_group",
      [](uint32_t rank, uint32_t world_size, py::function broadcast, py::function gather) {
        if (world_size == 0 || rank >= world_size) {
          Throw(
              InvalidArgument("callback group: rank {} is not in a group of {}", rank, world_size));
        }
        return GroupHandle{std::make_unique<CallbackGroup>(rank, world_size, std::move(broadcast),
                                                           std::move(gather))};
      },
      py::arg("rank"), py::arg("world_size"), py::arg("broadcast"), py::arg("gather"),
      "A producer group whose broadcast(message|None, timeout_s) -> bytes and "
      "gather(message, timeout_s) -> list[bytes]|None are Python callables.");
  m.def(
      "in_process_group",
      [](uint32_t world_size) {
        std::vector<GroupHandle> out;
        for (auto& group : Unwrap(MakeInProcessGroup(world_size))) {
          out.push_back(GroupHandle{std::move(group)});
        }
        return out;
      },
      py::arg("world_size"), "The W ranks of one group, for threads of one process.");

  py::class_<PyReceiver>(m, "Receiver", "A ReceiverNode embedded in this process.")
      .def(py::init([](const std::optional<LoadedConfig>& config, const py::list& overrides,
                       std::optional<uint64_t> version, const std::optional<py::dict>& loader,
                       std::optional<uint32_t> shard, const std::string& data_endpoint,
                       const std::string& data_bind, const std::vector<std::string>& peers,
                       const std::optional<std::string>& api_key,
                       const py::object& before_first_apply, const py::object& after_commit,
                       const py::object& after_abort) {
             return std::make_unique<PyReceiver>(
                 ReceiverOptionsFrom(config, overrides, version, loader, shard, data_endpoint,
                                     data_bind, peers, api_key),
                 before_first_apply, after_commit, after_abort);
           }),
           py::arg("config"), py::arg("overrides"), py::kw_only(), py::arg("version") = py::none(),
           py::arg("loader") = py::none(), py::arg("shard") = py::none(),
           py::arg("data_endpoint") = "", py::arg("data_bind") = "",
           py::arg("peers") = std::vector<std::string>(), py::arg("api_key") = py::none(),
           py::arg("before_first_apply") = py::none(), py::arg("after_commit") = py::none(),
           py::arg("after_abort") = py::none(),
           "A receiver configured by `config` (a Config or None) with `overrides`, a list of "
           "(key path, value, origin) from the keywords that name configuration keys.")
      .def("register", &PyReceiver::Register, py::arg("tensor"),
           "Register (name, dtype, shape, writable buffer) as a tensor, zero-copy, before start.")
      .def("register_device", &PyReceiver::RegisterDevice, py::arg("name"), py::arg("dtype"),
           py::arg("shape"), py::arg("memory"),
           "Register a tensor in device memory, reached through a TensorMemory backend.")
      .def("start", &PyReceiver::Start)
      .def("stop", &PyReceiver::Stop)
      .def("wait_for_version", &PyReceiver::WaitForVersion, py::arg("version"),
           py::arg("timeout_s") = -1.0)
      .def_property_readonly("control_url", [](PyReceiver& r) { return r.node().control_url(); })
      .def_property_readonly("producer_endpoint",
                             [](PyReceiver& r) { return r.node().producer_endpoint(); })
      .def("status",
           [](PyReceiver& r) {
             ReceiverStatus status;
             Readiness readiness;
             {
               py::gil_scoped_release release;
               status = r.node().status();
               readiness = r.node().readiness();
             }
             py::dict out = StatusToDict(status);
             PutReadiness(readiness, out);
             return out;
           })
      .def("readiness",
           [](PyReceiver& r) {
             Readiness readiness;
             {
               py::gil_scoped_release release;
               readiness = r.node().readiness();
             }
             py::dict out;
             PutReadiness(readiness, out);
             return out;
           })
      .def(
          "join",
          [](PyReceiver& r, const std::string& publisher_url, const std::string& control_url,
             const std::string& data_endpoint) {
            Result<FleetMembership> joined = [&] {
              py::gil_scoped_release release;
              return r.node().Join(publisher_url, MemberEndpoint{control_url, data_endpoint});
            }();
            return MembershipToDict(Unwrap(std::move(joined)));
          },
          py::arg("publisher_url"), py::arg("control_url") = "", py::arg("data_endpoint") = "")
      .def("leave", [](PyReceiver& r) {
        Result<FleetMembership> left = [&] {
          py::gil_scoped_release release;
          return r.node().Leave();
        }();
        return MembershipToDict(Unwrap(std::move(left)));
      });

  py::class_<TensorMemory, PyTensorMemory, std::shared_ptr<TensorMemory>>(
      m, "TensorMemory",
      "A tensor behind refit's device boundary; subclasses implement gather, scatter, read, "
      "write and synchronize (refit.torch.TorchTensorMemory).")
      .def(py::init<uint64_t, std::string>(), py::arg("size_bytes"), py::arg("description"))
      .def_property_readonly("size_bytes", &TensorMemory::size_bytes)
      .def_property_readonly("description", &TensorMemory::description)
      .def("traffic", [](const TensorMemory& memory) { return TrafficToDict(memory.traffic()); });

  py::class_<PyPublisher>(m, "Publisher", "One trainer rank's Publisher.")
      .def(py::init([](GroupHandle& group, const std::optional<LoadedConfig>& config,
                       const py::list& overrides, const std::optional<std::string>& api_key,
                       double transfer_timeout_s, std::optional<uint64_t> staging_bytes,
                       const std::optional<std::string>& run_id, bool resume,
                       const std::optional<std::string>& membership_host,
                       std::optional<uint16_t> membership_port,
                       std::optional<uint32_t> drop_after_missed_syncs) {
             PublisherOptions options = PublisherOptionsFrom(
                 config, overrides, api_key, transfer_timeout_s, staging_bytes, run_id, resume);
             if (membership_port.has_value() || membership_host.has_value()) {
               MembershipOptions membership;
               if (membership_host.has_value()) membership.bind_address = *membership_host;
               if (membership_port.has_value()) membership.port = *membership_port;
               if (drop_after_missed_syncs.has_value()) {
                 membership.drop_after_missed_syncs = *drop_after_missed_syncs;
               }
               options.membership = membership;
             }
             return std::make_unique<PyPublisher>(std::move(options), group);
           }),
           py::arg("group"), py::arg("config"), py::arg("overrides"), py::kw_only(),
           py::arg("api_key") = py::none(), py::arg("transfer_timeout_s") = 600.0,
           py::arg("staging_bytes") = py::none(), py::arg("run_id") = py::none(),
           py::arg("resume") = false, py::arg("membership_host") = py::none(),
           py::arg("membership_port") = py::none(), py::arg("drop_after_missed_syncs") = py::none(),
           "A Publisher configured by `config` (a Config or None) with `overrides`, a list of "
           "(key path, value, origin) from the keywords that name configuration keys.")
      .def("adopt_baseline", &PyPublisher::AdoptBaseline, py::arg("tensors"),
           py::arg("version") = py::none())
      .def("adopt_baseline_sharded", &PyPublisher::AdoptBaselineSharded, py::arg("pieces"),
           py::arg("locals"), py::arg("version") = py::none())
      .def("sync", &PyPublisher::Sync, py::arg("tensors"), py::arg("force_anchor") = false)
      .def("sync_sharded", &PyPublisher::SyncSharded, py::arg("pieces"), py::arg("locals"),
           py::arg("force_anchor") = false)
      .def("set_receivers",
           [](PyPublisher& p, const std::vector<std::pair<std::string, std::string>>& receivers) {
             Check(p.get().SetReceivers(ReceiversFrom(receivers)));
           })
      .def("cancel", [](PyPublisher& p) { p.get().Cancel(); })
      .def_property_readonly("rank", [](PyPublisher& p) { return p.get().rank(); })
      .def_property_readonly("world_size", [](PyPublisher& p) { return p.get().world_size(); })
      .def_property_readonly("version", [](PyPublisher& p) { return p.get().version(); })
      .def_property_readonly("run_id", [](PyPublisher& p) { return p.get().run_id(); })
      .def_property_readonly("epoch", [](PyPublisher& p) { return p.get().epoch(); })
      .def_property_readonly("baseline_bytes",
                             [](PyPublisher& p) { return p.get().baseline_bytes(); })
      .def_property_readonly("membership_url",
                             [](PyPublisher& p) { return p.get().membership_url(); })
      .def("membership",
           [](PyPublisher& p) { return MembershipToDict(Unwrap(p.get().membership())); });
}
