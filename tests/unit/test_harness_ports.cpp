// The test harness's TCP ports (support/multirank.h): each multi-rank test
// job gets a port that neither the kernel nor another test process can take
// between the pick and rank 0's listen, so tests running side by side
// (ctest -j) never meet at one rendezvous or fail on a port in use.
#include <fcntl.h>
#include <netinet/in.h>
#include <sys/file.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>
#include <fstream>

#include <gtest/gtest.h>

#include "support/multirank.h"

namespace shardtrain::testing {
namespace {

TEST(UnitHarnessPorts, APickedPortIsBelowTheEphemeralRangeFreeAndLockedAgainstOtherTestProcesses) {
  // The kernel hands out ports from this range by itself (bind to port 0, a
  // connection's source port), so a port in it may be taken before rank 0
  // listens on it.
  std::ifstream range("/proc/sys/net/ipv4/ip_local_port_range");
  int ephemeral_low = 0;
  range >> ephemeral_low;
  ASSERT_GT(ephemeral_low, 0);

  const int port = pick_free_port();
  EXPECT_GE(port, 1024);
  EXPECT_LT(port, ephemeral_low);

  // Another process opening the lock file cannot take it: flock() locks of
  // two open file descriptions conflict, in one process as in two.
  const int other = ::open(test_port_lock_path(port).c_str(), O_RDWR | O_CLOEXEC);
  ASSERT_GE(other, 0) << test_port_lock_path(port);
  EXPECT_EQ(::flock(other, LOCK_EX | LOCK_NB), -1);
  EXPECT_EQ(errno, EWOULDBLOCK);
  ::close(other);

  // Held until exit: a second pick in this process takes another port.
  EXPECT_NE(pick_free_port(), port);

  // And rank 0 can listen on it.
  const int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  ASSERT_GE(fd, 0);
  sockaddr_in address{};
  address.sin_family = AF_INET;
  address.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  address.sin_port = htons(static_cast<uint16_t>(port));
  EXPECT_EQ(::bind(fd, reinterpret_cast<sockaddr*>(&address), sizeof(address)), 0);
  EXPECT_EQ(::listen(fd, 1), 0);
  ::close(fd);
}

}  // namespace
}  // namespace shardtrain::testing
