include(CMakePackageConfigHelpers)

install(TARGETS shardtrain shardtrain_models EXPORT shardtrainTargets
  LIBRARY DESTINATION ${CMAKE_INSTALL_LIBDIR}
  ARCHIVE DESTINATION ${CMAKE_INSTALL_LIBDIR}
  RUNTIME DESTINATION ${CMAKE_INSTALL_BINDIR}
  INCLUDES DESTINATION ${CMAKE_INSTALL_INCLUDEDIR})
install(TARGETS shardtrain_cli RUNTIME DESTINATION ${CMAKE_INSTALL_BINDIR})
# load_sentencepiece() finds the shim in the directory libshardtrain is loaded from.
install(TARGETS shardtrain_spm LIBRARY DESTINATION ${CMAKE_INSTALL_LIBDIR})
install(DIRECTORY include/shardtrain DESTINATION ${CMAKE_INSTALL_INCLUDEDIR}
  FILES_MATCHING PATTERN "*.h")
install(FILES ${PROJECT_BINARY_DIR}/include/shardtrain/version.h
  DESTINATION ${CMAKE_INSTALL_INCLUDEDIR}/shardtrain)

set(SHARDTRAIN_CMAKE_DIR ${CMAKE_INSTALL_LIBDIR}/cmake/shardtrain)
install(EXPORT shardtrainTargets NAMESPACE shardtrain:: DESTINATION ${SHARDTRAIN_CMAKE_DIR})
configure_package_config_file(cmake/shardtrainConfig.cmake.in
  ${PROJECT_BINARY_DIR}/shardtrainConfig.cmake
  INSTALL_DESTINATION ${SHARDTRAIN_CMAKE_DIR})
write_basic_package_version_file(${PROJECT_BINARY_DIR}/shardtrainConfigVersion.cmake
  COMPATIBILITY SameMinorVersion)
install(FILES ${PROJECT_BINARY_DIR}/shardtrainConfig.cmake
  ${PROJECT_BINARY_DIR}/shardtrainConfigVersion.cmake
  ${PROJECT_SOURCE_DIR}/cmake/ShardtrainFmtPin.cmake
  ${PROJECT_SOURCE_DIR}/cmake/ShardtrainCudaRuntimes.cmake
  DESTINATION ${SHARDTRAIN_CMAKE_DIR})
