# Test registration helpers.
#
# hp_add_test(NAME <name> SOURCES <files...> [RANKS <n>...] [LABELS <labels...>] [TIMEOUT <s>]
#             [TIMING_RANKS <n>...])
#   Builds one gtest binary. With RANKS, registers one ctest entry per rank count,
#   named <name>.np<N>, run under mpirun (oversubscribed, allowed as root).
#   Without RANKS, registers a plain single-process test.
#   TIMING_RANKS: the binary's suites named *Timing (assertions on wall-clock or CPU time,
#   which a loaded machine can fail) leave the entries above and run alone as
#   <name>.timing.np<N>, labelled dist_timing (ctest -L dist_timing reruns them alone).

# GoogleTest: the installed package (Debian's googletest), else its sources at
# HP_GTEST_SOURCE_DIR (the GPU check carries a copy of /usr/src/googletest there).
find_package(GTest QUIET)
if(NOT GTest_FOUND)
  set(HP_GTEST_SOURCE_DIR "" CACHE PATH "GoogleTest sources, when no GoogleTest package is installed")
  if(NOT HP_GTEST_SOURCE_DIR OR NOT EXISTS "${HP_GTEST_SOURCE_DIR}/CMakeLists.txt")
    message(FATAL_ERROR "GoogleTest not found: install googletest (libgtest-dev), or set HP_GTEST_SOURCE_DIR "
                        "to its sources, or configure with -DHP_BUILD_TESTS=OFF")
  endif()
  set(INSTALL_GTEST OFF CACHE BOOL "" FORCE)
  set(BUILD_GMOCK OFF CACHE BOOL "" FORCE)
  add_subdirectory(${HP_GTEST_SOURCE_DIR} ${PROJECT_BINARY_DIR}/googletest EXCLUDE_FROM_ALL)
  if(NOT TARGET GTest::gtest)  # GoogleTest >= 1.11 defines it itself
    add_library(GTest::gtest ALIAS gtest)
  endif()
endif()

add_library(hp_test_main STATIC ${PROJECT_SOURCE_DIR}/tests/test_main.cpp)
target_link_libraries(hp_test_main PUBLIC hp GTest::gtest)
# Tests may include private headers (pure kernels and plans are tested directly).
target_include_directories(hp_test_main PUBLIC ${PROJECT_SOURCE_DIR}/src ${PROJECT_SOURCE_DIR}/tests)
if(HP_PRECOMPILED_HEADERS)  # CMakeLists.txt says when
  target_precompile_headers(hp_test_main PUBLIC
    <gtest/gtest.h> <ATen/ATen.h>)
endif()

# A sanitized build runs several times slower: scripts/sanitize.sh sets this factor, which
# scales every test's TIMEOUT and its communicators' HP_COMM_TIMEOUT_S.
set(HP_TEST_TIMEOUT_SCALE 1 CACHE STRING "factor on each test's time limit and communicator timeout")

# An entry added with add_test (a script, or a fixed rank count): its TIMEOUT and its
# environment's HP_COMM_TIMEOUT_S, both times HP_TEST_TIMEOUT_SCALE, and the other
# properties given after them.
function(hp_script_test_limits name timeout comm_timeout)
  math(EXPR t "${timeout} * ${HP_TEST_TIMEOUT_SCALE}")
  math(EXPR ct "${comm_timeout} * ${HP_TEST_TIMEOUT_SCALE}")
  set_tests_properties(${name} PROPERTIES TIMEOUT ${t}
    ENVIRONMENT "OMPI_ALLOW_RUN_AS_ROOT=1;OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1;HP_COMM_TIMEOUT_S=${ct}" ${ARGN})
endfunction()

function(hp_add_test)
  cmake_parse_arguments(T "" "NAME;TIMEOUT" "SOURCES;RANKS;LABELS;TIMING_RANKS" ${ARGN})
  if(NOT T_TIMEOUT)
    set(T_TIMEOUT 300)
  endif()
  math(EXPR T_TIMEOUT "${T_TIMEOUT} * ${HP_TEST_TIMEOUT_SCALE}")
  math(EXPR comm_timeout "120 * ${HP_TEST_TIMEOUT_SCALE}")
  set(filter "")
  if(T_TIMING_RANKS)
    set(filter "--gtest_filter=-*Timing.*")
    if(HP_HAVE_MPI AND HP_MPIEXEC)
      foreach(np IN LISTS T_TIMING_RANKS)
        add_test(NAME ${T_NAME}.timing.np${np}
          COMMAND ${HP_MPIEXEC} -np ${np} --oversubscribe --bind-to none
                  $<TARGET_FILE:${T_NAME}> "--gtest_filter=*Timing.*")
        set_tests_properties(${T_NAME}.timing.np${np} PROPERTIES
          TIMEOUT ${T_TIMEOUT} LABELS dist_timing PROCESSORS ${np}
          ENVIRONMENT "OMPI_ALLOW_RUN_AS_ROOT=1;OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1;OMPI_MCA_rmaps_base_oversubscribe=1;HP_COMM_TIMEOUT_S=${comm_timeout}")
      endforeach()
    endif()
  endif()
  add_executable(${T_NAME} ${T_SOURCES})
  target_link_libraries(${T_NAME} PRIVATE hp_test_main)
  if(HP_PRECOMPILED_HEADERS)
    target_precompile_headers(${T_NAME} REUSE_FROM hp_test_main)
  endif()
  if(T_RANKS)
    foreach(np IN LISTS T_RANKS)
      if(HP_HAVE_MPI AND HP_MPIEXEC)
        add_test(NAME ${T_NAME}.np${np}
          COMMAND ${HP_MPIEXEC} -np ${np} --oversubscribe --bind-to none
                  $<TARGET_FILE:${T_NAME}> ${filter})
        set_tests_properties(${T_NAME}.np${np} PROPERTIES
          TIMEOUT ${T_TIMEOUT} LABELS "${T_LABELS}" PROCESSORS ${np}
          ENVIRONMENT "OMPI_ALLOW_RUN_AS_ROOT=1;OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1;OMPI_MCA_rmaps_base_oversubscribe=1;HP_COMM_TIMEOUT_S=${comm_timeout}")
      elseif(np EQUAL 1)
        add_test(NAME ${T_NAME}.np1 COMMAND $<TARGET_FILE:${T_NAME}> ${filter})
        set_tests_properties(${T_NAME}.np1 PROPERTIES TIMEOUT ${T_TIMEOUT} LABELS "${T_LABELS}")
      endif()
    endforeach()
  else()
    add_test(NAME ${T_NAME} COMMAND $<TARGET_FILE:${T_NAME}> ${filter})
    set_tests_properties(${T_NAME} PROPERTIES TIMEOUT ${T_TIMEOUT} LABELS "${T_LABELS}")
  endif()
endfunction()
