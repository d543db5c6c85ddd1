// ExpandForApply (apply_internal.h): a payload's context-coded items decoded against the bits the
// receiver holds right before they are applied — host tensors read in place, device tensors
// through the device boundary's read (TensorMemory::Read), canonical tensors through the loader
// when one piece holds the whole tensor.
#include <cstring>
#include <span>
#include <string_view>

#include <fmt/format.h>

#include "receiver/apply_internal.h"
#include "refit/loader.h"
#include "refit/status_format.h"

namespace refit::internal {
namespace {

/// Read bytes [offset, offset + out.size()) of local tensor `name`: a device tensor through its
/// boundary in blocks, a host tensor by copy.
Status ReadLocal(const WeightStore& store, std::string_view name, uint64_t offset,
                 std::span<std::byte> out) {
  if (TensorMemory* device = store.DeviceMemory(name); device != nullptr) {
    return ReadDevice(*device, offset, out);
  }
  return store.ReadBytes(name, offset, out);
}

/// The old span of `item`, a tensor of the store itself.
Result<bool> ReadHeldSpan(const WeightStore& store, const ItemView& item,
                          std::span<std::byte> out) {
  REFIT_ASSIGN_OR_RETURN(TensorView tensor, store.Find(item.name));
  if (tensor.dtype != item.dtype || tensor.shape != item.shape) {
    return InvalidArgument("tensor '{}' is {} {} in the payload but {} {} in the receiver's model",
                           item.name, DTypeName(item.dtype), ShapeToString(item.shape),
                           DTypeName(tensor.dtype), ShapeToString(tensor.shape));
  }
  REFIT_RETURN_NOT_OK(ReadLocal(store, item.name, item.span_begin * DTypeSize(item.dtype), out));
  return true;
}

/// The old span of `item`, a canonical tensor mapped by the store's loader. A context-coded item
/// decodes only against every old element of its span, so the receiver must hold the whole
/// tensor in one piece (any layout, e.g. a row range of a fused tensor); a shard holding part of
/// it cannot decode it.
Result<bool> ReadCanonicalSpan(const WeightStore& store, const ItemView& item,
                               std::span<std::byte> out) {
  REFIT_ASSIGN_OR_RETURN(const CanonicalLayout* layout, store.ResolveCanonical(item.name));
  if (layout->skipped || layout->pieces.empty()) return false;  // The applier ignores it.
  if (layout->dtype != item.dtype || layout->shape != item.shape) {
    return InvalidArgument("tensor '{}' is {} {} in the payload but {} {} in the receiver's loader",
                           item.name, DTypeName(item.dtype), ShapeToString(item.shape),
                           DTypeName(layout->dtype), ShapeToString(layout->shape));
  }
  if (!layout->held_whole()) {
    return FailedPrecondition(
        "tensor '{}' is context-coded, but this receiver holds {} piece(s) of it, not the whole "
        "tensor: a context-coded item decodes only against every old element of its span. Have "
        "the producer send it plain (delta_compression.item_coding = plain)",
        item.name, layout->pieces.size());
  }
  const CanonicalPiece& piece = layout->pieces[0];
  const uint32_t width = DTypeSize(item.dtype);
  const uint64_t cols = layout->cols;
  uint64_t element = item.span_begin;
  while (element < item.span_end) {
    const uint64_t row = element / cols;
    const uint64_t col = element % cols;
    const uint64_t run = std::min(cols - col, item.span_end - element);
    const uint64_t local =
        (piece.local_row_offset + row - piece.row_begin) * piece.local_row_length +
        (col - piece.col_begin);
    REFIT_RETURN_NOT_OK(ReadLocal(store, piece.local_tensor, local * width,
                                  out.subspan((element - item.span_begin) * width, run * width)));
    element += run;
  }
  return true;
}

}  // namespace

Result<DecodedPayload> ExpandForApply(const DecodedPayload& payload, const WeightStore& store) {
  const bool through_loader = store.has_loader();
  return ExpandContextItems(payload, [&](const ItemView& item, std::span<std::byte> out) {
    return through_loader ? ReadCanonicalSpan(store, item, out) : ReadHeldSpan(store, item, out);
  });
}

}  // namespace refit::internal
