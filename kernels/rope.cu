// rope.cu — rotary position embeddings (Su et al. 2021, RoFormer, §3.4.2, eq. 34): each pair
// of a query or key row is rotated by an angle that grows with the row's position. The
// rotation is orthogonal, so the backward rotates the gradient back by the same angle and the
// forward keeps nothing.
//
// Math (f32), for a row at position p (position_offset + its index along the sequence axis)
// and pair i < R/2 of the R rotated dims (R even, R <= D):
//   inv_freq_i = base^(−2i/R),  θ = p·inv_freq_i,
//   y_a = x_a·cos θ − x_b·sin θ,  y_b = x_a·sin θ + x_b·cos θ        (inverse: θ → −θ)
//   (a, b) = (i, i + R/2): GPT-NeoX's halves (Llama, Hugging Face, candle's rope);
//   (a, b) = (2i, 2i + 1): GPT-J's interleaved pairs (candle's rope_i).
// Dims R..D pass through. inv_freq and θ are rounded to f32 as Hugging Face's f32 cos/sin
// cache computes them (here θ/π, for sincospif), so the angle's error is about 20·2^-24·|θ|
// (θ up to the position): the outputs' error is |x|·|Δθ| plus a few roundings (tests/rope.rs).
//
// Kernel: reads n·sizeof(T), writes n·sizeof(T), one thread per pair (and one per passed-through
// element), grid-stride, any strides (the logical index gives the position and the dim).
// Reference: crates/mesa-kernels/src/reference/rope.rs.
#include "quant_common.cuh"  // dispatch_dtype

namespace MESA_NS {

constexpr int kRopeBlock = 256;
constexpr float kInvPi = 0.318309886183790672f;

// The rotated pair (a, b) of pair i, and whether a thread is on a pair or a passed-through dim.
__device__ __forceinline__ void rope_pair(int64_t i, int64_t half, bool interleaved, int64_t* a, int64_t* b) {
  *a = interleaved ? 2 * i : i;
  *b = interleaved ? 2 * i + 1 : i + half;
}

template <typename T>
__global__ void __launch_bounds__(kRopeBlock)
    rope_kernel(const T* __restrict__ x, Strided xv, T* __restrict__ y, Strided yv, int64_t rows, int64_t seq,
                int64_t dim, int64_t rotary, int64_t offset, float base, bool interleaved, bool inverse) {
  const int64_t half = rotary / 2;
  const int64_t pass = dim - rotary;
  const int64_t pairs = rows * half;  // rows: every [.., s, :] row of the tensor
  const int64_t work = pairs + rows * pass;
  const int64_t step = int64_t(gridDim.x) * blockDim.x;
  for (int64_t w = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; w < work; w += step) {
    if (w >= pairs) {  // a passed-through dim
      const int64_t q = w - pairs;
      const int64_t e = (q / pass) * dim + rotary + q % pass;
      y[yv.offset(e)] = x[xv.offset(e)];
      continue;
    }
    const int64_t row = w / half, i = w % half;
    int64_t a, b;
    rope_pair(i, half, interleaved, &a, &b);
    const int64_t ea = row * dim + a, eb = row * dim + b;
    // θ/π, for sincospif: its reduction (mod 2) is exact, where sincosf's of a large angle
    // needs a local-memory table (a stack frame on sm_90)
    const float inv_freq_over_pi = powf(base, -float(2 * i) / float(rotary)) * kInvPi;
    const float turns = float(offset + row % seq) * inv_freq_over_pi;
    float s, c;
    sincospif(turns, &s, &c);
    if (inverse) s = -s;
    const float xa = to_float(x[xv.offset(ea)]), xb = to_float(x[xv.offset(eb)]);
    y[yv.offset(ea)] = from_float<T>(fmaf(xa, c, -xb * s));
    y[yv.offset(eb)] = from_float<T>(fmaf(xa, s, xb * c));
  }
}

// ---------------------------------------------------------------------------------------
// Launch policy (host): one grid-stride launch of a few waves.
template <typename T>
struct RopeLaunch {
  static MesaStatus run(const MesaRopeArgs& a, void* stream) {
    const int64_t n = numel(a.x_desc);
    const int64_t rows = n / a.head_dim;
    const int64_t work = rows * (a.rotary_dims / 2) + rows * (a.head_dim - a.rotary_dims);
    const int64_t want = ceil_div(work, kRopeBlock);
    const int64_t cap = int64_t(sm_count()) * 8;
    const unsigned grid = unsigned(want < 1 ? 1 : (want < cap ? want : cap));
    return status_from(MESA_LAUNCH((rope_kernel<T>), dim3(grid), dim3(kRopeBlock), 0, stream,
                                   static_cast<const T*>(a.x), strided_from(a.x_desc), static_cast<T*>(a.y),
                                   strided_from(a.y_desc), rows, a.seq_len, a.head_dim, a.rotary_dims,
                                   a.position_offset, a.base, a.pairing == MESA_ROPE_INTERLEAVED, a.inverse != 0));
  }
};

}  // namespace MESA_NS

using namespace MESA_NS;

extern "C" MesaStatus MESA_ENTRY(rope)(const MesaRopeArgs* a, void* stream) {
  if (a == nullptr || !desc_valid(a->x_desc) || !desc_valid(a->y_desc)) return MESA_STATUS_INVALID_ARGUMENT;
  if (numel(a->x_desc) != numel(a->y_desc) || a->x_desc.dtype != a->y_desc.dtype) return MESA_STATUS_INVALID_ARGUMENT;
  if (a->pairing != MESA_ROPE_HALVES && a->pairing != MESA_ROPE_INTERLEAVED) return MESA_STATUS_INVALID_ARGUMENT;
  if (a->seq_len < 1 || a->head_dim < 2 || a->rotary_dims < 2 || a->rotary_dims % 2 != 0 ||
      a->rotary_dims > a->head_dim || a->position_offset < 0 || !(a->base > 1.0f) || !(a->base < 3.0e38f))
    return MESA_STATUS_INVALID_ARGUMENT;
  const int64_t n = numel(a->x_desc);
  if (n % (a->seq_len * a->head_dim) != 0) return MESA_STATUS_INVALID_ARGUMENT;
  if (n == 0) return MESA_STATUS_OK;
  if (a->x == nullptr || a->y == nullptr) return MESA_STATUS_INVALID_ARGUMENT;
  return dispatch_dtype<RopeLaunch>(a->x_desc.dtype, *a, stream);
}
