// A small XML reader and escaper for the documents S3 exchanges: listings, upload ids, error
// replies (read) and CompleteMultipartUpload / CreateBucket bodies (written). S3 uses only a tiny,
// well-formed subset of XML, so this covers that subset instead of pulling in an XML library, and
// it refuses DOCTYPE so that a reply cannot declare entities. Kept apart from the S3 client so
// that it can be tested alone (tests/unit/s3_client_test.cc).
#pragma once

#include <string>
#include <string_view>
#include <vector>

#include "refit/status.h"

namespace refit::internal {

/// One element of a parsed XML document. Names are local names (a "prefix:" is dropped);
/// attributes are skipped: S3 replies carry nothing we need in them.
struct XmlElement {
  std::string name;
  /// The character data directly inside the element (entities decoded, CDATA included).
  std::string text;
  std::vector<XmlElement> children;

  /// The first child named `child_name`, or nullptr.
  const XmlElement* Child(std::string_view child_name) const;
  /// The text of the first child named `child_name`, or nullptr when there is none.
  const std::string* ChildText(std::string_view child_name) const;
};

/// Parse a whole XML document (a small non-validating subset: declaration, comments,
/// processing instructions, elements, attributes, character data, CDATA, the five predefined
/// entities and numeric character references). Errors: DataLoss describing the first defect
/// and its offset; a DOCTYPE is refused (S3 never sends one, and it could declare entities).
Result<XmlElement> ParseXml(std::string_view document);

/// Escape `text` for XML character data.
std::string XmlEscape(std::string_view text);

}  // namespace refit::internal
