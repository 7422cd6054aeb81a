// collectives.cu — sequence-parallel reduce-scatter and all-gather along S of [S, B, H]
// activations (Megatron sequence parallelism: Korthikanti et al. 2022, §4.2.2, the g / g-bar
// operators), intra-node, over a table of peer pointers. Protocol and shapes:
// kernels/include/mesa_collectives.h.
//
// Math (rank r, shard rows [o_r, o_{r+1}), n_r = (o_{r+1} - o_r)·B·H elements):
//   reduce-scatter  out_r[i] = rnd_T( (((x_0[i] + x_1[i]) + … + x_{W-1}[i]) + bias[h]) + res_r[i] )
//                   every + in f32, in rank order 0..W-1, one rounding at the end;
//                   W-1 + (bias) + (residual) adds per element.
//   all-gather      out_r[o_p·B·H + i] = x_p[i] for every peer p (bit copy, no arithmetic).
//
// Bytes moved per call (e = sizeof(T), N = S·B·H, all W ranks together):
//   reduce-scatter  reads W·N·e (every rank reads its shard of all W inputs), writes N·e
//                   (+ N·e read for the residual, + W·H·e for the bias)
//   all-gather      reads W·N·e (every rank reads all W shards), writes W·N·e
// FLOPs: reduce-scatter (W-1)·N (+ N per epilogue term); all-gather none.
// With all ranks on one device the floor is those bytes at the copy bandwidth (docs/sequence_parallel.md).
//
// Each call: block b of rank r (1) reads its epoch e = epoch[b] + 1, (2) meets block b of every
// peer at START (the peers' inputs are ready), (3) moves its part of the data, (4) meets them
// at END (every peer has finished reading r's input, so r may return and let its input be
// overwritten), (5) stores epoch[b] = e. After each meeting it checks the group's status words
// (a peer gave up); a block that times out or sees that replaces its part of the output with
// NaN (timeout argument: mesa_collectives.h). Block b of every rank handles the same part of its
// own shard, so no meeting needs more than the W counterparts of one block.
//
// Paths: dense views whose pointers are all 16-byte aligned move 16-byte vectors (tail
// elements one by one); dense views offset by an element take the scalar dense loop; any
// other strides take the strided loop. All paths do the same f32 operations in the same
// order per element, so the result does not depend on the path.
//
// Reference: crates/mesa-kernels/src/reference/collectives.rs.
#include "common.cuh"

