// Armed KERNEL launches: a pull's copy queued on the GPU before its lease is confirmed, held
// back by a gate the daemon opens at its decision point (kvxferd/ipc/armed.py).
//
// A gate is a 32-bit word in pinned host memory, mapped into the device. An armed launch is,
// on a stream of its own: a wait for the word to leave kGateClosed (cuStreamWaitValue32: the
// stream's front end waits; no SM is held and nothing of the launch runs), then the copy
// kernels (copy_ranges.cu, copy_group), each of which reads the word once per CTA and copies
// only if it is kGateOpen, then a completion event. The daemon writes kGateOpen once the
// confirmation succeeded and nothing cancelled the pull, or kGateAborted otherwise: an aborted
// launch's kernels return without reading a byte. A word goes from closed to open or to
// aborted, once; a slot is armed again only after its event fired.
//
// The launch's host work (the CUDA launch, ~60-90 us in a daemon, docs/benchmarks.md
// "Session 17") runs on a worker thread of this class, not the caller's: Gates::arm checks the
// tables, copies them and returns; the worker queues the wait, the kernels and the event. So
// the launch leaves the decode daemon's event loop entirely, and after the confirmation the copy
// costs the loop one store to the gate.
//
// Slots: `slots` of them, each a gate word (64 bytes apart), a non-blocking stream, an event.
// The caller (one thread at a time: the event loop) takes a free slot, arms it, opens or aborts
// its gate, and frees it once poll() says it ended.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

namespace kvxferd {

constexpr unsigned int kGateClosed = 0;
constexpr unsigned int kGateOpen = 1;
constexpr unsigned int kGateAborted = 2;

// What copy_group_check finds in a table: "" or why it cannot be launched; the vector width
// and the longest run when it can.
struct GroupCheck {
  std::string err;
  int v = 16;
  int64_t longest = 0;
};

GroupCheck copy_group_check(const int64_t* rows, int64_t numel, int64_t n_runs,
                            int64_t n_regions, int64_t max_ctas);
// The rest of copy_group's launch (copy_ranges.cu), with the kernels reading `gate` (device
// address of a gate word, or null: ungated), and the wait for a gate a gated launch queues first.
std::string copy_group_launch(const int64_t* rows, int64_t numel, int64_t n_runs,
                              int64_t n_regions, const GroupCheck& c, int64_t device,
                              int64_t max_ctas, int64_t stream, const unsigned int* gate);
std::string queue_gate_wait(int64_t stream, const unsigned int* gate);

class Gates {
 public:
  Gates(int64_t device, int64_t slots);
  ~Gates();
  Gates(const Gates&) = delete;
  Gates& operator=(const Gates&) = delete;

  // "" when the gates work here, else why not (no pinned memory, no stream memory operations).
  std::string unusable() const;
  int64_t slots() const;
  // Queue slot `slot`'s armed launch: one copy_group launch per table (tables[i] the host
  // address of numels[i] int64 values, runs[i] runs and regions[i] regions, as copy_group_raw
  // takes them), in order, behind one wait for the gate. The tables are checked and copied
  // before it returns; "" or why it was refused (nothing queued then).
  std::string arm(int64_t slot, const std::vector<int64_t>& tables,
                  const std::vector<int64_t>& numels, const std::vector<int64_t>& runs,
                  const std::vector<int64_t>& regions, int64_t max_ctas);
  // Open (kGateOpen) or abort (kGateAborted) slot `slot`'s gate.
  void set(int64_t slot, int64_t value);
  // 1 once the slot's armed work ended (its event fired, or arming failed before any was
  // queued), 0 while it is queued or running.
  int64_t poll(int64_t slot);
  // Block until poll(slot) would say 1 (call without the GIL).
  void wait(int64_t slot);
  // "" or why the slot's last arming failed on the worker (then its copy may not all have run:
  // the caller copies again).
  std::string error(int64_t slot);
  // Abort every gate, wait for every slot's work, stop the worker. Idempotent.
  void close();

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace kvxferd
