#include "util/environment.h"

#include <gtest/gtest.h>

#include <stdlib.h>

#include <string>

#include "test_util.h"

namespace refit {
namespace {

constexpr const char* kVariable = "REFIT_ENVIRONMENT_TEST_SECRET";

// Sets the test's variable for the scope of a test, and removes it afterwards.
class ScopedVariable {
 public:
  explicit ScopedVariable(const char* value) { ::setenv(kVariable, value, /*overwrite=*/1); }
  ~ScopedVariable() { ::unsetenv(kVariable); }
  ScopedVariable(const ScopedVariable&) = delete;
  ScopedVariable& operator=(const ScopedVariable&) = delete;
};

TEST(EnvironmentTest, ReturnsTheSecretTheVariableHolds) {
  ScopedVariable secret("s3cr3t key");
  ASSERT_OK_AND_ASSIGN(std::string value, SecretFromEnvironment(kVariable, "--api-key-env"));
  EXPECT_EQ(value, "s3cr3t key");
}

TEST(EnvironmentTest, UnsetAndEmptyAreRefusedNamingTheVariableAndTheSetting) {
  ::unsetenv(kVariable);
  EXPECT_STATUS_MSG(InvalidArgument,
                    "environment variable REFIT_ENVIRONMENT_TEST_SECRET (--api-key-env) is unset "
                    "or empty",
                    SecretFromEnvironment(kVariable, "--api-key-env"));
  // An empty key would turn authentication off without a word.
  ScopedVariable empty("");
  EXPECT_STATUS_MSG(InvalidArgument, "unset or empty",
                    SecretFromEnvironment(kVariable, "http_refit_api_key_env_var"));
}

TEST(EnvironmentTest, NamesNoVariableCanHaveAreRefused) {
  ScopedVariable secret("value");
  EXPECT_STATUS(InvalidArgument, SecretFromEnvironment("", "--api-key-env"));
  // getenv would stop at the NUL and read the test's variable.
  EXPECT_STATUS(InvalidArgument,
                SecretFromEnvironment(std::string(kVariable) + std::string(1, '\0') + "X", "x"));
  EXPECT_STATUS(InvalidArgument, SecretFromEnvironment("A=B", "x"));
}

}  // namespace
}  // namespace refit
