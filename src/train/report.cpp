#include "hp/train/report.h"

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <sstream>

#include <nlohmann/json.hpp>

#include "hp/core/error.h"
#include "hp/core/untrusted.h"

namespace hp::train {
namespace {

std::string fmt(const char* f, double x) {
  char b[64];
  std::snprintf(b, sizeof b, f, x);
  return b;
}

// JSON has no NaN or infinity.
std::string json_number(double x) { return std::isfinite(x) ? fmt("%.9g", x) : "null"; }

std::string xml_escape(const std::string& s) {
  std::string out;
  for (char ch : s) {
    if (ch == '&') out += "&amp;";
    else if (ch == '<') out += "&lt;";
    else if (ch == '>') out += "&gt;";
    else out += ch;
  }
  return out;
}

}  // namespace

std::string format_bytes(int64_t bytes) {
  const char* units[] = {"B", "KiB", "MiB", "GiB", "TiB"};
  double x = static_cast<double>(bytes);
  int u = 0;
  while (std::fabs(x) >= 1024 && u < 4) x /= 1024, ++u;
  return u == 0 ? std::to_string(bytes) + " B" : fmt("%.1f ", x) + units[u];
}

std::string format_duration(double seconds) {
  if (!std::isfinite(seconds) || seconds < 0) return "?";
  auto t = static_cast<int64_t>(std::llround(seconds));
  char b[32];
  if (t >= 3600) {
    std::snprintf(b, sizeof b, "%lld:%02lld:%02lld", static_cast<long long>(t / 3600),
                  static_cast<long long>(t / 60 % 60), static_cast<long long>(t % 60));
  } else {
    std::snprintf(b, sizeof b, "%lld:%02lld", static_cast<long long>(t / 60), static_cast<long long>(t % 60));
  }
  return b;
}

std::string format_rate(double x) {
  if (x >= 1e6) return fmt("%.2fM", x / 1e6);
  if (x >= 1e3) return fmt("%.1fk", x / 1e3);
  return fmt("%.0f", x);
}

std::string progress_line(const StepStats& s, int64_t total_steps, double eta_s, double ref_loss,
                          double valid_loss) {
  const int w = static_cast<int>(std::to_string(total_steps).size());
  std::ostringstream os;
  char step[64];
  std::snprintf(step, sizeof step, "step %*lld/%lld", w, static_cast<long long>(s.step),
                static_cast<long long>(total_steps));
  os << step << " | loss " << fmt("%.4f", s.loss);
  if (!std::isnan(s.mtp_loss)) os << " | mtp loss " << fmt("%.4f", s.mtp_loss);
  os << " | lr " << fmt("%.2e", s.lr) << " | grad norm "
     << fmt("%.3f", s.grad_norm) << " | " << format_rate(s.tokens_per_s) << " tok/s | peak "
     << format_bytes(s.peak_bytes) << " | ETA " << format_duration(eta_s);
  if (!s.expert_load.empty()) {
    // The most imbalanced MoE block: its busiest expert's tokens over the mean.
    double worst = 0, dropped = 0;
    for (const auto& e : s.expert_load) {
      worst = std::max(worst, e.max / e.mean);
      dropped = std::max(dropped, e.dropped);
    }
    os << " | experts max/mean " << fmt("%.2f", worst);
    if (dropped > 0) os << " dropped " << fmt("%.1f", 100 * dropped) << "%";
  }
  if (!std::isnan(valid_loss)) os << " | valid " << fmt("%.4f", valid_loss);
  if (!std::isnan(ref_loss)) os << " | ref diff " << fmt("%.1e", std::fabs(s.loss - ref_loss));
  return os.str();
}

std::string eval_line(const EvalStats& e, int64_t total_steps, double ref_loss) {
  std::ostringstream os;
  os << "validation after step " << e.step << "/" << total_steps << " | loss " << fmt("%.4f", e.loss) << " | ppl "
     << fmt("%.2f", e.perplexity) << " | " << format_rate(static_cast<double>(e.tokens)) << " tokens in "
     << format_duration(e.seconds);
  if (!std::isnan(ref_loss)) os << " | ref diff " << fmt("%.1e", std::fabs(e.loss - ref_loss));
  return os.str();
}

namespace {
std::string os_error() { return errno != 0 ? std::strerror(errno) : "unknown error"; }

// Renames a finished file into place; raises naming both names and the OS error.
void commit(const std::string& partial, const std::string& path) {
  errno = 0;
  HP_CHECK(std::rename(partial.c_str(), path.c_str()) == 0, "cannot rename '", partial, "' to '", path, "': ", os_error());
}
}  // namespace

MetricsLog::MetricsLog(const std::string& path, int64_t keep_through) : path_(path), partial_(path + ".partial") {
  std::string kept;
  if (keep_through >= 0) {
    std::ifstream earlier(partial_);
    if (!earlier.is_open()) earlier.open(path_);
    for (std::string line; std::getline(earlier, line);) {
      // Untrusted: a line that does not parse (torn by a kill) or nests too deep is dropped.
      if (!hp::text::json_nesting_within(line)) continue;
      const nlohmann::json j = nlohmann::json::parse(line, nullptr, /*allow_exceptions=*/false);
      if (!j.is_object()) continue;
      // A step's line, or a record {"eval"|"resume"|"stop": {"step": ...}}; a summary is
      // not carried over (this run writes its own).
      const bool is_step = j.contains("step") && j["step"].is_number_integer();
      const char* record = nullptr;
      for (const char* k : {"eval", "resume", "stop"}) {
        if (j.size() == 1 && j.contains(k) && j[k].is_object() && j[k].contains("step") &&
            j[k]["step"].is_number_integer()) {
          record = k;
        }
      }
      if (!is_step && record == nullptr) continue;
      const nlohmann::json& e = is_step ? j : j[record];
      const int64_t step = e["step"].get<int64_t>();
      if (is_step) last_seen_ = std::max(last_seen_, step);
      if (step < 0 || step > keep_through || (is_step && step < 1)) continue;
      const double loss = e.contains("loss") && e["loss"].is_number() ? e["loss"].get<double>() : NAN;
      if (is_step) kept_loss_.emplace_back(step, loss);
      if (record != nullptr && std::strcmp(record, "eval") == 0) kept_eval_.emplace_back(step, loss);
      if (record != nullptr && std::strcmp(record, "resume") == 0 && e.contains("cause") && e["cause"].is_string()) {
        kept_resume_causes_.push_back(e["cause"].get<std::string>());
      }
      kept += line + "\n";
    }
  }
  // A resumed run's kept lines go to a file of their own first: the earlier log stays whole
  // until they are safely written.
  const std::string first = keep_through >= 0 ? partial_ + ".new" : partial_;
  errno = 0;
  f_.open(first, std::ios::trunc);
  HP_CHECK(f_.good(), "cannot write the metrics file '", first, "': ", os_error());
  if (keep_through < 0) return;
  f_ << kept;
  check("the lines kept from the run resumed");
  commit(first, partial_);
  std::remove(path_.c_str());  // its lines are in partial_ now
}

void MetricsLog::check(const char* what) {
  errno = 0;
  f_.flush();
  HP_CHECK(f_.good(), "writing ", what, " to the metrics file '", partial_, "' failed: ", os_error(),
           " (the steps before are in it)");
}

void MetricsLog::finish() {
  f_.close();
  HP_CHECK(!f_.fail(), "closing the metrics file '", partial_, "' failed: ", os_error());
  commit(partial_, path_);
}

void MetricsLog::step(const StepStats& s, double ref_loss) {
  f_ << "{\"step\":" << s.step << ",\"loss\":" << json_number(s.loss) << ",\"lr\":" << json_number(s.lr)
     << ",\"grad_norm\":" << json_number(s.grad_norm) << ",\"step_time_s\":" << json_number(s.step_time_s)
     << ",\"tokens_per_s\":" << json_number(s.tokens_per_s) << ",\"peak_bytes\":" << s.peak_bytes
     << ",\"optimizer_time_s\":" << json_number(s.optimizer_time_s) << ",\"comm_bytes\":" << s.comm_bytes
     << ",\"optimizer_comm_bytes\":" << s.optimizer_comm_bytes;
  if (!std::isnan(ref_loss)) f_ << ",\"reference_loss\":" << json_number(ref_loss);
  if (!std::isnan(s.mtp_loss)) f_ << ",\"mtp_loss\":" << json_number(s.mtp_loss);
  if (!s.expert_load.empty()) {
    f_ << ",\"expert_load\":[";
    for (size_t i = 0; i < s.expert_load.size(); ++i) {
      const auto& e = s.expert_load[i];
      f_ << (i ? "," : "") << "{\"layer\":" << e.layer << ",\"tokens_max\":" << json_number(e.max)
         << ",\"tokens_mean\":" << json_number(e.mean) << ",\"dropped_fraction\":" << json_number(e.dropped) << "}";
    }
    f_ << "]";
  }
  f_ << "}\n";
  check(("step " + std::to_string(s.step)).c_str());
}

void MetricsLog::eval(const EvalStats& e, double ref_loss) {
  f_ << "{\"eval\":{\"step\":" << e.step << ",\"loss\":" << json_number(e.loss)
     << ",\"perplexity\":" << json_number(e.perplexity) << ",\"tokens\":" << e.tokens
     << ",\"seconds\":" << json_number(e.seconds);
  if (!std::isnan(ref_loss)) f_ << ",\"reference_loss\":" << json_number(ref_loss);
  f_ << "}}\n";
  check(("the validation after step " + std::to_string(e.step)).c_str());
}

namespace {
std::string json_string(const std::string& s) { return nlohmann::json(s).dump(); }
}  // namespace

void MetricsLog::resumed(int64_t step, const std::string& from, int64_t steps_lost, const std::string& cause, int ranks,
                         bool ended_before_training) {
  f_ << "{\"resume\":{\"step\":" << step << ",\"from\":" << json_string(from) << ",\"steps_lost\":" << steps_lost
     << ",\"cause\":" << json_string(cause);
  if (ended_before_training) {
    f_ << ",\"ended_before_training\":true";
  } else {
    f_ << ",\"ranks\":" << ranks;
  }
  f_ << "}}\n";
  check("the resume record");
}

void MetricsLog::stopped(int64_t step, const std::string& signal, int rank, const std::string& saved) {
  f_ << "{\"stop\":{\"step\":" << step << ",\"signal\":" << json_string(signal) << ",\"rank\":" << rank
     << ",\"saved\":" << json_string(saved) << "}}\n";
  check("the stop record");
}

void MetricsLog::summary(const std::vector<std::pair<std::string, double>>& fields) {
  f_ << "{\"summary\":{";
  for (size_t i = 0; i < fields.size(); ++i) {
    f_ << (i ? "," : "") << "\"" << fields[i].first << "\":" << json_number(fields[i].second);
  }
  f_ << "}}\n";
  check("the summary");
}

void write_loss_svg(const std::string& path, const LossCurve& curve, const std::string& title) {
  const std::string partial = path + ".partial";
  errno = 0;
  std::ofstream f(partial, std::ios::trunc);
  HP_CHECK(f.good(), "cannot write the loss curve '", partial, "': ", os_error());
  const double W = 720, H = 420, L = 70, R = 20, T = 40, B = 50;
  // (step, loss) points of each series.
  std::vector<std::pair<int64_t, double>> loss, ref;
  for (size_t i = 0; i < curve.loss.size(); ++i) {
    loss.emplace_back(curve.first_step + static_cast<int64_t>(i) + 1, curve.loss[i]);
  }
  for (size_t i = 0; i < curve.reference.size(); ++i) ref.emplace_back(static_cast<int64_t>(i) + 1, curve.reference[i]);
  double lo = INFINITY, hi = -INFINITY;
  int64_t first = INT64_MAX, last = 1;
  using Points = std::vector<std::pair<int64_t, double>>;
  for (const Points* v : std::initializer_list<const Points*>{&loss, &ref, &curve.validation}) {
    for (const auto& [step, x] : *v) {
      if (std::isfinite(x)) lo = std::min(lo, x), hi = std::max(hi, x);
      first = std::min(first, step);
      last = std::max(last, step);
    }
  }
  if (first > last) first = 1;
  if (last == first) last = first + 1;
  if (!std::isfinite(lo)) lo = 0, hi = 1;
  if (hi - lo < 1e-9) hi = lo + 1;
  auto X = [&](int64_t step) {
    return L + (W - L - R) * static_cast<double>(step - first) / static_cast<double>(last - first);
  };
  auto Y = [&](double v) { return T + (H - T - B) * (hi - v) / (hi - lo); };
  f << "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"" << W << "\" height=\"" << H
    << "\" font-family=\"sans-serif\" font-size=\"12\">\n"
    << "<rect width=\"100%\" height=\"100%\" fill=\"white\"/>\n"
    << "<text x=\"" << W / 2 << "\" y=\"22\" text-anchor=\"middle\" font-size=\"14\">" << xml_escape(title) << "</text>\n";
  for (int k = 0; k <= 4; ++k) {  // horizontal grid with loss labels
    const double v = lo + (hi - lo) * k / 4.0, y = Y(v);
    f << "<line x1=\"" << L << "\" y1=\"" << y << "\" x2=\"" << W - R << "\" y2=\"" << y
      << "\" stroke=\"#ddd\"/>\n<text x=\"" << L - 6 << "\" y=\"" << y + 4 << "\" text-anchor=\"end\">"
      << fmt("%.3g", v) << "</text>\n";
  }
  for (int k = 0; k <= 4; ++k) {  // step labels
    const int64_t step = first + (last - first) * k / 4;
    f << "<text x=\"" << X(step) << "\" y=\"" << H - B + 18 << "\" text-anchor=\"middle\">" << step << "</text>\n";
  }
  f << "<text x=\"" << (L + W - R) / 2 << "\" y=\"" << H - 12 << "\" text-anchor=\"middle\">step</text>\n"
    << "<text x=\"16\" y=\"" << (T + H - B) / 2 << "\" transform=\"rotate(-90 16 " << (T + H - B) / 2
    << ")\" text-anchor=\"middle\">loss</text>\n"
    << "<rect x=\"" << L << "\" y=\"" << T << "\" width=\"" << W - L - R << "\" height=\"" << H - T - B
    << "\" fill=\"none\" stroke=\"#444\"/>\n";
  auto polyline = [&](const std::vector<std::pair<int64_t, double>>& v, const char* style) {
    if (v.empty()) return;
    f << "<polyline fill=\"none\" " << style << " points=\"";
    for (const auto& [step, x] : v) {
      if (std::isfinite(x)) f << fmt("%.1f", X(step)) << "," << fmt("%.1f", Y(x)) << " ";
    }
    f << "\"/>\n";
  };
  polyline(loss, "stroke=\"#1f77b4\" stroke-width=\"2\"");
  polyline(ref, "stroke=\"#ff7f0e\" stroke-width=\"1.5\" stroke-dasharray=\"6 4\"");
  polyline(curve.validation, "stroke=\"#2ca02c\" stroke-width=\"1.5\"");
  for (const auto& [step, x] : curve.validation) {
    if (std::isfinite(x)) {
      f << "<circle cx=\"" << fmt("%.1f", X(step)) << "\" cy=\"" << fmt("%.1f", Y(x)) << "\" r=\"3.5\" fill=\"#2ca02c\"/>\n";
    }
  }
  double legend_y = T + 16;
  f << "<text x=\"" << W - R - 8 << "\" y=\"" << legend_y << "\" text-anchor=\"end\" fill=\"#1f77b4\">hp-train</text>\n";
  if (!ref.empty()) {
    legend_y += 16;
    f << "<text x=\"" << W - R - 8 << "\" y=\"" << legend_y
      << "\" text-anchor=\"end\" fill=\"#ff7f0e\">single process (--verify)</text>\n";
  }
  if (!curve.validation.empty()) {
    legend_y += 16;
    f << "<text x=\"" << W - R - 8 << "\" y=\"" << legend_y << "\" text-anchor=\"end\" fill=\"#2ca02c\">validation</text>\n";
  }
  f << "</svg>\n";
  errno = 0;
  f.close();
  HP_CHECK(!f.fail(), "writing the loss curve '", partial, "' failed: ", os_error());
  commit(partial, path);
}

void LossComparison::add(int64_t step, double loss, double ref) {
  if (std::isnan(ref)) return;
  const double d = std::fabs(loss - ref);
  if (!any || std::isnan(d) || (!std::isnan(worst_abs) && d > worst_abs)) {
    worst_abs = d, worst_step = step, worst_rel = d / std::fabs(ref);
  }
  any = true;
}

std::string LossComparison::line(int64_t count, const std::string& what, const std::string& unit) const {
  char buf[256];
  std::snprintf(buf, sizeof buf, "%.2e at step %lld (relative %.2e)", worst_abs, static_cast<long long>(worst_step),
                worst_rel);
  return "verify: largest |" + what + " - single-process " + what + "| over " + std::to_string(count) + " " + unit +
         ": " + buf;
}

std::string summary_line(const TrainSummary& s) {
  char buf[640];
  const int64_t steps = std::max<int64_t>(1, s.steps);
  const double rest = s.seconds - s.optimizer_seconds;
  std::snprintf(buf, sizeof buf,
                "done: %lld steps in %s | loss %.4f -> %.4f | %s tok/s | peak %s per rank | optimizer step %.1f%% of "
                "the rest | sent %s/step (optimizer %s)",
                static_cast<long long>(s.steps), format_duration(s.seconds).c_str(),
                s.losses.empty() ? 0.0 : s.losses.front(), s.losses.empty() ? 0.0 : s.losses.back(),
                format_rate(s.tokens_per_s).c_str(), format_bytes(s.peak_bytes).c_str(),
                rest > 0 ? 100.0 * s.optimizer_seconds / rest : 0.0, format_bytes(s.comm_bytes / steps).c_str(),
                format_bytes(s.optimizer_comm_bytes / steps).c_str());
  return buf;
}

std::string resume_optimizer_line(const ResumeReport& r, const TrainConfig& c) {
  if (r.fresh_tensors == 0 && r.saved_optimizer == c.optimizer) return "";
  std::ostringstream os;
  os << "optimizer: " << to_string(r.saved_optimizer) << " in the checkpoint, " << to_string(c.optimizer)
     << " in this config: " << r.fresh_tensors << " parameters (" << r.fresh_elements
     << " elements) start a fresh optimizer state (theirs was the other optimizer's); " << r.kept_tensors
     << " keep their state";
  return os.str();
}

}  // namespace hp::train
