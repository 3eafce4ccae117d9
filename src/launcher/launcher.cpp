// `shardtrain launch`: starts this machine's workers of a job and supervises
// them the way torchrun / `accelerate launch` do: environment per rank,
// prefixed output, signals forwarded, the job ended when one worker fails.
//
// One piece: the Supervisor owns the workers, their pipes, the signal
// self-pipe and the subreaper, and every other type here exists to serve its
// poll loop; the options it is given are parsed apart (launch_options.cpp).

#include "launcher/launcher.h"

#include <fcntl.h>
#include <poll.h>
#include <sched.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <iterator>
#include <optional>
#include <sstream>
#include <string_view>
#include <utility>
#include <vector>

#include "shardtrain/error.h"

extern char** environ;

namespace shardtrain::launcher {
namespace {

using Clock = std::chrono::steady_clock;

constexpr std::size_t kReadChunk = 64 * 1024;
/// A worker that prints without newlines still gets its output shown (and
/// the launcher's memory bounded): past this size a partial line is emitted.
constexpr std::size_t kMaxPartialLine = 64 * 1024;
/// Safety net only: the self-pipe wakes poll() for every signal.
constexpr int kIdlePollMs = 1000;
constexpr int kSettlePollMs = 20;

std::string signal_name(int signal_number) {
  switch (signal_number) {
    case SIGHUP: return "SIGHUP";
    case SIGINT: return "SIGINT";
    case SIGQUIT: return "SIGQUIT";
    case SIGILL: return "SIGILL";
    case SIGTRAP: return "SIGTRAP";
    case SIGABRT: return "SIGABRT";
    case SIGBUS: return "SIGBUS";
    case SIGFPE: return "SIGFPE";
    case SIGKILL: return "SIGKILL";
    case SIGUSR1: return "SIGUSR1";
    case SIGSEGV: return "SIGSEGV";
    case SIGUSR2: return "SIGUSR2";
    case SIGPIPE: return "SIGPIPE";
    case SIGALRM: return "SIGALRM";
    case SIGTERM: return "SIGTERM";
    case SIGXCPU: return "SIGXCPU";
    case SIGXFSZ: return "SIGXFSZ";
    case SIGSYS: return "SIGSYS";
    default: return "signal";
  }
}

std::string describe_wait_status(int status) {
  std::ostringstream out;
  if (WIFEXITED(status)) {
    out << "exited with status " << WEXITSTATUS(status);
  } else if (WIFSIGNALED(status)) {
    out << "was killed by signal " << signal_name(WTERMSIG(status)) << " (" << WTERMSIG(status) << ")";
    if (WCOREDUMP(status)) out << ", core dumped";
  } else {
    out << "ended with wait status " << status;
  }
  return out.str();
}

/// Writes everything, retrying on EINTR and waiting out a non-blocking
/// target. Returns false when the reader is gone (EPIPE): the job keeps
/// running even if nobody reads its output any more.
bool write_all(int fd, const char* data, std::size_t size) {
  while (size > 0) {
    ssize_t n = ::write(fd, data, size);
    if (n > 0) {
      data += n;
      size -= static_cast<std::size_t>(n);
      continue;
    }
    if (n < 0 && errno == EINTR) continue;
    if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) {
      pollfd writable{fd, POLLOUT, 0};
      ::poll(&writable, 1, 100);
      continue;
    }
    return false;
  }
  return true;
}

void say(const std::string& message) {
  const std::string line = "shardtrain launch: " + message + "\n";
  write_all(STDERR_FILENO, line.data(), line.size());
}

void close_fd(int& fd) {
  if (fd >= 0) ::close(fd);
  fd = -1;
}

// ---- signals -------------------------------------------------------------

using SignalHandler = void (*)(int);

std::atomic<int> g_signal_pipe_write{-1};

extern "C" void forward_to_self_pipe(int signal_number) {
  const int saved_errno = errno;
  const unsigned char byte = static_cast<unsigned char>(signal_number);
  const int fd = g_signal_pipe_write.load(std::memory_order_relaxed);
  if (fd >= 0) {
    // A full pipe already holds a wake-up; dropping this byte loses nothing
    // that matters (SIGCHLD is answered by reaping everything).
    [[maybe_unused]] ssize_t ignored = ::write(fd, &byte, 1);
  }
  errno = saved_errno;
}

/// Routes SIGINT, SIGTERM, SIGHUP, SIGQUIT and SIGCHLD into a pipe that the
/// supervision loop polls (the self-pipe trick), and ignores SIGPIPE so a
/// closed output does not kill the launcher and orphan the job. SIGHUP (a
/// closed ssh session) and SIGQUIT stop the job as SIGTERM does, as torchrun
/// handles them; a SIGHUP the launcher inherited ignored (nohup) stays
/// ignored. Restores everything on destruction.
class SignalRouter {
 public:
  static constexpr int kHandled[] = {SIGINT, SIGTERM, SIGHUP, SIGQUIT, SIGCHLD};

