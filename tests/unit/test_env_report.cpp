// `shardtrain env`'s report: what it says of the BLAS LibTorch computes with.
#include <string>

#include <gtest/gtest.h>

#include "shardtrain/env_report.h"

namespace {

const std::string* row(const shardtrain::EnvReport& report, const std::string& label) {
  for (const auto& [key, value] : report.rows) {
    if (key == label) return &value;
  }
  return nullptr;
}

// The PyPI wheel (the platform floor) links MKL into libtorch_cpu.so, where
// no BLAS library shows among the loaded ones; the report used to infer the
// BLAS from those and warned of a reference BLAS on every machine.
TEST(UnitEnvReport, NamesTheBlasLibTorchWasBuiltWithAndWarnsOfNoReferenceBlas) {
  const shardtrain::EnvReport report = shardtrain::collect_env_report(false);
  const std::string* blas = row(report, "CPU BLAS (LibTorch's build)");
  ASSERT_NE(blas, nullptr) << report.to_text();
  EXPECT_EQ(*blas, "mkl") << report.to_text();
  for (const std::string& warning : report.warnings) {
    EXPECT_EQ(warning.find("BLAS"), std::string::npos) << warning;
  }
}

}  // namespace
