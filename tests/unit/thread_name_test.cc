#include "util/thread_name.h"

#include <gtest/gtest.h>
#include <pthread.h>

#include <array>
#include <string>
#include <thread>

namespace refit::internal {
namespace {

// The name a new thread gets from `name_it`, as the kernel reports it.
template <typename NameIt>
std::string NameOfThreadNamedBy(NameIt name_it) {
  std::string name;
  std::thread thread([&] {
    name_it();
    std::array<char, kMaxThreadNameBytes + 1> buffer{};
    if (pthread_getname_np(pthread_self(), buffer.data(), buffer.size()) == 0) {
      name = buffer.data();
    }
  });
  thread.join();
  return name;
}

TEST(ThreadNameTest, NamesTheCallingThread) {
  EXPECT_EQ(NameOfThreadNamedBy([] { NameCurrentThread("refit-apply"); }), "refit-apply");
}

TEST(ThreadNameTest, LongNamesAreCutToWhatLinuxKeeps) {
  // pthread_setname_np refuses a longer name outright (ERANGE); cutting keeps it named.
  EXPECT_EQ(NameOfThreadNamedBy([] { NameCurrentThread("refit-zmq-forwarder-thread"); }),
            "refit-zmq-forwa");
}

TEST(ThreadNameTest, PoolNamesKeepTheirIndex) {
  EXPECT_EQ(NameOfThreadNamedBy([] { NameCurrentThread("encode", 3); }), "encode-3");
  EXPECT_EQ(NameOfThreadNamedBy([] { NameCurrentThread("refit-serialize", 12); }),
            "refit-serial-12");
}

}  // namespace
}  // namespace refit::internal