  SignalRouter() {
    static std::atomic<bool> active{false};
    ST_CHECK(!active.exchange(true), "run_launch is already running in this process");
    active_flag_ = &active;
    if (::pipe2(pipe_, O_CLOEXEC | O_NONBLOCK) != 0) {
      active.store(false);
      ST_THROW(Error, "shardtrain launch: pipe2 failed: ", std::strerror(errno));
    }
    g_signal_pipe_write.store(pipe_[1]);
    struct sigaction action {};
    action.sa_handler = forward_to_self_pipe;
    sigemptyset(&action.sa_mask);
    action.sa_flags = SA_RESTART;
    for (int signal_number : kHandled) {
      struct sigaction with_flags = action;
      if (signal_number == SIGCHLD) with_flags.sa_flags |= SA_NOCLDSTOP;
      struct sigaction& previous = previous_[index_of(signal_number)];
      ::sigaction(signal_number, &with_flags, &previous);
      if (signal_number == SIGHUP && previous.sa_handler == SIG_IGN) ::sigaction(SIGHUP, &previous, nullptr);
    }
    struct sigaction ignore {};
    ignore.sa_handler = SIG_IGN;
    sigemptyset(&ignore.sa_mask);
    ::sigaction(SIGPIPE, &ignore, &previous_sigpipe_);
  }

  ~SignalRouter() {
    for (int signal_number : kHandled) ::sigaction(signal_number, &previous_[index_of(signal_number)], nullptr);
    ::sigaction(SIGPIPE, &previous_sigpipe_, nullptr);
    g_signal_pipe_write.store(-1);
    close_fd(pipe_[0]);
    close_fd(pipe_[1]);
    active_flag_->store(false);
  }

  SignalRouter(const SignalRouter&) = delete;
  SignalRouter& operator=(const SignalRouter&) = delete;

  int read_fd() const { return pipe_[0]; }

  std::vector<int> take_signals() {
    std::vector<int> signals;
    unsigned char buffer[64];
    while (true) {
      ssize_t n = ::read(pipe_[0], buffer, sizeof(buffer));
      if (n > 0) {
        signals.insert(signals.end(), buffer, buffer + n);
        continue;
      }
      if (n < 0 && errno == EINTR) continue;
      break;
    }
    return signals;
  }

  /// Sets a worker's dispositions. SIGINT and SIGTERM start at their
  /// default even when the launcher inherited them ignored (a non-interactive
  /// shell ignores SIGINT for `launch ... &`): the launcher forwards them
  /// deliberately and a worker that ignores them would only be SIGKILLed
  /// later. SIGCHLD and SIGPIPE go back to what the launcher inherited.
  void set_worker_dispositions_in_child() const {
    reset_in_child(SIGINT, SIG_DFL);
    reset_in_child(SIGTERM, SIG_DFL);
    reset_in_child(SIGCHLD, inherited_or_default(previous_[index_of(SIGCHLD)]));
    reset_in_child(SIGPIPE, inherited_or_default(previous_sigpipe_));
  }

