// hp::train::PreemptionSignals: the first SIGTERM or SIGUSR1 is recorded (and nothing else
// happens), the second ends the process at once with 128 + its number; the handlers it
// replaced come back when it goes.
#include <gtest/gtest.h>

#include <signal.h>

#include <sys/stat.h>
#include <unistd.h>

#include <csignal>
#include <fstream>
#include <sstream>

#include "hp/core/files.h"
#include "hp/train/preemption.h"
#include "hp/train/run.h"

namespace ht = hp::train;

TEST(Preemption, TheFirstSignalIsRecordedTheSecondEndsTheProcess) {
  {
    ht::PreemptionSignals s;
    EXPECT_EQ(ht::PreemptionSignals::received(), 0);
    std::raise(SIGUSR1);
    EXPECT_EQ(ht::PreemptionSignals::received(), SIGUSR1) << "the first signal was not recorded";
    EXPECT_EQ(ht::signal_name(ht::PreemptionSignals::received()), "SIGUSR1");
  }
  // A new object starts over.
  ht::PreemptionSignals s;
  EXPECT_EQ(ht::PreemptionSignals::received(), 0);
}

TEST(Preemption, ASecondSignalAfterTheGraceEndsTheProcessAtOnce) {
  GTEST_FLAG_SET(death_test_style, "threadsafe");
  EXPECT_EXIT(
      {
        ht::PreemptionSignals s(/*grace_s=*/0);
        std::raise(SIGTERM);
        std::raise(SIGTERM);
        std::_Exit(0);  // not reached
      },
      ::testing::ExitedWithCode(128 + SIGTERM), "a second stop signal: exiting now");
  EXPECT_EXIT(
      {
        ht::PreemptionSignals s(/*grace_s=*/0.05);
        std::raise(SIGUSR1);
        ::usleep(100000);  // past the grace
        std::raise(SIGTERM);
        std::_Exit(0);
      },
      ::testing::ExitedWithCode(128 + SIGTERM), "a second stop signal");
}

// The same notice twice (SLURM signals the ranks and the launcher, which passes SIGUSR1 on
// at once): the second, within the grace, changes nothing, and the run goes on to save. It
// ended the process before, losing the steps since the last checkpoint.
TEST(Preemption, ASecondSignalWithinTheGraceIsTheSameNotice) {
  GTEST_FLAG_SET(death_test_style, "threadsafe");
  EXPECT_EXIT(
      {
        ht::PreemptionSignals s;  // the default grace
        std::raise(SIGTERM);
        std::raise(SIGUSR1);
        std::raise(SIGTERM);
        std::_Exit(ht::PreemptionSignals::received() == SIGTERM ? 7 : 8);
      },
      ::testing::ExitedWithCode(7), "within the grace after the first: the save goes on");
  EXPECT_THROW(ht::PreemptionSignals(-1), hp::Error);
}

TEST(Preemption, TheHandlersBeforeComeBack) {
  static volatile std::sig_atomic_t mine = 0;
  struct sigaction sa {}, old {};
  sa.sa_handler = [](int) { mine = 1; };
  sigemptyset(&sa.sa_mask);
  ASSERT_EQ(::sigaction(SIGUSR1, &sa, &old), 0);
  { ht::PreemptionSignals s; }
  std::raise(SIGUSR1);
  EXPECT_EQ(mine, 1) << "the handler in place before was not restored";
  ::sigaction(SIGUSR1, &old, nullptr);
}

TEST(Preemption, OneObjectAtATime) {
  ht::PreemptionSignals s;
  EXPECT_THROW(ht::PreemptionSignals t, std::exception);
}

namespace {

std::string slurp(const std::string& path) {
  std::ifstream f(path);
  std::stringstream ss;
  ss << f.rdbuf();
  return ss.str();
}
bool exists(const std::string& path) {
  struct stat st{};
  return ::stat(path.c_str(), &st) == 0;
}
// The lines of `text` that start with `what`.
size_t count(const std::string& text, const std::string& what) {
  size_t n = 0;
  std::istringstream in(text);
  for (std::string line; std::getline(in, line);) n += line.rfind(what, 0) == 0 ? 1 : 0;
  return n;
}

// A 3-step run's report through its callbacks; ended() after `done` steps with SIGTERM.
int stopped_run(const std::string& out, int64_t done, std::vector<std::string>* said) {
  ht::TrainConfig c;
  c.train_steps = 3;
  c.output_dir = out;
  ht::RunReport report(c, 1, true, nullptr, [said](const std::string& s) { said->push_back(s); });
  report.open_metrics(-1, "", "");
  ht::TrainCallbacks cb = report.callbacks(0);
  ht::TrainSummary sum;
  for (int64_t k = 1; k <= done; ++k) {
    ht::StepStats st;
    st.step = k;
    st.loss = 5.0 - static_cast<double>(k);
    cb.on_step(st);
    sum.losses.push_back(st.loss);
  }
  sum.steps = done;
  sum.stopped_by = SIGTERM;
  sum.stop_rank = 0;
  sum.stop_saved = out + "/checkpoints/step_" + std::to_string(done);
  return report.ended(sum, done);
}

}  // namespace

