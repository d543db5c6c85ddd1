# Installing refit as a library others build against: the public headers (with the generated
# refit/version.h), the static libraries of the public API, the `refit` CLI, a CMake package
# (find_package(refit) → refit::refit) and a pkg-config file (refit.pc).
#
# Every layer library is installed and exported, not only refit_lib: they are static archives,
# so a consumer's link line needs all of them, including those one layer links PRIVATE to another.
# Their third-party dependencies are found again by refitConfig.cmake (find_dependency, and
# pkg_check_modules for the pkg-config ones), under the same imported-target names as here.
include(CMakePackageConfigHelpers)

set(REFIT_LAYERS util core codec pipeline receiver transport control node workload)
set(REFIT_INSTALL_CMAKEDIR ${CMAKE_INSTALL_LIBDIR}/cmake/refit
    CACHE STRING "Where refitConfig.cmake is installed, relative to the prefix")

# Exported as refit::<layer>; refit_lib, the whole public API, as refit::refit.
foreach(layer IN LISTS REFIT_LAYERS)
  set_target_properties(refit_${layer} PROPERTIES EXPORT_NAME ${layer})
endforeach()
set_target_properties(refit_lib PROPERTIES EXPORT_NAME refit)

list(TRANSFORM REFIT_LAYERS PREPEND refit_ OUTPUT_VARIABLE REFIT_LAYER_TARGETS)
install(TARGETS ${REFIT_LAYER_TARGETS} refit_lib
  EXPORT refitTargets
  ARCHIVE DESTINATION ${CMAKE_INSTALL_LIBDIR}
  INCLUDES DESTINATION ${CMAKE_INSTALL_INCLUDEDIR})
# The CLI links only system shared libraries (and MPI's, outside the default search path), so it
# is linked once with its install RPATH: those directories. Rewriting a build RPATH at install
# time fails here (CMake expects the trailing ':' of its build RPATH, which ld drops).
set_target_properties(refit PROPERTIES BUILD_WITH_INSTALL_RPATH ON INSTALL_RPATH_USE_LINK_PATH ON)
install(TARGETS refit RUNTIME DESTINATION ${CMAKE_INSTALL_BINDIR})

install(DIRECTORY ${PROJECT_SOURCE_DIR}/include/refit
  DESTINATION ${CMAKE_INSTALL_INCLUDEDIR}
  FILES_MATCHING PATTERN "*.h")
install(FILES ${PROJECT_BINARY_DIR}/include/refit/version.h
  DESTINATION ${CMAKE_INSTALL_INCLUDEDIR}/refit)

install(EXPORT refitTargets
  NAMESPACE refit::
  FILE refitTargets.cmake
  DESTINATION ${REFIT_INSTALL_CMAKEDIR})

# What the config file has to look up again: MPI only when refit_node was built with it.
if(MPI_CXX_FOUND)
  set(REFIT_WITH_MPI ON)
else()
  set(REFIT_WITH_MPI OFF)
endif()
configure_package_config_file(${PROJECT_SOURCE_DIR}/cmake/refitConfig.cmake.in
  ${PROJECT_BINARY_DIR}/cmake/refitConfig.cmake
  INSTALL_DESTINATION ${REFIT_INSTALL_CMAKEDIR})
# Before 1.0 a minor release may break the API, so only the same major.minor is compatible.
write_basic_package_version_file(${PROJECT_BINARY_DIR}/cmake/refitConfigVersion.cmake
  VERSION ${PROJECT_VERSION}
  COMPATIBILITY SameMinorVersion)
install(FILES ${PROJECT_BINARY_DIR}/cmake/refitConfig.cmake
              ${PROJECT_BINARY_DIR}/cmake/refitConfigVersion.cmake
  DESTINATION ${REFIT_INSTALL_CMAKEDIR})

# refit.pc. Relocatable: the prefix is found from the file's own directory (${pcfiledir}), so an
# install with `cmake --install … --prefix DIR` works wherever DIR is. All dependencies are in
# Requires (not Requires.private) and all archives in Libs: the libraries are static, so a plain
# `pkg-config --libs refit` must give a complete link line.
if(IS_ABSOLUTE "${CMAKE_INSTALL_LIBDIR}" OR IS_ABSOLUTE "${CMAKE_INSTALL_INCLUDEDIR}")
  set(REFIT_PC_PREFIX "${CMAKE_INSTALL_PREFIX}")
  set(REFIT_PC_LIBDIR "${CMAKE_INSTALL_FULL_LIBDIR}")
  set(REFIT_PC_INCLUDEDIR "${CMAKE_INSTALL_FULL_INCLUDEDIR}")
else()
  file(RELATIVE_PATH REFIT_PC_UP "/refit-prefix/${CMAKE_INSTALL_LIBDIR}/pkgconfig" "/refit-prefix")
  string(REGEX REPLACE "/$" "" REFIT_PC_UP "${REFIT_PC_UP}")
  set(REFIT_PC_PREFIX "\${pcfiledir}/${REFIT_PC_UP}")
  set(REFIT_PC_LIBDIR "\${prefix}/${CMAKE_INSTALL_LIBDIR}")
  set(REFIT_PC_INCLUDEDIR "\${prefix}/${CMAKE_INSTALL_INCLUDEDIR}")
endif()
# Link order: every archive before the ones it depends on.
set(REFIT_PC_LIBS "")
foreach(layer IN ITEMS node control transport pipeline receiver workload codec core util)
  string(APPEND REFIT_PC_LIBS " -lrefit_${layer}")
endforeach()
set(REFIT_PC_CFLAGS "")
set(REFIT_PC_REQUIRES
    "fmt spdlog libzstd libhwy nlohmann_json yaml-cpp pugixml libxxhash libzmq cpp-httplib libcurl libssl libcrypto prometheus-cpp-core")
if(REFIT_WITH_MPI)
  string(APPEND REFIT_PC_CFLAGS " -DREFIT_HAVE_MPI=1")
  # The MPI implementation's own .pc name varies (ompi-cxx, mpich, …): its libraries by path.
  foreach(lib IN LISTS MPI_CXX_LIBRARIES)
    string(APPEND REFIT_PC_LIBS " ${lib}")
  endforeach()
endif()
# htscodecs (context-coded deltas, refit_codec) has no .pc file of its own.
string(APPEND REFIT_PC_LIBS " -lhtscodecs -pthread")
configure_file(${PROJECT_SOURCE_DIR}/cmake/refit.pc.in ${PROJECT_BINARY_DIR}/refit.pc @ONLY)
install(FILES ${PROJECT_BINARY_DIR}/refit.pc DESTINATION ${CMAKE_INSTALL_LIBDIR}/pkgconfig)
