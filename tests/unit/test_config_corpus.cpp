// `shardtrain config check` over every config the project ships (configs/)
// and every test config (tests/data/configs/: the corpus of patterns from
// public fine-tuning repositories, and the deliberately broken files), run
// as a user runs it: no flags, from the repository root. Each file's outcome
// is written down in tests/data/configs/EXPECTED: it loads silently, loads
// with a named warning, or fails with a named message.

#include <algorithm>
#include <chrono>
#include <filesystem>
#include <fstream>
#include <map>
#include <sstream>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "support/multirank.h"

namespace {

namespace fs = std::filesystem;

const fs::path kRepoRoot = SHARDTRAIN_SOURCE_DIR;

struct Expectation {
  std::string outcome;             ///< loads | warns | fails
  std::vector<std::string> texts;  ///< the error's text, or each warning's (one line of EXPECTED each)
  int line = 0;                    ///< in EXPECTED, for messages
};

/// EXPECTED: `path<TAB>outcome<TAB>text`, paths from the repository root, `#` comments.
std::map<std::string, Expectation> read_expectations(const fs::path& manifest) {
  std::ifstream in(manifest);
  EXPECT_TRUE(in.good()) << "cannot read " << manifest;
  std::map<std::string, Expectation> expectations;
  int number = 0;
  for (std::string line; std::getline(in, line);) {
    ++number;
    if (line.empty() || line[0] == '#') continue;
    std::vector<std::string> columns;
    std::istringstream fields(line);
    for (std::string column; std::getline(fields, column, '\t');) columns.push_back(column);
    if (columns.size() < 2) {
      ADD_FAILURE() << manifest << ":" << number << ": expected PATH<TAB>OUTCOME[<TAB>TEXT], got '" << line << "'";
      continue;
    }
    const std::string& outcome = columns[1];
    const std::string text = columns.size() > 2 ? columns[2] : "";
    EXPECT_TRUE(outcome == "loads" || outcome == "warns" || outcome == "fails")
        << manifest << ":" << number << ": outcome '" << outcome << "' is not one of loads, warns, fails";
    EXPECT_TRUE(outcome == "loads" || !text.empty())
        << manifest << ":" << number << ": a warning or failure needs the text it names";
    const auto [entry, added] = expectations.emplace(columns[0], Expectation{outcome, {}, number});
    // Only warnings may take several lines: one per warning the file gives.
    EXPECT_TRUE(added || (outcome == "warns" && entry->second.outcome == "warns"))
        << manifest << ":" << number << ": " << columns[0] << " is listed twice";
    if (!text.empty()) entry->second.texts.push_back(text);
  }
  return expectations;
}

/// Every config file under `directory`, as a path from the repository root.
std::vector<std::string> configs_under(const fs::path& directory) {
  std::vector<std::string> files;
  for (const auto& entry : fs::recursive_directory_iterator(kRepoRoot / directory)) {
    const std::string extension = entry.path().extension().string();
    if (entry.is_regular_file() && (extension == ".yaml" || extension == ".yml" || extension == ".json")) {
      files.push_back(fs::relative(entry.path(), kRepoRoot).generic_string());
    }
  }
  std::sort(files.begin(), files.end());
  return files;
}

std::vector<std::string> warning_lines(const std::string& output) {
  std::vector<std::string> warnings;
  std::istringstream lines(output);
  for (std::string line; std::getline(lines, line);) {
    if (line.rfind("# warning: ", 0) == 0) warnings.push_back(line);
  }
  return warnings;
}

TEST(UnitConfigCorpus, ConfigCheckOfEveryShippedAndCollectedFileHasItsRecordedOutcome) {
  const fs::path manifest = kRepoRoot / "tests/data/configs/EXPECTED";
  const std::map<std::string, Expectation> expectations = read_expectations(manifest);
  std::vector<std::string> files = configs_under("configs");
  for (const std::string& file : configs_under("tests/data/configs")) files.push_back(file);
  ASSERT_GT(files.size(), 40u);  // configs/ alone holds 26; a wrong root would find none

  for (const std::string& file : files) {
    SCOPED_TRACE(file);
    const auto found = expectations.find(file);
    if (found == expectations.end()) {
      ADD_FAILURE() << file << " has no line in " << manifest << ": add `" << file << "<TAB>loads|warns|fails<TAB>text`";
      continue;
    }
    const Expectation& expected = found->second;
    // From the repository root, as a user in a checkout runs it: a relative
    // deepspeed_config_file resolves against the working directory first.
    const auto result = shardtrain::testing::run_command(
        "cd '" + kRepoRoot.string() + "' && '" + SHARDTRAIN_BIN_DIR + "/shardtrain' config check '" + file + "' 2>&1",
        std::chrono::seconds(60));
    const std::vector<std::string> warnings = warning_lines(result.output);
    if (expected.outcome == "fails") {
      EXPECT_EQ(result.exit_code, 2) << result.output;
      EXPECT_NE(result.output.find("error: "), std::string::npos) << result.output;
      EXPECT_NE(result.output.find(expected.texts.at(0)), std::string::npos)
          << "the error does not name '" << expected.texts.at(0) << "':\n" << result.output;
      continue;
    }
    EXPECT_EQ(result.exit_code, 0) << result.output;
    // A loadable file prints a config that reads back (comments included).
    EXPECT_NE(result.output.find("distributed_type: "), std::string::npos) << result.output;
    // Exactly the listed warnings: as many, and each named by one of them.
    EXPECT_EQ(warnings.size(), expected.texts.size()) << "warnings other than those listed:\n" << result.output;
    for (const std::string& text : expected.texts) {
      const bool named = std::any_of(warnings.begin(), warnings.end(), [&](const std::string& warning) {
        return warning.find(text) != std::string::npos;
      });
      EXPECT_TRUE(named) << "no warning names '" << text << "':\n" << result.output;
    }
  }
  // A line for a file that is gone is a stale expectation.
  for (const auto& [file, expected] : expectations) {
    EXPECT_TRUE(std::find(files.begin(), files.end(), file) != files.end())
        << manifest << ":" << expected.line << ": " << file << " does not exist";
  }
}

}  // namespace
