// The multi-rank test harness: runs a test body on N rank processes (this
// binary re-executed with the test's filter), with a timeout and every
// failing rank's output in the failure (multirank.h).
#include "support/multirank.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <signal.h>
#include <sys/file.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <sstream>
#include <thread>
#include <vector>

#include <gtest/gtest.h>

#include "shardtrain/error.h"
#include "support/test_scratch.h"

extern char** environ;

namespace shardtrain::testing {
namespace {

/// Calls of run_on_ranks are numbered per test, so a child (which runs only
/// its own test) and the parent (which may have run other tests before) agree.
int next_call_index(const std::string& test_name) {
  static std::string current_test;
  static int counter = 0;
  if (test_name != current_test) {
    current_test = test_name;
    counter = 0;
  }
  return counter++;
}

std::string self_exe() {
  char buffer[4096];
  ssize_t n = readlink("/proc/self/exe", buffer, sizeof(buffer) - 1);
  ST_CHECK(n > 0, "cannot read /proc/self/exe");
  buffer[n] = '\0';
  return buffer;
}

std::string current_test_filter() {
  const auto* info = ::testing::UnitTest::GetInstance()->current_test_info();
  ST_CHECK(info != nullptr, "run_on_ranks must be called from inside a TEST body");
  return std::string(info->test_suite_name()) + "." + info->name();
}

std::string read_file(const std::string& path) {
  std::ifstream in(path);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

std::string tail(const std::string& text, std::size_t max_chars) {
  return text.size() <= max_chars ? text : "...\n" + text.substr(text.size() - max_chars);
}

pid_t spawn(const std::vector<std::string>& args, const std::map<std::string, std::string>& extra_env,
            const std::string& output_path) {
  pid_t pid = fork();
  ST_CHECK(pid >= 0, "fork failed: ", std::strerror(errno));
  if (pid == 0) {
    // Only async-signal-safe work until exec.
    int fd = open(output_path.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
    if (fd >= 0) {
      dup2(fd, 1);
      dup2(fd, 2);
      close(fd);
    }
    setpgid(0, 0);
    for (const auto& [k, v] : extra_env) setenv(k.c_str(), v.c_str(), 1);
    std::vector<char*> argv;
    for (const auto& a : args) argv.push_back(const_cast<char*>(a.c_str()));
    argv.push_back(nullptr);
    execv(argv[0], argv.data());
    _exit(127);
  }
  return pid;
}

int decode_status(int status) {
  if (WIFEXITED(status)) return WEXITSTATUS(status);
  if (WIFSIGNALED(status)) return 128 + WTERMSIG(status);
  return -1;
}

/// SHARDTRAIN_TEST_TIME_SCALE (default 1) stretches both bounds of a
/// multi-rank test, for runs under valgrind or a sanitizer, which are tens of
/// times slower than the machine the bounds were chosen for.
double time_scale() {
  const char* text = std::getenv("SHARDTRAIN_TEST_TIME_SCALE");
  const double scale = text != nullptr ? std::atof(text) : 1.0;
  return scale >= 1.0 ? scale : 1.0;
}

template <typename Duration>
Duration scaled(Duration bound) {
  return Duration(static_cast<typename Duration::rep>(static_cast<double>(bound.count()) * time_scale()));
}

void run_child(int world_size, const std::function<void(RankContext&)>& body,
               const MultiRankOptions& options) {
  RankContext context;
  int code = 0;
  try {
    context.env = detect_dist_env();
    ST_CHECK(context.env.world_size == world_size, "child world size mismatch");
    if (!options.skip_init) {
      InitOptions init;
      init.backend = "gloo";
      init.timeout = scaled(options.comm_timeout);
      context.comm = init_distributed(context.env, init);
    }
    body(context);
    if (::testing::Test::HasFailure()) code = 1;
    mark_rank_body_ran();
  } catch (const std::exception& e) {
    std::fprintf(stderr, "rank %d threw: %s\n", context.env.rank, e.what());
    code = 2;
  }
  std::fflush(stdout);
  std::fflush(stderr);
  // Skip static destructors and the rest of the gtest run: the parent owns the verdict.
  std::_Exit(code);
}

}  // namespace

void mark_rank_body_ran() {
  // Proof for the parent that this rank really ran the body (a mismatched
  // call index would otherwise pass silently).
  if (const char* marker = std::getenv("SHARDTRAIN_TEST_RAN_MARKER")) {
    std::ofstream(marker) << "ran\n";
  }
}

bool is_rank_process() { return std::getenv("SHARDTRAIN_TEST_RANK_CALL") != nullptr; }

int try_loopback_connection(int port) {
  const int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (fd < 0) return -1;
  sockaddr_in address{};
  address.sin_family = AF_INET;
  address.sin_port = htons(static_cast<uint16_t>(port));
  address.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  if (::connect(fd, reinterpret_cast<sockaddr*>(&address), sizeof(address)) == 0) return fd;
  ::close(fd);
  return -1;
}

std::string listening_ipv4_address(int port) {
  std::ifstream table("/proc/net/tcp");
  std::string line;
  std::getline(table, line);  // the header
  char port_hex[8];
  std::snprintf(port_hex, sizeof(port_hex), "%04X", port);
  while (std::getline(table, line)) {
    std::istringstream fields(line);
    std::string slot, local, remote, state;
    fields >> slot >> local >> remote >> state;
    const std::size_t colon = local.find(':');
    if (state == "0A" && colon != std::string::npos && local.substr(colon + 1) == port_hex) return local.substr(0, colon);
  }
  return "";
}

namespace {

/// The lowest port the kernel hands out by itself (bind to port 0, or the
/// source port of a connect), from /proc/sys/net/ipv4/ip_local_port_range.
int ephemeral_port_floor() {
  std::ifstream range("/proc/sys/net/ipv4/ip_local_port_range");
  int low = 0;
  range >> low;
  return low > 0 ? low : 32768;
}

/// Whether nothing holds `port` on 127.0.0.1 right now. Without SO_REUSEADDR,
/// so a port that still has connections in TIME_WAIT counts as taken too.
bool port_is_free(int port) {
  const int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  ST_CHECK(fd >= 0, "socket() failed: ", std::strerror(errno));
  sockaddr_in address{};
  address.sin_family = AF_INET;
  address.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  address.sin_port = htons(static_cast<uint16_t>(port));
  const bool free = ::bind(fd, reinterpret_cast<sockaddr*>(&address), sizeof(address)) == 0;
  ::close(fd);
  return free;
}

/// One directory per user: another user's directory may not be writable.
std::string test_port_lock_dir() { return "/tmp/shardtrain-test-ports-" + std::to_string(::getuid()); }

}  // namespace

std::string test_port_lock_path(int port) { return test_port_lock_dir() + "/" + std::to_string(port) + ".lock"; }

// Why not bind to port 0 and close, as before: the kernel may hand that port
// out again, before this test's rank 0 listens on it, to the next test's
// bind(0) or as the source port of any connection (the gloo pairs of a test
// running beside this one open hundreds). A port below the ephemeral range is
// never handed out by the kernel, and a lock file per port, held until this
// process exits, keeps two test processes of this suite off the same port.
int pick_free_port() {
  static std::vector<int> held_locks;  // open until exit: closing one releases its port
  ::mkdir(test_port_lock_dir().c_str(), 0700);  // EEXIST is the usual case
  const int top = ephemeral_port_floor();
  const int bottom = std::max(1024, top - 10000);
  const int span = top - bottom;
  ST_CHECK(span > 0, "no ports below the ephemeral range (", top, ") to pick from");
  // Different processes start at different places, so they rarely contend for a lock.
  const int start = static_cast<int>((static_cast<unsigned>(::getpid()) * 2654435761u +
                                      static_cast<unsigned>(std::chrono::steady_clock::now().time_since_epoch().count())) %
                                     static_cast<unsigned>(span));
  for (int i = 0; i < span; ++i) {
    const int port = bottom + (start + i) % span;
    const int fd = ::open(test_port_lock_path(port).c_str(), O_RDWR | O_CREAT | O_CLOEXEC, 0666);
    if (fd < 0) continue;
    if (::flock(fd, LOCK_EX | LOCK_NB) != 0) {
      ::close(fd);
      continue;
    }
    if (!port_is_free(port)) {
      ::close(fd);
      continue;
    }
    held_locks.push_back(fd);
    return port;
  }
  ST_THROW(Error, "no free port in [", bottom, ", ", top, ") on 127.0.0.1 for a test job");
}

void run_on_ranks(int world_size, const std::function<void(RankContext&)>& body,
                  const MultiRankOptions& options) {
  const std::string filter = current_test_filter();
  const int call = next_call_index(filter);
  if (const char* which = std::getenv("SHARDTRAIN_TEST_RANK_CALL")) {
    if (std::atoi(which) == call) run_child(world_size, body, options);
    return;  // another call of the same test body: not ours
  }

  const std::string exe = self_exe();
  const int port = pick_free_port();
  const int local_world = options.local_world_size > 0 ? options.local_world_size : world_size;
  char dir_template[] = "/tmp/shardtrain-test-XXXXXX";
  ST_CHECK(mkdtemp(dir_template) != nullptr, "mkdtemp failed");
  const std::string dir = dir_template;
  const std::string scratch = test_scratch_dir().string();

  std::vector<pid_t> pids(world_size);
  std::vector<std::string> logs(world_size);
  for (int r = 0; r < world_size; ++r) {
    std::map<std::string, std::string> env = options.env;
    env["SHARDTRAIN_TEST_RANK_CALL"] = std::to_string(call);
    env["RANK"] = std::to_string(r);
    env["WORLD_SIZE"] = std::to_string(world_size);
    env["LOCAL_RANK"] = std::to_string(r % local_world);
    env["LOCAL_WORLD_SIZE"] = std::to_string(local_world);
    env["MASTER_ADDR"] = "127.0.0.1";
    env["MASTER_PORT"] = std::to_string(port);
    env["OMP_NUM_THREADS"] = "1";
    env["SHARDTRAIN_TEST_SCRATCH"] = scratch;
    // Every job authenticates, as under `shardtrain launch`; a test may set its own.
    env.emplace("SHARDTRAIN_RDZV_TOKEN", "multirank-test-token-" + std::to_string(port) + "-" + std::to_string(::getpid()));
    logs[r] = dir + "/rank" + std::to_string(r) + ".log";
    env["SHARDTRAIN_TEST_RAN_MARKER"] = dir + "/rank" + std::to_string(r) + ".ran";
    // The filter names this one test; a disabled test (one that another test
    // runs on purpose) runs only with the flag.
    pids[r] = spawn({exe, "--gtest_filter=" + filter, "--gtest_also_run_disabled_tests", "--gtest_brief=1"}, env,
                    logs[r]);
  }

  const auto deadline = std::chrono::steady_clock::now() + scaled(options.timeout);
  std::vector<int> codes(world_size, -1);
  int remaining = world_size;
  while (remaining > 0) {
    for (int r = 0; r < world_size; ++r) {
      if (codes[r] != -1) continue;
      int status = 0;
      if (waitpid(pids[r], &status, WNOHANG) == pids[r]) {
        codes[r] = decode_status(status);
        --remaining;
      }
    }
    if (remaining == 0) break;
    if (std::chrono::steady_clock::now() > deadline) {
      for (int r = 0; r < world_size; ++r) {
        if (codes[r] == -1) kill(-pids[r], SIGKILL);
      }
      for (int r = 0; r < world_size; ++r) {
        if (codes[r] == -1) {
          int status = 0;
          waitpid(pids[r], &status, 0);
          codes[r] = 1000;  // marker: killed by the harness
        }
      }
      break;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }

  for (int r = 0; r < world_size; ++r) {
    const std::string marker = dir + "/rank" + std::to_string(r) + ".ran";
    if (codes[r] == 0) {
      if (!std::ifstream(marker).good()) {
        ADD_FAILURE() << "rank " << r << " exited 0 without running the test body; its output:\n"
                      << tail(read_file(logs[r]), 3000);
      }
      std::remove(marker.c_str());
      continue;
    }
    std::remove(marker.c_str());
    std::string why = codes[r] == 1000 ? "was still running after the " +
                                              std::to_string(scaled(options.timeout).count()) + " s test timeout"
                                        : "exited with status " + std::to_string(codes[r]);
    ADD_FAILURE() << "rank " << r << " of " << world_size << " " << why << "; its output:\n"
                  << tail(read_file(logs[r]), 6000);
  }
  for (const auto& log : logs) std::remove(log.c_str());
  rmdir(dir.c_str());
}

CommandResult run_command(const std::string& command, std::chrono::seconds timeout) {
  CommandResult result;
  char path_template[] = "/tmp/shardtrain-cmd-XXXXXX";
  int fd = mkstemp(path_template);
  ST_CHECK(fd >= 0, "mkstemp failed");
  close(fd);
  const std::string output_path = path_template;
  auto start = std::chrono::steady_clock::now();
  pid_t pid = spawn({"/bin/sh", "-c", command}, {}, output_path);
  const auto deadline = start + timeout;
  int status = 0;
  while (true) {
    pid_t done = waitpid(pid, &status, WNOHANG);
    if (done == pid) {
      result.exit_code = decode_status(status);
      break;
    }
    if (std::chrono::steady_clock::now() > deadline) {
      kill(-pid, SIGKILL);
      waitpid(pid, &status, 0);
      result.timed_out = true;
      result.exit_code = decode_status(status);
      break;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  result.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  result.output = read_file(output_path);
  std::remove(output_path.c_str());
  return result;
}

}  // namespace shardtrain::testing
