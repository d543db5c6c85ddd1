// ParseXml's recursive-descent reader and XmlEscape; see s3_xml.h.
#include "transport/s3/s3_xml.h"

#include <algorithm>
#include <charconv>
#include <cstdint>
#include <utility>

#include "transport/transport_internal.h"

namespace refit::internal {
namespace {

// Nesting deeper than any S3 reply (ListBucketResult/Contents/Owner/ID is 4 deep): a document
// nested deeper is not one of S3's, and the bound keeps the recursive parser's stack small.
constexpr int kMaxXmlDepth = 32;

// The recursive-descent reader behind ParseXml.
class XmlReader {
 public:
  explicit XmlReader(std::string_view document) : doc_(document) {}

  Result<XmlElement> ReadDocument() {
    REFIT_RETURN_NOT_OK(SkipMisc());
    if (AtEnd() || doc_[pos_] != '<') return Error("no root element");
    REFIT_ASSIGN_OR_RETURN(XmlElement root, ReadElement(1));
    REFIT_RETURN_NOT_OK(SkipMisc());
    if (!AtEnd()) return Error("content after the root element");
    return root;
  }

 private:
  bool AtEnd() const { return pos_ >= doc_.size(); }
  bool LookingAt(std::string_view text) const { return doc_.substr(pos_).starts_with(text); }

  Status Error(std::string_view what) const {
    return DataLoss("XML reply: {} at offset {}", what, pos_);
  }

  void SkipSpace() {
    while (!AtEnd() &&
           (doc_[pos_] == ' ' || doc_[pos_] == '\t' || doc_[pos_] == '\r' || doc_[pos_] == '\n')) {
      ++pos_;
    }
  }

  // Skip past `terminator`, which must follow.
  Status SkipPast(std::string_view terminator, std::string_view what) {
    const size_t end = doc_.find(terminator, pos_);
    if (end == std::string_view::npos) return Error(fmt::format("unterminated {}", what));
    pos_ = end + terminator.size();
    return Status::OK();
  }

  // Whitespace, comments and processing instructions (including the declaration) around the
  // root element.
  Status SkipMisc() {
    for (;;) {
      SkipSpace();
      if (LookingAt("<?")) {
        REFIT_RETURN_NOT_OK(SkipPast("?>", "processing instruction"));
      } else if (LookingAt("<!--")) {
        REFIT_RETURN_NOT_OK(SkipPast("-->", "comment"));
      } else if (LookingAt("<!")) {
        return Error("DOCTYPE or other markup declaration (refused)");
      } else {
        return Status::OK();
      }
    }
  }

  static bool IsNameChar(char ch) {
    return !(ch == ' ' || ch == '\t' || ch == '\r' || ch == '\n' || ch == '/' || ch == '>' ||
             ch == '<' || ch == '=' || ch == '"' || ch == '\'' || ch == '&');
  }

  // A name, returned without its "prefix:".
  Result<std::string_view> ReadName() {
    const size_t start = pos_;
    while (!AtEnd() && IsNameChar(doc_[pos_])) ++pos_;
    if (pos_ == start) return Error("expected a name");
    std::string_view name = doc_.substr(start, pos_ - start);
    if (const size_t colon = name.rfind(':'); colon != std::string_view::npos) {
      name.remove_prefix(colon + 1);
    }
    return name;
  }

  // Skip the attributes of a start tag; return whether the tag is self-closing ("/>").
  Result<bool> SkipAttributes() {
    for (;;) {
      SkipSpace();
      if (AtEnd()) return Error("unterminated start tag");
      if (LookingAt("/>")) {
        pos_ += 2;
        return true;
      }
      if (doc_[pos_] == '>') {
        ++pos_;
        return false;
      }
      REFIT_RETURN_NOT_OK(ReadName().status());
      SkipSpace();
      if (AtEnd() || doc_[pos_] != '=') return Error("attribute without '='");
      ++pos_;
      SkipSpace();
      if (AtEnd() || (doc_[pos_] != '"' && doc_[pos_] != '\'')) {
        return Error("attribute value without quotes");
      }
      const char quote = doc_[pos_++];
      const size_t end = doc_.find(quote, pos_);
      if (end == std::string_view::npos) return Error("unterminated attribute value");
      pos_ = end + 1;
    }
  }

  static void AppendUtf8(uint32_t code_point, std::string& out) {
    if (code_point < 0x80) {
      out.push_back(static_cast<char>(code_point));
    } else if (code_point < 0x800) {
      out.push_back(static_cast<char>(0xC0 | (code_point >> 6)));
      out.push_back(static_cast<char>(0x80 | (code_point & 0x3F)));
    } else if (code_point < 0x10000) {
      out.push_back(static_cast<char>(0xE0 | (code_point >> 12)));
      out.push_back(static_cast<char>(0x80 | ((code_point >> 6) & 0x3F)));
      out.push_back(static_cast<char>(0x80 | (code_point & 0x3F)));
    } else {
      out.push_back(static_cast<char>(0xF0 | (code_point >> 18)));
      out.push_back(static_cast<char>(0x80 | ((code_point >> 12) & 0x3F)));
      out.push_back(static_cast<char>(0x80 | ((code_point >> 6) & 0x3F)));
      out.push_back(static_cast<char>(0x80 | (code_point & 0x3F)));
    }
  }

