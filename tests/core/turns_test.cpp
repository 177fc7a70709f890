// hp::take_turns: two computations, one running at a time, switching only at yield_turn()
// and when one ends; an exception ends its side only and is rethrown after both ran.
#include <gtest/gtest.h>

#include <stdexcept>
#include <string>
#include <vector>

#include "hp/core/turns.h"

namespace {

TEST(Turns, SwitchOnlyAtYieldsAndWhenASideEnds) {
  std::vector<std::string> log;  // unguarded: the two sides never run at once
  const int64_t before = hp::turns_taken();
  hp::take_turns(
      [&] {
        log.push_back("a1");
        hp::yield_turn();
        log.push_back("a2");
        hp::yield_turn();
        log.push_back("a3");
        hp::yield_turn();  // b has ended: returns at once
        log.push_back("a4");
      },
      [&] {
        log.push_back("b1");
        hp::yield_turn();
        log.push_back("b2");
      });
  EXPECT_EQ(log, (std::vector<std::string>{"a1", "b1", "a2", "b2", "a3", "a4"}));
  EXPECT_EQ(hp::turns_taken() - before, 3);
}

TEST(Turns, YieldOutsideIsNothing) {
  const int64_t before = hp::turns_taken();
  hp::yield_turn();
  EXPECT_EQ(hp::turns_taken(), before);
}

TEST(Turns, AnExceptionEndsItsSideAndTheOtherFinishes) {
  std::vector<std::string> log;
  try {
    hp::take_turns(
        [&] {
          log.push_back("a1");
          hp::yield_turn();
          throw std::runtime_error("first failed");
        },
        [&] {
          log.push_back("b1");
          hp::yield_turn();
          log.push_back("b2");
          hp::yield_turn();
          log.push_back("b3");
        });
    FAIL() << "expected the first side's error";
  } catch (const std::runtime_error& e) {
    EXPECT_EQ(std::string(e.what()), "first failed");
  }
  EXPECT_EQ(log, (std::vector<std::string>{"a1", "b1", "b2", "b3"}));
  // The second's error, when the first ends well.
  EXPECT_THROW(hp::take_turns([] { hp::yield_turn(); }, [] { throw std::logic_error("second failed"); }),
               std::logic_error);
}

}  // namespace
