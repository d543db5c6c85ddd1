// The XML reader and escaper for the documents S3 exchanges: listings, upload ids, error replies
// (read) and CompleteMultipartUpload / CreateBucket bodies (written). Replies are untrusted, so
// the reader (on pugixml, which never expands entities) accepts only what S3 sends: one root
// element, no DOCTYPE (a reply cannot declare entities), no unknown entity, no NUL byte, a bounded
// depth. Kept apart from the S3 client so that it can be tested alone
// (tests/unit/s3_client_test.cc) and fuzzed (tests/fuzz/s3_xml_fuzz.cc).
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

/// Parse a whole XML document (non-validating: declaration, comments, processing instructions,
/// elements, attributes, character data, CDATA, the five predefined entities and numeric
/// character references). The document is UTF-8 and taken byte for byte: no end-of-line
/// normalisation. Errors: DataLoss describing the first defect and its byte offset; a DOCTYPE is
/// refused (S3 never sends one, and it could declare entities), as are several root elements,
/// text outside the root, an unknown entity, a NUL byte and nesting deeper than 32 elements.
Result<XmlElement> ParseXml(std::string_view document);

/// Escape `text` for XML character data.
std::string XmlEscape(std::string_view text);

}  // namespace refit::internal
