// cooperative_groups.h — the part of CUDA's cooperative groups the emulation provides, each
// group operation mapped onto the primitive it stands for, so that it gets that primitive's
// checks (docs/emulator.md):
//   this_thread_block()             sync() = __syncthreads (synccheck, racecheck ordering)
//   tiled_partition<N>(block)       N in {1, 2, 4, 8, 16, 32}: a tile of N consecutive lanes of
//                                   one warp; sync() = __syncwarp(tile mask), shfl* = __shfl*_sync
//                                   with the tile's mask and width N, ballot/any/all = votes
//   reduce(tile, v, op)             a butterfly of shfl_xor over the tile (cooperative_groups/reduce.h)
//   this_grid()                     sync() = every thread of every block (a cooperative launch only;
//                                   elsewhere synccheck fails the launch, as the GPU would hang)
// Found only by the emulator build (kernels/emu is on its include path, never on nvcc's).
#pragma once

#include <type_traits>

namespace cooperative_groups {

class thread_block {
 public:
  void sync(const char* file = __builtin_FILE(), int line = __builtin_LINE()) const { __syncthreads(file, line); }
  unsigned thread_rank() const {
    return threadIdx.x + threadIdx.y * blockDim.x + threadIdx.z * blockDim.x * blockDim.y;
  }
  unsigned size() const { return blockDim.x * blockDim.y * blockDim.z; }
  unsigned num_threads() const { return size(); }
  dim3 group_index() const { return dim3(blockIdx.x, blockIdx.y, blockIdx.z); }
  dim3 thread_index() const { return dim3(threadIdx.x, threadIdx.y, threadIdx.z); }
  dim3 group_dim() const { return dim3(blockDim.x, blockDim.y, blockDim.z); }
};
inline thread_block this_thread_block() { return thread_block(); }
inline void sync(const thread_block& g, const char* file = __builtin_FILE(), int line = __builtin_LINE()) {
  g.sync(file, line);
}

class grid_group {
 public:
  // false outside a cooperative launch, as on the GPU
  bool is_valid() const { return ::mesa_emu::launch_is_cooperative(); }
  void sync(const char* file = __builtin_FILE(), int line = __builtin_LINE()) const {
    ::mesa_emu::grid_sync(file, line);
  }
  unsigned long long thread_rank() const {
    const unsigned long long block =
        blockIdx.x + 1ull * blockIdx.y * gridDim.x + 1ull * blockIdx.z * gridDim.x * gridDim.y;
    return block * (blockDim.x * blockDim.y * blockDim.z) + this_thread_block_rank();
  }
  unsigned long long size() const {
    return 1ull * gridDim.x * gridDim.y * gridDim.z * blockDim.x * blockDim.y * blockDim.z;
  }
  unsigned long long num_threads() const { return size(); }

 private:
  static unsigned this_thread_block_rank() { return thread_block().thread_rank(); }
};
inline grid_group this_grid() { return grid_group(); }
inline void sync(const grid_group& g, const char* file = __builtin_FILE(), int line = __builtin_LINE()) {
  g.sync(file, line);
}

// A tile of N consecutive threads of the block (N a power of two, at most a warp), which the
// partition requires the block size to be a multiple of.
template <unsigned N>
class thread_block_tile {
  static_assert(N >= 1 && N <= 32 && (N & (N - 1)) == 0, "tiles of 1, 2, 4, 8, 16 or 32 threads");

 public:
  static constexpr unsigned num_threads() { return N; }
  static constexpr unsigned size() { return N; }
  unsigned thread_rank() const { return linear() % N; }
  unsigned meta_group_rank() const { return linear() / N; }
  unsigned meta_group_size() const { return thread_block().size() / N; }
  // this tile's lanes in its warp
  unsigned mask() const {
    const unsigned lane = linear() % 32u;
    return N == 32 ? 0xffffffffu : ((1u << N) - 1u) << (lane - lane % N);
  }
  void sync() const { __syncwarp(mask()); }
  template <typename T>
  T shfl(T v, int src_rank) const {
    return __shfl_sync(mask(), v, src_rank, int(N));
  }
  template <typename T>
  T shfl_xor(T v, unsigned lane_mask) const {
    return __shfl_xor_sync(mask(), v, int(lane_mask), int(N));
  }
  template <typename T>
  T shfl_down(T v, unsigned delta) const {
    return __shfl_down_sync(mask(), v, delta, int(N));
  }
  template <typename T>
  T shfl_up(T v, unsigned delta) const {
    return __shfl_up_sync(mask(), v, delta, int(N));
  }
  // bit r: thread r of the tile
  unsigned ballot(int pred) const {
    const unsigned lane = linear() % 32u;
    return (__ballot_sync(mask(), pred) & mask()) >> (lane - lane % N);
  }
  bool any(int pred) const { return ballot(pred) != 0u; }
  bool all(int pred) const { return ballot(pred) == (N == 32 ? 0xffffffffu : (1u << N) - 1u); }

 private:
  static unsigned linear() { return thread_block().thread_rank(); }
};

template <unsigned N>
inline thread_block_tile<N> tiled_partition(const thread_block&) {
  return thread_block_tile<N>();
}
template <unsigned N>
inline void sync(const thread_block_tile<N>& t) {
  t.sync();
}

// reduce's operators (cooperative_groups/reduce.h)
template <typename T>
struct plus {
  T operator()(T a, T b) const { return a + b; }
};
template <typename T>
struct less {
  T operator()(T a, T b) const { return b < a ? b : a; }
};
template <typename T>
struct greater {
  T operator()(T a, T b) const { return a < b ? b : a; }
};
template <typename T>
struct bit_and {
  T operator()(T a, T b) const { return a & b; }
};
template <typename T>
struct bit_or {
  T operator()(T a, T b) const { return a | b; }
};
template <typename T>
struct bit_xor {
  T operator()(T a, T b) const { return a ^ b; }
};

// Every thread of the tile gets op over the tile's values. The GPU's order of the partial
// results is unspecified; this one is a butterfly (each thread combines with rank ^ o for
// o = N/2, ..., 1), so a non-associative op (f32 +) may differ from the GPU in the last bits.
template <unsigned N, typename T, typename Op>
inline T reduce(const thread_block_tile<N>& tile, T v, Op op) {
  for (unsigned o = N / 2; o > 0; o /= 2) v = op(v, tile.shfl_xor(v, o));
  return v;
}

}  // namespace cooperative_groups
