// Armed KERNEL launches: see gates.h for what they are and why; this is the slots and the
// worker thread that queues their launches.
//
// Slot states (std::atomic, written by the caller and the worker): kIdle (free, or its work
// ended and was seen), kArming (queued for the worker, or being launched), kQueued (the wait,
// the kernels and the event are on the slot's stream). poll() is the event's query once
// kQueued. The caller arms a slot only when poll() said 1 (kIdle or the event fired).
#include <cuda_runtime.h>

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <mutex>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "gates.h"

namespace kvxferd {

namespace {

constexpr int kIdle = 0;
constexpr int kArming = 1;
constexpr int kQueued = 2;
constexpr int64_t kWordStride = 16;  // 64 bytes between gate words: one cache line each

struct Part {
  int64_t offset;  // into Job::rows
  int64_t numel;
  int64_t runs;
  int64_t regions;
  GroupCheck check;
};

struct Job {
  int64_t slot;
  int64_t max_ctas;
  std::vector<int64_t> rows;
  std::vector<Part> parts;
};

std::string cuda_msg(const char* what, cudaError_t e) {
  return std::string("gates: ") + what + " failed: " + cudaGetErrorString(e);
}

}  // namespace

struct Gates::Impl {
  int device = 0;
  int64_t n = 0;
  std::string bad;
  unsigned int* host = nullptr;  // the gate words, as the host writes them
  unsigned int* dev = nullptr;   // ... and as the device reads them
  std::vector<cudaStream_t> streams;
  std::vector<cudaEvent_t> events;
  std::unique_ptr<std::atomic<int>[]> state;
  std::vector<std::string> errors;  // guarded by mu
  std::mutex mu;
  std::condition_variable work;  // a job was queued, or stop
  std::condition_variable done;  // a slot left kArming
  std::deque<Job> jobs;
  bool stop = false;
  bool closed = false;
  std::thread worker;

  void run() {
    if (cudaSetDevice(device) != cudaSuccess) {
      // Every job below fails with the reason; keep serving them so no slot stays kArming.
    }
    for (;;) {
      Job job;
      {
        std::unique_lock<std::mutex> lock(mu);
        work.wait(lock, [this] { return stop || !jobs.empty(); });
        if (jobs.empty()) return;  // stop, and nothing left to launch
        job = std::move(jobs.front());
        jobs.pop_front();
      }
      std::string err = launch(job);
      {
        std::lock_guard<std::mutex> lock(mu);
        errors[job.slot] = std::move(err);
        state[job.slot].store(kQueued, std::memory_order_release);
      }
      done.notify_all();
    }
  }

  // The slot's wait, kernels and event, in that order on its stream; "" or why not all of
  // them were queued (the event is recorded whatever was, so poll() still says when it ended).
  std::string launch(const Job& job) {
    const auto stream = reinterpret_cast<int64_t>(streams[job.slot]);
    const unsigned int* gate = dev + kWordStride * job.slot;
    std::string err = queue_gate_wait(stream, gate);
    for (const Part& p : job.parts) {
      if (!err.empty()) break;
      err = copy_group_launch(job.rows.data() + p.offset, p.numel, p.runs, p.regions, p.check,
                              device, job.max_ctas, stream, gate);
    }
    const cudaError_t e = cudaEventRecord(events[job.slot], streams[job.slot]);
    if (e != cudaSuccess && err.empty()) err = cuda_msg("recording the event", e);
    return err;
  }
};

Gates::Gates(int64_t device, int64_t slots) : impl_(std::make_unique<Impl>()) {
  Impl& g = *impl_;
  g.device = static_cast<int>(device);
  g.n = slots;
  if (slots <= 0 || slots > 256) {
    g.bad = "gates: slots must be in 1..256";
    return;
  }
  int count = 0;
  if (cudaGetDeviceCount(&count) != cudaSuccess || device < 0 || device >= count) {
    g.bad = "gates: no CUDA device " + std::to_string(device) + " here";
    return;
  }
  int previous = 0;
  cudaGetDevice(&previous);
  cudaSetDevice(g.device);
  void* words = nullptr;
  const size_t bytes = sizeof(unsigned int) * kWordStride * slots;
  cudaError_t e = cudaHostAlloc(&words, bytes, cudaHostAllocMapped | cudaHostAllocPortable);
  if (e != cudaSuccess) {
    g.bad = cuda_msg("allocating the gate words", e);
  } else {
    g.host = static_cast<unsigned int*>(words);
    for (size_t i = 0; i < bytes / sizeof(unsigned int); ++i) g.host[i] = kGateAborted;
    void* on_dev = nullptr;
    e = cudaHostGetDevicePointer(&on_dev, words, 0);
    if (e != cudaSuccess) g.bad = cuda_msg("mapping the gate words", e);
    g.dev = static_cast<unsigned int*>(on_dev);
  }
  g.state = std::make_unique<std::atomic<int>[]>(slots);
  g.errors.resize(slots);
  for (int64_t i = 0; i < slots && g.bad.empty(); ++i) {
    g.state[i].store(kIdle);
    cudaStream_t s = nullptr;
    cudaEvent_t ev = nullptr;
    e = cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking);
    if (e != cudaSuccess) {
      g.bad = cuda_msg("creating a stream", e);
      break;
    }
    g.streams.push_back(s);
    e = cudaEventCreateWithFlags(&ev, cudaEventDisableTiming);
    if (e != cudaSuccess) {
      g.bad = cuda_msg("creating an event", e);
      break;
    }
    g.events.push_back(ev);
  }
  cudaSetDevice(previous);
  if (g.bad.empty() && g.dev != nullptr) {
    // The driver can queue waits: one on a word already open returns at once.
    g.host[0] = kGateOpen;
    std::string err = queue_gate_wait(reinterpret_cast<int64_t>(g.streams[0]), g.dev);
    if (err.empty()) {
      e = cudaStreamSynchronize(g.streams[0]);
      if (e != cudaSuccess) err = cuda_msg("a wait on an open gate", e);
    }
    g.host[0] = kGateAborted;
    g.bad = err;
  }
  if (g.bad.empty()) g.worker = std::thread([this] { impl_->run(); });
}

