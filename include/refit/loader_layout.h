// A trainer rank's producer layout, described in the loader vocabulary.
//
// A Megatron-style trainer holds plain local tensors in the same layouts an inference engine's
// receiver does: row- and column-parallel slices, fused q/k/v and gate/up, vocabulary-parallel
// embeddings, Megatron-Core's per-query-group interleaved `linear_qkv`, expert stacks. Instead of
// writing its pieces box by box, such a rank states its layout as a loader spec (refit/loader.h)
// and the canonical tensors it holds; ProducerLayoutFromLoader resolves the spec against the
// shapes of its local tensors, as a receiver's loader would, and turns every piece into the N-d
// boxes of refit/producer_layout.h.
#ifndef REFIT_LOADER_LAYOUT_H_
#define REFIT_LOADER_LAYOUT_H_

#include <span>
#include <string>

#include "refit/loader.h"
#include "refit/producer_layout.h"
#include "refit/status.h"
#include "refit/tensor.h"

namespace refit {

/// Return the layout of a rank holding `locals` (only their names, dtypes and shapes are read:
/// their bytes may be empty or device memory), laid out as `spec` maps the canonical tensors
/// `canonical_names` (the ones this rank holds: its pipeline stage's, for instance). A name a
/// skip rule matches contributes nothing. A piece that is a 2-D rectangle of a higher-rank
/// canonical tensor becomes the N-d boxes it is made of; a piece of a 2-D expert matrix in a
/// stack [experts, rows, cols] views the stack as [experts·rows, cols] (LayoutPiece::local_shape).
/// Errors: as Loader::ForShapes and Loader::Resolve (a canonical name no rule maps onto a local
/// tensor, a local shape that does not fit its rule), naming the tensor; InvalidArgument naming
/// a local tensor that no canonical name maps onto (a name missing from `canonical_names`), and
/// as CheckLayout for the result.
Result<ProducerLayout> ProducerLayoutFromLoader(const LoaderSpec& spec,
                                                std::span<const TensorView> locals,
                                                std::span<const std::string> canonical_names);

}  // namespace refit

#endif  // REFIT_LOADER_LAYOUT_H_
