// A raw ZeroMQ DEALER for tests that speak the zmq:// protocol (or not) by hand: to send what
// no correct sender would, and read the relay's reply frames.
#pragma once

#include <zmq.h>

#include <string>
#include <vector>

#include <gtest/gtest.h>

namespace refit::testing {

class RawZmqClient {
 public:
  // `plain_password`: present it in a PLAIN handshake (what a keyed relay requires: the
  // PlainPassword of its api key); empty: the NULL mechanism.
  explicit RawZmqClient(const std::string& endpoint, const std::string& plain_password = "")
      : context_(zmq_ctx_new()), socket_(zmq_socket(context_, ZMQ_DEALER)) {
    const int linger = 0;
    zmq_setsockopt(socket_, ZMQ_LINGER, &linger, sizeof(linger));
    if (!plain_password.empty()) {
      const std::string user = "refit";
      EXPECT_EQ(zmq_setsockopt(socket_, ZMQ_PLAIN_USERNAME, user.data(), user.size()), 0);
      EXPECT_EQ(
          zmq_setsockopt(socket_, ZMQ_PLAIN_PASSWORD, plain_password.data(), plain_password.size()),
          0);
    }
    EXPECT_EQ(zmq_connect(socket_, ("tcp://" + endpoint).c_str()), 0);
  }
  ~RawZmqClient() {
    zmq_close(socket_);
    zmq_ctx_term(context_);
  }
  RawZmqClient(const RawZmqClient&) = delete;
  RawZmqClient& operator=(const RawZmqClient&) = delete;

  void Send(const std::vector<std::string>& frames) {
    for (size_t i = 0; i < frames.size(); ++i) {
      EXPECT_GE(zmq_send(socket_, frames[i].data(), frames[i].size(),
                         i + 1 < frames.size() ? ZMQ_SNDMORE : 0),
                0);
    }
  }

  // Send `frames` unless ZeroMQ cannot take them within `wait_ms`: a DEALER whose handshake was
  // refused may have no connection to queue them on, and then a blocking send never returns.
  // Returns whether every frame was taken.
  bool TrySend(const std::vector<std::string>& frames, int wait_ms) {
    zmq_setsockopt(socket_, ZMQ_SNDTIMEO, &wait_ms, sizeof(wait_ms));
    bool sent = true;
    for (size_t i = 0; i < frames.size() && sent; ++i) {
      sent = zmq_send(socket_, frames[i].data(), frames[i].size(),
                      i + 1 < frames.size() ? ZMQ_SNDMORE : 0) >= 0;
    }
    const int forever = -1;
    zmq_setsockopt(socket_, ZMQ_SNDTIMEO, &forever, sizeof(forever));
    return sent;
  }

  // The next reply's frames, or empty after `wait_ms` without one.
  std::vector<std::string> Receive(int wait_ms) {
    zmq_pollitem_t item{socket_, 0, ZMQ_POLLIN, 0};
    if (zmq_poll(&item, 1, wait_ms) <= 0) return {};
    std::vector<std::string> frames;
    int more = 1;
    while (more != 0) {
      zmq_msg_t message;
      zmq_msg_init(&message);
      EXPECT_GE(zmq_msg_recv(&message, socket_, 0), 0);
      frames.emplace_back(static_cast<const char*>(zmq_msg_data(&message)), zmq_msg_size(&message));
      more = zmq_msg_more(&message);
      zmq_msg_close(&message);
    }
    return frames;
  }

 private:
  void* context_;
  void* socket_;
};

}  // namespace refit::testing
