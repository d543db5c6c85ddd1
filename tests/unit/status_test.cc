#include <cerrno>
#include <cstring>
#include <memory>
#include <set>
#include <string>
#include <utility>

#include "refit/status.h"
#include "refit/status_format.h"
#include "test_util.h"

namespace refit {
namespace {

TEST(StatusTest, DefaultIsOk) {
  Status status;
  EXPECT_TRUE(status.ok());
  EXPECT_EQ(status.code(), StatusCode::kOk);
  EXPECT_EQ(status.message(), "");
  EXPECT_EQ(status.ToString(), "OK");
  EXPECT_EQ(status, Status::OK());
}

TEST(StatusTest, EveryCodeHasItsOwnName) {
  const std::pair<StatusCode, std::string_view> expected[] = {
      {StatusCode::kOk, "OK"},
      {StatusCode::kInvalidArgument, "InvalidArgument"},
      {StatusCode::kDataLoss, "DataLoss"},
      {StatusCode::kFailedPrecondition, "FailedPrecondition"},
      {StatusCode::kUnavailable, "Unavailable"},
      {StatusCode::kDeadlineExceeded, "DeadlineExceeded"},
      {StatusCode::kResourceExhausted, "ResourceExhausted"},
      {StatusCode::kCancelled, "Cancelled"},
      {StatusCode::kPermissionDenied, "PermissionDenied"},
      {StatusCode::kNotFound, "NotFound"},
      {StatusCode::kAlreadyExists, "AlreadyExists"},
      {StatusCode::kIoError, "IoError"},
      {StatusCode::kInternal, "Internal"},
  };
  std::set<std::string_view> names;
  for (const auto& [code, name] : expected) {
    EXPECT_EQ(StatusCodeName(code), name);
    names.insert(StatusCodeName(code));
  }
  EXPECT_EQ(names.size(), std::size(expected));
}

TEST(StatusTest, FactoriesSetCodeAndFormatMessage) {
  const Status status = DataLoss("payload {} of producer {}: checksum mismatch", 7, 2);
  EXPECT_FALSE(status.ok());
  EXPECT_EQ(status.code(), StatusCode::kDataLoss);
  EXPECT_EQ(status.message(), "payload 7 of producer 2: checksum mismatch");
  EXPECT_EQ(status.ToString(), "DataLoss: payload 7 of producer 2: checksum mismatch");

  EXPECT_EQ(InvalidArgument("x").code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(FailedPrecondition("x").code(), StatusCode::kFailedPrecondition);
  EXPECT_EQ(Unavailable("x").code(), StatusCode::kUnavailable);
  EXPECT_EQ(DeadlineExceeded("x").code(), StatusCode::kDeadlineExceeded);
  EXPECT_EQ(ResourceExhausted("x").code(), StatusCode::kResourceExhausted);
  EXPECT_EQ(Cancelled("x").code(), StatusCode::kCancelled);
  EXPECT_EQ(PermissionDenied("x").code(), StatusCode::kPermissionDenied);
  EXPECT_EQ(NotFound("x").code(), StatusCode::kNotFound);
  EXPECT_EQ(AlreadyExists("x").code(), StatusCode::kAlreadyExists);
  EXPECT_EQ(IoError("x").code(), StatusCode::kIoError);
  EXPECT_EQ(Internal("x").code(), StatusCode::kInternal);
}

TEST(StatusTest, ConstructingWithOkCodeIsOk) {
  const Status status(StatusCode::kOk, "ignored");
  EXPECT_TRUE(status.ok());
  EXPECT_EQ(status.message(), "");
}

TEST(StatusTest, EqualityComparesCodeAndMessage) {
  EXPECT_EQ(NotFound("tensor 'a'"), NotFound("tensor 'a'"));
  EXPECT_NE(NotFound("tensor 'a'"), NotFound("tensor 'b'"));
  EXPECT_NE(NotFound("tensor 'a'"), InvalidArgument("tensor 'a'"));
  EXPECT_NE(NotFound("tensor 'a'"), Status::OK());
}

TEST(StatusTest, CopiesAreIndependentValues) {
  Status original = Unavailable("peer 3 down");
  const Status copy = original;
  original = Status::OK();
  EXPECT_TRUE(original.ok());
  EXPECT_EQ(copy.code(), StatusCode::kUnavailable);
  EXPECT_EQ(copy.message(), "peer 3 down");
}

TEST(StatusTest, WithContextPrefixesErrorsAndKeepsOk) {
  const Status status = DataLoss("checksum mismatch").WithContext("payload 7");
  EXPECT_EQ(status.code(), StatusCode::kDataLoss);
  EXPECT_EQ(status.message(), "payload 7: checksum mismatch");
  EXPECT_EQ(status.WithContext("transfer 1").message(), "transfer 1: payload 7: checksum mismatch");
  EXPECT_TRUE(Status::OK().WithContext("payload 7").ok());
}

TEST(StatusTest, IoErrorFromErrnoAppendsTheSystemMessage) {
  const Status status = IoErrorFromErrno(ENOENT, "open '/no/such/file'");
  EXPECT_EQ(status.code(), StatusCode::kIoError);
  EXPECT_EQ(status.message(), std::string("open '/no/such/file': ") + std::strerror(ENOENT));
}

TEST(ResultTest, HoldsAValue) {
  Result<std::string> result(std::string("weights"));
  ASSERT_TRUE(result.ok());
  EXPECT_TRUE(result.status().ok());
  EXPECT_EQ(*result, "weights");
  EXPECT_EQ(result->size(), 7u);
  EXPECT_EQ(result.ValueOrDie(), "weights");
  EXPECT_EQ(result.MoveValueUnsafe(), "weights");
}

TEST(ResultTest, HoldsAnError) {
  const Result<int> result = NotFound("tensor '{}'", "lm_head.weight");
  EXPECT_FALSE(result.ok());
  EXPECT_EQ(result.status(), NotFound("tensor 'lm_head.weight'"));
}

TEST(ResultTest, MoveOnlyValues) {
  Result<std::unique_ptr<int>> result(std::make_unique<int>(42));
  ASSERT_TRUE(result.ok());
  std::unique_ptr<int> value = std::move(result).ValueOrDie();
  ASSERT_NE(value, nullptr);
  EXPECT_EQ(*value, 42);
}

TEST(ResultTest, OkStatusBecomesInternalError) {
  const Result<int> result = Status::OK();
  EXPECT_FALSE(result.ok());
  EXPECT_EQ(result.status().code(), StatusCode::kInternal);
  EXPECT_NE(result.status().message().find("OK Status"), std::string::npos);
}

// Helpers for the macro tests: each records how far it got, so a test can tell an early return
// from a fall-through.
Status FailIf(bool fail) { return fail ? DataLoss("bad chunk") : Status::OK(); }

Result<int> ParseIf(bool fail) {
  if (fail) return InvalidArgument("not a number");
  return 7;
}

Status ReturnNotOk(bool fail_status, bool fail_result, int* reached) {
  *reached = 0;
  REFIT_RETURN_NOT_OK(FailIf(fail_status));
  *reached = 1;
  REFIT_RETURN_NOT_OK(ParseIf(fail_result));
  *reached = 2;
  return Status::OK();
}

Result<int> AssignOrReturn(bool fail, int* reached) {
  *reached = 0;
  REFIT_ASSIGN_OR_RETURN(int value, ParseIf(fail));
  *reached = 1;
  // Two uses in one function must not collide on the hidden temporary's name.
  REFIT_ASSIGN_OR_RETURN(int second, ParseIf(false));
  return value + second;
}

Result<std::unique_ptr<int>> MakeBox(int value) { return std::make_unique<int>(value); }

Result<int> UnboxMoveOnly() {
  REFIT_ASSIGN_OR_RETURN(std::unique_ptr<int> box, MakeBox(5));
  return *box;
}

TEST(StatusMacrosTest, ReturnNotOkPropagatesStatusErrors) {
  int reached = -1;
  EXPECT_STATUS_MSG(DataLoss, "bad chunk", ReturnNotOk(true, false, &reached));
  EXPECT_EQ(reached, 0);
}

TEST(StatusMacrosTest, ReturnNotOkPropagatesResultErrors) {
  int reached = -1;
  EXPECT_STATUS_MSG(InvalidArgument, "not a number", ReturnNotOk(false, true, &reached));
  EXPECT_EQ(reached, 1);
}

TEST(StatusMacrosTest, ReturnNotOkContinuesOnOk) {
  int reached = -1;
  EXPECT_OK(ReturnNotOk(false, false, &reached));
  EXPECT_EQ(reached, 2);
}

TEST(StatusMacrosTest, AssignOrReturnAssignsOrPropagates) {
  int reached = -1;
  ASSERT_OK_AND_ASSIGN(const int sum, AssignOrReturn(false, &reached));
  EXPECT_EQ(sum, 14);
  EXPECT_EQ(reached, 1);

  EXPECT_STATUS(InvalidArgument, AssignOrReturn(true, &reached));
  EXPECT_EQ(reached, 0);
}

TEST(StatusMacrosTest, AssignOrReturnMovesMoveOnlyValues) {
  ASSERT_OK_AND_ASSIGN(const int value, UnboxMoveOnly());
  EXPECT_EQ(value, 5);
}

}  // namespace
}  // namespace refit
