// What a receiver keeps to undo an anchor if it aborts: its memory policy during a FULL
// (ReceiverSessionOptions::anchor_undo, `refit serve --anchor-undo`, docs/configuration.md).
#pragma once

#include <cstdint>
#include <string_view>

#include "refit/status.h"

namespace refit {

/// What an undo log keeps of the bits a FULL item (an anchor) overwrites. An anchor rewrites the
/// whole model, so its old bits are as large as the model: this is the receiver's memory policy
/// during a FULL (docs/benchmark-results.md has the receiver peaks measured under each policy).
enum class AnchorUndo : uint8_t {
  /// Old bits in memory: the receiver holds about 2× the model during a FULL; an abort restores
  /// the base at memory speed. The default.
  kMemory,
  /// Old bits spilled to a file (UndoLogOptions::spill_directory, unlinked as soon as it is
  /// made): about 1× the model in memory and 1× on disk during a FULL; an abort restores the base
  /// at disk speed.
  kFile,
  /// Nothing kept: about 1× the model during a FULL. An abort after a FULL item was applied
  /// cannot restore the base; the receiver then needs an anchor (ReceiverStatus::needs_anchor)
  /// and refuses deltas until one commits.
  kNone,
};

/// Return "memory", "file" or "none".
std::string_view AnchorUndoName(AnchorUndo policy);
/// Parse AnchorUndoName's spelling. Errors: InvalidArgument naming the value and the choices.
Result<AnchorUndo> ParseAnchorUndo(std::string_view name);

}  // namespace refit