// A stop signal during the last step stops nothing: the run is complete, so it is reported
// as one (metrics.jsonl with its summary, loss.svg; exit 0). Before it left only
// metrics.jsonl.partial and exit 75, and every later resume said "nothing to train" with
// the report never written. A signal before the last step still stops the run (75).
TEST(Preemption, AStopSignalInTheLastStepFinishesTheRun) {
  const std::string out = ::testing::TempDir() + "/hp_stop_last";
  hp::files::remove_tree(out);
  hp::files::create_folders(out);  // (the run's folders claim it)
  std::vector<std::string> said;
  EXPECT_EQ(stopped_run(out, 3, &said), 0);
  EXPECT_TRUE(exists(out + "/metrics.jsonl"));
  EXPECT_FALSE(exists(out + "/metrics.jsonl.partial"));
  EXPECT_TRUE(exists(out + "/loss.svg"));
  const std::string m = slurp(out + "/metrics.jsonl");
  EXPECT_EQ(count(m, "{\"step\":"), 3u) << m;
  EXPECT_EQ(count(m, "{\"summary\""), 1u) << m;
  bool told = false;
  for (const auto& s : said) told = told || s.find("came during the last step: the run is complete") != s.npos;
  EXPECT_TRUE(told);

  hp::files::remove_tree(out);
  hp::files::create_folders(out);
  said.clear();
  EXPECT_EQ(stopped_run(out, 2, &said), ht::kPreemptedExit);
  EXPECT_FALSE(exists(out + "/metrics.jsonl"));
  EXPECT_NE(slurp(out + "/metrics.jsonl.partial").find("{\"stop\":{\"step\":2,\"signal\":\"SIGTERM\""),
            std::string::npos);
  hp::files::remove_tree(out);
}

// A run left at train_steps with its report unfinished (metrics.jsonl.partial alone, as an
// older version's stop in the last step or a kill while writing left it): the resume that
// finds nothing to train writes metrics.jsonl (every line kept, one summary of the lines'
// own losses) and loss.svg; a finished run's report is left alone.
TEST(Preemption, AnUnfinishedReportIsFinishedByTheResumeThatFindsNothingToTrain) {
  const std::string out = ::testing::TempDir() + "/hp_finish_earlier";
  hp::files::remove_tree(out);
  hp::files::create_folders(out);
  {
    std::ofstream f(out + "/metrics.jsonl.partial");
    f << "{\"step\":1,\"loss\":4.5}\n{\"step\":2,\"loss\":4.25}\n{\"eval\":{\"step\":2,\"loss\":4.4}}\n"
         "{\"step\":3,\"loss\":4.125}\n{\"stop\":{\"step\":3,\"signal\":\"SIGTERM\",\"rank\":0,\"saved\":\"x\"}}\n";
  }
  ht::TrainConfig c;
  c.train_steps = 3;
  c.output_dir = out;
  std::vector<std::string> said;
  ht::RunReport report(c, 2, true, nullptr, [&](const std::string& s) { said.push_back(s); });
  EXPECT_TRUE(report.finish_earlier());
  EXPECT_FALSE(exists(out + "/metrics.jsonl.partial"));
  EXPECT_TRUE(exists(out + "/loss.svg"));
  const std::string m = slurp(out + "/metrics.jsonl");
  EXPECT_EQ(count(m, "{\"step\":"), 3u) << m;
  EXPECT_NE(m.find("{\"eval\":{\"step\":2,\"loss\":4.4}}"), std::string::npos) << m;
  EXPECT_NE(m.find("{\"summary\":{\"steps\":3,\"ranks\":2,\"first_loss\":4.5,\"final_loss\":4.125,"
                   "\"final_valid_loss\":4.4}}"),
            std::string::npos)
      << m;
  ASSERT_EQ(said.size(), 1u);
  EXPECT_NE(said[0].find("(3 steps)"), std::string::npos) << said[0];
  // Finished now (and a finished run's report is never rewritten).
  EXPECT_FALSE(report.finish_earlier());
  EXPECT_EQ(slurp(out + "/metrics.jsonl"), m);
  hp::files::remove_tree(out);
}
