#!/usr/bin/env python3
"""Every GoogleTest suite of shardtrain_tests reaches CTest.

tests/CMakeLists.txt registers the suites by their name's prefix, one
gtest_discover_tests filter per label (unit -> Unit*, dist -> Dist*, ...). A
suite named otherwise is compiled but never registered, so `scripts/test`
and CI would never run it, silently. This lists the binary's suites and
fails naming each one outside those prefixes.

Usage: check_test_labels.py PATH/TO/shardtrain_tests LABEL...
(the labels are tests/CMakeLists.txt's _st_test_labels, passed by CTest)
"""
import subprocess
import sys


def suites(listing):
    """The suite lines of --gtest_list_tests: unindented, ending in '.'
    (a parameterised one as 'Instantiation/Suite.  # TypeParam ...'); gtest_main's
    "Running main() ..." line is neither."""
    for line in listing.splitlines():
        token = line.split()[0] if line and not line[0].isspace() else ""
        if token.endswith("."):
            yield token[:-1]


def main():
    if len(sys.argv) < 3:
        sys.exit(__doc__)
    prefixes = tuple(label[:1].upper() + label[1:] for label in sys.argv[2:])  # as the CMake loop forms them
    listing = subprocess.run([sys.argv[1], "--gtest_list_tests"], check=True, capture_output=True, text=True,
                             timeout=60).stdout
    found = list(suites(listing))
    if not found:
        sys.exit(f"check_test_labels: {sys.argv[1]} listed no test suites")
    unlabeled = [name for name in found if not name.startswith(prefixes)]
    if unlabeled:
        print("These test suites never run under CTest: their names start with none of " + ", ".join(prefixes) +
              ", the prefixes tests/CMakeLists.txt registers by. Rename each (e.g. Foo -> UnitFoo):")
        for name in unlabeled:
            print("  " + name)
        sys.exit(1)
    print(f"all {len(found)} test suites carry a label prefix")


if __name__ == "__main__":
    main()
