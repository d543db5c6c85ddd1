// libFuzzer target for ParseXml, the reader of every XML reply an S3 endpoint sends (listings,
// upload ids, error documents): hostile bytes must come back as DataLoss, never a crash, a
// runaway recursion or an entity expansion.
//
// Invariants: every name the parser accepts can be written back as a start tag (the parser refuses
// names that are not XML names and documents that are not well-formed UTF-8), and a parsed tree
// written back as XML (names as parsed, text through XmlEscape, children after the text) parses
// to the same tree.
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <string_view>

#include "transport/s3/s3_xml.h"

namespace {

using refit::internal::XmlElement;

[[noreturn]] void Fail(const char* what) {
  std::fprintf(stderr, "s3_xml_fuzz: %s\n", what);
  std::abort();
}

void Check(bool condition, const char* what) {
  if (!condition) Fail(what);
}

bool Writable(const XmlElement& element) {
  if (element.name.empty() || element.name[0] == '!' || element.name[0] == '?') return false;
  for (const XmlElement& child : element.children) {
    if (!Writable(child)) return false;
  }
  return true;
}

void Write(const XmlElement& element, std::string& out) {
  out += '<';
  out += element.name;
  out += '>';
  out += refit::internal::XmlEscape(element.text);
  for (const XmlElement& child : element.children) Write(child, out);
  out += "</";
  out += element.name;
  out += '>';
}

bool Same(const XmlElement& a, const XmlElement& b) {
  if (a.name != b.name || a.text != b.text || a.children.size() != b.children.size()) return false;
  for (size_t i = 0; i < a.children.size(); ++i) {
    if (!Same(a.children[i], b.children[i])) return false;
  }
  return true;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string_view document(reinterpret_cast<const char*>(data), size);
  refit::Result<XmlElement> root = refit::internal::ParseXml(document);
  if (!root.ok()) {
    Check(root.status().code() == refit::StatusCode::kDataLoss,
          "an XML error that is not DataLoss");
    return 0;
  }
  // What the S3 client reads of a reply.
  for (std::string_view name : {"Code", "Message", "RequestId", "UploadId", "IsTruncated",
                                "NextContinuationToken", "Contents", "Key", "Size"}) {
    const XmlElement* child = root->Child(name);
    const std::string* text = root->ChildText(name);
    Check((child == nullptr) == (text == nullptr), "Child and ChildText disagree");
    if (child != nullptr) Check(&child->text == text, "ChildText is not the child's text");
  }
  Check(Writable(*root), "a parsed name that cannot be written back as a start tag");
  std::string written;
  Write(*root, written);
  refit::Result<XmlElement> again = refit::internal::ParseXml(written);
  if (!again.ok()) {
    std::fprintf(stderr, "s3_xml_fuzz: %s\n", again.status().ToString().c_str());
    Fail("a parsed tree written back does not parse");
  }
  Check(Same(*again, *root), "a tree does not survive write -> parse");
  return 0;
}
