/* mesa_collectives.h — sequence-parallel collectives (Megatron: Korthikanti et al. 2022, §4.2.2):
 * reduce-scatter and all-gather of [S, B, H] activations along the sequence axis S between the
 * W ranks of a tensor-parallel group. Kernels: kernels/collectives.cu.
 *
 * Shards: rank r owns rows [split_offsets[r], split_offsets[r+1]) of S (uneven allowed).
 *
 *   reduce-scatter:  out_r[s,b,h] = ((((in_0[S_r0+s,b,h] + in_1[..]) + ...) + in_{W-1}[..])
 *                                    + bias[h]) + residual_r[s,b,h]
 *                    summed in f32 in the fixed rank order 0, 1, ..., W-1, so the result is
 *                    bitwise the same whichever rank computes it and however the launch is
 *                    split (bias and residual optional, added in that order, then one rounding
 *                    to the output dtype).
 *   all-gather:      out_r[S_p0+s,b,h] = in_p[s,b,h] for every p (a copy, bitwise).
 *
 * Intra-node kernels work over a pointer table: for every rank, its input, output, optional
 * residual and bias, and its flag buffer. The pointers may live on W GPUs (peer access or
 * CUDA IPC, set up by the caller) or all on one device (how the tests run). One launch covers
 * ranks [rank_begin, rank_begin + rank_count): one launch per GPU (rank_count = 1), or one
 * launch for all W ranks of a single device. Launches are cooperative (all blocks co-resident)
 * and every launch of one call must use the same blocks_per_rank.
 *
 * Synchronisation: block b of rank r meets block b of every peer twice per call (START: the
 * peers' inputs are ready; END: the peers finished reading r's input). A meeting is a
 * release-store of the call's epoch into the peer's flag slot and an acquire-spin on one's own
 * slot. Epochs are u32 counters kept per block in the rank's own flag buffer, incremented by
 * every call, never reset (wrap-safe comparison), so nothing needs clearing between calls and
 * CUDA-graph replays stay correct.
 *
 * Timeouts: NaN, never stale data. Every spin is bounded by timeout_ns. A block that gives up
 * stores MESA_STATUS_TIMEOUT into its rank's status word (release, system scope) *before* it
 * writes NaN and exits, and the status is sticky: the rank does nothing but write NaN, with no
 * meeting, until the flag buffer is cleared. A spin also ends early when the awaited peer's
 * status is set. Giving up happens when (1) a START or END wait expires, or (2) after START, or
 * after END, some rank's status word is set (checked behind a block barrier and a system-scope
 * fence, after the block's reads). The block then writes NaN over the whole part of the output
 * it owns (again, if it had written numbers). Why no stale number survives: rank x's input may
 * change only after x's kernel exits, and x exits either after passing its END meeting (which
 * needs every peer's END flag, published after that peer's last read of x's input) or after
 * setting its status. So a block that read changing data of x did so after x set its status,
 * and its own check after the reads (behind the fence) sees it and writes NaN. A late rank
 * that finds the START flags of peers that already gave up sees their status at (2) and writes
 * NaN without reading their inputs; a rank that passed START but times out at END writes NaN
 * over the numbers it had written. Hence every output of a rank that timed out, or that saw a
 * peer's status, is NaN, and the status words report the timeout to the host.
 * What bounded waits cannot give (two generals): a block that passed END and found every
 * status clear keeps its numbers if the first block to give up does so only after that check.
 * They are exact (every input it read was still stable), and this needs a wait to expire at a
 * deadline the rest of the group had already met (a block of a running launch late by more
 * than the bound, or a flag arriving just past it). The status words still make the call
 * report MESA_STATUS_TIMEOUT. A call whose missing or late rank never got as far as the
 * others' END (the failure this protects against) leaves NaN on every rank that ran.
 *
 * In-place: not supported (a rank's output overlapping any input, residual or bias, or another
 * rank's output, is rejected by the safe crate with Error::Aliasing): ranks read every input
 * while others write their outputs.
 */
#ifndef MESA_COLLECTIVES_H
#define MESA_COLLECTIVES_H