 private:
  static int index_of(int signal_number) {
    for (int i = 0; i < static_cast<int>(std::size(kHandled)); ++i) {
      if (kHandled[i] == signal_number) return i;
    }
    return 0;
  }

  static SignalHandler inherited_or_default(const struct sigaction& inherited) {
    return inherited.sa_handler == SIG_IGN ? SIG_IGN : SIG_DFL;
  }

  // Runs between fork and exec: async-signal-safe calls only.
  static void reset_in_child(int signal_number, SignalHandler handler) {
    struct sigaction action {};
    action.sa_handler = handler;
    sigemptyset(&action.sa_mask);
    ::sigaction(signal_number, &action, nullptr);
  }

  int pipe_[2] = {-1, -1};
  struct sigaction previous_[std::size(kHandled)] {};
  struct sigaction previous_sigpipe_ {};
  std::atomic<bool>* active_flag_ = nullptr;
};

/// Orphans of a worker (its children whose parent died) are re-parented to
/// the launcher instead of init, so they can be reaped and the launcher can
/// tell when a worker's process group is really empty.
class ChildSubreaper {
 public:
  ChildSubreaper() {
    int previous = 0;
    if (::prctl(PR_GET_CHILD_SUBREAPER, &previous) == 0) was_subreaper_ = previous != 0;
    ::prctl(PR_SET_CHILD_SUBREAPER, 1);
  }
  ~ChildSubreaper() {
    if (!was_subreaper_) ::prctl(PR_SET_CHILD_SUBREAPER, 0);
  }
  ChildSubreaper(const ChildSubreaper&) = delete;
  ChildSubreaper& operator=(const ChildSubreaper&) = delete;

 private:
  bool was_subreaper_ = false;
};

// ---- worker output ---------------------------------------------------------

/// One worker stream (stdout or stderr) re-emitted line by line with the
/// worker's prefix, so that lines of different ranks never interleave.
class PrefixedStream {
 public:
  PrefixedStream(int read_fd, int target_fd, std::string prefix)
      : fd_(read_fd), target_fd_(target_fd), prefix_(std::move(prefix)) {}
  PrefixedStream(const PrefixedStream&) = delete;
  PrefixedStream& operator=(const PrefixedStream&) = delete;
  PrefixedStream(PrefixedStream&& other) noexcept { *this = std::move(other); }
  PrefixedStream& operator=(PrefixedStream&& other) noexcept {
    std::swap(fd_, other.fd_);
    target_fd_ = other.target_fd_;
    prefix_ = std::move(other.prefix_);
    pending_ = std::move(other.pending_);
    return *this;
  }
  ~PrefixedStream() { close_fd(fd_); }

  int fd() const { return fd_; }
  bool open() const { return fd_ >= 0; }

  /// One read (so a chatty worker cannot starve the others). Returns false
  /// when nothing more can be read now.
  bool read_some() {
    if (fd_ < 0) return false;
    char buffer[kReadChunk];
    ssize_t n = ::read(fd_, buffer, sizeof(buffer));
    if (n > 0) {
      pending_.append(buffer, static_cast<std::size_t>(n));
      emit_complete_lines();
      return true;
    }
    if (n < 0 && errno == EINTR) return true;
    if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) return false;
    finish();  // EOF or a broken pipe
    return false;
  }

  /// Reads what is already buffered in the pipe without waiting for EOF:
  /// a worker's descendants may keep the pipe open after it exited.
  void drain_available() {
    std::size_t budget = 16 * kReadChunk;
    while (fd_ >= 0 && budget >= kReadChunk && read_some()) budget -= kReadChunk;
    finish();
  }

