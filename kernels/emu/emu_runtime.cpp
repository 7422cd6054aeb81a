// emu_runtime.cpp — the scheduler behind cuda_emu.h.
//
// A launch runs its blocks on `worker_count()` OS threads (the calling thread plus helpers
// spawned for the launch); each OS thread runs one block at a time. The CUDA threads of a
// block are fibers on that OS thread, scheduled round-robin: a fiber runs until it finishes
// or waits (barrier, warp exchange, spin-wait), then the next one runs. A switch saves the
// callee-saved registers and the stack pointer (x86-64, AArch64: a few instructions, no
// system call; ucontext elsewhere), which is what makes barrier-heavy kernels affordable.
// Fiber stacks are cached between launches, so a launch costs a few microseconds plus
// the kernel's own work.
//
// A cooperative launch gives every block its own OS thread at once, so that blocks that
// wait for each other through global memory (the collectives) all make progress.
#include "cuda_emu.h"

#include <sys/mman.h>
#include <unistd.h>
#if !defined(__x86_64__) && !defined(__aarch64__)
#include <ucontext.h>
#define MESA_EMU_UCONTEXT 1
#endif

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <exception>
#include <memory>
#include <mutex>
#include <thread>
#include <vector>


// ---------------------------------------------------------------------------------------
// Fiber context switch: `mesa_emu_switch(&save_sp, next_sp)` pushes the callee-saved
// registers on the current stack, stores the stack pointer in *save_sp, loads next_sp and
// pops the next fiber's registers, returning into it. A fresh stack is prepared so that the
// first switch "returns" into fiber_start.
#if defined(__x86_64__)
extern "C" void mesa_emu_switch(void** save_sp, void* next_sp);
asm(R"(
.text
.p2align 4
.globl mesa_emu_switch
.hidden mesa_emu_switch
.type mesa_emu_switch,@function
mesa_emu_switch:
  pushq %rbp
  pushq %rbx
  pushq %r12
  pushq %r13
  pushq %r14
  pushq %r15
  subq $8, %rsp
  stmxcsr (%rsp)
  fnstcw 4(%rsp)
  movq %rsp, (%rdi)
  movq %rsi, %rsp
  ldmxcsr (%rsp)
  fldcw 4(%rsp)
  addq $8, %rsp
  popq %r15
  popq %r14
  popq %r13
  popq %r12
  popq %rbx
  popq %rbp
  ret
.size mesa_emu_switch,.-mesa_emu_switch
.section .note.GNU-stack,"",@progbits
.text
)");
#elif defined(__aarch64__)
extern "C" void mesa_emu_switch(void** save_sp, void* next_sp);
asm(R"(
.text
.p2align 4
.globl mesa_emu_switch
.hidden mesa_emu_switch
.type mesa_emu_switch,%function
mesa_emu_switch:
  sub sp, sp, #0xb0
  stp x19, x20, [sp, #0x00]
  stp x21, x22, [sp, #0x10]
  stp x23, x24, [sp, #0x20]
  stp x25, x26, [sp, #0x30]
  stp x27, x28, [sp, #0x40]
  stp x29, x30, [sp, #0x50]
  stp d8, d9, [sp, #0x60]
  stp d10, d11, [sp, #0x70]
  stp d12, d13, [sp, #0x80]
  stp d14, d15, [sp, #0x90]
  mrs x9, fpcr
  str x9, [sp, #0xa0]
  mov x9, sp
  str x9, [x0]
  mov sp, x1
  ldr x9, [sp, #0xa0]
  msr fpcr, x9
  ldp x19, x20, [sp, #0x00]
  ldp x21, x22, [sp, #0x10]
  ldp x23, x24, [sp, #0x20]
  ldp x25, x26, [sp, #0x30]
  ldp x27, x28, [sp, #0x40]
  ldp x29, x30, [sp, #0x50]
  ldp d8, d9, [sp, #0x60]
  ldp d10, d11, [sp, #0x70]
  ldp d12, d13, [sp, #0x80]
  ldp d14, d15, [sp, #0x90]
  add sp, sp, #0xb0
  ret
.size mesa_emu_switch,.-mesa_emu_switch
.section .note.GNU-stack,"",%progbits
.text
)");
#endif

namespace mesa_emu {

thread_local uint3 tl_block_idx{0, 0, 0};
thread_local dim3 tl_block_dim{1, 1, 1};
thread_local dim3 tl_grid_dim{1, 1, 1};
thread_local ThreadState* tl_current = nullptr;

namespace {

constexpr size_t kStackBytes = 128 * 1024;
constexpr unsigned kMaxThreadsPerBlock = 1024;
constexpr unsigned kMaxGridYZ = 65535;
constexpr unsigned long long kMaxGridX = 2147483647ull;
constexpr unsigned long long kMaxCooperativeBlocks = 512;

struct Block;

}  // namespace

struct ThreadState {
  uint3 idx{0, 0, 0};
#ifdef MESA_EMU_UCONTEXT
  ucontext_t ctx;
#else
  void* sp = nullptr;  // saved stack pointer while switched out
#endif
  bool done = false;
  Block* block = nullptr;
};

namespace {

struct Warp {
  unsigned live = 0;
  unsigned arrived = 0;
  uint64_t generation = 0;
  alignas(16) unsigned char slot[32][16];
};

// The fiber stacks of one block: a single mapping of n stacks (one memory map per block,
// whatever its thread count, so that many concurrent blocks stay far below the kernel's
// limit on mappings), cached across launches. A canary word at the low end of every stack is
// checked after the block: an overflow is reported instead of silently corrupting a
// neighbour.
constexpr uint64_t kStackCanary = 0x6d6573615f737461ull;  // "mesa_sta"

struct StackSet {
  unsigned char* base = nullptr;
  size_t count = 0;
  ~StackSet() {
    if (base != nullptr) munmap(base, count * kStackBytes);
  }
  unsigned char* stack(size_t i) const { return base + i * kStackBytes; }
  bool reserve(size_t n) {
    if (n <= count) return true;
    if (base != nullptr) munmap(base, count * kStackBytes);
    base = nullptr;
    count = 0;
    void* p = mmap(nullptr, n * kStackBytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    if (p == MAP_FAILED) return false;
    base = static_cast<unsigned char*>(p);
    count = n;
    return true;
  }
  void arm(size_t n) {
    for (size_t i = 0; i < n; ++i) std::memcpy(stack(i), &kStackCanary, sizeof kStackCanary);
  }
  bool intact(size_t n) const {
    for (size_t i = 0; i < n; ++i)
      if (std::memcmp(stack(i), &kStackCanary, sizeof kStackCanary) != 0) return false;
    return true;
  }
};

std::mutex g_stack_mutex;
std::vector<std::unique_ptr<StackSet>> g_stack_cache;

std::unique_ptr<StackSet> take_stacks() {
  std::lock_guard<std::mutex> lock(g_stack_mutex);
  if (g_stack_cache.empty()) return std::make_unique<StackSet>();
  std::unique_ptr<StackSet> s = std::move(g_stack_cache.back());
  g_stack_cache.pop_back();
  return s;
}
void give_stacks(std::unique_ptr<StackSet> s) {
  std::lock_guard<std::mutex> lock(g_stack_mutex);
  // keep enough sets for the usual concurrency; free the rest (cooperative launches and
  // concurrent callers may have needed many at once)
  if (g_stack_cache.size() < 64) g_stack_cache.push_back(std::move(s));
}

struct Block {
#ifdef MESA_EMU_UCONTEXT
  ucontext_t scheduler;
#else
  void* scheduler_sp = nullptr;
#endif
  std::vector<ThreadState> threads;
  std::vector<Warp> warps;
  std::vector<unsigned char> dynamic_smem;
  unsigned live = 0;
  unsigned barrier_arrived = 0;
  uint64_t barrier_generation = 0;
  const std::function<void()>* body = nullptr;
};

thread_local Block* tl_block = nullptr;

void fiber_body() {
  ThreadState* self = tl_current;
  (*self->block->body)();
  self->done = true;
  self->block->live -= 1;
}

#ifdef MESA_EMU_UCONTEXT
void fiber_entry() { fiber_body(); }  // returning resumes the scheduler through uc_link
#else
[[noreturn]] void fiber_start() {
  fiber_body();
  ThreadState* self = tl_current;
  void* dead_sp = nullptr;
  mesa_emu_switch(&dead_sp, self->block->scheduler_sp);
  std::abort();  // a finished fiber is never resumed
}

// Lays out a fresh stack so that switching to it enters fiber_start.
void* prepare_stack(unsigned char* base, size_t bytes) {
  uintptr_t top = (reinterpret_cast<uintptr_t>(base) + bytes) & ~uintptr_t(15);
  void** sp = reinterpret_cast<void**>(top);
#if defined(__x86_64__)
  *--sp = nullptr;  // keeps rsp % 16 == 8 at fiber_start's entry, as after a call
  *--sp = reinterpret_cast<void*>(&fiber_start);  // return address
  for (int i = 0; i < 6; ++i) *--sp = nullptr;    // rbp rbx r12 r13 r14 r15
  --sp;                                            // mxcsr + x87 control word
  const uint32_t mxcsr = 0x1f80;                   // default: all exceptions masked, nearest
  const uint16_t fcw = 0x037f;
  std::memcpy(reinterpret_cast<unsigned char*>(sp), &mxcsr, 4);
  std::memcpy(reinterpret_cast<unsigned char*>(sp) + 4, &fcw, 2);
#elif defined(__aarch64__)
  sp -= 0xb0 / sizeof(void*);
  std::memset(sp, 0, 0xb0);
  sp[11] = reinterpret_cast<void*>(&fiber_start);  // x30 (link register) at offset 0x58
#endif
  return sp;
}
#endif

unsigned linear_tid(const ThreadState* t) {
  return t->idx.x + t->idx.y * tl_block_dim.x + t->idx.z * tl_block_dim.x * tl_block_dim.y;
}

// Runs one block to completion on the calling OS thread.
bool run_block(Block& b, StackSet& stacks, uint3 block_idx, bool cooperative) {
  tl_block_idx = block_idx;
  tl_block = &b;
  const unsigned n = unsigned(b.threads.size());
  b.live = n;
  b.barrier_arrived = 0;
  for (unsigned w = 0; w < b.warps.size(); ++w) {
    b.warps[w].live = std::min(32u, n - w * 32u);
    b.warps[w].arrived = 0;
  }
  stacks.arm(n);
  for (unsigned i = 0; i < n; ++i) {
    ThreadState& t = b.threads[i];
    t.done = false;
    t.block = &b;
    t.idx = uint3{i % tl_block_dim.x, (i / tl_block_dim.x) % tl_block_dim.y,
                  i / (tl_block_dim.x * tl_block_dim.y)};
#ifdef MESA_EMU_UCONTEXT
    getcontext(&t.ctx);
    t.ctx.uc_stack.ss_sp = stacks.stack(i);
    t.ctx.uc_stack.ss_size = kStackBytes;
    t.ctx.uc_link = &b.scheduler;
    makecontext(&t.ctx, fiber_entry, 0);
#else
    t.sp = prepare_stack(stacks.stack(i), kStackBytes);
#endif
  }
  while (b.live > 0) {
    for (unsigned i = 0; i < n; ++i) {
      ThreadState& t = b.threads[i];
      if (t.done) continue;
      tl_current = &t;
#ifdef MESA_EMU_UCONTEXT
      swapcontext(&b.scheduler, &t.ctx);
#else
      mesa_emu_switch(&b.scheduler_sp, t.sp);
#endif
      if (t.done) {
        // a finished thread no longer counts towards its warp's exchanges
        b.warps[i / 32].live -= 1;
      }
    }
    if (cooperative) std::this_thread::yield();
  }
  if (!stacks.intact(n)) {
    std::fprintf(stderr, "mesa emulator: a kernel overflowed its %zu-byte fiber stack\n", kStackBytes);
    std::abort();
  }
  tl_current = nullptr;
  tl_block = nullptr;
  return true;
}

void yield_to_scheduler() {
  ThreadState* self = tl_current;
#ifdef MESA_EMU_UCONTEXT
  swapcontext(&self->ctx, &self->block->scheduler);
#else
  mesa_emu_switch(&self->sp, self->block->scheduler_sp);
#endif
}

int env_threads() {
  const char* s = std::getenv("MESA_EMU_THREADS");
  if (s != nullptr) {
    const int v = std::atoi(s);
    if (v > 0) return v < 256 ? v : 256;  // more workers than this only costs fiber stacks
  }
  const unsigned hw = std::thread::hardware_concurrency();
  return hw == 0 ? 1 : int(hw);
}

}  // namespace

long long steady_ns() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

int worker_count() {
  static const int n = env_threads();
  return n;
}

const uint3& thread_idx() { return tl_current->idx; }

void yield_thread() {
  if (tl_current != nullptr) yield_to_scheduler();
}

void syncthreads() {
  Block& b = *tl_block;
  const uint64_t gen = b.barrier_generation;
  b.barrier_arrived += 1;
  for (;;) {
    if (b.barrier_generation != gen) return;
    if (b.barrier_arrived >= b.live) {  // everyone still running has arrived
      b.barrier_arrived = 0;
      b.barrier_generation += 1;
      return;
    }
    yield_to_scheduler();
  }
}

namespace {
void warp_barrier(Warp& w) {
  const uint64_t gen = w.generation;
  w.arrived += 1;
  for (;;) {
    if (w.generation != gen) return;
    if (w.arrived >= w.live) {
      w.arrived = 0;
      w.generation += 1;
      return;
    }
    yield_to_scheduler();
  }
}
}  // namespace

void syncwarp() {
  Block& b = *tl_block;
  warp_barrier(b.warps[linear_tid(tl_current) / 32]);
}

void warp_exchange(const void* value, void* out, unsigned size, unsigned src_lane) {
  Block& b = *tl_block;
  const unsigned tid = linear_tid(tl_current);
  Warp& w = b.warps[tid / 32];
  std::memcpy(w.slot[tid % 32], value, size);
  warp_barrier(w);
  std::memcpy(out, w.slot[src_lane % 32], size);
  warp_barrier(w);
}

unsigned warp_ballot(bool pred) {
  Block& b = *tl_block;
  const unsigned tid = linear_tid(tl_current);
  Warp& w = b.warps[tid / 32];
  w.slot[tid % 32][0] = pred ? 1 : 0;
  warp_barrier(w);
  unsigned mask = 0;
  const unsigned lanes = std::min(32u, unsigned(b.threads.size()) - (tid / 32) * 32);
  for (unsigned l = 0; l < lanes; ++l) mask |= unsigned(w.slot[l][0]) << l;
  warp_barrier(w);
  return mask;
}

unsigned char* dynamic_smem() { return tl_block->dynamic_smem.data(); }

int launch(dim3 grid, dim3 block, size_t dynamic_smem_bytes, bool cooperative,
           const std::function<void()>& body) {
  const unsigned long long threads = 1ull * block.x * block.y * block.z;
  if (threads == 0 || threads > kMaxThreadsPerBlock || block.z > 64) return cudaErrorInvalidConfiguration;
  if (grid.x == 0 || grid.y == 0 || grid.z == 0) return cudaErrorInvalidConfiguration;
  if (grid.x > kMaxGridX || grid.y > kMaxGridYZ || grid.z > kMaxGridYZ) return cudaErrorInvalidConfiguration;
  if (dynamic_smem_bytes > 227u * 1024u) return cudaErrorInvalidConfiguration;
  const unsigned long long blocks = 1ull * grid.x * grid.y * grid.z;
  if (cooperative && blocks > kMaxCooperativeBlocks) return cudaErrorCooperativeLaunchTooLarge;

  auto decode = [&](unsigned long long linear) {
    return uint3{unsigned(linear % grid.x), unsigned((linear / grid.x) % grid.y),
                 unsigned(linear / (1ull * grid.x * grid.y))};
  };
  std::atomic<unsigned long long> next{0};
  std::atomic<bool> out_of_memory{false};
  auto worker = [&](bool coop_single, unsigned long long only) {
    tl_grid_dim = grid;
    tl_block_dim = block;
    std::unique_ptr<StackSet> stacks = take_stacks();
    if (!stacks->reserve(threads)) {
      // no fiber stacks: this worker runs nothing; the launch reports the failure
      out_of_memory = true;
      give_stacks(std::move(stacks));
      return;
    }
    Block b;
    b.threads.resize(threads);
    b.warps.resize((threads + 31) / 32);
    b.dynamic_smem.assign(dynamic_smem_bytes + 16, 0);
    b.body = &body;
    if (coop_single) {
      run_block(b, *stacks, decode(only), true);
    } else {
      for (;;) {
        const unsigned long long i = next.fetch_add(1);
        if (i >= blocks) break;
        run_block(b, *stacks, decode(i), false);
      }
    }
    give_stacks(std::move(stacks));
  };

  if (cooperative) {
    // every block needs its own OS thread; if the system refuses one, the blocks already
    // started cannot meet their missing peers: their bounded waits expire, they finish, and
    // the launch reports "too large" (as cudaLaunchCooperativeKernel would up front)
    std::vector<std::thread> pool;
    pool.reserve(blocks);
    bool spawn_failed = false;
    for (unsigned long long i = 0; i < blocks && !spawn_failed; ++i) {
      try {
        pool.emplace_back(worker, true, i);
      } catch (const std::exception&) {
        spawn_failed = true;
      }
    }
    for (auto& t : pool) t.join();
    if (spawn_failed) return cudaErrorCooperativeLaunchTooLarge;
    return out_of_memory ? cudaErrorMemoryAllocation : cudaSuccess;
  }
  const unsigned long long helpers =
      std::min<unsigned long long>(blocks, (unsigned long long)worker_count()) - 1;
  std::vector<std::thread> pool;
  pool.reserve(helpers);
  for (unsigned long long i = 0; i < helpers; ++i) {
    try {
      pool.emplace_back(worker, false, 0ull);
    } catch (const std::exception&) {
      break;  // fewer helpers: the blocks still all run, on the threads that exist
    }
  }
  worker(false, 0ull);
  for (auto& t : pool) t.join();
  // a worker without stacks ran nothing; the others may have covered its blocks, but the
  // launch is reported as failed either way
  return out_of_memory ? cudaErrorMemoryAllocation : cudaSuccess;
}

}  // namespace mesa_emu
