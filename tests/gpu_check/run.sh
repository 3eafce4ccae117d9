#!/usr/bin/env bash
# scripts/gpu-check's dry run, as CI can prove it without a GPU, in a clean
# copy of the tree (the files git tracks or would track: what ships to a GPU
# node), against a bundle scripts/gpu-bundle packs from the suite's build:
#  - the bundle fits in 48 MiB;
#  - the whole dry run passes, given the bundle by a relative path (the tests
#    run in a scratch folder), its JSON is valid after every step (each
#    rewrite is kept through SHARDTRAIN_GPU_CHECK_SNAPSHOTS) and not ok while
#    a step is pending, every GPU half is not_run with its reason and every
#    CPU half left its numbers; the environment step names the glibc the
#    bundle needs and the one it found; $OUT holds the JSON and at most six
#    logs, nothing else;
#  - a 15 s budget stops it cleanly: it ends within the budget and a margin,
#    and its JSON says which steps ran and which did not fit. 15 s leaves the
#    kernels' step the 10 s it needs to start after an environment step of up
#    to 5 s, and is too short for the engines' 20 s and the benchmark's 40 s
#    (scripts/gpu-check's BOUNDS); a larger budget would only repeat the
#    engines' step of the whole run above, in a test that runs alone;
#  - a test step killed at its bound names the test it stopped inside.
# Usage: run.sh SOURCE_DIR BUILD_DIR WORK_DIR
set -euo pipefail
src=$1 build=$2 work=$3
python=$src/.venv/bin/python3
rm -rf "$work"; mkdir -p "$work/tree"
fail() { echo "FAIL: $*"; exit 1; }

(cd "$src" && git ls-files -z --cached --others --exclude-standard) |
  (cd "$src" && xargs -0 cp --parents -t "$work/tree")
tree=$work/tree
[ -x "$tree/scripts/gpu-check" ] || fail "the copy lacks scripts/gpu-check"

PYTHON=$python "$tree/scripts/gpu-bundle" "$work/bundle" --from-build "$build" >"$work/bundle.log" 2>&1 ||
  { cat "$work/bundle.log"; fail "scripts/gpu-bundle failed"; }
bytes=$(du -sb "$work/bundle" | cut -f1)
[ "$bytes" -le $(( 48 << 20 )) ] || fail "the bundle is $bytes bytes, over 48 MiB"
echo "ok: bundle of $(( bytes >> 20 )) MiB"

# The whole dry run.
rc=0
(cd "$work" && OUT=$work/out SHARDTRAIN_GPU_CHECK_SNAPSHOTS=$work/snapshots \
  "$python" "$tree/scripts/gpu-check" --prebuilt bundle --dry-run) >"$work/dry.txt" 2>&1 || rc=$?
[ "$rc" -eq 0 ] || { cat "$work/dry.txt"; fail "the dry run exited with $rc"; }
chars=$(wc -c <"$work/dry.txt")
[ "$chars" -le 12000 ] || fail "the dry run printed $chars characters (at most about 12,000)"
"$python" - "$work/out" "$work/snapshots" <<'PY' || { cat "$work/dry.txt"; exit 1; }
import json, os, sys
out, snapshots = sys.argv[1:3]
names = ["environment", "kernels", "nccl", "engines", "benchmark"]
versions = sorted(os.listdir(snapshots))
if len(versions) < len(names) + 1:
    sys.exit(f"FAIL: {len(versions)} JSON versions, expected one before the steps and one after each")
for v in versions:
    report = json.load(open(os.path.join(snapshots, v)))  # raises on a torn or invalid file
    assert [s["name"] for s in report["steps"]] == names, v
    for s in report["steps"]:
        assert s["status"] in ("passed", "failed", "not_run"), (v, s)
    if any(s["reason"] == "pending" for s in report["steps"]):
        assert report["ok"] is False, (v, "ok while a step is pending", report["ok"])
final = json.load(open(os.path.join(out, "gpu-check.json")))
steps = {s["name"]: s for s in final["steps"]}
assert final["ok"] is True and final["dry_run"] is True, final
assert steps["environment"]["status"] == "passed", steps["environment"]
environment = steps["environment"]["numbers"]
assert environment["bundle"]["glibc_required"].startswith("2."), environment["bundle"]
assert environment["glibc"].startswith("glibc 2."), environment
for name in names[1:]:
    s = steps[name]
    assert s["status"] == "not_run" and s["reason"].startswith("dry run"), s
engines = steps["engines"]["numbers"]
assert engines["passed"] >= 9 and engines["failed"] == 0, engines
measured = engines["measured"]
assert any(n.endswith("fsdp_pure") for n in measured), measured  # every engine's CPU half left its numbers
runs = steps["benchmark"]["numbers"]["runs"]
for run in ("shardtrain_zero3", "pytorch_eager", "shardtrain_fsdp_standard", "pytorch_fsdp2"):
    assert runs[run]["status"] == "ran" and runs[run]["tokens_per_s"] > 0, (run, runs.get(run))