  /// Emits the unterminated last line, if any, and closes the pipe.
  void finish() {
    if (!pending_.empty()) {
      pending_.push_back('\n');
      emit(pending_);
      pending_.clear();
    }
    close_fd(fd_);
  }

 private:
  void emit_complete_lines() {
    std::size_t newline = pending_.rfind('\n');
    if (newline == std::string::npos) {
      if (pending_.size() >= kMaxPartialLine) {
        pending_.push_back('\n');
        emit(pending_);
        pending_.clear();
      }
      return;
    }
    emit(std::string_view(pending_).substr(0, newline + 1));
    pending_.erase(0, newline + 1);
  }

  // `text` is whole lines, each ending in '\n'.
  void emit(std::string_view text) {
    std::string out;
    out.reserve(text.size() + prefix_.size() * 8);
    std::size_t start = 0;
    while (start < text.size()) {
      std::size_t end = text.find('\n', start);
      out += prefix_;
      out.append(text.substr(start, end - start + 1));
      start = end + 1;
    }
    if (!reader_gone_) reader_gone_ = !write_all(target_fd_, out.data(), out.size());
  }

  int fd_ = -1;
  int target_fd_ = -1;
  std::string prefix_;
  std::string pending_;
  bool reader_gone_ = false;
};

// ---- workers ----------------------------------------------------------------

struct Worker {
  int rank = 0;
  int local_rank = 0;
  /// Also the id of the worker's process group.
  pid_t pid = -1;
  bool exited = false;
  int wait_status = 0;
  std::vector<PrefixedStream> streams;
};

struct Pipe {
  int read = -1;
  int write = -1;
  Pipe() {
    int fds[2];
    if (::pipe2(fds, O_CLOEXEC) != 0) ST_THROW(Error, "shardtrain launch: pipe2 failed: ", std::strerror(errno));
    read = fds[0];
    write = fds[1];
  }
  ~Pipe() {
    close_fd(read);
    close_fd(write);
  }
  Pipe(const Pipe&) = delete;
  Pipe& operator=(const Pipe&) = delete;
};

/// Environment block for execvp: the launcher's own environment with the
/// worker's variables set, overridden or (empty value) removed.
std::vector<std::string> build_environment(const std::map<std::string, std::string>& overrides) {
  std::vector<std::string> entries;
  for (char** entry = environ; entry != nullptr && *entry != nullptr; ++entry) {
    std::string_view text(*entry);
    std::string name(text.substr(0, text.find('=')));
    if (overrides.count(name) == 0) entries.emplace_back(text);
  }
  for (const auto& [name, value] : overrides) {
    if (!value.empty()) entries.push_back(name + "=" + value);
  }
  return entries;
}

/// Starts every local worker and supervises them; owns their lifetime, so
/// an exception never leaves a worker behind.
class Supervisor {
 public:
  explicit Supervisor(const LaunchOptions& options) : options_(options) {}

  ~Supervisor() {
    // Only reached with live workers on an error path (exception).
    bool any_running = false;
    for (auto& worker : workers_) {
      if (!worker.exited && worker.pid > 0) {
        ::kill(-worker.pid, SIGKILL);
        any_running = true;
      }
    }
    if (any_running) {
      for (auto& worker : workers_) {
        if (!worker.exited && worker.pid > 0) {
          int status = 0;
          while (::waitpid(worker.pid, &status, 0) < 0 && errno == EINTR) {
          }
        }
      }
    }
  }

  Supervisor(const Supervisor&) = delete;
  Supervisor& operator=(const Supervisor&) = delete;

  void start_workers() {
    const int local_count = options_.processes_per_machine();
    workers_.reserve(static_cast<std::size_t>(local_count));
    for (int local_rank = 0; local_rank < local_count; ++local_rank) start_worker(local_rank);
  }