namespace MESA_NS {
namespace seqpar {

// 256 threads: enough 16-byte loads in flight per block with W peers to read, and small
// enough that W × blocks_per_rank blocks stay co-resident (the cooperative launch requires
// it) at two blocks per SM.
constexpr int kBlock = 256;
constexpr int kMaxRanks = MESA_SEQPAR_MAX_RANKS;

__device__ __forceinline__ bool aligned16(const void* p) { return (reinterpret_cast<uintptr_t>(p) & 15u) == 0; }

// One meeting of block `blk` of `rank` with block `blk` of every peer: thread p < W releases
// the epoch into peer p's slot [blk][rank] and acquires its own slot [blk][p]. Returns false
// (for every thread of the block) when some wait outlived the bound, or when peer p's status
// word is set while its flag is still missing (p gave up: its flag will not come). `s_fail` is
// this meeting's own shared word (never reused, so no thread can reset it early).
__device__ bool meet(const MesaSeqParArgs& a, int rank, int blk, uint32_t epoch, int region, int* s_fail) {
  if (threadIdx.x == 0) *s_fail = 0;
  __syncthreads();
  const int p = int(threadIdx.x);
  if (p < a.world_size) {
    store_release_sys(a.ranks[p].flags + region + blk * kMaxRanks + rank, epoch);
    const uint32_t* mine = a.ranks[rank].flags + region + blk * kMaxRanks + p;
    const uint32_t* peer_status = a.ranks[p].flags + MESA_SEQPAR_FLAG_STATUS;
    const uint64_t t0 = timer_ns();
    uint32_t spins = 0;
    while (!epoch_reached(load_acquire_sys(mine), epoch)) {
      if (timer_ns() - t0 > a.timeout_ns || ((++spins & 15u) == 0u && load_acquire_sys(peer_status) != 0u)) {
        atomicExch(s_fail, 1);
        break;
      }
      __nanosleep(200);
    }
  }
  __syncthreads();
  return *s_fail == 0;
}

// True (for every thread of the block) when some rank of the group has given up: its status
// word is set (sticky until the flags are cleared). The barrier ends this block's reads of the
// peers' inputs and its writes; the system-scope fence orders them before the status loads,
// so a read that saw an input already being overwritten (which only happens after its owner
// set its status and exited) is followed by a load that sees that status.
__device__ bool group_aborted(const MesaSeqParArgs& a, int* s_flag) {
  if (threadIdx.x == 0) *s_flag = 0;
  __syncthreads();
  const int p = int(threadIdx.x);
  if (p < a.world_size) {
    __threadfence_system();
    if (load_acquire_sys(a.ranks[p].flags + MESA_SEQPAR_FLAG_STATUS) != 0u) atomicExch(s_flag, 1);
  }
  __syncthreads();
  return *s_flag != 0;
}

// Element offset of logical (s, b, h) = index i of a [rows, B, H] view.
__device__ __forceinline__ int64_t strided_offset(int64_t i, int64_t B, int64_t H, const int64_t* st) {
  const int64_t h = i % H;
  const int64_t sb = i / H;
  return (sb / B) * st[0] + (sb % B) * st[1] + h * st[2];
}

template <typename T>
__device__ __forceinline__ T nan_of() {
  return from_float<T>(__uint_as_float(0x7fc00000u));
}

// ---------------------------------------------------------------------------------------
// Reduce-scatter.
// Vectors per rank and thread in the dense loop, for up to kMaxW ranks: the loads of an
// iteration (kReduceVecs vectors of each input, and of the residual) are issued before the
// first add, in phases of at most 8 ranks, so a thread has min(W, 8)·kReduceVecs 16-byte
// loads in flight: two per rank up to 4 ranks, one beyond (at most 32 registers of data
// under the 128 that two blocks per SM allow).
template <int kMaxW>
constexpr int kReduceVecs = kMaxW <= 4 ? 2 : 1;

// The dense vector loop of the reduce-scatter for W <= kMaxW ranks (kMaxW a template
// argument: the loads and adds of absent ranks are predicated off, the per-rank loop
// unrolled; W <= 8: all loads issued before the first add). Per element the f32 sum in rank order, then bias, then residual: the operations
// of the scalar loop, so the same bits. The bias column h of a vector's first element
// advances with the grid stride by one conditional subtraction (no 64-bit modulo per vector).
// Returns the elements it handled (a multiple of the vector width).
template <typename T, int kMaxW>
__device__ int64_t reduce_vectors(const MesaSeqParArgs& a, int rank, int64_t tid, int64_t stride, int64_t n,
                                  bool poison) {
  constexpr int N = Vec16<T>::N;
  constexpr int K = kReduceVecs<kMaxW>;
  constexpr int kPhase = kMaxW < 8 ? kMaxW : 8;
  const int W = a.world_size;
  const int64_t H = a.hidden;
  const int64_t base = a.split_offsets[rank] * a.batch * H;  // shard start inside every (dense) input
  T* out = static_cast<T*>(a.ranks[rank].output);
  const T* bias = static_cast<const T*>(a.ranks[rank].bias);
  const T* res = static_cast<const T*>(a.ranks[rank].residual);
  const int64_t nvec = n / N;
  // H a multiple of N: a vector never wraps around a row, and starts at a multiple of N
  const bool bias_vec = bias != nullptr && a.bias_stride == 1 && H % N == 0 && aligned16(bias);
  // h of element v·N for this thread's first vector of each of its K slots, and the step
  const int64_t step_h = (K * stride * N) % H;
  int64_t h0[K];
#pragma unroll
  for (int k = 0; k < K; ++k) h0[k] = ((tid + k * stride) * N) % H;
  for (int64_t v0 = tid; v0 < nvec; v0 += K * stride) {
    float acc[K][N];
    Vec16<T> x[K][kPhase], r[K];
    // ranks in phases of kPhase: every load of a phase is issued before its first add
#pragma unroll
    for (int p0 = 0; p0 < kMaxW; p0 += kPhase) {
#pragma unroll
      for (int k = 0; k < K; ++k) {
        const int64_t v = v0 + k * stride;
        if (poison || v >= nvec) continue;
#pragma unroll
        for (int q = 0; q < kPhase; ++q)
          if (p0 + q < W) x[k][q] = load16(static_cast<const T*>(a.ranks[p0 + q].input) + base + v * N);
        if (p0 == 0 && res != nullptr) r[k] = load16(res + v * N);
      }
#pragma unroll
      for (int k = 0; k < K; ++k) {
        if (poison || v0 + k * stride >= nvec) continue;
#pragma unroll
        for (int q = 0; q < kPhase; ++q)
          if (p0 + q < W) {
#pragma unroll
            for (int j = 0; j < N; ++j) acc[k][j] = p0 + q == 0 ? to_float(x[k][q].v[j]) : acc[k][j] + to_float(x[k][q].v[j]);
          }
      }
    }
#pragma unroll
    for (int k = 0; k < K; ++k) {
      const int64_t v = v0 + k * stride;
      if (v >= nvec) break;
      Vec16<T> o;
      if (poison) {
#pragma unroll
        for (int j = 0; j < N; ++j) o.v[j] = nan_of<T>();
      } else {
        if (bias_vec) {  // the vector's N columns are one 16-byte run of the bias
          const Vec16<T> bv = load16(bias + h0[k]);
#pragma unroll
          for (int j = 0; j < N; ++j) acc[k][j] = acc[k][j] + to_float(bv.v[j]);
        } else if (bias != nullptr) {
          int64_t h = h0[k];
#pragma unroll
          for (int j = 0; j < N; ++j) {
            acc[k][j] = acc[k][j] + to_float(bias[h * a.bias_stride]);
            h = h + 1 == H ? 0 : h + 1;
          }
        }
        if (res != nullptr) {
#pragma unroll
          for (int j = 0; j < N; ++j) acc[k][j] = acc[k][j] + to_float(r[k].v[j]);
        }
#pragma unroll
        for (int j = 0; j < N; ++j) o.v[j] = from_float<T>(acc[k][j]);
      }
      store16(out + v * N, o);
    }
#pragma unroll
    for (int k = 0; k < K; ++k) {
      h0[k] += step_h;
      h0[k] -= h0[k] >= H ? H : 0;
    }
  }
  return nvec * N;
}

// Whether the dense vector loop applies: every pointer it touches 16-byte aligned.
template <typename T>
__device__ __forceinline__ bool vectors_ok(const MesaSeqParArgs& a, int rank) {
  const int64_t base = a.split_offsets[rank] * a.batch * a.hidden;
  const void* res = a.ranks[rank].residual;
  bool vec = aligned16(a.ranks[rank].output) && (res == nullptr || aligned16(res));
  for (int p = 0; p < a.world_size; ++p) vec = vec && aligned16(static_cast<const T*>(a.ranks[p].input) + base);
  return vec;
}

// kMaxW > 0: dense views, the vector loop for up to kMaxW ranks where the pointers allow, the
// scalar loop for the tail; kMaxW = 0: any strides, the scalar loop.
template <typename T, int kMaxW>
__device__ void reduce_shard(const MesaSeqParArgs& a, int rank, int64_t tid, int64_t stride, bool poison) {
  constexpr bool kDense = kMaxW > 0;
  const int W = a.world_size;
  const int64_t B = a.batch, H = a.hidden;
  const int64_t row0 = a.split_offsets[rank];
  const int64_t n = (a.split_offsets[rank + 1] - row0) * B * H;
  T* out = static_cast<T*>(a.ranks[rank].output);
  const T* bias = static_cast<const T*>(a.ranks[rank].bias);
  const T* res = static_cast<const T*>(a.ranks[rank].residual);
  const T poison_value = nan_of<T>();
  int64_t done = 0;  // elements handled by the vector loop
  if constexpr (kDense) {
    if (vectors_ok<T>(a, rank)) done = reduce_vectors<T, kMaxW>(a, rank, tid, stride, n, poison);
  }
  // scalar: the tail of the vector loop, misaligned dense views, any strides
  for (int64_t i = done + tid; i < n; i += stride) {
    const int64_t in_off = kDense ? row0 * B * H + i : row0 * a.in_strides[0] + strided_offset(i, B, H, a.in_strides);
    const int64_t out_off = kDense ? i : strided_offset(i, B, H, a.out_strides);
    if (poison) {
      out[out_off] = poison_value;
      continue;
    }
    float acc = to_float(static_cast<const T*>(a.ranks[0].input)[in_off]);
    for (int p = 1; p < W; ++p) acc = acc + to_float(static_cast<const T*>(a.ranks[p].input)[in_off]);
    if (bias != nullptr) acc = acc + to_float(bias[(i % H) * a.bias_stride]);
    if (res != nullptr) acc = acc + to_float(res[kDense ? i : strided_offset(i, B, H, a.residual_strides)]);
    out[out_off] = from_float<T>(acc);
  }
}

// ---------------------------------------------------------------------------------------
// All-gather: rank r pulls every peer's shard into its own output.
template <typename T, bool kDense>
__device__ void gather_shards(const MesaSeqParArgs& a, int rank, int64_t tid, int64_t stride, bool poison) {
  const int64_t B = a.batch, H = a.hidden;
  T* out = static_cast<T*>(a.ranks[rank].output);
  const T poison_value = nan_of<T>();
  for (int p = 0; p < a.world_size; ++p) {
    const int64_t row0 = a.split_offsets[p];
    const int64_t n = (a.split_offsets[p + 1] - row0) * B * H;
    const T* src = static_cast<const T*>(a.ranks[p].input);
    int64_t done = 0;
    if (kDense) {
      constexpr int N = Vec16<T>::N;
      T* dst = out + row0 * B * H;
      if (aligned16(src) && aligned16(dst)) {
        const int64_t nvec = n / N;
        for (int64_t v = tid; v < nvec; v += stride) {
          Vec16<T> o;
          if (poison) {
#pragma unroll
            for (int j = 0; j < N; ++j) o.v[j] = poison_value;
          } else {
            o = load16(src + v * N);
          }
          store16(dst + v * N, o);
        }
        done = nvec * N;
      }
    }
    for (int64_t i = done + tid; i < n; i += stride) {
      const int64_t out_off =
          kDense ? row0 * B * H + i : row0 * a.out_strides[0] + strided_offset(i, B, H, a.out_strides);
      out[out_off] = poison ? poison_value : src[kDense ? i : strided_offset(i, B, H, a.in_strides)];
    }
  }
}

// ---------------------------------------------------------------------------------------
// Block `blk` of `rank` moves its part of the output (all-gather or reduce-scatter), or with
// `poison` writes NaN over exactly the same elements.
// kMaxW: 0 for strided views, else dense views of up to kMaxW ranks (all-gather: any W).
template <typename T, int kMaxW, bool kGather>
__device__ __forceinline__ void move_part(const MesaSeqParArgs& a, int rank, int blk, int bpr, bool poison) {
  const int64_t tid = int64_t(blk) * blockDim.x + threadIdx.x;
  const int64_t stride = int64_t(bpr) * blockDim.x;
  if constexpr (kGather)
    gather_shards<T, (kMaxW > 0)>(a, rank, tid, stride, poison);
  else
    reduce_shard<T, kMaxW>(a, rank, tid, stride, poison);
}

// The collective kernel: grid.x = rank_count × bpr, block r·bpr + b is block b of rank
// rank_begin + r. kGather selects all-gather, else reduce-scatter; kMaxW as move_part. The
// protocol and why a timed-out call leaves NaN and never stale data: mesa_collectives.h.
// Two blocks per SM at most 128 registers (auto_blocks_per_rank counts on two).
template <typename T, int kMaxW, bool kGather>
__global__ void __launch_bounds__(kBlock, 2) seqpar_kernel(const MesaSeqParArgs a, int bpr) {
  __shared__ int s_word[4];
  __shared__ uint32_t s_epoch;
  __shared__ int s_sick;
  const int rank = a.rank_begin + int(blockIdx.x) / bpr;
  const int blk = int(blockIdx.x) % bpr;
  uint32_t* flags = a.ranks[rank].flags;
  if (threadIdx.x == 0) {
    // only this block of this rank touches its epoch word, and only between calls
    s_epoch = flags[MESA_SEQPAR_FLAG_EPOCH + blk] + 1u;
    s_sick = load_acquire_sys(flags + MESA_SEQPAR_FLAG_STATUS) != 0u ? 1 : 0;
  }
  __syncthreads();
  const uint32_t epoch = s_epoch;
  const bool sick = s_sick != 0;
  // giving up: set the rank's (sticky) status first, so that peers still reading this
  // rank's input see it before the input can change (after this kernel exits)
  const auto give_up = [&] {
    if (threadIdx.x == 0 && !sick) store_release_sys(flags + MESA_SEQPAR_FLAG_STATUS, uint32_t(MESA_STATUS_TIMEOUT));
  };
  // START, then: has a peer already given up (e.g. this rank is late)? Its input may be
  // changing: do not read it
  bool ok = !sick && meet(a, rank, blk, epoch, MESA_SEQPAR_FLAG_START, &s_word[0]) && !group_aborted(a, &s_word[1]);
  if (!ok) give_up();
  move_part<T, kMaxW, kGather>(a, rank, blk, bpr, !ok);
  if (ok) {
    // END, then the same question after the reads: a peer that gave up meanwhile may have
    // changed its input under them. Either way the finite part just written is replaced.
    ok = meet(a, rank, blk, epoch, MESA_SEQPAR_FLAG_END, &s_word[2]) && !group_aborted(a, &s_word[3]);
    if (!ok) {
      give_up();
      // same partition: every thread overwrites exactly the elements it wrote
      move_part<T, kMaxW, kGather>(a, rank, blk, bpr, true);
    }
  }
  if (threadIdx.x == 0) flags[MESA_SEQPAR_FLAG_EPOCH + blk] = epoch;
}

// ---------------------------------------------------------------------------------------
// Epilogue / conversion (NCCL backend): dst = rnd((src + bias) + residual), grid-stride.
template <typename S, typename D>
__global__ void __launch_bounds__(kBlock) epilogue_kernel(const S* src, D* dst, const D* bias, const D* res,
                                                          int64_t n, int64_t H) {
  const int64_t stride = int64_t(gridDim.x) * blockDim.x;
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += stride) {
    float acc = to_float(src[i]);
    if (bias != nullptr) acc = acc + to_float(bias[i % H]);
    if (res != nullptr) acc = acc + to_float(res[i]);
    dst[i] = from_float<D>(acc);
  }
}

// ---------------------------------------------------------------------------------------
// Launch policy (host).
inline bool is_dense3(const int64_t* st, int64_t B, int64_t H) {
  return (H <= 1 || st[2] == 1) && (B <= 1 || st[1] == H) && st[0] == B * H;
}

inline int64_t max_shard_rows(const MesaSeqParArgs& a) {
  int64_t m = 0;
  for (int r = 0; r < a.world_size; ++r) {
    const int64_t rows = a.split_offsets[r + 1] - a.split_offsets[r];
    m = rows > m ? rows : m;
  }
  return m;
}

// Blocks per rank: two blocks per SM over the ranks this launch runs on its device (W when one
// device holds the whole group; 1 for one rank per GPU, which then gets the whole GPU), no
// more than the largest shard needs, at most MESA_SEQPAR_MAX_BLOCKS. It depends on the rank
// count and the global sizes only, so every launch of one call computes the same value on the
// same GPU model; launches on different GPU models must pass blocks_per_rank.
inline int auto_blocks_per_rank(const MesaSeqParArgs& a, bool gather) {
  const int64_t elems = (gather ? a.split_offsets[a.world_size] : max_shard_rows(a)) * a.batch * a.hidden;
  const int64_t need = ceil_div(ceil_div(elems, 8), kBlock);
  int64_t bpr = ceil_div(2 * int64_t(sm_count()), a.rank_count);
  bpr = bpr < need ? bpr : need;
  bpr = bpr < MESA_SEQPAR_MAX_BLOCKS ? bpr : MESA_SEQPAR_MAX_BLOCKS;
  return int(bpr < 1 ? 1 : bpr);
}

template <typename T>
MesaStatus launch_collective(const MesaSeqParArgs& a, bool gather, void* stream) {
  const int bpr = a.blocks_per_rank > 0 ? a.blocks_per_rank : auto_blocks_per_rank(a, gather);
  const dim3 grid(unsigned(a.rank_count * bpr));
  const bool dense = is_dense3(a.in_strides, a.batch, a.hidden) && is_dense3(a.out_strides, a.batch, a.hidden) &&
                     (gather || is_dense3(a.residual_strides, a.batch, a.hidden) ||
                      [&] {
                        for (int r = a.rank_begin; r < a.rank_begin + a.rank_count; ++r)
                          if (a.ranks[r].residual != nullptr) return false;
                        return true;
                      }());
  const int W = a.world_size;
  cudaError_t e;
  if (gather && dense)
    e = MESA_LAUNCH_COOPERATIVE((seqpar_kernel<T, 1, true>), grid, dim3(kBlock), 0, stream, a, bpr);
  else if (gather)
    e = MESA_LAUNCH_COOPERATIVE((seqpar_kernel<T, 0, true>), grid, dim3(kBlock), 0, stream, a, bpr);
  else if (!dense)
    e = MESA_LAUNCH_COOPERATIVE((seqpar_kernel<T, 0, false>), grid, dim3(kBlock), 0, stream, a, bpr);
  else if (W <= 2)
    e = MESA_LAUNCH_COOPERATIVE((seqpar_kernel<T, 2, false>), grid, dim3(kBlock), 0, stream, a, bpr);
  else if (W <= 4)
    e = MESA_LAUNCH_COOPERATIVE((seqpar_kernel<T, 4, false>), grid, dim3(kBlock), 0, stream, a, bpr);
  else if (W <= 8)
    e = MESA_LAUNCH_COOPERATIVE((seqpar_kernel<T, 8, false>), grid, dim3(kBlock), 0, stream, a, bpr);
  else
    e = MESA_LAUNCH_COOPERATIVE((seqpar_kernel<T, kMaxRanks, false>), grid, dim3(kBlock), 0, stream, a, bpr);
  return status_from(e);
}

inline MesaStatus collective(const MesaSeqParArgs* a, bool gather, void* stream) {
  if (a == nullptr) return MESA_STATUS_INVALID_ARGUMENT;
  const int W = a->world_size;
  if (W < 1 || W > kMaxRanks) return MESA_STATUS_INVALID_ARGUMENT;
  if (a->rank_begin < 0 || a->rank_count < 1 || a->rank_begin + a->rank_count > W) return MESA_STATUS_INVALID_ARGUMENT;
  if (a->blocks_per_rank < 0 || a->blocks_per_rank > MESA_SEQPAR_MAX_BLOCKS) return MESA_STATUS_INVALID_ARGUMENT;
  if (a->batch < 0 || a->hidden < 0 || a->split_offsets[0] != 0) return MESA_STATUS_INVALID_ARGUMENT;
  if (a->dtype != MESA_DTYPE_F32 && a->dtype != MESA_DTYPE_F16 && a->dtype != MESA_DTYPE_BF16)
    return MESA_STATUS_INVALID_ARGUMENT;
  for (int r = 0; r < W; ++r)
    if (a->split_offsets[r + 1] < a->split_offsets[r]) return MESA_STATUS_INVALID_ARGUMENT;
  const int64_t S = a->split_offsets[W];
  // element counts and the largest offsets stay far from int64 overflow
  const int64_t limit = int64_t(1) << 62;
  if (a->batch > 0 && a->hidden > 0 && (S > limit / a->batch || S * a->batch > limit / a->hidden))
    return MESA_STATUS_INVALID_ARGUMENT;
  if (S == 0 || a->batch == 0 || a->hidden == 0) return MESA_STATUS_OK;  // nothing moves, no meeting
  for (int k = 0; k < 3; ++k)
    if (a->in_strides[k] < 0 || a->out_strides[k] < 0 || a->residual_strides[k] < 0) return MESA_STATUS_INVALID_ARGUMENT;
  if (a->bias_stride < 0) return MESA_STATUS_INVALID_ARGUMENT;
  // an empty shard may be a null pointer (cudaMalloc(0), framework allocators): all-gather
  // inputs and reduce-scatter outputs are shards; the others are the whole [S, B, H]
  for (int r = 0; r < W; ++r) {
    const bool empty_shard = a->split_offsets[r + 1] == a->split_offsets[r];
    if (a->ranks[r].flags == nullptr) return MESA_STATUS_INVALID_ARGUMENT;
    if (a->ranks[r].input == nullptr && !(gather && empty_shard)) return MESA_STATUS_INVALID_ARGUMENT;
  }
  for (int r = a->rank_begin; r < a->rank_begin + a->rank_count; ++r) {
    const bool empty_shard = a->split_offsets[r + 1] == a->split_offsets[r];
    if (a->ranks[r].output == nullptr && !(!gather && empty_shard)) return MESA_STATUS_INVALID_ARGUMENT;
  }
  switch (a->dtype) {
    case MESA_DTYPE_F32: return launch_collective<float>(*a, gather, stream);
    case MESA_DTYPE_F16: return launch_collective<__half>(*a, gather, stream);
    default: return launch_collective<__nv_bfloat16>(*a, gather, stream);
  }
}

template <typename S, typename D>
MesaStatus launch_epilogue(const MesaSeqParEpilogueArgs& a, void* stream) {
  const int64_t want = ceil_div(a.n, kBlock);
  const int64_t cap = int64_t(sm_count()) * 4;
  const unsigned grid = unsigned(want < cap ? want : cap);
  return status_from(MESA_LAUNCH((epilogue_kernel<S, D>), dim3(grid), dim3(kBlock), 0, stream,
                                 static_cast<const S*>(a.src), static_cast<D*>(a.dst),
                                 static_cast<const D*>(a.bias), static_cast<const D*>(a.residual), a.n, a.hidden));
}

template <typename S>
MesaStatus epilogue_dst(const MesaSeqParEpilogueArgs& a, void* stream) {
  switch (a.dst_dtype) {
    case MESA_DTYPE_F32: return launch_epilogue<S, float>(a, stream);
    case MESA_DTYPE_F16: return launch_epilogue<S, __half>(a, stream);
    default: return launch_epilogue<S, __nv_bfloat16>(a, stream);
  }
}

inline bool dtype_ok(MesaDType t) { return t == MESA_DTYPE_F32 || t == MESA_DTYPE_F16 || t == MESA_DTYPE_BF16; }

}  // namespace seqpar
}  // namespace MESA_NS

