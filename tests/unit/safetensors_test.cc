#include "refit/safetensors.h"

#include <fmt/format.h>
#include <stdlib.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <map>
#include <string>
#include <utility>
#include <vector>

#include "core/mapped_file.h"
#include "test_util.h"

namespace refit {
namespace {

namespace fs = std::filesystem;
using internal::MappedFile;

std::vector<std::byte> ToBytes(std::string_view text) {
  const auto* begin = reinterpret_cast<const std::byte*>(text.data());
  return {begin, begin + text.size()};
}

// A file image: the little-endian u64 length of `header`, `header` itself (unpadded), `data`.
std::vector<std::byte> FileImage(std::string_view header, std::vector<std::byte> data = {}) {
  std::vector<std::byte> out;
  out.reserve(8 + header.size() + data.size());
  const uint64_t length = header.size();
  for (int i = 0; i < 8; ++i) {
    out.push_back(static_cast<std::byte>((length >> (8 * i)) & 0xff));
  }
  const std::vector<std::byte> header_bytes = ToBytes(header);
  out.insert(out.end(), header_bytes.begin(), header_bytes.end());
  out.insert(out.end(), data.begin(), data.end());
  return out;
}

// A tensor whose bytes are a pattern distinct per tensor, so swapped or shifted data shows.
OwnedTensor PatternTensor(std::string name, DType dtype, Shape shape, uint8_t seed) {
  OwnedTensor tensor{std::move(name), dtype, std::move(shape), {}};
  const uint64_t numel = NumElements(tensor.shape).ValueOrDie();
  tensor.bytes.resize(numel * DTypeSize(dtype));
  for (size_t i = 0; i < tensor.bytes.size(); ++i) {
    tensor.bytes[i] = static_cast<std::byte>(seed + 7 * i);
  }
  return tensor;
}

std::vector<TensorView> Views(const std::vector<OwnedTensor>& tensors) {
  std::vector<TensorView> views;
  views.reserve(tensors.size());
  for (const OwnedTensor& tensor : tensors) {
    views.push_back(tensor.view());
  }
  return views;
}

bool SameBytes(std::span<const std::byte> a, std::span<const std::byte> b) {
  return a.size() == b.size() && (a.empty() || std::memcmp(a.data(), b.data(), a.size()) == 0);
}

void ExpectSameTensors(const std::vector<TensorView>& actual,
                       const std::vector<TensorView>& expected) {
  ASSERT_EQ(actual.size(), expected.size());
  for (size_t i = 0; i < actual.size(); ++i) {
    SCOPED_TRACE(expected[i].name);
    EXPECT_EQ(actual[i].name, expected[i].name);
    EXPECT_EQ(actual[i].dtype, expected[i].dtype);
    EXPECT_EQ(actual[i].shape, expected[i].shape);
    EXPECT_TRUE(SameBytes(actual[i].bytes, expected[i].bytes));
  }
}

class SafetensorsTest : public ::testing::Test {
 protected:
  void SetUp() override {
    std::string pattern = (fs::temp_directory_path() / "refit-safetensors-XXXXXX").string();
    ASSERT_NE(::mkdtemp(pattern.data()), nullptr) << std::strerror(errno);
    dir_ = pattern;
  }
  void TearDown() override { fs::remove_all(dir_); }

  std::string PathOf(const std::string& name) const { return (dir_ / name).string(); }

  std::string WriteFile(const std::string& name, const std::vector<std::byte>& bytes) const {
    std::string path = PathOf(name);
    std::ofstream out(path, std::ios::binary);
    out.write(reinterpret_cast<const char*>(bytes.data()),
              static_cast<std::streamsize>(bytes.size()));
    EXPECT_TRUE(out.good()) << path;
    return path;
  }