#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

#define MESA_SEQPAR_MAX_RANKS 16
#define MESA_SEQPAR_MAX_BLOCKS 128

/* Flag buffer of one rank (u32 words, all zero before first use; owned by the rank, written
 * by its peers). Word offsets: */
#define MESA_SEQPAR_FLAG_STATUS 0 /* 0 = healthy, MESA_STATUS_TIMEOUT after an expired wait */
#define MESA_SEQPAR_FLAG_EPOCH 32 /* [MAX_BLOCKS]: the last epoch of each block */
#define MESA_SEQPAR_FLAG_START (MESA_SEQPAR_FLAG_EPOCH + MESA_SEQPAR_MAX_BLOCKS) /* [MAX_BLOCKS][MAX_RANKS] */
#define MESA_SEQPAR_FLAG_END (MESA_SEQPAR_FLAG_START + MESA_SEQPAR_MAX_BLOCKS * MESA_SEQPAR_MAX_RANKS)
#define MESA_SEQPAR_FLAG_WORDS (MESA_SEQPAR_FLAG_END + MESA_SEQPAR_MAX_BLOCKS * MESA_SEQPAR_MAX_RANKS)

/* One rank's buffers. Element (s, b, h) of a view is at base + s*strides[0] + b*strides[1]
 * + h*strides[2] (elements), with the strides given once for all ranks in the args. */
typedef struct MesaSeqParRank {
  const void* input;    /* RS: partial sums [S, B, H];       AG: this rank's shard [S_r, B, H] */
  void* output;         /* RS: this rank's shard [S_r, B, H]; AG: the whole [S, B, H] */
  const void* residual; /* RS only: [S_r, B, H] or NULL */
  const void* bias;     /* RS only: [H] (bias_stride) or NULL */
  uint32_t* flags;      /* MESA_SEQPAR_FLAG_WORDS words */
} MesaSeqParRank;

typedef struct MesaSeqParArgs {
  MesaSeqParRank ranks[MESA_SEQPAR_MAX_RANKS];
  int64_t split_offsets[MESA_SEQPAR_MAX_RANKS + 1]; /* rows; [0] = 0, [W] = S, nondecreasing */
  int64_t batch;                                    /* B */
  int64_t hidden;                                   /* H */
  int64_t in_strides[3];
  int64_t out_strides[3];
  int64_t residual_strides[3];
  int64_t bias_stride;
  uint64_t timeout_ns;        /* bound of every wait (wall clock) */
  int32_t world_size;         /* W, 1..MESA_SEQPAR_MAX_RANKS */
  int32_t rank_begin;         /* first rank of this launch */
  int32_t rank_count;         /* ranks of this launch */
  int32_t blocks_per_rank;    /* 0: chosen by the launcher (one-device launches only) */
  MesaDType dtype;            /* of input, output, residual and bias */
  int32_t _pad;
} MesaSeqParArgs;

/* Elementwise epilogue/conversion for the NCCL backend: for i < n (dense, row-major [n/H, H]),
 *   dst[i] = (src[i] + bias[i % H]) + residual[i]     in f32, one rounding to dst_dtype.
 * bias/residual may be NULL; src may equal dst (in place, same dtype). With no bias or
 * residual and dst_dtype F32 it upcasts; with src F32 it rounds an f32 sum to the output. */
typedef struct MesaSeqParEpilogueArgs {
  const void* src;
  void* dst;
  const void* bias;     /* [H] or NULL, dst_dtype */
  const void* residual; /* [n] or NULL, dst_dtype */
  int64_t n;
  int64_t hidden;
  MesaDType src_dtype;
  MesaDType dst_dtype;
} MesaSeqParEpilogueArgs;

MESA_DECLARE_ENTRY(seqpar_reduce_scatter, MesaSeqParArgs)
MESA_DECLARE_ENTRY(seqpar_all_gather, MesaSeqParArgs)
MESA_DECLARE_ENTRY(seqpar_epilogue, MesaSeqParEpilogueArgs)

#ifdef __cplusplus
}
#endif

#endif /* MESA_COLLECTIVES_H */