using namespace MESA_NS;

// ---------------------------------------------------------------------------------------
// C entry points: they re-check what would make a kernel touch memory it should not.
extern "C" MesaStatus MESA_ENTRY(seqpar_reduce_scatter)(const MesaSeqParArgs* a, void* stream) {
  return seqpar::collective(a, false, stream);
}

extern "C" MesaStatus MESA_ENTRY(seqpar_all_gather)(const MesaSeqParArgs* a, void* stream) {
  return seqpar::collective(a, true, stream);
}

extern "C" MesaStatus MESA_ENTRY(seqpar_epilogue)(const MesaSeqParEpilogueArgs* a, void* stream) {
  if (a == nullptr || a->n < 0 || !seqpar::dtype_ok(a->src_dtype) || !seqpar::dtype_ok(a->dst_dtype))
    return MESA_STATUS_INVALID_ARGUMENT;
  if (a->n == 0) return MESA_STATUS_OK;
  if (a->src == nullptr || a->dst == nullptr || (a->bias != nullptr && a->hidden < 1)) return MESA_STATUS_INVALID_ARGUMENT;
  switch (a->src_dtype) {
    case MESA_DTYPE_F32: return seqpar::epilogue_dst<float>(*a, stream);
    case MESA_DTYPE_F16: return seqpar::epilogue_dst<__half>(*a, stream);
    default: return seqpar::epilogue_dst<__nv_bfloat16>(*a, stream);
  }
}
