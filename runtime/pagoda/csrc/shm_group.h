// The shared-memory TP collectives (distributed/shm_allreduce.cpp; distributed/shm_allreduce.py sets a group up
// and documents the protocol): torch.classes.pagoda_cpu.ShmGroup and torch.ops.pagoda_cpu.shm_unlink, registered
// with the other ops in csrc/register_ops.cpp. A torch custom class, since a group is state shared by calls
// (the mapped segment, the sequence number); torch releases the GIL around its methods, so the heartbeat and
// watcher threads run while a collective waits.
#pragma once

#include <ATen/core/Tensor.h>
#include <ATen/core/ivalue.h>

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <mutex>
#include <stdexcept>
#include <string>
#include <vector>

namespace pagoda::shm {

struct Header;

class ShmGroup : public torch::CustomClassHolder {
 public:
  // Creates (rank 0) or opens the segment `name`; peer_pids by rank (empty: not visible here) let a waiting
  // rank notice a peer's death; a peer later than timeout_seconds fails the collective.
  ShmGroup(std::string name, int64_t rank, int64_t world_size, int64_t slot_bytes, bool create,
           std::vector<int64_t> peer_pids, double timeout_seconds);
  ~ShmGroup() override;

  // x += the same tensor of every other rank, in place (contiguous fp32, bf16 or fp16 on the CPU).
  void all_reduce(at::Tensor x);
  // x: [rows, n] on each rank -> out: [rows, n * world_size], ranks in order along the last dim.
  void all_gather(at::Tensor x, at::Tensor out);
  // Make every rank's current and future collectives fail at once (the group is going down).
  void abort();
  // Unmap. A collective running in another thread fails (it checks `closing_` while waiting) first.
  void close();

  int64_t slot_bytes() const { return slot_bytes_; }
  std::string name() const { return name_; }

 private:
  char* slot(int64_t rank, uint64_t step) const;
  template <typename T>
  void sum_slots(uint64_t step, char* chunk, int64_t n) const;
  void check_open() const;
  std::runtime_error aborted_error() const;
  [[noreturn]] void fail(const std::string& message);
  void publish_and_wait(uint64_t step);
  void wait_for(int64_t peer, uint64_t step);

  std::string name_;
  int64_t rank_, world_, slot_bytes_;
  std::vector<int64_t> pids_;  // by rank; empty when the peers' pids are not visible here
  double timeout_;
  size_t bytes_ = 0;
  char* base_ = nullptr;
  Header* header_ = nullptr;
  uint64_t seq_ = 0;
  std::mutex mutex_;      // one collective at a time; close() waits for it
  std::mutex map_mutex_;  // abort() against close()
  std::atomic<bool> closing_{false};
};

// shm_unlink(name); a name already gone is not an error
void unlink(const std::string& name);
constexpr const char* kUnlinkSchema = "shm_unlink(str name) -> ()";

}  // namespace pagoda::shm
