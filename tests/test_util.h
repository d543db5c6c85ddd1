// GoogleTest helpers for Status and Result.
#pragma once

#include <gtest/gtest.h>

#include "refit/status.h"

#define REFIT_TEST_CONCAT_IMPL(a, b) a##b
#define REFIT_TEST_CONCAT(a, b) REFIT_TEST_CONCAT_IMPL(a, b)

#define ASSERT_OK(expr)                                               \
  do {                                                                \
    ::refit::Status _st = ::refit::internal::ToStatus(expr);          \
    ASSERT_TRUE(_st.ok()) << #expr << " returned " << _st.ToString(); \
  } while (false)

#define EXPECT_OK(expr)                                               \
  do {                                                                \
    ::refit::Status _st = ::refit::internal::ToStatus(expr);          \
    EXPECT_TRUE(_st.ok()) << #expr << " returned " << _st.ToString(); \
  } while (false)

#define ASSERT_OK_AND_ASSIGN_IMPL(tmp, lhs, rexpr)                            \
  auto tmp = (rexpr);                                                         \
  ASSERT_TRUE(tmp.ok()) << #rexpr << " returned " << tmp.status().ToString(); \
  lhs = std::move(tmp).ValueOrDie()

#define ASSERT_OK_AND_ASSIGN(lhs, rexpr) \
  ASSERT_OK_AND_ASSIGN_IMPL(REFIT_TEST_CONCAT(_refit_test_result_, __LINE__), lhs, rexpr)

/// Expect `expr` (a Status or Result) to fail with StatusCode::k<status_code>.
#define EXPECT_STATUS(status_code, expr)                       \
  do {                                                         \
    ::refit::Status _st = ::refit::internal::ToStatus(expr);   \
    EXPECT_EQ(_st.code(), ::refit::StatusCode::k##status_code) \
        << #expr << " returned " << _st.ToString();            \
  } while (false)

/// Expect `expr` to fail with k<status_code> and a message containing `substring`.
#define EXPECT_STATUS_MSG(status_code, substring, expr)                     \
  do {                                                                      \
    ::refit::Status _st = ::refit::internal::ToStatus(expr);                \
    EXPECT_EQ(_st.code(), ::refit::StatusCode::k##status_code)              \
        << #expr << " returned " << _st.ToString();                         \
    EXPECT_NE(_st.message().find(substring), std::string::npos)             \
        << "message '" << _st.message() << "' lacks '" << substring << "'"; \
  } while (false)
