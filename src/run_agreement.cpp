// The prepare()-time agreement check between ranks (see run_agreement.h).

#include "run_agreement.h"

#include <cstdint>
#include <sstream>
#include <vector>

#include <ATen/ATen.h>
#include <torch/nn/module.h>

#include "comm/text_exchange.h"
#include "shardtrain/error.h"

namespace shardtrain {
namespace {

/// FNV-1a, 64 bits: a fingerprint for equality, not security (a rank that
/// wants to lie can, and one that differs by accident differs here).
int64_t fingerprint(const std::string& text) {
  uint64_t hash = 1469598103934665603ull;
  for (const unsigned char c : text) {
    hash ^= c;
    hash *= 1099511628211ull;
  }
  return static_cast<int64_t>(hash);
}

std::vector<std::string> lines_of(const std::string& text) {
  std::vector<std::string> lines;
  std::istringstream in(text);
  for (std::string line; std::getline(in, line);) lines.push_back(line);
  return lines;
}

std::string shape_of(const at::Tensor& t) {
  std::ostringstream out;
  out << t.sizes();
  return out.str();
}

}  // namespace

std::string describe_run(const TrainingConfig& resolved, int world_size, const std::string& load_dtype,
                         std::optional<uint64_t> seed) {
  std::ostringstream out;
  std::istringstream yaml(to_yaml(resolved));
  for (std::string line; std::getline(yaml, line);) {
    if (line.rfind("machine_rank:", 0) == 0) continue;
    out << line << "\n";
  }
  out << "world_size: " << world_size << "\n";
  out << "load_dtype: " << load_dtype << "\n";
  if (seed) out << "seed: " << *seed << "\n";
  return out.str();
}

std::string describe_model(const torch::nn::Module& module) {
  std::ostringstream out;
  for (const auto& item : module.named_parameters(/*recurse=*/true)) {
    const at::Tensor& p = item.value();
    out << "param " << item.key() << " " << shape_of(p) << " " << c10::toString(p.scalar_type()) << " "
        << (p.requires_grad() ? "trainable" : "frozen") << "\n";
  }
  for (const auto& item : module.named_buffers(/*recurse=*/true)) {
    out << "buffer " << item.key() << " " << shape_of(item.value()) << " "
        << c10::toString(item.value().scalar_type()) << "\n";
  }
  return out.str();
}

void check_ranks_agree(comm::Communicator& comm, const std::string& what, const std::string& description) {
  const int world = comm.world_size();
  if (world == 1) return;
  const auto host = at::TensorOptions().dtype(at::kLong);
  at::Tensor mine = at::full({1}, fingerprint(description), host).to(comm.device());
  at::Tensor all = at::empty({world}, host.device(comm.device()));
  comm.all_gather(all, mine);
  const at::Tensor hashes = all.cpu();
  int differing = -1;
  for (int r = 1; r < world && differing < 0; ++r) {
    if (hashes.data_ptr<int64_t>()[r] != hashes.data_ptr<int64_t>()[0]) differing = r;
  }
  if (differing < 0) return;
  // Every rank learns both texts, so every rank throws the same message.
  const std::vector<std::string> reference = lines_of(comm::broadcast_text(comm, description, 0));
  const std::vector<std::string> other = lines_of(comm::broadcast_text(comm, description, differing));
  size_t line = 0;
  while (line < reference.size() && line < other.size() && reference[line] == other[line]) ++line;
  auto at = [](const std::vector<std::string>& lines, size_t i) {
    return i < lines.size() ? "'" + lines[i] + "'" : std::string("nothing (its description ends there)");
  };
  ST_THROW(ConfigError, "ranks disagree on the ", what, ": at line ", line + 1, " rank 0 has ", at(reference, line),
           " and rank ", differing, " has ", at(other, line),
           ". Every rank must run the same program with the same config, model and flags; check that each machine "
           "has the same files (config, model directory) and command line");
}

}  // namespace shardtrain