  // Decode the entity or character reference at pos_ (on '&') and append it to `out`.
  Status ReadReference(std::string& out) {
    const size_t end = doc_.find(';', pos_);
    if (end == std::string_view::npos) return Error("unterminated entity reference");
    const std::string_view name = doc_.substr(pos_ + 1, end - pos_ - 1);
    if (name == "lt") {
      out.push_back('<');
    } else if (name == "gt") {
      out.push_back('>');
    } else if (name == "amp") {
      out.push_back('&');
    } else if (name == "quot") {
      out.push_back('"');
    } else if (name == "apos") {
      out.push_back('\'');
    } else if (name.starts_with('#')) {
      // The largest Unicode code point and the UTF-16 surrogate range, which XML excludes.
      constexpr uint32_t kMaxCodePoint = 0x10FFFF;
      constexpr uint32_t kFirstSurrogate = 0xD800;
      constexpr uint32_t kLastSurrogate = 0xDFFF;
      const bool hex = name.size() > 1 && (name[1] == 'x' || name[1] == 'X');
      const std::string_view digits = name.substr(hex ? 2 : 1);
      uint32_t code_point = 0;
      const auto [ptr, ec] =
          std::from_chars(digits.data(), digits.data() + digits.size(), code_point, hex ? 16 : 10);
      if (digits.empty() || ec != std::errc() || ptr != digits.data() + digits.size() ||
          code_point == 0 || code_point > kMaxCodePoint ||
          (code_point >= kFirstSurrogate && code_point <= kLastSurrogate)) {
        return Error(fmt::format("bad character reference '&{};'", Printable(name)));
      }
      AppendUtf8(code_point, out);
    } else {
      return Error(fmt::format("unknown entity '&{};'", Printable(name)));
    }
    pos_ = end + 1;
    return Status::OK();
  }

  // pos_ is on the '<' of a start tag.
  Result<XmlElement> ReadElement(int depth) {
    if (depth > kMaxXmlDepth) return Error("elements nested too deep");
    ++pos_;
    XmlElement element;
    REFIT_ASSIGN_OR_RETURN(std::string_view name, ReadName());
    element.name = std::string(name);
    REFIT_ASSIGN_OR_RETURN(bool self_closing, SkipAttributes());
    if (self_closing) return element;
    for (;;) {
      if (AtEnd()) return Error(fmt::format("element '{}' is not closed", Printable(name)));
      if (LookingAt("</")) {
        pos_ += 2;
        REFIT_ASSIGN_OR_RETURN(std::string_view end_name, ReadName());
        if (end_name != name) {
          return Error(
              fmt::format("end tag '{}' closes '{}'", Printable(end_name), Printable(name)));
        }
        SkipSpace();
        if (AtEnd() || doc_[pos_] != '>') return Error("unterminated end tag");
        ++pos_;
        return element;
      }
      if (LookingAt("<!--")) {
        REFIT_RETURN_NOT_OK(SkipPast("-->", "comment"));
      } else if (LookingAt("<![CDATA[")) {
        constexpr std::string_view kCdataOpen = "<![CDATA[";
        constexpr std::string_view kCdataClose = "]]>";
        const size_t start = pos_ + kCdataOpen.size();
        const size_t end = doc_.find(kCdataClose, start);
        if (end == std::string_view::npos) return Error("unterminated CDATA section");
        element.text.append(doc_.substr(start, end - start));
        pos_ = end + kCdataClose.size();
      } else if (LookingAt("<?")) {
        REFIT_RETURN_NOT_OK(SkipPast("?>", "processing instruction"));
      } else if (LookingAt("<!")) {
        return Error("markup declaration inside an element");
      } else if (doc_[pos_] == '<') {
        REFIT_ASSIGN_OR_RETURN(XmlElement child, ReadElement(depth + 1));
        element.children.push_back(std::move(child));
      } else if (doc_[pos_] == '&') {
        REFIT_RETURN_NOT_OK(ReadReference(element.text));
      } else {
        const size_t end = std::min(doc_.find_first_of("<&", pos_), doc_.size());
        element.text.append(doc_.substr(pos_, end - pos_));
        pos_ = end;
      }
    }
  }

  std::string_view doc_;
  size_t pos_ = 0;
};

}  // namespace

const XmlElement* XmlElement::Child(std::string_view child_name) const {
  for (const XmlElement& child : children) {
    if (child.name == child_name) return &child;
  }
  return nullptr;
}

const std::string* XmlElement::ChildText(std::string_view child_name) const {
  const XmlElement* child = Child(child_name);
  return child == nullptr ? nullptr : &child->text;
}

Result<XmlElement> ParseXml(std::string_view document) {
  return XmlReader(document).ReadDocument();
}

std::string XmlEscape(std::string_view text) {
  std::string out;
  out.reserve(text.size());
  for (char ch : text) {
    switch (ch) {
      case '<':
        out += "&lt;";
        break;
      case '>':
        out += "&gt;";
        break;
      case '&':
        out += "&amp;";
        break;
      case '"':
        out += "&quot;";
        break;
      case '\'':
        out += "&apos;";
        break;
      default:
        out.push_back(ch);
    }
  }
  return out;
}

}  // namespace refit::internal
