#include "util/bounded_queue.h"

#include <atomic>
#include <chrono>
#include <cstdint>
#include <memory>
#include <optional>
#include <stop_token>
#include <thread>
#include <vector>

#include "test_util.h"

namespace refit::internal {
namespace {

// How long a test lets a thread run before checking that it is still blocked. A blocked call
// stays blocked however long we wait, so this only sets how likely a wrongly non-blocking queue
// is to be caught; it can never make a correct queue fail.
constexpr auto kSettleTime = std::chrono::milliseconds(50);

TEST(BoundedQueueTest, FifoOrder) {
  BoundedQueue<int> queue(4);
  for (int i = 0; i < 4; ++i) ASSERT_OK(queue.Push(i));
  EXPECT_EQ(queue.size(), 4u);
  EXPECT_EQ(queue.capacity(), 4u);
  for (int i = 0; i < 4; ++i) EXPECT_EQ(queue.Pop(), i);
  EXPECT_EQ(queue.size(), 0u);
}

TEST(BoundedQueueTest, RingWrapsAround) {
  BoundedQueue<int> queue(3);
  for (int round = 0; round < 5; ++round) {
    ASSERT_OK(queue.Push(2 * round));
    ASSERT_OK(queue.Push(2 * round + 1));
    EXPECT_EQ(queue.Pop(), 2 * round);
    EXPECT_EQ(queue.Pop(), 2 * round + 1);
  }
}

TEST(BoundedQueueTest, TryPushReportsFullAndKeepsTheValue) {
  BoundedQueue<std::unique_ptr<int>> queue(1, "apply queue");
  ASSERT_OK(queue.TryPush(std::make_unique<int>(1)));
  auto value = std::make_unique<int>(2);
  EXPECT_STATUS_MSG(ResourceExhausted, "apply queue is full at capacity 1",
                    queue.TryPush(std::move(value)));
  // A failed TryPush does not consume its argument, so the caller can retry with it.
  ASSERT_NE(value, nullptr);  // NOLINT(bugprone-use-after-move): documented to be untouched
  EXPECT_EQ(*value, 2);
  EXPECT_EQ(queue.size(), 1u);
}

TEST(BoundedQueueTest, TryPopOnEmptyReturnsNothing) {
  BoundedQueue<int> queue(2);
  EXPECT_EQ(queue.TryPop(), std::nullopt);
  ASSERT_OK(queue.TryPush(9));
  EXPECT_EQ(queue.TryPop(), 9);
  EXPECT_EQ(queue.TryPop(), std::nullopt);
}

TEST(BoundedQueueTest, FullQueueBlocksProducerUntilAPop) {
  BoundedQueue<int> queue(2);
  ASSERT_OK(queue.Push(0));
  ASSERT_OK(queue.Push(1));
  std::atomic<bool> pushed{false};
  std::jthread producer([&] {
    EXPECT_OK(queue.Push(2));
    pushed = true;
  });
  std::this_thread::sleep_for(kSettleTime);
  EXPECT_FALSE(pushed) << "Push returned while the queue was full";
  EXPECT_EQ(queue.size(), 2u);

  EXPECT_EQ(queue.Pop(), 0);
  producer.join();
  EXPECT_TRUE(pushed);
  EXPECT_EQ(queue.Pop(), 1);
  EXPECT_EQ(queue.Pop(), 2);
}

TEST(BoundedQueueTest, EmptyQueueBlocksConsumerUntilAPush) {
  BoundedQueue<int> queue(2);
  std::atomic<bool> popped{false};
  std::optional<int> value;
  std::jthread consumer([&] {
    value = queue.Pop();
    popped = true;
  });
  std::this_thread::sleep_for(kSettleTime);
  EXPECT_FALSE(popped) << "Pop returned while the queue was empty";
  ASSERT_OK(queue.Push(5));
  consumer.join();
  EXPECT_EQ(value, 5);
}

TEST(BoundedQueueTest, CloseWakesBlockedProducersAndConsumers) {
  BoundedQueue<int> empty(1, "empty queue");
  BoundedQueue<int> full(1, "full queue");
  ASSERT_OK(full.Push(0));

  constexpr int kWaiters = 3;
  std::atomic<int> consumers_woken{0};
  std::atomic<int> producers_cancelled{0};
  std::vector<std::jthread> threads;
  for (int i = 0; i < kWaiters; ++i) {
    threads.emplace_back([&] {
      if (empty.Pop() == std::nullopt) ++consumers_woken;
    });
    threads.emplace_back([&] {
      Status status = full.Push(1);
      if (status.code() == StatusCode::kCancelled) ++producers_cancelled;
      EXPECT_NE(status.message().find("full queue is closed"), std::string::npos)
          << status.ToString();
    });
  }
  std::this_thread::sleep_for(kSettleTime);
  EXPECT_EQ(consumers_woken, 0);
  EXPECT_EQ(producers_cancelled, 0);

  empty.Close();
  full.Close();
  for (std::jthread& thread : threads) thread.join();
  EXPECT_EQ(consumers_woken, kWaiters);
  EXPECT_EQ(producers_cancelled, kWaiters);
  EXPECT_TRUE(full.closed());
}

TEST(BoundedQueueTest, CloseStillDrainsQueuedElements) {
  BoundedQueue<int> queue(3);
  ASSERT_OK(queue.Push(1));
  ASSERT_OK(queue.Push(2));
  queue.Close();
  queue.Close();  // idempotent
  EXPECT_STATUS(Cancelled, queue.Push(3));
  EXPECT_STATUS(Cancelled, queue.TryPush(3));
  EXPECT_EQ(queue.Pop(), 1);
  EXPECT_EQ(queue.TryPop(), 2);
  EXPECT_EQ(queue.Pop(), std::nullopt);
}

TEST(BoundedQueueTest, StopTokenCancelsABlockedPop) {
  BoundedQueue<int> queue(1);
  std::optional<int> value = 0;
  std::jthread consumer([&](std::stop_token stop) { value = queue.Pop(stop); });
  std::this_thread::sleep_for(kSettleTime);
  consumer.request_stop();
  consumer.join();
  EXPECT_EQ(value, std::nullopt);
  // Stopping one caller does not close the queue for others.
  EXPECT_FALSE(queue.closed());
  ASSERT_OK(queue.Push(4));
  EXPECT_EQ(queue.Pop(), 4);
}

TEST(BoundedQueueTest, StopTokenCancelsABlockedPush) {
  BoundedQueue<int> queue(1);
  ASSERT_OK(queue.Push(0));
  Status status;
  std::jthread producer([&](std::stop_token stop) { status = queue.Push(1, stop); });
  std::this_thread::sleep_for(kSettleTime);
  producer.request_stop();
  producer.join();
  EXPECT_STATUS_MSG(Cancelled, "stop requested", status);
  EXPECT_FALSE(queue.closed());
  EXPECT_EQ(queue.size(), 1u);
  EXPECT_EQ(queue.Pop(), 0);
}

TEST(BoundedQueueTest, StoppedTokenWinsOverAvailableElements) {
  BoundedQueue<int> queue(2);
  ASSERT_OK(queue.Push(1));
  std::stop_source stop;
  stop.request_stop();
  EXPECT_EQ(queue.Pop(stop.get_token()), std::nullopt);
  EXPECT_STATUS(Cancelled, queue.Push(2, stop.get_token()));
  EXPECT_EQ(queue.size(), 1u);
}

TEST(BoundedQueueTest, ManyProducersAndConsumersDeliverEveryElementOnce) {
  constexpr int kProducers = 4;
  constexpr int kConsumers = 4;
  constexpr uint64_t kPerProducer = 20000;
  // A small capacity keeps both sides blocking often, which is what the test exercises.
  BoundedQueue<uint64_t> queue(8);

  std::atomic<uint64_t> sum{0};
  std::atomic<uint64_t> count{0};
  std::vector<std::jthread> consumers;
  for (int c = 0; c < kConsumers; ++c) {
    consumers.emplace_back([&] {
      uint64_t local_sum = 0;
      uint64_t local_count = 0;
      while (std::optional<uint64_t> value = queue.Pop()) {
        local_sum += *value;
        ++local_count;
      }
      sum += local_sum;
      count += local_count;
    });
  }
  {
    std::vector<std::jthread> producers;
    for (int p = 0; p < kProducers; ++p) {
      producers.emplace_back([&, p] {
        // Producer p sends p*kPerProducer+1 … (p+1)*kPerProducer, so every value is distinct.
        for (uint64_t i = 1; i <= kPerProducer; ++i) {
          ASSERT_OK(queue.Push(p * kPerProducer + i));
        }
      });
    }
  }  // joins the producers
  queue.Close();
  for (std::jthread& consumer : consumers) consumer.join();

  constexpr uint64_t kTotal = kProducers * kPerProducer;
  EXPECT_EQ(count, kTotal);
  EXPECT_EQ(sum, kTotal * (kTotal + 1) / 2);
  EXPECT_EQ(queue.size(), 0u);
}

}  // namespace
}  // namespace refit::internal