assert steps["benchmark"]["numbers"]["ratios_step_time"]["zero3_over_eager"] > 0
offload = runs["shardtrain_zero3_offload"]  # the offload row's plumbing (nothing moves on a CPU)
assert offload["status"] == "ran" and offload["tokens_per_s"] > 0, offload
files = sorted(os.listdir(out))
logs = [f for f in files if f.endswith(".log")]
assert files == sorted(["gpu-check.json"] + logs) and len(logs) <= 6, files
print(f"ok: dry run, {len(versions)} valid JSON versions, {len(logs)} logs")
PY

# A 15 s budget: it stops cleanly, with what it found.
budget=15
start=$(date +%s)
rc=0
OUT=$work/out-budget "$python" "$tree/scripts/gpu-check" --prebuilt "$work/bundle" --dry-run --budget $budget \
  >"$work/dry-budget.txt" 2>&1 || rc=$?
seconds=$(( $(date +%s) - start ))
# The bound covers the steps; the margin is start-up and the last JSON write.
[ "$seconds" -le $(( budget + 15 )) ] || { cat "$work/dry-budget.txt"; fail "a $budget s budget took $seconds s"; }
"$python" - "$work/out-budget/gpu-check.json" $budget <<'PY' || { cat "$work/dry-budget.txt"; exit 1; }
import json, sys
report, budget = json.load(open(sys.argv[1])), sys.argv[2]
steps = {s["name"]: s for s in report["steps"]}
assert steps["environment"]["status"] == "passed", steps["environment"]
skipped = [n for n, s in steps.items() if s["status"] == "not_run" and s["reason"].startswith("budget")]
assert skipped, f"a {budget} s budget left no step out: " + json.dumps(report["steps"])
assert all(s["reason"] != "pending" for s in report["steps"]), report["steps"]
print(f"ok: a {budget} s budget stopped cleanly; left out: {', '.join(skipped)}")
PY
# A step killed at its bound (or crashed) has no gtest JSON: its printed lines
# must still say which tests passed and inside which one it stopped. The
# engines' step, bounded at 4 s, over the eight engine runs (about 18 s on a
# 2-core Zen 4): it is killed inside one of them, after start-up.
"$python" - "$tree/scripts/gpu-check" "$work/bundle" "$work/out-killed" <<'PY' || exit 1
import argparse, importlib.machinery, importlib.util, os, sys
script, bundle, out = sys.argv[1:4]
loader = importlib.machinery.SourceFileLoader("gpu_check", script)
gpu_check = importlib.util.module_from_spec(importlib.util.spec_from_loader("gpu_check", loader))
loader.exec_module(gpu_check)
# The parser on gtest's own forms: a parameterised failure names the test before its GetParam().
printed = gpu_check.read_gtest_log("\n".join([
    "[ RUN      ] P/Suite.Case/0", "a.cpp:3: Failure", "Expected equality", "[  FAILED  ] P/Suite.Case/0, where "
    "GetParam() = 4-byte object <00-00 00-00> (3 ms)", "[ RUN      ] Suite.Next", "last words"]))
assert [(t["name"], t["result"], bool(t.get("unfinished"))) for t in printed] == \
    [("P/Suite.Case/0", "failed", False), ("Suite.Next", "failed", True)], printed
assert printed[0]["failure"] == ["a.cpp:3: Failure", "Expected equality"], printed
assert printed[1]["failure"][-1] == "last words", printed
# A run that died between two tests has every printed test finished: the step
# must still fail, since its report is missing (the tests after never ran).
crashed = os.path.join(out, "crashed")
os.makedirs(crashed, exist_ok=True)
fake = os.path.join(crashed, "fake_tests")
with open(fake, "w") as f:
    f.write("#!/bin/sh\necho '[ RUN      ] Suite.First'\necho '[       OK ] Suite.First (1 ms)'\nkill -SEGV $$\n")
os.chmod(fake, 0o755)
dead = gpu_check.Check(argparse.Namespace(prebuilt=bundle, dry_run=True, budget=60, build=False), crashed)
dead.bin = crashed
os.rename(fake, os.path.join(crashed, "shardtrain_gpu_tests"))
dead.gtest_step("kernels", "*")
step = dead.step("kernels")
assert step["status"] == "failed" and "between tests, without their report; 1 tests passed" in step["reason"], step
os.makedirs(out, exist_ok=True)
check = gpu_check.Check(argparse.Namespace(prebuilt=bundle, dry_run=True, budget=120, build=False), out)
assert check.environment(), check.step("environment")
gpu_check.BOUNDS["engines"] = (4, 1)
check.gtest_step("engines", "GpuTraining/GpuEngines.*")
step = check.step("engines")
assert step["status"] == "failed" and "timed out after 4 s inside GpuTraining/GpuEngines." in step["reason"], step
unfinished = [f for f in step["failures"] if f["first_lines"][0].startswith("did not finish")]
assert len(unfinished) == 1 and unfinished[0]["test"] in step["reason"], step
numbers = step["numbers"]
assert numbers["tests"] == numbers["passed"] + 1 and numbers["failed"] == 1, step
print(f"ok: a step killed at its bound names the test it stopped inside ({step['reason']})")
PY
echo "ok: gpu-check dry run in a clean copy"
