// The split backward's recording of module outputs during a forward (private to src/pp/;
// pipeline_compute.cpp).
#pragma once

namespace hp::pp {

// Ends any recording on this thread (after a forward that failed part way).
void stop_recording();

}  // namespace hp::pp
