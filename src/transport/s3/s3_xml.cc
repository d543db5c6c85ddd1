// ParseXml on pugixml, and XmlEscape; see s3_xml.h.
//
// pugixml reads the structure: tags, attributes, comments, processing instructions, CDATA, and
// whether a DOCTYPE is present. Everything this file accepts beyond that is checked here, because
// pugixml is lenient where an S3 reply never is (several root elements, text beside the root,
// unknown entities kept as text, input cut short at a NUL byte), and character references are
// decoded here so that an unknown or malformed one is an error rather than literal text.
#include "transport/s3/s3_xml.h"

#include <pugixml.hpp>

#include <charconv>
#include <cstdint>
#include <cstring>
#include <string>
#include <utility>

#include <fmt/format.h>

#include "refit/status_format.h"
#include "transport/transport_internal.h"

namespace refit::internal {
namespace {

// Nesting deeper than any S3 reply (ListBucketResult/Contents/Owner/ID is 4 deep): a document
// nested deeper is not one of S3's, and the bound keeps the recursive conversion's stack small
// (pugixml's own parser is not recursive).
constexpr int kMaxXmlDepth = 32;

// What pugixml is asked to do. Character data keeps its whitespace (parse_ws_pcdata) and its
// bytes as sent: no end-of-line normalisation and no entity decoding (done here, strictly).
// parse_doctype only records that a DOCTYPE was there, so that it can be refused; pugixml never
// reads entity declarations or expands entities, with or without it. parse_fragment keeps text
// outside the root element as nodes, so that it is refused instead of dropped. Comments,
// processing instructions and the declaration are skipped (their flags are off).
constexpr unsigned kParseFlags =
    pugi::parse_cdata | pugi::parse_ws_pcdata | pugi::parse_doctype | pugi::parse_fragment;

Status XmlError(std::string_view what, ptrdiff_t offset) {
  return DataLoss("XML reply: {} at offset {}", what, offset);
}

bool IsXmlSpace(char ch) { return ch == ' ' || ch == '\t' || ch == '\r' || ch == '\n'; }

// XML 1.0's Char production: what a document (and a character reference) may hold. Excludes the
// C0 controls but tab, LF and CR, the UTF-16 surrogates, and U+FFFE / U+FFFF.
bool IsXmlChar(uint32_t cp) {
  return cp == 0x9 || cp == 0xA || cp == 0xD || (cp >= 0x20 && cp <= 0xD7FF) ||
         (cp >= 0xE000 && cp <= 0xFFFD) || (cp >= 0x10000 && cp <= 0x10FFFF);
}

// XML 1.0 (5th edition) NameStartChar, without ':' (a namespace-aware name is prefix:local, each
// part an NCName).
bool IsNameStartChar(uint32_t cp) {
  return (cp >= 'A' && cp <= 'Z') || (cp >= 'a' && cp <= 'z') || cp == '_' ||
         (cp >= 0xC0 && cp <= 0xD6) || (cp >= 0xD8 && cp <= 0xF6) || (cp >= 0xF8 && cp <= 0x2FF) ||
         (cp >= 0x370 && cp <= 0x37D) || (cp >= 0x37F && cp <= 0x1FFF) ||
         (cp >= 0x200C && cp <= 0x200D) || (cp >= 0x2070 && cp <= 0x218F) ||
         (cp >= 0x2C00 && cp <= 0x2FEF) || (cp >= 0x3001 && cp <= 0xD7FF) ||
         (cp >= 0xF900 && cp <= 0xFDCF) || (cp >= 0xFDF0 && cp <= 0xFFFD) ||
         (cp >= 0x10000 && cp <= 0xEFFFF);
}

bool IsNameChar(uint32_t cp) {
  return IsNameStartChar(cp) || cp == '-' || cp == '.' || (cp >= '0' && cp <= '9') || cp == 0xB7 ||
         (cp >= 0x300 && cp <= 0x36F) || (cp >= 0x203F && cp <= 0x2040);
}

// Decode the UTF-8 sequence at `text[pos]` into `cp` and advance `pos`; false for a malformed,
// overlong or truncated sequence, or one that encodes a surrogate or a value past U+10FFFF.
bool NextCodePoint(std::string_view text, size_t& pos, uint32_t& cp) {
  const auto byte = [&](size_t i) { return static_cast<uint8_t>(text[i]); };
  const uint8_t lead = byte(pos);
  size_t length = 0;
  uint32_t min = 0;
  if (lead < 0x80) {
    cp = lead;
    ++pos;
    return true;
  } else if ((lead & 0xE0) == 0xC0) {
    length = 2, cp = lead & 0x1F, min = 0x80;
  } else if ((lead & 0xF0) == 0xE0) {
    length = 3, cp = lead & 0x0F, min = 0x800;
  } else if ((lead & 0xF8) == 0xF0) {
    length = 4, cp = lead & 0x07, min = 0x10000;
  } else {
    return false;
  }
  if (text.size() - pos < length) return false;
  for (size_t i = 1; i < length; ++i) {
    if ((byte(pos + i) & 0xC0) != 0x80) return false;
    cp = (cp << 6) | (byte(pos + i) & 0x3F);
  }
  if (cp < min || cp > 0x10FFFF || (cp >= 0xD800 && cp <= 0xDFFF)) return false;
  pos += length;
  return true;
}

// The whole document is well-formed UTF-8 of XML characters: a reply that is not is refused
// before pugixml reads it (pugixml takes any byte above 0x7F in a name or in text).
Status CheckCharacters(std::string_view document) {
  size_t pos = 0;
  while (pos < document.size()) {
    const size_t start = pos;
    uint32_t cp = 0;
    if (!NextCodePoint(document, pos, cp)) {
      return XmlError(
          fmt::format("malformed UTF-8 (byte 0x{:02x})", static_cast<uint8_t>(document[start])),
          static_cast<ptrdiff_t>(start));
    }
    if (!IsXmlChar(cp)) {
      return XmlError(fmt::format("character U+{:04X} is not allowed in XML", cp),
                      static_cast<ptrdiff_t>(start));
    }
  }
  return Status::OK();
}

// An NCName: a NameStartChar (no ':'), then NameChars (no ':'). `name` is well-formed UTF-8.
bool IsNcName(std::string_view name) {
  size_t pos = 0;
  uint32_t cp = 0;
  if (name.empty() || !NextCodePoint(name, pos, cp) || !IsNameStartChar(cp)) return false;
  while (pos < name.size()) {
    if (!NextCodePoint(name, pos, cp) || !IsNameChar(cp)) return false;
  }
  return true;
}

// An element's name as Namespaces in XML writes it: "local" or "prefix:local", both NCNames.
// pugixml accepts any bytes there; a name this refuses could not be written back as a start tag.
Status CheckElementName(std::string_view name, ptrdiff_t offset) {
  const size_t colon = name.find(':');
  const bool ok = colon == std::string_view::npos
                      ? IsNcName(name)
                      : IsNcName(name.substr(0, colon)) && IsNcName(name.substr(colon + 1));
  if (!ok) return XmlError(fmt::format("bad element name '{}'", Printable(name)), offset);
  return Status::OK();
}

bool IsBlank(std::string_view text) {
  for (char ch : text) {
    if (!IsXmlSpace(ch)) return false;
  }
  return true;
}

void AppendUtf8(uint32_t code_point, std::string& out) {
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

// Append `text`, raw character data that starts at `offset` in the document, to `out`, decoding
// the five predefined entities and numeric character references: the only references a document
// without a DTD can hold.
Status AppendCharacterData(std::string_view text, ptrdiff_t offset, std::string& out) {
  size_t pos = 0;
  while (pos < text.size()) {
    const size_t amp = text.find('&', pos);
    out.append(text.substr(pos, amp == std::string_view::npos ? amp : amp - pos));
    if (amp == std::string_view::npos) break;
    const ptrdiff_t where = offset + static_cast<ptrdiff_t>(amp);
    const size_t end = text.find(';', amp);
    if (end == std::string_view::npos) return XmlError("unterminated entity reference", where);
    const std::string_view name = text.substr(amp + 1, end - amp - 1);
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
      // A reference must name an XML Char, like the characters written out (no U+0001).
      const bool hex = name.size() > 1 && (name[1] == 'x' || name[1] == 'X');
      const std::string_view digits = name.substr(hex ? 2 : 1);
      uint32_t code_point = 0;
      const auto [ptr, ec] =
          std::from_chars(digits.data(), digits.data() + digits.size(), code_point, hex ? 16 : 10);
      if (digits.empty() || ec != std::errc() || ptr != digits.data() + digits.size() ||
          !IsXmlChar(code_point)) {
        return XmlError(fmt::format("bad character reference '&{};'", Printable(name)), where);
      }
      AppendUtf8(code_point, out);
    } else {
      return XmlError(fmt::format("unknown entity '&{};'", Printable(name)), where);
    }
    pos = end + 1;
  }
  return Status::OK();
}

// The local name: "s3:Key" is "Key".
std::string_view LocalName(std::string_view name) {
  const size_t colon = name.rfind(':');
  return colon == std::string_view::npos ? name : name.substr(colon + 1);
}

Result<XmlElement> Convert(const pugi::xml_node& node, int depth) {
  if (depth > kMaxXmlDepth) return XmlError("elements nested too deep", node.offset_debug());
  REFIT_RETURN_NOT_OK(CheckElementName(node.name(), node.offset_debug()));
  XmlElement element;
  element.name = std::string(LocalName(node.name()));
  for (const pugi::xml_node& child : node.children()) {
    switch (child.type()) {
      case pugi::node_element: {
        REFIT_ASSIGN_OR_RETURN(XmlElement converted, Convert(child, depth + 1));
        element.children.push_back(std::move(converted));
        break;
      }
      case pugi::node_pcdata:
        REFIT_RETURN_NOT_OK(AppendCharacterData(child.value(), child.offset_debug(), element.text));
        break;
      case pugi::node_cdata:
        element.text.append(child.value());
        break;
      case pugi::node_doctype:
        return XmlError("markup declaration inside an element", child.offset_debug());
      default:
        // Comments, processing instructions and declarations are not kept (kParseFlags).
        break;
    }
  }
  return element;
}

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
  // XML has no U+0000, and pugixml would end the document at one, ignoring what follows.
  if (const void* nul = std::memchr(document.data(), '\0', document.size()); nul != nullptr) {
    return XmlError("NUL byte", static_cast<const char*>(nul) - document.data());
  }
  REFIT_RETURN_NOT_OK(CheckCharacters(document));
  pugi::xml_document parsed;
  const pugi::xml_parse_result result =
      parsed.load_buffer(document.data(), document.size(), kParseFlags, pugi::encoding_utf8);
  if (!result) return XmlError(result.description(), result.offset);
  pugi::xml_node root;
  for (const pugi::xml_node& node : parsed.children()) {
    switch (node.type()) {
      case pugi::node_element:
        if (root) return XmlError("content after the root element", node.offset_debug());
        root = node;
        break;
      case pugi::node_doctype:
        // S3 never sends one, and it could declare entities.
        return XmlError("DOCTYPE or other markup declaration (refused)", node.offset_debug());
      case pugi::node_pcdata:
        if (!IsBlank(node.value())) {
          return XmlError(root ? "content after the root element" : "text before the root element",
                          node.offset_debug());
        }
        break;
      default:
        break;
    }
  }
  if (!root) return XmlError("no root element", static_cast<ptrdiff_t>(document.size()));
  return Convert(root, 1);
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
