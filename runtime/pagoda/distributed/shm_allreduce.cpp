// All-reduce and all-gather through one POSIX shared-memory segment, for the CPU tensor-parallel ranks
// of one host (pagoda/distributed/shm_allreduce.py sets it up and documents the protocol; csrc/shm_group.h
// declares the class, registered with the kernel library's other ops in csrc/register_ops.cpp).
//
// Layout: a header (one cache line per rank holding its sequence stamp), then per rank two slots
// (double buffering) of `slot_bytes`. One step of a collective, with sequence number s:
//   1. copy this rank's chunk into its slot s % 2;
//   2. publish stamp = s (release);
//   3. wait until every peer's stamp >= s (acquire), spinning a little, then yielding;
//   4. read every rank's slot s % 2 (summing in fp32, in rank order, so every rank gets the same bits).
// A rank writes slot s % 2 again only at step s + 2, after it saw every peer's stamp s + 1, which a peer
// publishes only once it finished reading step s: two slots are enough.
//
// The library is built with -ffast-math, which may reassociate float additions and assume no NaN. The sums
// must be plain fp32 additions in rank order, the same bits on every rank whichever path (vector or scalar
// remainder) an element takes, so they do not depend on it: each partial sum passes an association barrier,
// and bfloat16 is rounded with integer operations (NaN recognised by its bits). float16 uses the hardware
// conversions (F16C, aarch64's native type) on every level but x86 generic.

#include <ATen/Parallel.h>
#include <c10/util/Half.h>
#include <errno.h>
#include <fcntl.h>
#include <sched.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstring>
#include <fstream>
#include <sstream>
#include <stdexcept>
#include <string>
#include <vector>

#include "avx512_math.h"
#include "shm_group.h"

#if defined(__x86_64__)
#include <immintrin.h>
#endif

namespace pagoda::shm {

namespace {

constexpr uint64_t kMagic = 0x3170616730646170ULL;
constexpr int kMaxRanks = 64;
constexpr size_t kPage = 4096;
constexpr int kSpinsBeforeYield = 1024;  // ~25 us; yielding costs little when no one else wants the core
constexpr int64_t kParallelGrain = 1 << 16;  // elements; smaller collectives stay on one thread

}  // namespace

struct alignas(64) RankControl {
  std::atomic<uint64_t> stamp;  // the last step whose data this rank has published
};

struct Header {
  uint64_t magic;
  uint64_t world_size;
  uint64_t slot_bytes;
  alignas(64) std::atomic<uint32_t> aborted;  // a rank gave up: the others fail at once instead of waiting
  alignas(64) RankControl ranks[kMaxRanks];
};
static_assert(std::atomic<uint64_t>::is_always_lock_free, "stamps must be lock-free to work across processes");

namespace {

size_t data_offset() { return (sizeof(Header) + kPage - 1) / kPage * kPage; }

std::string errno_text() { return std::strerror(errno); }

// A peer that exited, or is a zombie not yet reaped by its parent.
bool process_gone(int64_t pid) {
  if (kill(static_cast<pid_t>(pid), 0) != 0 && errno == ESRCH) return true;
  std::ifstream stat("/proc/" + std::to_string(pid) + "/stat");
  std::string text;
  if (!std::getline(stat, text)) return false;
  size_t paren = text.rfind(')');
  if (paren == std::string::npos || paren + 2 >= text.size()) return false;
  char state = text[paren + 2];
  return state == 'Z' || state == 'X';
}

// ---- elementwise fp32 sums over the ranks' slots ------------------------------------------------------

// Keeps -ffast-math from reassociating a chain of additions: the sum stays ((r0 + r1) + r2) + ...
template <typename V>
inline V in_order(V v) {
#if defined(__has_builtin)
#if __has_builtin(__builtin_assoc_barrier)
  return __builtin_assoc_barrier(v);
#endif
#endif
  return v;
}

inline uint32_t float_bits(float v) {
  uint32_t bits;
  std::memcpy(&bits, &v, sizeof(bits));
  return bits;
}

inline float bits_float(uint32_t bits) {
  float v;
  std::memcpy(&v, &bits, sizeof(v));
  return v;
}

inline float to_float(float v) { return v; }
inline float to_float(c10::BFloat16 v) { return bits_float(static_cast<uint32_t>(v.x) << 16); }
inline float to_float(c10::Half v) { return static_cast<float>(v); }

inline void store_float(float* p, float v) { *p = v; }
// Round to nearest even; a NaN stays a NaN of its sign, made quiet: what AVX512-BF16's vcvtneps2bf16 does, so
// every path gives the same bits.
inline void store_float(c10::BFloat16* p, float v) {
  const uint32_t bits = float_bits(v);
  const bool nan = (bits & 0x7fffffffu) > 0x7f800000u;
  p->x = static_cast<uint16_t>(nan ? (bits >> 16) | 0x40u : (bits + 0x7fffu + ((bits >> 16) & 1u)) >> 16);
}
inline void store_float(c10::Half* p, float v) { *p = c10::Half(v); }

template <typename T>
void sum_scalar(const std::vector<const T*>& in, T* out, int64_t begin, int64_t end) {
  for (int64_t i = begin; i < end; ++i) {
    float acc = to_float(in[0][i]);
    for (size_t r = 1; r < in.size(); ++r) acc = in_order(acc) + to_float(in[r][i]);
    store_float(out + i, acc);
  }
}

#if defined(PAGODA_ISA_AVX512)
inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
inline void store16(float* p, __m512 v) { _mm512_storeu_ps(p, v); }
inline __m512 load16(const c10::BFloat16* p) { return avx512::load_bf16x16(p); }
inline void store16(c10::BFloat16* p, __m512 v) { avx512::store_bf16x16(p, v); }  // as store_float, 16 at a time
inline __m512 load16(const c10::Half* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}
inline void store16(c10::Half* p, __m512 v) {
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm512_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT));
}

