// The batched LoRA delta on the CPU, punica's shrink then expand for every adapter of a step at once:
// y[rows of slot s] += (x[rows] A_s^T) B_s^T, where A_s stacks each sub-output's A (q, k, v of a fused
// projection: sub-output i's rows at i*R) and B_s each sub-output's B [size, R], packed one after the other.
//
// Two parallel regions per projection, whatever the number of adapters: the shrink of every group's rows
// against its A's blocks, then the expand of every group against its B's blocks, each task adding its
// [rows, 8 x 32] delta into y at once. Calling the matmul per adapter group (two calls, each a parallel region
// and an allocation, plus a gather and an index_add) cost ~25 % of a decode step's projections at 4
// adapters of 8 rows. B is not padded to a block-diagonal [out, n_sub * R]: each sub-output's blocks read
// only its R columns of the shrunk rows, a third of the block-diagonal's bytes for q/k/v.
//
// The sums are bf16_matmul's micro-kernel's (csrc/bf16_matmul_isa.h), rounded to bfloat16 after the shrink,
// after the expand and after the add: what add_lora_torch computes in bfloat16, one group at a time.

#include <ATen/core/Tensor.h>

#include <algorithm>
#include <cstring>
#include <memory>
#include <vector>

#include "bf16_matmul_isa.h"
#include "ops.h"
#include "parallel_tasks.h"

