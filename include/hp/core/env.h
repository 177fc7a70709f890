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
};

// Every knob the library reads.
const std::vector<Knob>& knobs();

// The knob's value: the environment's when set and non-empty, else its default.
std::string get_string(const char* name);
// Parsed as an integer / double; a malformed value raises hp::Error naming the knob.
int64_t get_int(const char* name);
double get_double(const char* name);

}  // namespace hp::env