Gates::~Gates() { close(); }

std::string Gates::unusable() const { return impl_->bad; }

int64_t Gates::slots() const { return impl_->n; }

std::string Gates::arm(int64_t slot, const std::vector<int64_t>& tables,
                       const std::vector<int64_t>& numels, const std::vector<int64_t>& runs,
                       const std::vector<int64_t>& regions, int64_t max_ctas) {
  Impl& g = *impl_;
  if (!g.bad.empty()) return g.bad;
  if (g.closed) return "gates: closed";
  if (slot < 0 || slot >= g.n) return "gates: no slot " + std::to_string(slot);
  if (g.state[slot].load(std::memory_order_acquire) != kIdle ||
      cudaEventQuery(g.events[slot]) == cudaErrorNotReady) {
    return "gates: slot " + std::to_string(slot) + " is still in use";
  }
  const size_t k = tables.size();
  if (k == 0 || numels.size() != k || runs.size() != k || regions.size() != k) {
    return "gates: one table, value count, run count and region count per launch";
  }
  Job job;
  job.slot = slot;
  job.max_ctas = max_ctas;
  for (size_t i = 0; i < k; ++i) {
    if (tables[i] == 0) return "gates: a table's address is null";
    const auto* rows = reinterpret_cast<const int64_t*>(tables[i]);
    Part p{static_cast<int64_t>(job.rows.size()), numels[i], runs[i], regions[i],
           copy_group_check(rows, numels[i], runs[i], regions[i], max_ctas)};
    if (!p.check.err.empty()) return p.check.err;
    job.rows.insert(job.rows.end(), rows, rows + numels[i]);
    job.parts.push_back(std::move(p));
  }
  // Closed before the wait is queued: the previous launch on this slot has ended (its event).
  reinterpret_cast<volatile unsigned int*>(g.host)[kWordStride * slot] = kGateClosed;
  std::atomic_thread_fence(std::memory_order_seq_cst);
  g.state[slot].store(kArming, std::memory_order_release);
  {
    std::lock_guard<std::mutex> lock(g.mu);
    g.errors[slot].clear();
    g.jobs.push_back(std::move(job));
  }
  g.work.notify_one();
  return {};
}

void Gates::set(int64_t slot, int64_t value) {
  Impl& g = *impl_;
  if (g.host == nullptr || slot < 0 || slot >= g.n) return;
  if (value != kGateOpen && value != kGateAborted) return;
  std::atomic_thread_fence(std::memory_order_seq_cst);
  reinterpret_cast<volatile unsigned int*>(g.host)[kWordStride * slot] =
      static_cast<unsigned int>(value);
  std::atomic_thread_fence(std::memory_order_seq_cst);
}

int64_t Gates::poll(int64_t slot) {
  Impl& g = *impl_;
  if (slot < 0 || slot >= g.n || !g.bad.empty()) return 1;
  const int s = g.state[slot].load(std::memory_order_acquire);
  if (s == kArming) return 0;
  if (s == kIdle) return 1;
  if (cudaEventQuery(g.events[slot]) == cudaErrorNotReady) return 0;
  g.state[slot].store(kIdle, std::memory_order_release);
  return 1;
}

void Gates::wait(int64_t slot) {
  Impl& g = *impl_;
  if (slot < 0 || slot >= g.n || !g.bad.empty()) return;
  {
    std::unique_lock<std::mutex> lock(g.mu);
    g.done.wait(lock, [&] { return g.state[slot].load(std::memory_order_acquire) != kArming; });
  }
  if (g.state[slot].load(std::memory_order_acquire) == kQueued) {
    cudaEventSynchronize(g.events[slot]);
    g.state[slot].store(kIdle, std::memory_order_release);
  }
}

std::string Gates::error(int64_t slot) {
  Impl& g = *impl_;
  if (slot < 0 || slot >= g.n) return "gates: no slot " + std::to_string(slot);
  std::lock_guard<std::mutex> lock(g.mu);
  return g.errors[slot];
}

void Gates::close() {
  Impl& g = *impl_;
  if (g.closed) return;
  g.closed = true;
  for (int64_t i = 0; i < g.n && g.host != nullptr; ++i) set(i, kGateAborted);
  {
    std::lock_guard<std::mutex> lock(g.mu);
    g.stop = true;
  }
  g.work.notify_all();
  if (g.worker.joinable()) g.worker.join();  // it launches what was queued, then returns
  for (cudaStream_t s : g.streams) {
    cudaStreamSynchronize(s);  // aborted kernels return at once
    cudaStreamDestroy(s);
  }
  for (cudaEvent_t ev : g.events) cudaEventDestroy(ev);
  g.streams.clear();
  g.events.clear();
  if (g.host != nullptr) cudaFreeHost(g.host);
  g.host = nullptr;
  g.dev = nullptr;
}

}  // namespace kvxferd