  int supervise() {
    while (true) {
      reap();
      if (all_exited()) break;
      if (stopping_ && !killed_ && Clock::now() >= kill_deadline_) kill_everything();

      std::vector<pollfd> fds;
      std::vector<PrefixedStream*> streams;
      fds.push_back({signals_.read_fd(), POLLIN, 0});
      for (auto& worker : workers_) {
        for (auto& stream : worker.streams) {
          if (!stream.open()) continue;
          fds.push_back({stream.fd(), POLLIN, 0});
          streams.push_back(&stream);
        }
      }
      int ready = ::poll(fds.data(), fds.size(), poll_timeout_ms());
      if (ready < 0) {
        if (errno == EINTR) continue;
        ST_THROW(Error, "shardtrain launch: poll failed: ", std::strerror(errno));
      }
      if (fds[0].revents != 0) {
        for (int signal_number : signals_.take_signals()) on_signal(signal_number);
      }
      for (std::size_t i = 1; i < fds.size(); ++i) {
        if (fds[i].revents != 0) streams[i - 1]->read_some();
      }
    }
    for (auto& worker : workers_) {
      for (auto& stream : worker.streams) stream.drain_available();
    }
    if (stopping_) finish_stop();

    if (received_signal_) return 128 + *received_signal_;
    return failed_ ? 1 : 0;
  }

 private:
  void start_worker(int local_rank) {
    Worker worker;
    worker.local_rank = local_rank;
    worker.rank = options_.machine_rank * options_.processes_per_machine() + local_rank;

    const std::vector<std::string> environment = build_environment(worker_environment(options_, local_rank));
    std::vector<char*> envp;
    for (const auto& entry : environment) envp.push_back(const_cast<char*>(entry.c_str()));
    envp.push_back(nullptr);
    std::vector<char*> argv;
    argv.push_back(const_cast<char*>(options_.program.c_str()));
    for (const auto& arg : options_.program_args) argv.push_back(const_cast<char*>(arg.c_str()));
    argv.push_back(nullptr);

    Pipe out, err, exec_report;
    int null_input = ::open("/dev/null", O_RDONLY | O_CLOEXEC);
    ST_CHECK(null_input >= 0, "shardtrain launch: cannot open /dev/null: ", std::strerror(errno));

    // Signals stay blocked across fork so that the child never runs the
    // launcher's handler (it would write into the launcher's self-pipe).
    sigset_t all, previous_mask;
    sigfillset(&all);
    ::pthread_sigmask(SIG_SETMASK, &all, &previous_mask);
    const pid_t launcher_pid = ::getpid();
    const pid_t pid = ::fork();
    if (pid == 0) {
      // Child: async-signal-safe calls only until exec.
      signals_.set_worker_dispositions_in_child();
      ::setpgid(0, 0);
      // A launcher killed outright (SIGKILL, OOM killer, a harness timeout)
      // cannot stop its workers, and being in their own process groups they
      // would not get a signal meant for the launcher's group either.
      ::prctl(PR_SET_PDEATHSIG, SIGKILL);
      if (::getppid() != launcher_pid) ::_exit(127);  // it died before prctl took effect
      ::dup2(null_input, STDIN_FILENO);
      ::dup2(out.write, STDOUT_FILENO);
      ::dup2(err.write, STDERR_FILENO);
      ::pthread_sigmask(SIG_SETMASK, &previous_mask, nullptr);
      environ = envp.data();
      ::execvp(argv[0], argv.data());
      const int exec_errno = errno;
      [[maybe_unused]] ssize_t ignored = ::write(exec_report.write, &exec_errno, sizeof(exec_errno));
      ::_exit(127);
    }
    const int fork_errno = errno;
    ::pthread_sigmask(SIG_SETMASK, &previous_mask, nullptr);
    ::close(null_input);
    if (pid < 0) ST_THROW(Error, "shardtrain launch: fork failed for rank ", worker.rank, ": ", std::strerror(fork_errno));

    // Also set here: a signal sent to the group right after fork must not
    // miss a child that has not run setpgid itself yet.
    ::setpgid(pid, pid);
    worker.pid = pid;
    close_fd(out.write);
    close_fd(err.write);
    close_fd(exec_report.write);
    ::fcntl(out.read, F_SETFL, O_NONBLOCK);
    ::fcntl(err.read, F_SETFL, O_NONBLOCK);
    const std::string prefix = "[rank " + std::to_string(worker.rank) + "] ";
    worker.streams.emplace_back(std::exchange(out.read, -1), STDOUT_FILENO, prefix);
    worker.streams.emplace_back(std::exchange(err.read, -1), STDERR_FILENO, prefix);
    workers_.push_back(std::move(worker));

    // The report pipe closes on a successful exec (O_CLOEXEC) and carries
    // errno when exec failed.
    int exec_errno = 0;
    ssize_t n;
    do {
      n = ::read(exec_report.read, &exec_errno, sizeof(exec_errno));
    } while (n < 0 && errno == EINTR);
    if (n == static_cast<ssize_t>(sizeof(exec_errno))) {
      Worker& failed = workers_.back();
      int status = 0;
      while (::waitpid(failed.pid, &status, 0) < 0 && errno == EINTR) {
      }
      failed.exited = true;
      ST_THROW(ConfigError, "cannot execute PROGRAM ", options_.program, " for rank ", failed.rank, ": ",
               std::strerror(exec_errno),
               exec_errno == ENOEXEC ? " (not a binary and no #! line: launch it through its interpreter)"
                                     : "");
    }
  }

