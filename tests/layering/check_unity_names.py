#!/usr/bin/env python3
"""No two sources of shardtrain_tests define the same file-scope name
(ctest Layout.TestSourcesShareNoFileScopeName).

shardtrain_tests is a unity build (tests/CMakeLists.txt): CMake pastes its
sources, several at a time, into one translation unit, so every file's
anonymous namespace becomes one. Two helpers of one name then either fail
to compile (same signature; which files meet depends on the batching, so
adding a file elsewhere can break a build) or, worse, silently become one
overload set: `engine_config(true, "sgd")` written for
engine_config(bool, const std::string&) would call another file's
engine_config(bool, bool), a pointer-to-bool conversion beating the string's
user-defined one. So each name defined at file scope (a function, a
constant, a type) belongs to one source; a helper two files need lives in
tests/support. Type aliases are left out: C++ allows the same alias twice,
and two different ones do not compile.

What counts as file scope: a definition that starts at column 0, the
project's format for namespace-scope code (bodies are indented). The sources
are those add_executable(shardtrain_tests ...) lists.

Usage: check_unity_names.py [REPO_ROOT]; prints each shared name with its
       files, exits 1 if any.
       check_unity_names.py --self-test: plants a shared helper, a shared
       constant and a shared type in a small tree and checks each is
       reported, and that a name used only once is not.
"""
import pathlib
import re
import sys

TARGET = "shardtrain_tests"
# Lines at column 0 that open a definition, and the name each defines.
FUNCTION = re.compile(r"^(?!TEST|INSTANTIATE|return\b|namespace\b|using\b|template\b|struct\b|class\b|enum\b)"
                      r"[A-Za-z_][\w:<>,\s\*&]*?[\s\*&](\w+)\s*\(")
CONSTANT = re.compile(r"^(?:static\s+|inline\s+|constexpr\s+|const\s+)+[\w:<>,\s\*&]*?[\s\*&](\w+)\s*(?:=|\{)")
MORE_CONSTANTS = re.compile(r",\s*(k[A-Z]\w*)\s*=")  # constexpr int kA = 1, kB = 2;
TYPE = re.compile(r"^(?:struct|class|enum\s+class|enum)\s+(\w+)\b(?!\s*;)")


def target_sources(root):
    """The files add_executable(shardtrain_tests ...) compiles."""
    cmake = root / "tests" / "CMakeLists.txt"
    listing = re.search(r"add_executable\(\s*" + TARGET + r"\b(.*?)\)", cmake.read_text(), re.DOTALL)
    if not listing:
        sys.exit(f"{cmake} has no add_executable({TARGET} ...)")
    for entry in listing.group(1).split():
        entry = entry.replace("${PROJECT_SOURCE_DIR}", str(root))
        path = pathlib.Path(entry) if entry.startswith("/") else root / "tests" / entry
        yield path


def file_scope_names(text):
    names = set()
    for line in text.splitlines():
        for pattern in (TYPE, CONSTANT, FUNCTION):
            found = pattern.match(line)
            if found:
                names.add(found.group(1))
                break
        if CONSTANT.match(line):
            names.update(MORE_CONSTANTS.findall(line))
    return names


def find_shared(root):
    owners = {}
    for path in target_sources(root):
        for name in file_scope_names(path.read_text(errors="replace")):
            owners.setdefault(name, []).append(path.relative_to(root).as_posix())
    return {name: files for name, files in sorted(owners.items()) if len(files) > 1}


PLANTED = {
    "tests/CMakeLists.txt": "add_executable(shardtrain_tests\n  unit/a.cpp\n  dist/b.cpp)\n",
    "tests/unit/a.cpp": ("namespace {\nconstexpr int kWorld = 2, kSteps = 3;\nstruct RunResult {\n  int steps;\n};\n"
                         "std::string engine_config(bool fsdp, bool rank0_loads) {\n  return {};\n}\n"
                         "int only_here(int x) { return x; }\n}  // namespace\n"
                         "TEST(UnitA, Works) {\n  int inner = 1;\n}\n"),
    "tests/dist/b.cpp": ("namespace {\nconstexpr int kSteps = 20;\nstruct RunResult;\nclass RunResult {};\n"
                         "shardtrain::TrainingConfig engine_config(bool fsdp, const std::string& optimizer) {\n"
                         "  return {};\n}\n}  // namespace\nTEST(DistB, Works) {\n  int inner = 2;\n}\n"),
}
EXPECTED_SHARED = {"kSteps", "RunResult", "engine_config"}


def self_test():
    import tempfile
    with tempfile.TemporaryDirectory() as tmp:
        root = pathlib.Path(tmp).resolve()
        for name, text in PLANTED.items():
            (root / name).parent.mkdir(parents=True, exist_ok=True)
            (root / name).write_text(text)
        shared = find_shared(root)
    if set(shared) != EXPECTED_SHARED:
        print(f"self-test failed: reported {sorted(shared)}, planted {sorted(EXPECTED_SHARED)}")
        return 1
    print(f"self-test: each of the {len(EXPECTED_SHARED)} planted shared names reported, nothing else")
    return 0


def main():
    if len(sys.argv) > 1 and sys.argv[1] == "--self-test":
        return self_test()
    root = pathlib.Path(sys.argv[1] if len(sys.argv) > 1 else pathlib.Path(__file__).resolve().parents[2]).resolve()
    shared = find_shared(root)
    if shared:
        print(f"{len(shared)} file-scope name(s) defined by more than one source of {TARGET}, a unity build "
              "(give each a name of its own, or move a common helper into tests/support):")
        for name, files in shared.items():
            print(f"  {name}: {', '.join(files)}")
        return 1
    print(f"every file-scope name of {TARGET}'s sources is defined once")
    return 0


if __name__ == "__main__":
    sys.exit(main())
