// The rendezvous environment: which launcher started the process, its rank,
// world and store address, and the job's token and id.
#include <sys/stat.h>

#include <cstdio>
#include <fstream>
#include <map>
#include <string>

#include <gtest/gtest.h>

#include "shardtrain/comm/rendezvous.h"
#include "shardtrain/error.h"
#include "support/scratch_dir.h"

namespace {

using Vars = std::map<std::string, std::string>;

shardtrain::DistEnv detect(const Vars& vars) {
  return shardtrain::detect_dist_env([&vars](const char* name) -> const char* {
    auto it = vars.find(name);
    return it == vars.end() ? nullptr : it->second.c_str();
  });
}

std::string env_error_of(const Vars& vars) {
  try {
    detect(vars);
  } catch (const shardtrain::ConfigError& e) {
    return e.what();
  }
  return "no error";
}

TEST(UnitRendezvousEnv, NothingSetIsSingleProcess) {
  auto env = detect({});
  EXPECT_EQ(env.source, "single");
  EXPECT_EQ(env.rank, 0);
  EXPECT_EQ(env.world_size, 1);
}

TEST(UnitRendezvousEnv, Torchrun) {
  auto env = detect({{"RANK", "5"}, {"WORLD_SIZE", "8"}, {"LOCAL_RANK", "1"}, {"LOCAL_WORLD_SIZE", "4"},
                     {"MASTER_ADDR", "node0"}, {"MASTER_PORT", "1234"}});
  EXPECT_EQ(env.source, "torchrun");
  EXPECT_EQ(env.rank, 5);
  EXPECT_EQ(env.world_size, 8);
  EXPECT_EQ(env.local_rank, 1);
  EXPECT_EQ(env.local_world_size, 4);
  EXPECT_EQ(env.machine_rank(), 1);
  EXPECT_EQ(env.num_machines(), 2);
  EXPECT_EQ(env.master_addr, "node0");
  EXPECT_EQ(env.master_port, 1234);
}

TEST(UnitRendezvousEnv, SlurmWithTasksPerNodeSyntax) {
  auto env = detect({{"SLURM_PROCID", "3"}, {"SLURM_NTASKS", "4"}, {"SLURM_LOCALID", "1"},
                     {"SLURM_TASKS_PER_NODE", "2(x2)"}, {"MASTER_ADDR", "n1"}, {"MASTER_PORT", "29400"}});
  EXPECT_EQ(env.source, "slurm");
  EXPECT_EQ(env.rank, 3);
  EXPECT_EQ(env.local_world_size, 2);
  EXPECT_EQ(env.machine_rank(), 1);
}

TEST(UnitRendezvousEnv, OpenMpi) {
  auto env = detect({{"OMPI_COMM_WORLD_RANK", "2"}, {"OMPI_COMM_WORLD_SIZE", "4"},
                     {"OMPI_COMM_WORLD_LOCAL_RANK", "0"}, {"OMPI_COMM_WORLD_LOCAL_SIZE", "2"},
                     {"MASTER_ADDR", "h"}, {"MASTER_PORT", "29500"}});
  EXPECT_EQ(env.source, "openmpi");
  EXPECT_EQ(env.rank, 2);
  EXPECT_EQ(env.machine_rank(), 1);
}

TEST(UnitRendezvousEnv, ErrorsNameTheVariableAndTheFix) {
  const Vars master{{"MASTER_ADDR", "127.0.0.1"}, {"MASTER_PORT", "29500"}};
  auto with = [&](Vars extra) {
    Vars all = master;
    for (auto& [k, v] : extra) all[k] = v;
    return all;
  };
  auto expect_error = [&](const Vars& vars, const std::string& needle) {
    std::string message = env_error_of(vars);
    EXPECT_NE(message.find(needle), std::string::npos) << "expected '" << needle << "' in: " << message;
  };
  expect_error(with({{"RANK", "0"}}), "WORLD_SIZE is not set");
  expect_error(with({{"RANK", "0"}}), "shardtrain launch");
  expect_error(with({{"RANK", "x"}, {"WORLD_SIZE", "2"}}), "RANK='x' is not an integer");
  expect_error(with({{"RANK", "2"}, {"WORLD_SIZE", "2"}}), "RANK=2 is outside 0..1");
  expect_error(with({{"RANK", "0"}, {"WORLD_SIZE", "2"}, {"LOCAL_RANK", "0"}}), "LOCAL_RANK is set but LOCAL_WORLD_SIZE is not");
  expect_error(with({{"RANK", "0"}, {"WORLD_SIZE", "6"}, {"LOCAL_RANK", "0"}, {"LOCAL_WORLD_SIZE", "4"}}),
               "not a multiple of LOCAL_WORLD_SIZE=4");
  expect_error({{"RANK", "0"}, {"WORLD_SIZE", "2"}, {"MASTER_PORT", "1"}}, "MASTER_ADDR is not set");
  expect_error({{"RANK", "0"}, {"WORLD_SIZE", "2"}, {"MASTER_ADDR", "h"}}, "MASTER_PORT is not set");
  expect_error(with({{"RANK", "0"}, {"WORLD_SIZE", "2"}, {"MASTER_PORT", "70000"}}), "not a TCP port");
  expect_error({{"SLURM_PROCID", "0"}, {"SLURM_NTASKS", "2"}, {"SLURM_LOCALID", "0"}, {"SLURM_NNODES", "1"}},
               "MASTER_ADDR is not set");
  expect_error(with({{"SLURM_PROCID", "0"}, {"SLURM_NTASKS", "2"}}), "SLURM_LOCALID is not set");
  expect_error(with({{"OMPI_COMM_WORLD_RANK", "0"}}), "OMPI_COMM_WORLD_SIZE is not set");
}

TEST(UnitRendezvousEnv, TheJobIdComesFromShardtrainTorchrunOrSlurm) {
  EXPECT_EQ(detect({}).rdzv_job_id, "");
  EXPECT_EQ(detect({{"TORCHELASTIC_RUN_ID", "run-7"}}).rdzv_job_id, "run-7");
  EXPECT_EQ(detect({{"SLURM_JOB_ID", "4242"}}).rdzv_job_id, "4242");
  EXPECT_EQ(detect({{"SHARDTRAIN_RDZV_ID", "mine"}, {"TORCHELASTIC_RUN_ID", "run-7"}, {"SLURM_JOB_ID", "4242"}})
                .rdzv_job_id,
            "mine");
  EXPECT_NE(env_error_of({{"SHARDTRAIN_RDZV_ID", std::string(200, 'x')}}).find("at most 128"), std::string::npos);
}

TEST(UnitRendezvousEnv, TheTokenMayComeFromAPrivateFile) {
  const shardtrain::testing::ScratchDir scratch;
  const std::string path = scratch.file("rdzv_env_token");
  {
    std::ofstream out(path);
    out << "secret-from-a-file\n";
  }
  ::chmod(path.c_str(), 0600);
  EXPECT_EQ(detect({{"SHARDTRAIN_RDZV_TOKEN_FILE", path}}).rdzv_token, "secret-from-a-file");
  // The variable wins over the file, as an explicit value over a reference.
  EXPECT_EQ(detect({{"SHARDTRAIN_RDZV_TOKEN", "inline"}, {"SHARDTRAIN_RDZV_TOKEN_FILE", path}}).rdzv_token, "inline");
  ::chmod(path.c_str(), 0640);
  const std::string open_file = env_error_of({{"SHARDTRAIN_RDZV_TOKEN_FILE", path}});
  EXPECT_NE(open_file.find("has mode 0640"), std::string::npos) << open_file;
  EXPECT_NE(open_file.find("chmod 600 " + path), std::string::npos) << open_file;
  std::remove(path.c_str());  // and a file that is not there
  EXPECT_NE(env_error_of({{"SHARDTRAIN_RDZV_TOKEN_FILE", path}}).find("cannot be read"), std::string::npos);
}

}  // namespace
