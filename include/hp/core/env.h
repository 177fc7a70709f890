// Environment knobs read by hyperparallel. Each knob is declared once, here, with its
// default and meaning; docs/env.md lists the same table for users. Reading a name that is
// not declared is an internal error, so a knob cannot be used without being documented.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace hp::env {

struct Knob {
  const char* name;
  const char* default_value;
  const char* meaning;
  // Numeric knobs: the accepted range, inclusive (min > max: not numeric).
  double min = 1, max = 0;
  // String knobs with fixed values: "a|b|c" (empty: any).
  const char* choices = "";
  bool numeric() const { return min <= max; }
};

// Every knob the library reads.
const std::vector<Knob>& knobs();

// The knob's value: the environment's when set and non-empty, else its default.
std::string get_string(const char* name);
// Parsed as an integer / double; a malformed value, one outside the knob's range (or, for a
// double, not finite) raises hp::Error naming the knob, the value and the range.
int64_t get_int(const char* name);
double get_double(const char* name);
// Reads and checks every knob (range, choices); raises on the first bad one. hp::init
// calls it first, so a bad knob stops a program before anything starts.
void check_all();

}  // namespace hp::env