  int poll_timeout_ms() const {
    if (killed_) return kSettlePollMs;
    if (stopping_) {
      auto left = std::chrono::duration_cast<std::chrono::milliseconds>(kill_deadline_ - Clock::now()).count();
      return static_cast<int>(std::clamp<long long>(left + 1, 0, kIdlePollMs));
    }
    return kIdlePollMs;
  }

  bool all_exited() const {
    for (const auto& worker : workers_) {
      if (!worker.exited) return false;
    }
    return true;
  }

  /// Reaps finished workers and any orphans of theirs that were re-parented
  /// to the launcher (see ChildSubreaper); starts the stop on a failure.
  void reap() {
    for (auto& worker : workers_) {
      while (true) {
        int status = 0;
        const pid_t done = ::waitpid(-worker.pid, &status, WNOHANG);
        if (done < 0 && errno == EINTR) continue;
        if (done <= 0) break;
        if (done == worker.pid) on_worker_exit(worker, status);
      }
      if (!worker.exited) {
        // A worker that moved itself to another process group is still our child.
        int status = 0;
        if (::waitpid(worker.pid, &status, WNOHANG) == worker.pid) on_worker_exit(worker, status);
      }
    }
  }

  void on_worker_exit(Worker& worker, int status) {
    worker.exited = true;
    worker.wait_status = status;
    const bool success = WIFEXITED(status) && WEXITSTATUS(status) == 0;
    if (success || stopping_) return;
    failed_ = true;
    say("rank " + std::to_string(worker.rank) + " (pid " + std::to_string(worker.pid) + ") " +
        describe_wait_status(status));
    // The sweep still runs with no other worker: the failed one's children may live on.
    begin_stop(SIGTERM, all_exited() ? "" : "stopping the other workers");
  }

  void on_signal(int signal_number) {
    if (signal_number == SIGCHLD) return;  // reap() runs next
    // SIGHUP and SIGQUIT reach the workers as SIGTERM: SIGQUIT's default
    // would dump the core of every worker.
    const int forwarded = signal_number == SIGINT ? SIGINT : SIGTERM;
    if (received_signal_ && !killed_) {
      say("received " + signal_name(signal_number) + " again: killing the workers now");
      kill_everything();
      return;
    }
    if (!received_signal_) received_signal_ = signal_number;
    if (!stopping_) {
      begin_stop(forwarded, "received " + signal_name(signal_number) + ", forwarding " + signal_name(forwarded) +
                                " to the workers");
    } else {
      signal_all_groups(forwarded);
    }
  }

