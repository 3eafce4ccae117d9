#!/usr/bin/env python3
"""The layering of the tree, checked from its #include lines (ctest
Layout.IncludesFollowTheLayers). docs/architecture.md draws these layers.

Rules, each a way a newcomer's picture of the tree would stop being true:
  0. The build's include folders (target_include_directories of every
     CMakeLists.txt) are these roots, and no others (but vendored
     third_party/ libraries' own include folders).
  1. One include root per kind of header. Each top-level include folder
     ("comm/", "engine/", "shardtrain/", ...) exists under exactly one root,
     so an include path names one folder of the tree: src/ holds every
     private header, include/ every public one, examples/, tests/ and bench/
     their own.
  2. Every quoted include resolves to exactly one file (next to the includer,
     or under one root), or is one of the headers CMake generates.
  3. The layers only include downward: the engine core (src/engine/) never
     includes the sharding backends (src/backends/); communication
     (src/comm/) and kernels (src/kernels/) include neither of them; of the
     backends, only src/engine_factory.cpp (the one place that picks one)
     and the tests include them; one backend never includes another.
  4. Public headers (include/shardtrain/) include only public headers.
  5. Examples include only public headers and their own files.
  6. Optional backends (Gloo, NCCL, the CUDA kernels) are reached through
     their seam, a factory with a stub: no source outside their own folder
     tests SHARDTRAIN_WITH_* with #if (the tests may).
  7. A source of the library, the examples or the benchmarks over 600 lines
     says near its top why it is one piece ("One piece: ..."); else split it.
Usage: check_layering.py [REPO_ROOT]; prints every violation, exits 1 if any.
       check_layering.py --self-test: builds a small tree that breaks each
       rule once and checks that every break is reported.
"""
import pathlib
import re
import sys

ROOT = pathlib.Path(__file__).resolve().parents[2]
# Include roots, as the CMake targets set them (-I), and what lives there.
ROOTS = ["src", "include", "examples", "tests", "bench"]
# Headers CMake writes into the build tree (configure_file), by include path.
GENERATED = {
    "build_config.h": "src/build_config.h.in (private: what this build contains)",
    "shardtrain/version.h": "include/shardtrain/version.h.in",
    "data_dir.h": "examples/data_dir.h.in (examples' data directory)",
}
SOURCE_SUFFIXES = {".h", ".hpp", ".cpp", ".cu", ".cuh", ".in"}
INCLUDE = re.compile(r'^\s*#\s*include\s+"([^"]+)"', re.MULTILINE)
BUILD_CONDITION = re.compile(r'^\s*#\s*(?:if|ifdef|ifndef|elif)\b.*\bSHARDTRAIN_WITH_(GLOO|NCCL|CUDA_KERNELS)\b',
                             re.MULTILINE)
# The folders that implement an optional backend, and so may test its flag.
SEAM_FOLDERS = ("src/comm/gloo/", "src/comm/nccl/", "src/kernels/cuda/")
LONG_FILE_LINES = 600
ONE_PIECE = "One piece:"
HEADER_SUFFIXES = {".h", ".hpp", ".cuh"}


def sources():
    for root in ROOTS:
        for path in sorted((ROOT / root).rglob("*")):
            if path.is_file() and path.suffix in SOURCE_SUFFIXES:
                yield path


def rel(path):
    return path.relative_to(ROOT).as_posix()


def resolve(includer, name):
    """Every file the quoted include `name` in `includer` could open."""
    found = []
    local = includer.parent / name
    if local.is_file():
        return [local.resolve()]  # the includer's own folder is searched first
    for root in ROOTS:
        candidate = ROOT / root / name
        if candidate.is_file():
            found.append(candidate.resolve())
    return found