  static std::vector<std::byte> ReadFile(const std::string& path) {
    std::ifstream in(path, std::ios::binary);
    const std::string text((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
    return ToBytes(text);
  }

  std::vector<std::string> DirEntries() const {
    std::vector<std::string> names;
    for (const auto& entry : fs::directory_iterator(dir_)) {
      names.push_back(entry.path().filename().string());
    }
    return names;
  }

  fs::path dir_;
};

// ---------------------------------------------------------------------------------------------
// Round trips

TEST_F(SafetensorsTest, RoundTripsEveryDTypeScalarsEmptyTensorsAndMetadata) {
  std::vector<OwnedTensor> tensors;
  uint8_t seed = 1;
  for (const DTypeInfo& info : AllDTypes()) {
    tensors.push_back(
        PatternTensor(fmt::format("layer.{}.weight", info.name), info.dtype, {2, 3}, seed++));
  }
  tensors.push_back(PatternTensor("scalar.f32", DType::kFloat32, {}, seed++));
  tensors.push_back(PatternTensor("empty.bf16", DType::kBFloat16, {0, 4}, seed++));
  tensors.push_back(PatternTensor("scalar.i64", DType::kInt64, {}, seed++));
  const std::map<std::string, std::string> metadata = {{"format", "pt"}, {"step", "7"}};
  const std::string path = PathOf("model.safetensors");
  ASSERT_OK(WriteSafetensors(path, Views(tensors), metadata));

  for (LoadMode mode : {LoadMode::kMmap, LoadMode::kRead}) {
    SCOPED_TRACE(static_cast<int>(mode));
    ASSERT_OK_AND_ASSIGN(auto file, SafetensorsFile::Open(path, mode));
    // Written in the given order, so ascending offsets reproduce it.
    ExpectSameTensors(file->tensors(), Views(tensors));
    EXPECT_EQ(file->metadata(), metadata);
    EXPECT_EQ(file->path(), path);
  }
}

TEST_F(SafetensorsTest, BothLoadModesGiveIdenticalViews) {
  const std::vector<OwnedTensor> tensors = {
      PatternTensor("b", DType::kFloat16, {5, 3}, 3),
      PatternTensor("a", DType::kFloat8E5M2, {7}, 9),
      PatternTensor("c", DType::kFloat64, {1, 1, 2}, 17),
  };
  const std::string path = PathOf("modes.safetensors");
  ASSERT_OK(WriteSafetensors(path, Views(tensors), {{"k", "v"}}));
  ASSERT_OK_AND_ASSIGN(auto mapped, SafetensorsFile::Open(path, LoadMode::kMmap));
  ASSERT_OK_AND_ASSIGN(auto read, SafetensorsFile::Open(path, LoadMode::kRead));
  ExpectSameTensors(read->tensors(), mapped->tensors());
  EXPECT_EQ(read->metadata(), mapped->metadata());
  // The two files own different memory: the read copy must not alias the mapping.
  EXPECT_NE(read->tensors()[0].bytes.data(), mapped->tensors()[0].bytes.data());
}

TEST_F(SafetensorsTest, WrittenDataSectionIsAligned) {
  // A 1-byte name makes the unpadded header length odd.
  const std::vector<OwnedTensor> tensors = {PatternTensor("x", DType::kInt64, {3}, 5)};
  const std::string path = PathOf("aligned.safetensors");
  ASSERT_OK(WriteSafetensors(path, Views(tensors)));
  const std::vector<std::byte> bytes = ReadFile(path);
  ASSERT_GE(bytes.size(), 8u);
  uint64_t header_size = 0;
  for (int i = 0; i < 8; ++i) {
    header_size |= static_cast<uint64_t>(bytes[i]) << (8 * i);
  }
  EXPECT_EQ((8 + header_size) % 8, 0u);
  EXPECT_EQ(bytes.size(), 8 + header_size + 24);
  // The padding is spaces, as the upstream writer emits.
  EXPECT_EQ(static_cast<char>(bytes[8 + header_size - 1]), ' ');
}

TEST_F(SafetensorsTest, WritesAndReadsAFileWithoutTensors) {
  const std::string path = PathOf("empty.safetensors");
  ASSERT_OK(WriteSafetensors(path, {}));
  EXPECT_EQ(ReadFile(path), FileImage("{}      "));
  ASSERT_OK_AND_ASSIGN(auto file, SafetensorsFile::Open(path));
  EXPECT_TRUE(file->tensors().empty());
  EXPECT_TRUE(file->metadata().empty());
}

TEST_F(SafetensorsTest, EscapesNamesAndMetadataLikeTheUpstreamWriter) {
  // serde_json escapes '"', '\\' and control characters and leaves other UTF-8 as is.
  const std::string name = "w\"\\\n\xc3\xa9";
  const std::vector<OwnedTensor> tensors = {PatternTensor(name, DType::kUInt8, {1}, 1)};
  const std::string path = PathOf("escaped.safetensors");
  ASSERT_OK(WriteSafetensors(path, Views(tensors), {{"tab", "a\tb"}}));
  const std::vector<std::byte> bytes = ReadFile(path);
  const std::string text(reinterpret_cast<const char*>(bytes.data()), bytes.size());
  EXPECT_NE(text.find(R"("w\"\\\n)"
                      "\xc3\xa9\":"),
            std::string::npos)
      << text;
  EXPECT_NE(text.find(R"("tab":"a\tb")"), std::string::npos) << text;
  ASSERT_OK_AND_ASSIGN(auto file, SafetensorsFile::Open(path));
  ASSERT_EQ(file->tensors().size(), 1u);
  EXPECT_EQ(file->tensors()[0].name, name);
  EXPECT_EQ(file->metadata().at("tab"), "a\tb");
}

// ---------------------------------------------------------------------------------------------
// Interop with the upstream safetensors library, byte for byte. The expected images are the
// literals of huggingface/safetensors bindings/python/tests/test_simple.py.

// save({"test": torch.zeros((2, 2), dtype=torch.int32)}) in the current upstream library.
std::vector<std::byte> UpstreamInt32Image() {
  return FileImage(R"({"test":{"dtype":"I32","shape":[2,2],"data_offsets":[0,16]}}    )",
                   std::vector<std::byte>(16));
}

TEST_F(SafetensorsTest, WriterOutputMatchesUpstreamBytes) {
  const OwnedTensor test{"test", DType::kInt32, {2, 2}, std::vector<std::byte>(16)};
  const std::string path = PathOf("upstream.safetensors");
  ASSERT_OK(WriteSafetensors(path, {test.view()}));
  EXPECT_EQ(ReadFile(path), UpstreamInt32Image());
}

TEST_F(SafetensorsTest, WriterPlacesMetadataFirstLikeUpstream) {
  const OwnedTensor a{"a", DType::kFloat32, {2}, ToBytes(std::string("\0\0\x80?\0\0\0@", 8))};
  const OwnedTensor b{"b", DType::kBFloat16, {1, 2}, ToBytes(std::string("\x80?\0@", 4))};
  const std::string path = PathOf("metadata.safetensors");
  ASSERT_OK(WriteSafetensors(path, {a.view(), b.view()}, {{"format", "pt"}}));
  // 142 bytes of JSON padded to 144 with two spaces.
  const std::vector<std::byte> expected = FileImage(
      R"({"__metadata__":{"format":"pt"},"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},)"
      R"("b":{"dtype":"BF16","shape":[1,2],"data_offsets":[8,12]}}  )",
      ToBytes(std::string("\0\0\x80?\0\0\0@\x80?\0@", 12)));
  EXPECT_EQ(ReadFile(path), expected);
}

TEST_F(SafetensorsTest, ParsesUpstreamImages) {
  std::map<std::string, std::string> metadata;
  const std::vector<std::byte> image = UpstreamInt32Image();
  ASSERT_OK_AND_ASSIGN(std::vector<TensorView> tensors,
                       ParseSafetensors(image, "upstream", &metadata));
  ASSERT_EQ(tensors.size(), 1u);
  EXPECT_EQ(tensors[0].name, "test");
  EXPECT_EQ(tensors[0].dtype, DType::kInt32);
  EXPECT_EQ(tensors[0].shape, (Shape{2, 2}));
  EXPECT_EQ(tensors[0].bytes.data(), image.data() + 72);
  EXPECT_EQ(tensors[0].bytes.size(), 16u);
  EXPECT_TRUE(metadata.empty());

  // An older upstream image, from before the writer aligned the data section: a 102-byte header.
  const std::vector<std::byte> unaligned =
      FileImage(R"({"__metadata__":{"framework":"pt"},"test1":{"dtype":"I32","shape":[2,2],)"
                R"("data_offsets":[0,16]}}       )",
                std::vector<std::byte>(16));
  ASSERT_EQ(unaligned.size(), 8u + 102u + 16u);
  ASSERT_OK_AND_ASSIGN(tensors, ParseSafetensors(unaligned, "upstream-v0", &metadata));
  ASSERT_EQ(tensors.size(), 1u);
  EXPECT_EQ(tensors[0].name, "test1");
  EXPECT_EQ(tensors[0].bytes.data(), unaligned.data() + 110);
  EXPECT_EQ(metadata, (std::map<std::string, std::string>{{"framework", "pt"}}));
}

TEST_F(SafetensorsTest, ReturnsTensorsInOffsetOrderNotKeyOrder) {
  const std::vector<std::byte> image =
      FileImage(R"({"a":{"dtype":"U8","shape":[2],"data_offsets":[3,5]},)"
                R"("c":{"dtype":"U8","shape":[0],"data_offsets":[3,3]},)"
                R"("b":{"dtype":"U8","shape":[3],"data_offsets":[0,3]}})",
                ToBytes("xyzuv"));
  ASSERT_OK_AND_ASSIGN(std::vector<TensorView> tensors, ParseSafetensors(image, "order", nullptr));
  ASSERT_EQ(tensors.size(), 3u);
  EXPECT_EQ(tensors[0].name, "b");
  EXPECT_EQ(tensors[1].name, "c");
  EXPECT_EQ(tensors[2].name, "a");
  EXPECT_TRUE(SameBytes(tensors[0].bytes, ToBytes("xyz")));
  EXPECT_TRUE(tensors[1].bytes.empty());
  EXPECT_TRUE(SameBytes(tensors[2].bytes, ToBytes("uv")));
}

TEST_F(SafetensorsTest, FindReturnsTheNamedTensorOrNotFound) {
  const std::vector<OwnedTensor> tensors = {PatternTensor("a", DType::kInt16, {2}, 1),
                                            PatternTensor("b", DType::kInt32, {3}, 2)};
  const std::string path = PathOf("find.safetensors");
  ASSERT_OK(WriteSafetensors(path, Views(tensors)));
  ASSERT_OK_AND_ASSIGN(auto file, SafetensorsFile::Open(path));
  ASSERT_OK_AND_ASSIGN(TensorView b, file->Find("b"));
  EXPECT_EQ(b.dtype, DType::kInt32);
  EXPECT_TRUE(SameBytes(b.bytes, tensors[1].bytes));
  EXPECT_STATUS_MSG(NotFound, "'missing'", file->Find("missing"));
}

// ---------------------------------------------------------------------------------------------
// Writer errors and atomicity

TEST_F(SafetensorsTest, WriteReplacesAnExistingFileAndLeavesNoTemporary) {
  const std::string path = PathOf("replace.safetensors");
  ASSERT_OK(WriteSafetensors(path, {PatternTensor("old", DType::kUInt8, {4}, 1).view()}));
  const OwnedTensor fresh = PatternTensor("new", DType::kUInt8, {2}, 2);
  ASSERT_OK(WriteSafetensors(path, {fresh.view()}));
  ASSERT_OK_AND_ASSIGN(auto file, SafetensorsFile::Open(path));
  ExpectSameTensors(file->tensors(), {fresh.view()});
  EXPECT_EQ(DirEntries(), std::vector<std::string>{"replace.safetensors"});
}

TEST_F(SafetensorsTest, WriteRejectsDuplicateNames) {
  const OwnedTensor w = PatternTensor("w", DType::kUInt8, {1}, 1);
  EXPECT_STATUS_MSG(InvalidArgument, "duplicate tensor name 'w'",
                    WriteSafetensors(PathOf("dup.safetensors"), {w.view(), w.view()}));
  EXPECT_TRUE(DirEntries().empty());
}

TEST_F(SafetensorsTest, WriteRejectsSizeMismatch) {
  OwnedTensor w = PatternTensor("w", DType::kFloat32, {2}, 1);
  w.bytes.resize(6);
  EXPECT_STATUS_MSG(InvalidArgument, "needs 8 bytes, got 6",
                    WriteSafetensors(PathOf("size.safetensors"), {w.view()}));
  EXPECT_TRUE(DirEntries().empty());
}

TEST_F(SafetensorsTest, WriteRejectsReservedAndNonUtf8Names) {
  const OwnedTensor reserved = PatternTensor("__metadata__", DType::kUInt8, {1}, 1);
  EXPECT_STATUS_MSG(InvalidArgument, "reserved",
                    WriteSafetensors(PathOf("r.safetensors"), {reserved.view()}));
  const OwnedTensor latin1 = PatternTensor("caf\xe9", DType::kUInt8, {1}, 1);
  EXPECT_STATUS_MSG(InvalidArgument, "not valid UTF-8",
                    WriteSafetensors(PathOf("u.safetensors"), {latin1.view()}));
  EXPECT_STATUS_MSG(InvalidArgument, "metadata value of 'k'",
                    WriteSafetensors(PathOf("m.safetensors"), {}, {{"k", "\xff"}}));
  EXPECT_TRUE(DirEntries().empty());
}

TEST_F(SafetensorsTest, WriteIntoMissingDirectoryIsIoError) {
  EXPECT_STATUS(IoError, WriteSafetensors(PathOf("no/such/dir/x.safetensors"), {}));
}

TEST_F(SafetensorsTest, OpenMissingFileIsIoErrorInBothModes) {
  const std::string path = PathOf("missing.safetensors");
  EXPECT_STATUS_MSG(IoError, path, SafetensorsFile::Open(path, LoadMode::kMmap));
  EXPECT_STATUS_MSG(IoError, path, SafetensorsFile::Open(path, LoadMode::kRead));
}

TEST_F(SafetensorsTest, OpenReportsMalformedFilesWithTheirPath) {
  const std::string empty = WriteFile("empty.safetensors", {});
  for (LoadMode mode : {LoadMode::kMmap, LoadMode::kRead}) {
    EXPECT_STATUS_MSG(InvalidArgument, empty + ": not a safetensors file: file of 0 bytes",
                      SafetensorsFile::Open(empty, mode));
  }
}

// A user handing refit a file of another kind (here random bytes whose first 8 give the header
// length a new user once saw) is told so first, with the value that did not fit after it.
TEST_F(SafetensorsTest, RandomBytesAreNotASafetensorsFile) {
  constexpr uint64_t kNoiseLength = 16024638156421364339u;
  std::vector<std::byte> noise(4096);
  for (size_t i = 0; i < noise.size(); ++i) {
    noise[i] = static_cast<std::byte>(i < 8 ? kNoiseLength >> (8 * i) : (i * 2654435761u) >> 13);
  }
  const std::string path = WriteFile("noise.safetensors", noise);
  for (LoadMode mode : {LoadMode::kMmap, LoadMode::kRead}) {
    EXPECT_STATUS_MSG(InvalidArgument,
                      path + ": not a safetensors file: header length 16024638156421364339",
                      SafetensorsFile::Open(path, mode));
  }
  // Text (a config file given by mistake): its first 8 bytes make a huge length too.
  const std::string_view text = "model:\n  layers: 32\n  hidden: 4096\n";
  std::vector<std::byte> text_bytes(text.size());
  std::memcpy(text_bytes.data(), text.data(), text.size());
  const std::string yaml = WriteFile("config.safetensors", text_bytes);
  EXPECT_STATUS_MSG(InvalidArgument, yaml + ": not a safetensors file",
                    SafetensorsFile::Open(yaml, LoadMode::kRead));
}

// ---------------------------------------------------------------------------------------------
// Malformed images: one test per rejection rule. Each names the offending value.

constexpr char kOrigin[] = "bad.safetensors";

Status ParseImage(const std::vector<std::byte>& image) {
  std::map<std::string, std::string> metadata;
  return ParseSafetensors(image, kOrigin, &metadata).status();
}

// One U8 tensor entry with the given fields, as header JSON.
std::string Entry(std::string_view name, std::string_view fields) {
  return fmt::format(R"("{}":{{{}}})", name, fields);
}

TEST(SafetensorsMalformedTest, ShorterThanLengthField) {
  EXPECT_STATUS_MSG(InvalidArgument,
                    "bad.safetensors: not a safetensors file: file of 5 bytes is shorter",
                    ParseImage(ToBytes("12345")));
}

TEST(SafetensorsMalformedTest, HeaderLengthBeyondFile) {
  std::vector<std::byte> image = FileImage("{}");
  image[0] = std::byte{100};
  EXPECT_STATUS_MSG(InvalidArgument, "header length 100 exceeds the 2 bytes", ParseImage(image));
}

TEST(SafetensorsMalformedTest, HeaderLengthBeyondCap) {
  std::vector<std::byte> image = FileImage("{}");
  const uint64_t length = (uint64_t{100} << 20) + 1;  // one byte over the 100 MiB cap
  for (int i = 0; i < 8; ++i) {
    image[i] = static_cast<std::byte>((length >> (8 * i)) & 0xff);
  }
  EXPECT_STATUS_MSG(InvalidArgument, "header length 104857601 exceeds the limit",
                    ParseImage(image));
}

TEST(SafetensorsMalformedTest, InvalidJson) {
  EXPECT_STATUS_MSG(InvalidArgument, "header of 5 bytes is not valid JSON",
                    ParseImage(FileImage(R"({"a":)")));
  EXPECT_STATUS_MSG(InvalidArgument, "not valid JSON", ParseImage(FileImage("{\"caf\xe9\":1}")));
  EXPECT_STATUS_MSG(InvalidArgument, "header length is 0", ParseImage(FileImage("")));
}

TEST(SafetensorsMalformedTest, NulByteInHeader) {
  // nlohmann would stop at the NUL and accept "{}"; the format does not.
  EXPECT_STATUS_MSG(InvalidArgument, "NUL byte at offset 2",
                    ParseImage(FileImage(std::string_view("{}\0junk", 7))));
}

TEST(SafetensorsMalformedTest, NotAnObject) {
  EXPECT_STATUS_MSG(InvalidArgument, "not a JSON object: it starts with byte 0x5b",
                    ParseImage(FileImage("[1,2]")));
  EXPECT_STATUS_MSG(InvalidArgument, "starts with byte 0x20", ParseImage(FileImage(" {}")));
}

TEST(SafetensorsMalformedTest, NestingDeeperThanTheSchema) {
  EXPECT_STATUS_MSG(
      InvalidArgument, "nests deeper than 3 levels",
      ParseImage(
          FileImage("{" + Entry("a", R"("dtype":"U8","shape":[[1]],"data_offsets":[0,1])") + "}")));
}

TEST(SafetensorsMalformedTest, EntryNotAnObject) {
  EXPECT_STATUS_MSG(InvalidArgument, "tensor 'a': entry is [1]",
                    ParseImage(FileImage(R"({"a":[1]})")));
}

TEST(SafetensorsMalformedTest, MissingOrUnknownField) {
  EXPECT_STATUS_MSG(InvalidArgument, "tensor 'a': missing field 'data_offsets'",
                    ParseImage(FileImage("{" + Entry("a", R"("dtype":"U8","shape":[0])") + "}")));
  EXPECT_STATUS_MSG(
      InvalidArgument, "tensor 'a': unknown field 'stride'",
      ParseImage(FileImage(
          "{" + Entry("a", R"("dtype":"U8","shape":[0],"data_offsets":[0,0],"stride":1)") + "}")));
}

TEST(SafetensorsMalformedTest, UnknownDType) {
  const Status status = ParseImage(
      FileImage("{" + Entry("a", R"("dtype":"Q4","shape":[1],"data_offsets":[0,1])") + "}",
                std::vector<std::byte>(1)));
  EXPECT_STATUS_MSG(InvalidArgument, "tensor 'a': unknown dtype \"Q4\"", status);
  EXPECT_STATUS_MSG(InvalidArgument, "accepted: BOOL, U8", status);
  // ParseDType knows "bfloat16", but a header may only hold safetensors codes.
  EXPECT_STATUS_MSG(
      InvalidArgument, "unknown dtype \"bfloat16\"",
      ParseImage(FileImage(
          "{" + Entry("a", R"("dtype":"bfloat16","shape":[1],"data_offsets":[0,2])") + "}",
          std::vector<std::byte>(2))));
  EXPECT_STATUS_MSG(
      InvalidArgument, "unknown dtype 8",
      ParseImage(FileImage("{" + Entry("a", R"("dtype":8,"shape":[1],"data_offsets":[0,2])") + "}",
                           std::vector<std::byte>(2))));
}

TEST(SafetensorsMalformedTest, ShapeNotAnArrayOfNonNegativeIntegers) {
  const auto with_shape = [](std::string_view shape) {
    return ParseImage(FileImage(
        "{" + Entry("a", fmt::format(R"("dtype":"U8","shape":{},"data_offsets":[0,0])", shape)) +
        "}"));
  };
  EXPECT_STATUS_MSG(InvalidArgument, "tensor 'a': shape \"2\" is not an array",
                    with_shape("\"2\""));
  EXPECT_STATUS_MSG(InvalidArgument, "has extent -1", with_shape("[0,-1]"));
  EXPECT_STATUS_MSG(InvalidArgument, "has extent 1.5", with_shape("[1.5]"));
  EXPECT_STATUS_MSG(InvalidArgument, "has extent 9223372036854775808",
                    with_shape("[0,9223372036854775808]"));
  EXPECT_STATUS_MSG(InvalidArgument, "more than 2^63 elements",
                    with_shape("[4611686018427387904,4]"));
}

TEST(SafetensorsMalformedTest, OffsetsNotTwoOrderedNonNegativeIntegers) {
  const auto with_offsets = [](std::string_view offsets) {
    return ParseImage(FileImage(
        "{" + Entry("a", fmt::format(R"("dtype":"U8","shape":[4],"data_offsets":{})", offsets)) +
            "}",
        std::vector<std::byte>(8)));
  };
  EXPECT_STATUS_MSG(InvalidArgument, "tensor 'a': data_offsets [0] must be", with_offsets("[0]"));
  EXPECT_STATUS_MSG(InvalidArgument, "data_offsets [0,4,8] must be", with_offsets("[0,4,8]"));
  EXPECT_STATUS_MSG(InvalidArgument, "data_offsets [-4,0] must be", with_offsets("[-4,0]"));
  EXPECT_STATUS_MSG(InvalidArgument, "data_offsets [8,4] must be", with_offsets("[8,4]"));
  EXPECT_STATUS_MSG(InvalidArgument, "data_offsets \"0-4\" must be", with_offsets("\"0-4\""));
}

TEST(SafetensorsMalformedTest, EndBeyondDataSection) {
  EXPECT_STATUS_MSG(
      InvalidArgument, "tensor 'a': data_offsets [0,16] end beyond the data section of 8 bytes",
      ParseImage(
          FileImage("{" + Entry("a", R"("dtype":"U8","shape":[16],"data_offsets":[0,16])") + "}",
                    std::vector<std::byte>(8))));
}

TEST(SafetensorsMalformedTest, ByteRangeDoesNotMatchShape) {
  EXPECT_STATUS_MSG(InvalidArgument,
                    "tensor 'a': shape [3] of F32 has 3 elements of 4 bytes, but data_offsets "
                    "[0,8] span 8 bytes",
                    ParseImage(FileImage(
                        "{" + Entry("a", R"("dtype":"F32","shape":[3],"data_offsets":[0,8])") + "}",
                        std::vector<std::byte>(8))));
}

TEST(SafetensorsMalformedTest, OverlappingTensors) {
  EXPECT_STATUS_MSG(
      InvalidArgument, "tensor 'b' at data_offsets [4, 12] overlaps tensor 'a' at [0, 8]",
      ParseImage(
          FileImage("{" + Entry("a", R"("dtype":"F32","shape":[2],"data_offsets":[0,8])") + "," +
                        Entry("b", R"("dtype":"F32","shape":[2],"data_offsets":[4,12])") + "}",
                    std::vector<std::byte>(12))));
  // A zero-byte tensor inside another one overlaps it too.
  EXPECT_STATUS_MSG(
      InvalidArgument, "tensor 'z' at data_offsets [4, 4] overlaps tensor 'a'",
      ParseImage(
          FileImage("{" + Entry("a", R"("dtype":"F32","shape":[2],"data_offsets":[0,8])") + "," +
                        Entry("z", R"("dtype":"F32","shape":[0],"data_offsets":[4,4])") + "}",
                    std::vector<std::byte>(8))));
}

TEST(SafetensorsMalformedTest, GapBetweenTensors) {
  EXPECT_STATUS_MSG(
      InvalidArgument, "4 unused bytes at data offset 4 before tensor 'b'",
      ParseImage(
          FileImage("{" + Entry("a", R"("dtype":"F32","shape":[1],"data_offsets":[0,4])") + "," +
                        Entry("b", R"("dtype":"F32","shape":[1],"data_offsets":[8,12])") + "}",
                    std::vector<std::byte>(12))));
}

TEST(SafetensorsMalformedTest, UnusedBytesAtTheEnd) {
  EXPECT_STATUS_MSG(InvalidArgument, "4 unused bytes at the end of the data section of 8 bytes",
                    ParseImage(FileImage(
                        "{" + Entry("a", R"("dtype":"F32","shape":[1],"data_offsets":[0,4])") + "}",
                        std::vector<std::byte>(8))));
  EXPECT_STATUS_MSG(InvalidArgument, "3 unused bytes at the end",
                    ParseImage(FileImage("{}", std::vector<std::byte>(3))));
}

TEST(SafetensorsMalformedTest, DuplicateNames) {
  const std::string entry = Entry("a", R"("dtype":"U8","shape":[0],"data_offsets":[0,0])");
  EXPECT_STATUS_MSG(InvalidArgument, "duplicate tensor name 'a'",
                    ParseImage(FileImage("{" + entry + "," + entry + "}")));
  EXPECT_STATUS_MSG(
      InvalidArgument, "duplicate key 'shape'",
      ParseImage(FileImage(
          "{" + Entry("a", R"("dtype":"U8","shape":[0],"shape":[0],"data_offsets":[0,0])") + "}")));
}

TEST(SafetensorsMalformedTest, MetadataNotAMapOfStrings) {
  EXPECT_STATUS_MSG(InvalidArgument, "__metadata__ value of 'step' is 7, expected a string",
                    ParseImage(FileImage(R"({"__metadata__":{"step":7}})")));
  EXPECT_STATUS_MSG(InvalidArgument, "__metadata__ is \"pt\", expected an object",
                    ParseImage(FileImage(R"({"__metadata__":"pt"})")));
}

TEST(SafetensorsMalformedTest, QuotedValuesAreShortened) {
  const std::string long_dtype(1000, 'X');
  const Status status = ParseImage(FileImage(
      "{" +
      Entry("a", fmt::format(R"("dtype":"{}","shape":[0],"data_offsets":[0,0])", long_dtype)) +
      "}"));
  EXPECT_STATUS_MSG(InvalidArgument, "XXX...", status);
  EXPECT_LT(status.message().size(), 400u);
}

// ---------------------------------------------------------------------------------------------
// MappedFile

class MappedFileTest : public SafetensorsTest {};

TEST_F(MappedFileTest, ReadOnlyMapsTheFileContents) {
  const std::string path = WriteFile("ro.bin", ToBytes("hello, map"));
  ASSERT_OK_AND_ASSIGN(auto mapped, MappedFile::OpenReadOnly(path));
  EXPECT_EQ(mapped->size(), 10u);
  EXPECT_TRUE(SameBytes(std::as_const(*mapped).bytes(), ToBytes("hello, map")));
}

TEST_F(MappedFileTest, ReadWriteChangesReachTheFile) {
  const std::string path = WriteFile("rw.bin", ToBytes("abcdef"));
  {
    ASSERT_OK_AND_ASSIGN(auto mapped, MappedFile::OpenReadWrite(path));
    mapped->bytes()[2] = std::byte{'X'};
  }
  EXPECT_EQ(ReadFile(path), ToBytes("abXdef"));
}

TEST_F(MappedFileTest, CopyOnWriteChangesStayInMemory) {
  const std::string path = WriteFile("cow.bin", ToBytes("abcdef"));
  {
    ASSERT_OK_AND_ASSIGN(auto mapped, MappedFile::OpenCopyOnWrite(path));
    mapped->bytes()[2] = std::byte{'X'};
    EXPECT_TRUE(SameBytes(mapped->bytes(), ToBytes("abXdef")));
    EXPECT_EQ(ReadFile(path), ToBytes("abcdef"));
  }
  EXPECT_EQ(ReadFile(path), ToBytes("abcdef"));
}

TEST_F(MappedFileTest, CreateTemporaryIsZeroFilledWritableAndUnnamed) {
  constexpr size_t kSize = 3 * 4096 + 5;  // spans several pages, not a whole number of them
  ASSERT_OK_AND_ASSIGN(auto mapped, MappedFile::CreateTemporary(dir_.string(), kSize));
  ASSERT_EQ(mapped->size(), kSize);
  std::span<std::byte> bytes = mapped->bytes();
  EXPECT_TRUE(
      std::all_of(bytes.begin(), bytes.end(), [](std::byte b) { return b == std::byte{0}; }));
  for (size_t i = 0; i < kSize; ++i) {
    bytes[i] = static_cast<std::byte>(i);
  }
  for (size_t i = 0; i < kSize; ++i) {
    ASSERT_EQ(bytes[i], static_cast<std::byte>(i)) << i;
  }
  EXPECT_TRUE(DirEntries().empty());
}

TEST_F(MappedFileTest, CreateTemporaryOfZeroBytesIsEmpty) {
  ASSERT_OK_AND_ASSIGN(auto mapped, MappedFile::CreateTemporary(dir_.string(), 0));
  EXPECT_EQ(mapped->size(), 0u);
  EXPECT_TRUE(mapped->bytes().empty());
}

TEST_F(MappedFileTest, CreateTemporaryInMissingDirectoryIsIoError) {
  EXPECT_STATUS_MSG(IoError, "no-such-dir", MappedFile::CreateTemporary(PathOf("no-such-dir"), 16));
}

TEST_F(MappedFileTest, EmptyFileMapsToAnEmptySpan) {
  const std::string path = WriteFile("empty.bin", {});
  ASSERT_OK_AND_ASSIGN(auto read_only, MappedFile::OpenReadOnly(path));
  EXPECT_EQ(read_only->size(), 0u);
  EXPECT_TRUE(std::as_const(*read_only).bytes().empty());
  ASSERT_OK_AND_ASSIGN(auto read_write, MappedFile::OpenReadWrite(path));
  EXPECT_TRUE(read_write->bytes().empty());
}

TEST_F(MappedFileTest, MissingFileIsIoErrorNamingThePath) {
  const std::string path = PathOf("missing.bin");
  EXPECT_STATUS_MSG(IoError, path, MappedFile::OpenReadOnly(path));
  EXPECT_STATUS_MSG(IoError, path, MappedFile::OpenReadWrite(path));
  EXPECT_STATUS_MSG(IoError, path, MappedFile::OpenCopyOnWrite(path));
}

TEST_F(MappedFileTest, DirectoryIsIoError) {
  EXPECT_STATUS_MSG(IoError, "not a regular file", MappedFile::OpenReadOnly(dir_.string()));
}

}  // namespace
}  // namespace refit