  void begin_stop(int signal_number, const std::string& why) {
    stopping_ = true;
    if (!why.empty()) {
      std::ostringstream message;
      message << why << " (SIGKILL after " << options_.grace_period_s << " s)";
      say(message.str());
    }
    signal_all_groups(signal_number);
    const auto grace = std::chrono::duration_cast<Clock::duration>(
        std::chrono::duration<double>(options_.grace_period_s));
    kill_deadline_ = Clock::now() + grace;
  }

  // Exited workers' groups too: their own children may still be running.
  void signal_all_groups(int signal_number) {
    for (const auto& worker : workers_) ::kill(-worker.pid, signal_number);
  }

  void kill_everything() {
    killed_ = true;
    for (const auto& worker : workers_) {
      if (!worker.exited) ++killed_workers_;
    }
    signal_all_groups(SIGKILL);
  }

  bool any_group_alive() {
    reap();
    for (const auto& worker : workers_) {
      if (::kill(-worker.pid, 0) == 0) return true;
    }
    return false;
  }

  /// Every worker has exited; what is left of their process groups (children
  /// that outlived them) gets the rest of the grace period, then SIGKILL.
  void finish_stop() {
    while (!killed_ && any_group_alive() && Clock::now() < kill_deadline_) {
      for (int signal_number : signals_.take_signals()) on_signal(signal_number);
      pollfd wake{signals_.read_fd(), POLLIN, 0};
      ::poll(&wake, 1, std::min(poll_timeout_ms(), 50));
    }
    if (any_group_alive()) signal_all_groups(SIGKILL);
    const auto settle_deadline = Clock::now() + std::chrono::seconds(1);
    while (any_group_alive() && Clock::now() < settle_deadline) ::poll(nullptr, 0, kSettlePollMs);

    if (workers_.size() > 1 || killed_workers_ > 0) {
      std::ostringstream summary;
      summary << "all " << workers_.size() << " workers have stopped";
      if (killed_workers_ > 0) {
        summary << " (" << killed_workers_ << " needed SIGKILL after the " << options_.grace_period_s
                << " s grace period)";
      }
      say(summary.str());
    }
  }

  const LaunchOptions& options_;
  SignalRouter signals_;
  ChildSubreaper subreaper_;
  std::vector<Worker> workers_;
  bool stopping_ = false;
  bool killed_ = false;
  int killed_workers_ = 0;
  bool failed_ = false;
  std::optional<int> received_signal_;
  Clock::time_point kill_deadline_{};
};

bool is_executable_file(const std::string& path) {
  struct stat info {};
  return ::stat(path.c_str(), &info) == 0 && S_ISREG(info.st_mode) && ::access(path.c_str(), X_OK) == 0;
}

}  // namespace

std::string find_program(const std::string& program) {
  if (program.empty()) ST_THROW(ConfigError, "missing PROGRAM: usage: shardtrain launch [options] PROGRAM [ARGS...]");
  if (program.find('/') != std::string::npos) {
    struct stat info {};
    if (::stat(program.c_str(), &info) != 0) {
      ST_THROW(ConfigError, "PROGRAM ", program, " does not exist (", std::strerror(errno),
               "); check the path, which is relative to the current directory");
    }
    if (S_ISDIR(info.st_mode)) ST_THROW(ConfigError, "PROGRAM ", program, " is a directory, not a program");
    if (::access(program.c_str(), X_OK) != 0) {
      ST_THROW(ConfigError, "PROGRAM ", program, " is not executable: run `chmod +x ", program,
               "` or launch it through its interpreter (shardtrain launch ... python3 ", program, ")");
    }
    return program;
  }
  const char* path_variable = std::getenv("PATH");
  // execvp's own fallback when PATH is unset.
  const std::string search_path = path_variable != nullptr ? path_variable : "/bin:/usr/bin";
  std::stringstream directories(search_path);
  std::string directory;
  while (std::getline(directories, directory, ':')) {
    const std::string candidate = (directory.empty() ? std::string(".") : directory) + "/" + program;
    if (is_executable_file(candidate)) return candidate;
  }
  ST_THROW(ConfigError, "PROGRAM ", program, " was not found in PATH (", search_path,
           "); give its path instead, e.g. ./", program);
}