def build_include_roots():
    """Source-tree folders the CMake targets put on the include path."""
    found = {}
    for cmake in sorted(ROOT.rglob("CMakeLists.txt")):
        if ".git" in cmake.parts or any(part.startswith("build") for part in cmake.relative_to(ROOT).parts):
            continue
        text = cmake.read_text(errors="replace")
        for call in re.findall(r"target_include_directories\s*\((.*?)\)", text, re.DOTALL):
            for folder in re.findall(r"\$\{PROJECT_SOURCE_DIR\}/([A-Za-z0-9_./-]+)", call):
                found.setdefault(folder, rel(cmake))
    return found


def find_problems():
    problems = []

    # 0. The build's roots are the rule's roots.
    build_roots = build_include_roots()
    for folder, cmake in sorted(build_roots.items()):
        if folder.startswith("third_party/"):
            continue  # vendored libraries' own include folders, included with <...>
        if folder not in ROOTS:
            problems.append(f"{cmake} puts {folder}/ on the include path; the include roots are "
                            + ", ".join(ROOTS) + " (private headers live under src/)")

    # 1. One root per top-level include folder.
    owners = {}
    searched = ROOTS + sorted(f for f in build_roots if f not in ROOTS and not f.startswith("third_party/")
                              and (ROOT / f).is_dir())
    for root in searched:
        for folder in sorted(p for p in (ROOT / root).iterdir() if p.is_dir()):
            if not any(p.suffix in HEADER_SUFFIXES for p in folder.rglob("*")):
                continue  # data, scripts or sources only: nothing to include from there
            owners.setdefault(folder.name, []).append(f"{root}/{folder.name}")
    for name, folders in owners.items():
        if len(folders) > 1:
            problems.append(f'include paths "{name}/..." resolve into {len(folders)} folders: '
                            + ", ".join(folders) + " (keep one root per kind of header)")

    for path in sources():
        where = rel(path)
        text = path.read_text(errors="replace")
        # 7. Long files say why they are one piece.
        lines = text.split("\n")
        if (not where.startswith("tests/") and len(lines) - 1 > LONG_FILE_LINES
                and ONE_PIECE not in "\n".join(lines[:40])):
            problems.append(f"{where} has {len(lines) - 1} lines: split it, or say near its top why it is one "
                            f"piece (\"{ONE_PIECE} ...\")")
        # 6. Optional backends through their seam.
        if not where.startswith("tests/") and not where.startswith(SEAM_FOLDERS):
            for flag in sorted(set(BUILD_CONDITION.findall(text))):
                problems.append(f"{where} tests SHARDTRAIN_WITH_{flag} with #if: call the backend's factory, "
                                "whose stub answers in a build without it")
        for name in INCLUDE.findall(text):
            targets = resolve(path, name)
            if not targets:
                if name in GENERATED or name.endswith(".cuh") and (ROOT / "src" / name).is_file():
                    continue
                problems.append(f'{where}: "{name}" resolves to no file of the tree and is not generated')
                continue
            if len(targets) > 1:
                problems.append(f'{where}: "{name}" resolves to {len(targets)} files: '
                                + ", ".join(rel(t) for t in targets))
            target = rel(targets[0])

            # 3. Downward only.
            if target.startswith("src/backends/"):
                own = where.split("/")[2] if where.startswith("src/backends/") else None
                theirs = target.split("/")[2]
                allowed = (where == "src/engine_factory.cpp" or where.startswith("tests/")
                           or own == theirs)
                if not allowed:
                    problems.append(f"{where} includes the sharding backend {target}: only "
                                    "src/engine_factory.cpp chooses a backend; the rest reaches the engine "
                                    "through src/engine/engine.h and its plan")
            if (where.startswith("src/comm/") or where.startswith("src/kernels/")) and (
                    target.startswith("src/engine/") or target.startswith("src/backends/")):
                problems.append(f"{where} includes {target}: communication and kernels sit below the engine")

            # 4. Public headers stay public.
            if where.startswith("include/") and not target.startswith("include/"):
                problems.append(f"public header {where} includes the non-public {target}")

            # 5. Examples see only public headers and their own files.
            if where.startswith("examples/") and not (target.startswith("include/") or
                                                      target.startswith("examples/")):
                problems.append(f"example {where} includes {target}: examples use only public headers "
                                "(include/shardtrain); make what they need public and documented")

    return problems


