# One Fuzz.* test: replay the regression inputs, then fuzz for SECONDS from
# the seed corpus into a scratch corpus (the committed seeds are never
# written). A crash, a sanitizer report, a timeout of one input or an escaped
# exception makes the fuzzer exit non-zero, and the test fails with its output.
# LibTorch is not instrumented: its start-up allocations look like leaks and
# exceed libFuzzer's default RSS limit, hence detect_leaks=0 and -rss_limit_mb.
set(ENV{ASAN_OPTIONS} "detect_leaks=0:detect_container_overflow=0")
set(ENV{UBSAN_OPTIONS} "print_stacktrace=1:halt_on_error=1")
file(GLOB regressions "${REGRESSIONS}/*")
if(regressions)
  execute_process(COMMAND ${FUZZER} -rss_limit_mb=4096 -timeout=20 ${regressions} RESULT_VARIABLE rc)
  if(NOT rc EQUAL 0)
    message(FATAL_ERROR "${FUZZER} failed on a committed regression input in ${REGRESSIONS} (exit ${rc})")
  endif()
endif()
file(REMOVE_RECURSE "${WORK}")
file(MAKE_DIRECTORY "${WORK}/corpus" "${WORK}/artifacts")
execute_process(COMMAND ${FUZZER} "${WORK}/corpus" "${SEEDS}" -max_total_time=${SECONDS} -max_len=131072
                        -rss_limit_mb=4096 -timeout=20 -print_final_stats=1 -artifact_prefix=${WORK}/artifacts/
                RESULT_VARIABLE rc)
if(NOT rc EQUAL 0)
  message(FATAL_ERROR "${FUZZER} found a failing input (exit ${rc}); it is in ${WORK}/artifacts. Reproduce with "
                      "${FUZZER} FILE, fix the parser, and commit the file to ${REGRESSIONS}")
endif()