template <typename T>
void sum_range(const std::vector<const T*>& in, T* out, int64_t begin, int64_t end) {
  int64_t i = begin;
  for (; i + 16 <= end; i += 16) {  // the same order of additions as sum_scalar: identical bits
    __m512 acc = load16(in[0] + i);
    for (size_t r = 1; r < in.size(); ++r) acc = _mm512_add_ps(in_order(acc), load16(in[r] + i));
    store16(out + i, acc);
  }
  sum_scalar(in, out, i, end);
}
#else
template <typename T>
void sum_range(const std::vector<const T*>& in, T* out, int64_t begin, int64_t end) {
  sum_scalar(in, out, begin, end);
}
#endif

void parallel_copy(char* dst, const char* src, int64_t bytes) {
  at::parallel_for(0, bytes, kParallelGrain * 4, [&](int64_t b, int64_t e) { std::memcpy(dst + b, src + b, e - b); });
}

void check_input(const at::Tensor& x) {
  TORCH_CHECK(x.device().is_cpu() && x.is_contiguous(), "shared-memory collectives take contiguous CPU tensors");
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16 || x.scalar_type() == at::kHalf,
              "shared-memory collectives take float32, bfloat16 or float16, not ", x.scalar_type());
}

}  // namespace

// ---- the group ---------------------------------------------------------------------------------------

