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
user-defined one. So each name defined at file scope (a function, an
operator, a variable or constant, a type) belongs to one source, and a
using-declaration (`using shardtrain::testing::f;`) may not bring in a name
another source defines; a helper two files need lives in tests/support.
Type aliases and repeated using-declarations of the same entity are left
alone: C++ allows both twice, and two different ones do not compile.

How it reads a source: comments, literals and preprocessor lines are blanked;
then each statement at namespace scope (outside every function and class
body) is classified by its shape. Definitions in a named namespace
(shardtrain::testing's helpers in tests/support) are checked against the
same namespace only; the global and every anonymous namespace are one scope.
The sources are those add_executable(shardtrain_tests ...) lists.

Why by hand: no C++ parser is among the project's tools, and the question is
narrow (names at namespace scope); the self-test plants each shape it reads.

Usage: check_unity_names.py [REPO_ROOT]; prints each shared name with its
       files, exits 1 if any.
       check_unity_names.py --self-test: plants every shape of definition it
       reads in a small tree, shared between two files, with look-alikes that
       are not definitions, and checks that exactly the shared ones are
       reported.
"""
import pathlib
import re
import sys

TARGET = "shardtrain_tests"
FILE_SCOPE = ""  # the global namespace and every anonymous one: one scope in a unity unit
SKIPPED_STATEMENTS = re.compile(r"^(?:TEST|TYPED_TEST|INSTANTIATE_|REGISTER_|static_assert\b|typedef\b|friend\b|extern\b"
                                r"|template\s+(?:class|struct)\b|using\s+namespace\b"
                                r"|using\s+\w+\s*=|namespace\s+\w+\s*=)")
TYPE = re.compile(r"^(?:struct|class|union|enum(?:\s+class|\s+struct)?)\s+(?:alignas\s*\([^)]*\)\s*)?(\w+)")
KEYWORDS = {"if", "for", "while", "switch", "return", "sizeof", "decltype", "alignof", "noexcept", "alignas",
            "static_cast", "const_cast", "reinterpret_cast", "dynamic_cast", "throw", "new", "delete"}
MORE_DECLARATORS = re.compile(r",\s*(\w+)\s*(?:=|\{|\[)")  # constexpr int kA = 1, kB = 2;


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


def blank_comments_literals_and_directives(text):
    """The text with comments, string and character literals (raw ones too) and
    preprocessor lines replaced by blanks, keeping the braces and semicolons
    of the code itself."""
    code = re.sub(r'R"([^(\s]*)\((?:.|\n)*?\)\1"', '""', text)
    code = re.sub(r"//[^\n]*|/\*(?:.|\n)*?\*/|\"(?:\\.|[^\"\\\n])*\"|'(?:\\.|[^'\\\n])+'", " ", code)
    return re.sub(r"^\s*#(?:[^\n]*\\\n)*[^\n]*", " ", code, flags=re.MULTILINE)


def without_template_header(statement):
    """`template <typename T, int N = (1 > 0)> T f(...)` -> `T f(...)`."""
    if not statement.startswith("template"):
        return statement
    depth = 0
    for i, ch in enumerate(statement):
        if ch == "<":
            depth += 1
        elif ch == ">":
            depth -= 1
            if depth == 0:
                return statement[i + 1:].strip()
    return statement


def declared_name(statement, opens_body):
    """(kind, name, further names) of one namespace-scope statement, or None.
    kind: 'type', 'function', 'variable' or 'using' (a using-declaration, whose
    name is the qualified one)."""
    statement = re.sub(r"\[\[.*?\]\]\s*", "", statement).strip()
    if not statement or SKIPPED_STATEMENTS.match(statement):
        return None
    using = re.match(r"^using\s+((?:\w+::)+)(\w+)$", statement)
    if using:
        return "using", using.group(1) + using.group(2), []
    statement = without_template_header(statement)
    typed = TYPE.match(statement)
    if typed:
        # `struct X;` declares; `struct X {` and `struct X : Base {` define.
        return ("type", typed.group(1), []) if opens_body else None
    angle = paren = 0
    previous = None
    for token in re.finditer(r"operator\s*(?:\(\)|\[\]|[^\s(\w]+|\w+)|\w+|::|[()<>=\[,{]", statement):
        text = token.group(0)
        if text.startswith("operator") and angle == 0 and paren == 0:
            return ("function", re.sub(r"\s+", "", text), []) if opens_body else None
        if text == "<" and previous and re.match(r"\w", previous):
            angle += 1
        elif text == ">" and angle:
            angle -= 1
        elif angle:
            pass
        elif text == "(":
            if paren == 0 and previous and re.match(r"\w+$", previous) and previous not in KEYWORDS:
                # A definition has a body; `int f(int);` only declares.
                return ("function", previous, []) if opens_body else None
            paren += 1
        elif text == ")":
            paren -= 1
        elif paren == 0 and text in ("=", "[", "{") and previous and re.match(r"\w+$", previous):
            return "variable", previous, MORE_DECLARATORS.findall(statement[token.start():])
        previous = text
    # `std::mutex m;` (no initialiser), or `int x{3}` (seen as `int x` + a body).
    words = re.findall(r"\w+", statement)
    return ("variable", words[-1], []) if len(words) >= 2 else None


def namespace_scope_statements(text):
    """Yields (namespace path, statement, opens_body) for every statement at
    namespace scope. Anonymous namespaces and the global one are FILE_SCOPE."""
    code = blank_comments_literals_and_directives(text)
    scopes = []  # one entry per open brace: a namespace name, or None for any other body
    statement = []
    parens = 0  # of the statement being read: braces inside parentheses (a macro's arguments) open no body
    for ch in code:
        in_namespace_scope = all(scope is not None for scope in scopes)
        if in_namespace_scope and (parens or ch in "()"):
            parens += {"(": 1, ")": -1}.get(ch, 0)
            statement.append(ch)
            continue
        if ch in "{;}" and in_namespace_scope:
            line = " ".join("".join(statement).split())
            statement = []
            if ch == "}":
                scopes.pop()
                continue
            named = re.match(r"^(?:inline\s+)?namespace\s*([\w:]*)$", line)
            if ch == "{" and named:
                scopes.append(named.group(1))
                continue
            if ch == "{" and re.match(r'^extern\s*$', line):  # extern "C" {, its literal blanked
                scopes.append("")
                continue
            path = "::".join(scope for scope in scopes if scope) or FILE_SCOPE
            yield path, line, ch == "{"
            if ch == "{":
                scopes.append(None)
            continue
        if ch == "{":
            scopes.append(None)
        elif ch == "}":
            scopes.pop()
        elif in_namespace_scope:
            statement.append(ch)


def definitions(text):
    """{(namespace path, name)} defined, and {name} using-declared, at namespace scope."""
    defined, using = set(), set()
    for path, statement, opens_body in namespace_scope_statements(text):
        found = declared_name(statement, opens_body)
        if not found:
            continue
        kind, name, more = found
        if kind == "using":
            using.add(name.rsplit("::", 1)[1])
            continue
        defined.add((path, name))
        defined.update((path, extra) for extra in more)
    return defined, using


def find_shared(root):
    owners, users = {}, {}
    for path in target_sources(root):
        where = path.relative_to(root).as_posix()
        defined, using = definitions(path.read_text(errors="replace"))
        for key in defined:
            owners.setdefault(key, []).append(where)
        for name in using:
            users.setdefault(name, set()).add(where)
    shared = {}
    for (path, name), files in sorted(owners.items()):
        label = f"{path}::{name}" if path else name
        if len(files) > 1:
            shared[label] = files
        if path == FILE_SCOPE and name in users:
            # Another file's using-declaration puts a same-named entity into the shared scope.
            others = sorted(users[name] - set(files))
            if others:
                shared[label] = files + [f"{f} (using-declaration)" for f in others]
    return shared


PLANTED = {
    "tests/CMakeLists.txt": "add_executable(shardtrain_tests\n  unit/a.cpp\n  dist/b.cpp)\n",
    "tests/unit/a.cpp": """#include "x.h"
// engine_config(int) in a comment, and "kHidden = 1;" in a string, define nothing.
namespace {
using shardtrain::testing::RankContext;
using shardtrain::testing::expect_same_bits;
using Clock = std::chrono::steady_clock;
namespace fs = std::filesystem;
extern char** environ;
INSTANTIATE_TEST_SUITE_P(S, X, ::testing::Values(Case{1, 2}), [](const auto& info) { return info.param.name; });
constexpr int kWorld = 2, kSteps = 3;
std::atomic<int> g_calls{0};
std::mutex g_lock;
struct RunResult {
  int steps;
};
enum class Mode { kA, kB };
struct Forward;
int prototype_only(int x);
std::string engine_config(bool fsdp, bool rank0_loads) {
  int local_only = 1;
  return {};
}
template <typename T> T pick(T a) { return a; }
std::ostream& operator<<(std::ostream& os, const RunResult& r) { return os; }
std::function<void(int)> make_callback(int n) { return {}; }
int only_here(int x) { return x; }
}  // namespace
namespace shardtrain::testing {
int helper_in_named(int x) { return x; }
}  // namespace shardtrain::testing
TEST(UnitA, Works) {
  int inner = 1;
}
""",
    "tests/dist/b.cpp": """namespace {
extern char** environ;
INSTANTIATE_TEST_SUITE_P(T, Y, ::testing::Values(Case{3, 4}), [](const auto& info) { return info.param.name; });
using shardtrain::testing::RankContext;
using Clock = std::chrono::steady_clock;
constexpr int kSteps = 20;
int g_calls = 0;
struct RunResult;
class RunResult {};
enum Mode { kC };
struct Forward;
int prototype_only(int x);
shardtrain::TrainingConfig engine_config(bool fsdp, const std::string& optimizer) {
  return {};
}
template <class U>
U pick(U a, U b) { return a; }
std::ostream& operator<<(std::ostream& os, const RunResult& r) { return os; }
void make_callback() {}
void expect_same_bits(const at::Tensor& a, const at::Tensor& b) {}
void local_only() {}
}  // namespace
namespace other {
int helper_in_named(int x) { return x; }
}  // namespace other
TEST(DistB, Works) {
  int inner = 2;
}
""",
}
# Not `local_only`: a.cpp has it only as a local variable in a function body,
# so b.cpp alone defines it at file scope.
EXPECTED_SHARED = {"kSteps", "g_calls", "RunResult", "Mode", "engine_config", "pick", "operator<<",
                   "make_callback", "expect_same_bits"}


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