namespace pagoda::lora {  // the ops are declared in csrc/ops.h

namespace {

using bf16_matmul::BlockTask;
using bf16_matmul::kBlockN;
using bf16 = c10::BFloat16;
namespace isa = bf16_matmul::isa;

constexpr int64_t kRowsPerTask = 64;  // rows of a group one task runs against a block, as bf16_linear's
// B's blocks one expand task runs: its delta is added to 8 * 64 bytes of each y row at once (one 64-byte line
// per row and block, a block at a time, made the add wait on memory at prefill's many rows)
constexpr int64_t kBlocksPerExpandTask = 8;

// A run of one group's rows, the unit of a task.
struct RowRun {
  int64_t group, first, rows;  // rows [first, first + rows) of the gathered order
};

// group g's rows in chunks of kRowsPerTask
std::vector<RowRun> row_runs(const RowGroups& groups) {
  std::vector<RowRun> runs;
  for (int64_t g = 0; g + 1 < static_cast<int64_t>(groups.starts.size()); ++g)
    for (int64_t m = groups.starts[g]; m < groups.starts[g + 1]; m += kRowsPerTask)
      runs.push_back({g, m, std::min(kRowsPerTask, groups.starts[g + 1] - m)});
  return runs;
}

// n elements, not initialised (a std::vector would zero them first)
template <typename T>
std::unique_ptr<T[]> buffer(int64_t n) {
  return std::unique_ptr<T[]>(new T[n]);
}

// the rows of groups whose kernel wants float32 x (AVX2's and NEON's from kFloatXRows rows), widened; else null
std::unique_ptr<float[]> widened_rows(const bf16* rows, int64_t cols, const RowGroups& groups) {
  std::unique_ptr<float[]> out;
  if (!isa::kWantsFloatX) return out;
  for (int64_t g = 0; g + 1 < static_cast<int64_t>(groups.starts.size()); ++g) {
    const int64_t first = groups.starts[g], count = groups.starts[g + 1] - first;
    if (count < isa::kFloatXRows) continue;
    if (!out) out = buffer<float>(static_cast<int64_t>(groups.rows.size()) * cols);
    for (int64_t i = first * cols; i < (first + count) * cols; ++i) out[i] = bf16_to_float(rows[i]);
  }
  return out;
}

// where a task's rows read x: the float32 copy when its group was widened
const float* float_rows(const std::unique_ptr<float[]>& widened, const RowGroups& groups, const RowRun& run,
                        int64_t cols, int64_t column) {
  if (!widened || groups.starts[run.group + 1] - groups.starts[run.group] < isa::kFloatXRows) return nullptr;
  return widened.get() + run.first * cols + column;
}

}  // namespace

RowGroups group_rows(const at::Tensor& row_slots) {
  TORCH_CHECK(row_slots.device().is_cpu() && row_slots.scalar_type() == at::kInt && row_slots.dim() == 1 &&
                  row_slots.is_contiguous(),
              "lora_add_: row_slots must be a contiguous int32 [T] CPU tensor");
  const int32_t* slots = row_slots.data_ptr<int32_t>();
  const int64_t n = row_slots.numel();
  std::vector<int64_t> order;  // slots by first row, as lora/ops.py's RowGroups
  std::vector<std::vector<int64_t>> rows_of;
  for (int64_t row = 0; row < n; ++row) {
    const int64_t slot = slots[row];
    if (slot < 0) continue;  // the base model's row
    if (slot >= static_cast<int64_t>(rows_of.size())) rows_of.resize(slot + 1);
    if (rows_of[slot].empty()) order.push_back(slot);
    rows_of[slot].push_back(row);
  }
  RowGroups groups;
  groups.starts.push_back(0);
  for (const int64_t slot : order) {
    groups.rows.insert(groups.rows.end(), rows_of[slot].begin(), rows_of[slot].end());
    groups.starts.push_back(static_cast<int64_t>(groups.rows.size()));
    groups.slots.push_back(slot);
  }
  return groups;
}

void add_grouped(at::Tensor& y, const at::Tensor& x, const RowGroups& groups, const at::Tensor& packed_a,
                 const at::Tensor& packed_b, at::IntArrayRef sub_sizes) {
  const int64_t n = static_cast<int64_t>(groups.rows.size());
  if (n == 0) return;
  TORCH_CHECK(x.device().is_cpu() && x.scalar_type() == at::kBFloat16 && x.dim() == 2 && x.stride(1) == 1,
              "lora_add_: x must be a bfloat16 [T, K] CPU tensor with contiguous rows");
  TORCH_CHECK(y.scalar_type() == at::kBFloat16 && y.dim() == 2 && y.stride(1) == 1 && y.size(0) == x.size(0),
              "lora_add_: y must be a bfloat16 [T, out] tensor with contiguous rows, as many as x's");
  TORCH_CHECK(packed_a.dim() == 5 && packed_a.is_contiguous() && packed_a.scalar_type() == at::kBFloat16 &&
                  packed_a.size(3) == kBlockN && packed_a.size(4) == 2,
              "lora_add_: packed_a must be [slots, blocks, K/2, 32, 2] bfloat16, got ", packed_a.sizes());
  TORCH_CHECK(packed_b.dim() == 5 && packed_b.is_contiguous() && packed_b.scalar_type() == at::kBFloat16 &&
                  packed_b.size(0) == packed_a.size(0) && packed_b.size(3) == kBlockN && packed_b.size(4) == 2,
              "lora_add_: packed_b must be [slots, blocks, R/2, 32, 2] bfloat16, got ", packed_b.sizes());
  const int64_t in_size = x.size(1), k_pairs = packed_a.size(2), rank = 2 * packed_b.size(2);
  const int64_t num_subs = static_cast<int64_t>(sub_sizes.size());
  const int64_t shrink_size = num_subs * rank, blocks_a = packed_a.size(1);
  TORCH_CHECK(in_size == 2 * k_pairs, "lora_add_: x has ", in_size, " columns, A ", 2 * k_pairs);
  TORCH_CHECK(blocks_a == (shrink_size + kBlockN - 1) / kBlockN, "lora_add_: A has ", blocks_a, " blocks, ",
              num_subs, " sub-outputs of rank ", rank, " need ", (shrink_size + kBlockN - 1) / kBlockN);
  // B's blocks: each sub-output's, in order; block j writes y's columns [column, column + ncols)
  struct ExpandBlock {
    int64_t sub, column, ncols;
  };
  std::vector<ExpandBlock> expand_blocks;
  int64_t out_size = 0;
  for (int64_t i = 0; i < num_subs; ++i) {
    for (int64_t c = 0; c < sub_sizes[i]; c += kBlockN)
      expand_blocks.push_back({i, out_size + c, std::min(kBlockN, sub_sizes[i] - c)});
    out_size += sub_sizes[i];
  }
  TORCH_CHECK(out_size == y.size(1), "lora_add_: the sub-outputs' sizes add up to ", out_size, ", y has ",
              y.size(1), " columns");
  const int64_t blocks_b = static_cast<int64_t>(expand_blocks.size());
  TORCH_CHECK(packed_b.size(1) == blocks_b, "lora_add_: B has ", packed_b.size(1), " blocks, the sub-outputs ",
              blocks_b);
  for (const int64_t slot : groups.slots)
    TORCH_CHECK(slot < packed_a.size(0), "lora_add_: slot ", slot, " past the ", packed_a.size(0), " slots");

  // the groups' rows of x, one after the other [n, K]
  const std::unique_ptr<bf16[]> gathered = buffer<bf16>(n * in_size);
  const bf16* x_data = x.data_ptr<bf16>();
  for (int64_t i = 0; i < n; ++i)
    std::memcpy(gathered.get() + i * in_size, x_data + groups.rows[i] * x.stride(0), in_size * sizeof(bf16));
  const std::unique_ptr<float[]> gathered_float = widened_rows(gathered.get(), in_size, groups);
  const std::vector<RowRun> runs = row_runs(groups);
  const bf16* a_data = packed_a.data_ptr<bf16>();
  const bf16* b_data = packed_b.data_ptr<bf16>();
  const int64_t a_slot_size = blocks_a * k_pairs * 2 * kBlockN, b_slot_size = blocks_b * rank * kBlockN;

  // shrink: [n, n_sub * R], each group's rows against its A
  const std::unique_ptr<bf16[]> shrunk = buffer<bf16>(n * shrink_size);
  pagoda::parallel_tasks(static_cast<int64_t>(runs.size()) * blocks_a, [&](int64_t task) {
    const RowRun& run = runs[task / blocks_a];
    const int64_t b = task % blocks_a;
    const BlockTask t{gathered.get() + run.first * in_size, float_rows(gathered_float, groups, run, in_size, 0),
                      in_size, in_size, run.rows,
                      a_data + groups.slots[run.group] * a_slot_size + b * k_pairs * 2 * kBlockN, k_pairs,
                      shrink_size, std::min(kBlockN, shrink_size - b * kBlockN), nullptr};
    isa::rows_against_block(t, shrunk.get() + run.first * shrink_size + b * kBlockN);
  });

  // expand: each block of B against its sub-output's R columns of the shrunk rows, added into y
  const std::unique_ptr<float[]> shrunk_float = widened_rows(shrunk.get(), shrink_size, groups);
  bf16* y_data = y.data_ptr<bf16>();
  const int64_t ldy = y.stride(0);
  const int64_t strips = (blocks_b + kBlocksPerExpandTask - 1) / kBlocksPerExpandTask;
  pagoda::parallel_tasks(static_cast<int64_t>(runs.size()) * strips, [&](int64_t task) {
    const RowRun& run = runs[task / strips];
    const int64_t first_block = (task % strips) * kBlocksPerExpandTask;
    const int64_t num_blocks = std::min(kBlocksPerExpandTask, blocks_b - first_block);
    bf16 delta[kRowsPerTask * kBlocksPerExpandTask * kBlockN];  // [rows, num_blocks * 32]
    const int64_t ld_delta = num_blocks * kBlockN;
    for (int64_t j = 0; j < num_blocks; ++j) {
      const int64_t column = expand_blocks[first_block + j].sub * rank;  // the sub-output's shrunk columns
      const BlockTask t{shrunk.get() + run.first * shrink_size + column,
                        float_rows(shrunk_float, groups, run, shrink_size, column), shrink_size, shrink_size,
                        run.rows,
                        b_data + groups.slots[run.group] * b_slot_size + (first_block + j) * rank * kBlockN,
                        rank / 2, ld_delta, expand_blocks[first_block + j].ncols, nullptr};
      isa::rows_against_block(t, delta + j * kBlockN);
    }
    for (int64_t m = 0; m < run.rows; ++m) {
      bf16* y_row = y_data + groups.rows[run.first + m] * ldy;
      const bf16* d = delta + m * ld_delta;
      for (int64_t j = 0; j < num_blocks; ++j) {
        const ExpandBlock& block = expand_blocks[first_block + j];
        bf16* out = y_row + block.column;
        for (int64_t c = 0; c < block.ncols; ++c)
          out[c] = float_to_bf16(bf16_to_float(out[c]) + bf16_to_float(d[j * kBlockN + c]));
      }
    }
  });
}

void add_(at::Tensor y, const at::Tensor& x, const at::Tensor& row_slots, const at::Tensor& packed_a,
          const at::Tensor& packed_b, at::IntArrayRef sub_sizes) {
  TORCH_CHECK(row_slots.numel() == x.size(0), "lora_add_: ", row_slots.numel(), " row slots for ", x.size(0),
              " rows");
  add_grouped(y, x, group_rows(row_slots), packed_a, packed_b, sub_sizes);
}

}  // namespace pagoda::lora
