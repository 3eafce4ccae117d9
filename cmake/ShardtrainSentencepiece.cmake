# libshardtrain_spm.so: the sentencepiece shim that shardtrain::load_sentencepiece()
# dlopen()s. Debian's libsentencepiece exports its own protobuf-lite, which
# crashes a process that also loads Debian's LibTorch if both are linked
# normally; so this module is the only thing that links sentencepiece, it never
# includes LibTorch, and it does not reuse the LibTorch PCH (its flags differ:
# hidden visibility).

find_path(SHARDTRAIN_SENTENCEPIECE_INCLUDE_DIR sentencepiece_processor.h
  DOC "Directory that contains sentencepiece_processor.h")
find_library(SHARDTRAIN_SENTENCEPIECE_LIBRARY NAMES sentencepiece
  DOC "libsentencepiece (the runtime library, not sentencepiece_train)")
if(NOT SHARDTRAIN_SENTENCEPIECE_INCLUDE_DIR OR NOT SHARDTRAIN_SENTENCEPIECE_LIBRARY)
  message(FATAL_ERROR
    "sentencepiece not found (sentencepiece_processor.h / libsentencepiece). The tokenizer shim needs it.\n"
    "On Debian: apt-get install libsentencepiece-dev sentencepiece (scripts/setup does this), or set "
    "SHARDTRAIN_SENTENCEPIECE_INCLUDE_DIR and SHARDTRAIN_SENTENCEPIECE_LIBRARY.")
endif()

add_library(shardtrain_spm MODULE src/tokenizer/spm_shim.cpp)
target_include_directories(shardtrain_spm PRIVATE ${PROJECT_SOURCE_DIR}/src ${SHARDTRAIN_SENTENCEPIECE_INCLUDE_DIR})
target_link_libraries(shardtrain_spm PRIVATE ${SHARDTRAIN_SENTENCEPIECE_LIBRARY})
set_target_properties(shardtrain_spm PROPERTIES
  CXX_VISIBILITY_PRESET hidden
  VISIBILITY_INLINES_HIDDEN ON)
# An unresolved symbol should fail the build, not the dlopen() at run time.
# Not under the sanitizers: clang leaves their runtime's symbols to the
# executable on purpose.
if(NOT SHARDTRAIN_FUZZ AND NOT CMAKE_CXX_FLAGS MATCHES "-fsanitize")
  target_link_options(shardtrain_spm PRIVATE -Wl,-z,defs)
endif()

# load_sentencepiece() looks for the shim next to libshardtrain, so a plain
# build of the library must produce it.
add_dependencies(shardtrain shardtrain_spm)