std::map<std::string, std::string> worker_environment(const LaunchOptions& options, int local_rank) {
  const int local_world_size = options.processes_per_machine();
  std::map<std::string, std::string> env;
  env["RANK"] = std::to_string(options.machine_rank * local_world_size + local_rank);
  env["WORLD_SIZE"] = std::to_string(options.num_processes);
  env["LOCAL_RANK"] = std::to_string(local_rank);
  env["LOCAL_WORLD_SIZE"] = std::to_string(local_world_size);
  env["GROUP_RANK"] = std::to_string(options.machine_rank);
  env["MASTER_ADDR"] = options.main_process_ip;
  env["MASTER_PORT"] = std::to_string(options.main_process_port);
  env["SHARDTRAIN_MIXED_PRECISION"] = options.mixed_precision;
  env["SHARDTRAIN_DISTRIBUTED_TYPE"] = options.distributed_type;
  // Empty removes a value inherited from an outer launch, which would
  // describe a different run.
  env["SHARDTRAIN_CONFIG_FILE"] = options.config_file;
  env["SHARDTRAIN_DEEPSPEED_CONFIG_FILE"] = options.deepspeed_config_file;
  env["ACCELERATE_MIXED_PRECISION"] = options.mixed_precision;
  env["ACCELERATE_USE_DEEPSPEED"] = options.use_deepspeed ? "true" : "false";
  env["ACCELERATE_USE_FSDP"] = options.use_fsdp ? "true" : "false";
  env["ACCELERATE_DEEPSPEED_CONFIG_FILE"] = options.deepspeed_config_file;
  env["SHARDTRAIN_RDZV_TOKEN"] = options.rdzv_token;
  env["SHARDTRAIN_RDZV_ID"] = options.rdzv_id;
  env["SHARDTRAIN_OUTPUT_PREFIXED"] = "1";  // the logger then leaves out its own rank prefix
  // N workers each spawning one OpenMP thread per core oversubscribe the
  // machine N-fold; split the cores as torchrun's default does (it uses 1).
  // The cores this launcher may run on (taskset, a Slurm or container
  // cpuset), not every core the machine has.
  if (const char* threads = std::getenv("OMP_NUM_THREADS"); threads == nullptr || *threads == '\0') {
    cpu_set_t allowed;
    CPU_ZERO(&allowed);
    const long cores = ::sched_getaffinity(0, sizeof(allowed), &allowed) == 0 ? CPU_COUNT(&allowed)
                                                                               : ::sysconf(_SC_NPROCESSORS_ONLN);
    env["OMP_NUM_THREADS"] = std::to_string(std::max(1L, cores / std::max(1, local_world_size)));
  }
  return env;
}

int run_launch(const LaunchOptions& options) {
  ST_CHECK_T(ConfigError, options.num_machines >= 1 && options.num_processes % options.num_machines == 0,
             "invalid launch options: num_processes ", options.num_processes, ", num_machines ",
             options.num_machines, " (resolve them with resolve_launch_options)");
  find_program(options.program);
  if (options.rdzv_token_generated && options.num_machines > 1) {
    // The only way the other machines can learn it; a job script that starts
    // every machine at once generates one and passes it to all instead.
    say("rendezvous token of this job (pass it to the other machines as --rdzv_token): " + options.rdzv_token);
  }
  Supervisor supervisor(options);
  supervisor.start_workers();
  return supervisor.supervise();
}

}  // namespace shardtrain::launcher