# The self-test's tree: one file per rule, each breaking it once, and the
# words its report must contain.
BROKEN_TREE = {
    "CMakeLists.txt": "target_include_directories(x PRIVATE ${PROJECT_SOURCE_DIR}/backends)\n",
    "backends/comm/extra.h": "",                       # rule 1 (with src/comm below)
    "src/comm/work.h": '#include "engine/core.h"\n',  # rule 3: comm above the engine
    "src/engine/core.h": '#include "backends/zero/zero.h"\n',  # rule 3: core into a backend
    "src/backends/zero/zero.h": "",
    "src/backends/fsdp/fsdp.h": '#include "backends/zero/zero.h"\n',  # rule 3: backend into backend
    "src/missing.cpp": '#include "nowhere/none.h"\n',  # rule 2
    "include/shardtrain/api.h": '#include "engine/core.h"\n',  # rule 4
    "examples/main.cpp": '#include "engine/core.h"\n',  # rule 5
    "tests/t.cpp": '#include "backends/zero/zero.h"\n#if defined(SHARDTRAIN_WITH_NCCL)\n#endif\n',  # allowed
    "src/caller.cpp": '#if defined(SHARDTRAIN_WITH_GLOO)\n#endif\n',  # rule 6
    "src/comm/nccl/impl.cpp": '#if !defined(SHARDTRAIN_WITH_CUDA_KERNELS)\n#endif\n',  # allowed: its own seam
    "src/long.cpp": "// A long file.\n" + "int x;\n" * 601,  # rule 7
    "src/long_reasoned.cpp": "// A long file.\n// One piece: a reason.\n" + "int x;\n" * 601,  # allowed
}
EXPECTED = [
    "puts backends/ on the include path",
    'include paths "comm/..." resolve into 2 folders',
    '"nowhere/none.h" resolves to no file',
    "src/comm/work.h includes src/engine/core.h",
    "src/engine/core.h includes the sharding backend",
    "src/backends/fsdp/fsdp.h includes the sharding backend",
    "public header include/shardtrain/api.h includes the non-public src/engine/core.h",
    "example examples/main.cpp includes src/engine/core.h",
    "src/caller.cpp tests SHARDTRAIN_WITH_GLOO with #if",
    "src/long.cpp has 602 lines",
]


def self_test():
    global ROOT
    import tempfile
    with tempfile.TemporaryDirectory() as tmp:
        ROOT = pathlib.Path(tmp).resolve()
        for name, text in BROKEN_TREE.items():
            (ROOT / name).parent.mkdir(parents=True, exist_ok=True)
            (ROOT / name).write_text(text)
        for root in ROOTS:
            (ROOT / root).mkdir(exist_ok=True)
        problems = find_problems()
    report = "\n".join(problems)
    missed = [words for words in EXPECTED if words not in report]
    unexpected = [p for p in problems if not any(words in p for words in EXPECTED)]
    if missed or unexpected or len(problems) != len(EXPECTED):
        print("self-test failed. Reported:\n  " + "\n  ".join(problems))
        for words in missed:
            print(f"  not reported: {words}")
        for problem in unexpected:
            print(f"  reported but not planted: {problem}")
        return 1
    print(f"self-test: each of the {len(EXPECTED)} planted breaks reported, nothing else")
    return 0


def main():
    global ROOT
    if len(sys.argv) > 1 and sys.argv[1] == "--self-test":
        return self_test()
    if len(sys.argv) > 1:
        ROOT = pathlib.Path(sys.argv[1]).resolve()
    problems = find_problems()
    if problems:
        print(f"{len(problems)} layering problem(s) in {ROOT}:")
        for problem in problems:
            print("  " + problem)
        return 1
    print(f"layering holds in {ROOT}: {sum(1 for _ in sources())} files, roots {', '.join(ROOTS)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