ShmGroup::ShmGroup(std::string name, int64_t rank, int64_t world_size, int64_t slot_bytes, bool create,
                   std::vector<int64_t> peer_pids, double timeout_seconds)
    : name_(std::move(name)), rank_(rank), world_(world_size), slot_bytes_(slot_bytes), pids_(std::move(peer_pids)),
      timeout_(timeout_seconds) {
  if (world_ < 1 || world_ > kMaxRanks || rank_ < 0 || rank_ >= world_) {
    throw std::invalid_argument("shared-memory group: rank " + std::to_string(rank_) + " of " +
                                std::to_string(world_) + " (at most " + std::to_string(kMaxRanks) + " ranks)");
  }
  if (slot_bytes_ <= 0 || slot_bytes_ % 64 != 0) throw std::invalid_argument("slot_bytes must be a multiple of 64");
  if (!pids_.empty() && static_cast<int64_t>(pids_.size()) != world_) {
    throw std::invalid_argument("peer_pids: one per rank, or none");
  }
  bytes_ = data_offset() + static_cast<size_t>(world_) * 2 * slot_bytes_;
  int fd = shm_open(name_.c_str(), O_RDWR | (create ? O_CREAT | O_EXCL : 0), 0600);
  if (fd < 0) throw std::runtime_error("shm_open(" + name_ + "): " + errno_text());
  if (create) {
    // reserve the pages now: a full /dev/shm then fails here, not with SIGBUS on first touch
    int err = posix_fallocate(fd, 0, static_cast<off_t>(bytes_));
    if (err != 0) {
      ::close(fd);
      shm_unlink(name_.c_str());
      throw std::runtime_error("cannot reserve " + std::to_string(bytes_ >> 20) + " MiB in /dev/shm for " + name_ +
                               ": " + std::strerror(err));
    }
  } else {
    struct stat st;
    if (fstat(fd, &st) != 0 || static_cast<size_t>(st.st_size) != bytes_) {
      ::close(fd);
      throw std::runtime_error("shared-memory segment " + name_ + " has an unexpected size");
    }
  }
  void* base = mmap(nullptr, bytes_, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  ::close(fd);
  if (base == MAP_FAILED) {
    if (create) shm_unlink(name_.c_str());
    throw std::runtime_error("mmap(" + name_ + "): " + errno_text());
  }
  base_ = static_cast<char*>(base);
  header_ = reinterpret_cast<Header*>(base_);
  if (create) {  // fallocate zeroed it: stamps start at 0
    header_->world_size = world_;
    header_->slot_bytes = slot_bytes_;
    header_->magic = kMagic;
  } else if (header_->magic != kMagic || header_->world_size != static_cast<uint64_t>(world_) ||
             header_->slot_bytes != static_cast<uint64_t>(slot_bytes_)) {
    munmap(base_, bytes_);
    base_ = nullptr;
    header_ = nullptr;
    throw std::runtime_error("shared-memory segment " + name_ + " was made for another group");
  }
}

ShmGroup::~ShmGroup() { close(); }

void ShmGroup::all_reduce(at::Tensor x) {
  check_input(x);
  std::lock_guard<std::mutex> guard(mutex_);
  check_open();
  const int64_t elem = x.element_size();
  const int64_t per_step = slot_bytes_ / elem;
  char* data = static_cast<char*>(x.data_ptr());
  for (int64_t start = 0; start < x.numel(); start += per_step) {
    const int64_t n = std::min(per_step, x.numel() - start);
    const uint64_t step = ++seq_;
    char* chunk = data + start * elem;
    parallel_copy(slot(rank_, step), chunk, n * elem);
    publish_and_wait(step);
    switch (x.scalar_type()) {
      case at::kFloat: sum_slots<float>(step, chunk, n); break;
      case at::kBFloat16: sum_slots<c10::BFloat16>(step, chunk, n); break;
      default: sum_slots<c10::Half>(step, chunk, n); break;
    }
  }
}

void ShmGroup::all_gather(at::Tensor x, at::Tensor out) {
  check_input(x);
  check_input(out);
  TORCH_CHECK(x.dim() == 2 && out.dim() == 2 && out.size(0) == x.size(0) && out.size(1) == x.size(1) * world_ &&
              out.scalar_type() == x.scalar_type(), "all_gather: out must be [rows, n * world_size] of x's dtype");
  std::lock_guard<std::mutex> guard(mutex_);
  check_open();
  const int64_t row_bytes = x.size(1) * x.element_size();
  TORCH_CHECK(row_bytes <= slot_bytes_, "all_gather: a row of ", row_bytes, " bytes exceeds the slot");
  const int64_t rows_per_step = slot_bytes_ / row_bytes;
  const char* src = static_cast<const char*>(x.data_ptr());
  char* dst = static_cast<char*>(out.data_ptr());
  for (int64_t row0 = 0; row0 < x.size(0); row0 += rows_per_step) {
    const int64_t rows = std::min(rows_per_step, x.size(0) - row0);
    const uint64_t step = ++seq_;
    parallel_copy(slot(rank_, step), src + row0 * row_bytes, rows * row_bytes);
    publish_and_wait(step);
    at::parallel_for(0, rows, std::max<int64_t>(1, kParallelGrain * 2 / (row_bytes * world_)),
                     [&](int64_t b, int64_t e) {
      for (int64_t i = b; i < e; ++i) {
        char* out_row = dst + (row0 + i) * row_bytes * world_;
        for (int64_t r = 0; r < world_; ++r) std::memcpy(out_row + r * row_bytes, slot(r, step) + i * row_bytes, row_bytes);
      }
    });
  }
}

void ShmGroup::abort() {
  std::lock_guard<std::mutex> guard(map_mutex_);  // not mutex_: a collective holds that while it waits
  if (header_ != nullptr) header_->aborted.store(1, std::memory_order_release);
}

void ShmGroup::close() {
  closing_.store(true);
  std::lock_guard<std::mutex> guard(mutex_);
  std::lock_guard<std::mutex> map_guard(map_mutex_);
  if (base_ != nullptr) munmap(base_, bytes_);
  base_ = nullptr;
  header_ = nullptr;
}

char* ShmGroup::slot(int64_t rank, uint64_t step) const {
  return base_ + data_offset() + (static_cast<size_t>(rank) * 2 + (step & 1)) * slot_bytes_;
}

template <typename T>
void ShmGroup::sum_slots(uint64_t step, char* chunk, int64_t n) const {  // chunk[0:n] = sum over ranks of slot[0:n]
  std::vector<const T*> in(world_);
  for (int64_t r = 0; r < world_; ++r) in[r] = reinterpret_cast<const T*>(slot(r, step));
  T* out = reinterpret_cast<T*>(chunk);
  at::parallel_for(0, n, kParallelGrain, [&](int64_t b, int64_t e) { sum_range(in, out, b, e); });
}

void ShmGroup::check_open() const {
  if (base_ == nullptr) throw std::runtime_error("shared-memory group " + name_ + " is closed");
  if (header_->aborted.load(std::memory_order_acquire) != 0) throw aborted_error();
}

std::runtime_error ShmGroup::aborted_error() const {
  return std::runtime_error("shared-memory TP collective: another TP rank gave up (group " + name_ + " aborted)");
}

void ShmGroup::fail(const std::string& message) {
  header_->aborted.store(1, std::memory_order_release);
  throw std::runtime_error(message);
}

void ShmGroup::publish_and_wait(uint64_t step) {
  header_->ranks[rank_].stamp.store(step, std::memory_order_release);
  for (int64_t r = 0; r < world_; ++r) {
    if (r != rank_) wait_for(r, step);
  }
}

void ShmGroup::wait_for(int64_t peer, uint64_t step) {
  std::atomic<uint64_t>& stamp = header_->ranks[peer].stamp;
  for (int i = 0; i < kSpinsBeforeYield; ++i) {
    if (stamp.load(std::memory_order_acquire) >= step) return;
#if defined(__x86_64__)
    _mm_pause();
#endif
  }
  // The peer is late (descheduled, or still computing): yield the core, and watch for its death.
  using clock = std::chrono::steady_clock;
  const auto start = clock::now();
  auto next_check = start;
  for (uint64_t i = 0;; ++i) {
    if (stamp.load(std::memory_order_acquire) >= step) return;
    sched_yield();
    if ((i & 63) != 0) continue;
    if (header_->aborted.load(std::memory_order_acquire) != 0) throw aborted_error();
    if (closing_.load()) throw std::runtime_error("shared-memory group " + name_ + " closed during a collective");
    const auto now = clock::now();
    if (now < next_check) continue;
    next_check = now + std::chrono::milliseconds(100);
    const double waited = std::chrono::duration<double>(now - start).count();
    if (!pids_.empty() && process_gone(pids_[peer])) {
      std::ostringstream msg;
      msg << "shared-memory TP collective: TP rank " << peer << " (pid " << pids_[peer]
          << ") exited; this rank waited " << waited << " s for it";
      fail(msg.str());
    }
    if (waited > timeout_) {
      std::ostringstream msg;
      msg << "shared-memory TP collective: TP rank " << peer << " did not arrive within " << timeout_
          << " s (PAGODA_CPU_SHM_ALLREDUCE_TIMEOUT); it is stuck or gone";
      fail(msg.str());
    }
  }
}

void unlink(const std::string& name) {
  if (shm_unlink(name.c_str()) != 0 && errno != ENOENT) throw std::runtime_error("shm_unlink(" + name + "): " + errno_text());
}

}  // namespace pagoda::shm
